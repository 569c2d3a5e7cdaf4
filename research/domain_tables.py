"""Per-domain, per-budget tables of the question-agnostic evaluations, kvpress's presses beside every row.

Reads, for every domain folder under ROOT (``criticalkv eval needle|ruler --question-agnostic --domain D --out
ROOT/D/needle`` or ``.../ruler``, ``python -m criticalkv.bench.peers.kvpress needle|ruler --domain D --out ROOT/D/kvpress``,
and any further ``ROOT/D/<name>/needle.json`` runs on the same prompts, labelled ``[<name>]``), and writes ROOT/tables.md: the needle and
RULER-style scores per policy and budget, kvpress's KVzipPress and KVzip+ on the same prompts, the prompts where a
policy found the needle at a budget and lost it at a larger one, and the commands. No model runs.

    python research/domain_tables.py results/domains
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's criticalkv, installed or not

from criticalkv.eval.io import write_text  # noqa: E402

KVPRESS_NAMES = {"KVzipPress": "kvpress KVzipPress", "KVzipPress:kvzip_plus_normalization=True": "kvpress KVzip+"}


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _split(key: str) -> tuple[str, int | None]:
    spec, at, budget = key.rpartition("@")
    return (spec, int(budget)) if at and budget.isdigit() else (key, None)


def collect(folder: Path, task: str) -> tuple[dict, list[str], dict]:
    """{(spec, budget): {prompt key: score}}, the commands, {spec: mean scoring seconds / prefill seconds}."""
    cells: dict = {}
    commands: list[str] = []
    cost: dict = {}
    runs = sorted(p for p in folder.glob(f"*/{task}.json"))
    peer = folder / "kvpress" / f"kvpress_{task}.json"
    for path in runs:
        data = _load(path)
        commands.append(data["command"])
        label = "" if path.parent.name == task else f" [{path.parent.name}]"  # another run on the same prompts
        for rec in data["records"]:
            spent: dict = {}
            for key, res in rec["results"].items():
                spec, budget = _split(key)
                spec += label
                cells.setdefault((spec, budget), {})[rec["key"]] = res["score"]
                spent[score_source(spec)] = spent.get(score_source(spec), 0.0) + res.get("scores_s", 0.0)
            for source, seconds in spent.items():  # a score is computed once per prompt, by whichever run came first
                if source and rec.get("prefill_s"):
                    cost.setdefault(source, []).append(seconds / rec["prefill_s"])
    data = _load(peer)
    if data is not None:
        commands.append(data["command"])
        for rec in data["records"]:
            for key, res in rec["results"].items():
                spec, budget = _split(key)
                cells.setdefault((KVPRESS_NAMES.get(spec, f"kvpress {spec}"), budget), {})[rec["key"]] = res["score"]
    return cells, commands, {k: sum(v) / len(v) for k, v in cost.items()}


def score_source(spec: str) -> str | None:
    """Where a policy's score comes from: ``surrogate``, ``re-read`` (KVzip's) or None (none beside the prefill)."""
    if "kvzip" not in spec.split(":")[0]:
        return None
    return "surrogate" if "kvzip_score=surrogate" in spec else "re-read"


def monotone_losses(cells: dict, spec: str, budgets: list[int]) -> tuple[int, int]:
    """(prompts found at a budget and lost at a larger one, prompts compared) for ``spec``."""
    losses = compared = 0
    for small, large in zip(budgets, budgets[1:]):
        a, b = cells.get((spec, small), {}), cells.get((spec, large), {})
        for key in set(a) & set(b):
            compared += 1
            losses += int(a[key] >= 1 and b[key] < 1)
    return losses, compared


def table(domain: str, task: str, cells: dict, commands: list[str], cost: dict) -> list[str]:
    budgets = sorted({b for (_, b) in cells if b is not None})
    specs = list(dict.fromkeys(s for (s, _) in cells))
    prompts = max((len(v) for v in cells.values()), default=0)
    name = "needle found, %" if task == "needle" else "RULER-style average, %"
    lines = [f"### {domain}: {name} ({prompts} prompts of 2,048 tokens, question-agnostic)", "",
             "| policy | " + " | ".join(f"b={b} ({100 * b / 2048:.1f} %)" for b in budgets) + " | lost at a larger budget |"
             " scoring / prefill |", "|---|" + "---:|" * (len(budgets) + 2)]
    for spec in specs:
        row = []
        for b in budgets:
            values = cells.get((spec, b)) or cells.get((spec, None))
            row.append("-" if not values else f"{100 * sum(values.values()) / len(values):.1f}"
                       + ("" if len(values) == prompts else f" ({len(values)})"))
        losses, compared = monotone_losses(cells, spec, budgets) if task == "needle" else (0, 0)
        lost = f"{losses} of {compared}" if compared else "-"
        source = score_source(spec)
        if spec.startswith("kvpress"):
            ratio = "its re-read"  # kvpress's own timing is not split into prefill and scoring
        else:
            ratio = "0" if source is None else (f"{cost[source]:.2f}x" if source in cost else source)
        lines.append(f"| `{spec}` | " + " | ".join(row) + f" | {lost} | {ratio} |")
    lines += ["", "Commands:", ""] + [f"    {c}" for c in commands] + [""]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python research/domain_tables.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", nargs="?", type=Path, default=Path("results/domains"),
                    help="the folder of the domain folders; ROOT/tables.md is written (default: results/domains)")
    root = ap.parse_args(argv).root
    if not root.is_dir():
        ap.error(f"{root}: not a folder")
    lines = ["# Question-agnostic quality per domain (generated by `python research/domain_tables.py "
             f"{root}`)", "",
             "Every table: the bundled SmolLM2-135M-Instruct, 2,048-token prompts, the context compressed before the "
             "question; kvpress 0.5.5's presses on the same prompts in their own environment. \"lost at a larger "
             "budget\": prompts whose needle the policy found at one budget and lost at the next larger one (of the "
             "pairs compared). \"scoring / prefill\": the mean ratio of the time spent scoring (the re-read, or the "
             "surrogate) to the prefill's, measured inside the evaluation on a shared machine (a rough ratio; the idle "
             "measurements are in results/benchmarks/serving).", ""]
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        for task in ("needle", "ruler"):
            cells, commands, cost = collect(folder, task)
            if cells:
                lines += table(folder.name, task, cells, commands, cost)
    write_text(root / "tables.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
