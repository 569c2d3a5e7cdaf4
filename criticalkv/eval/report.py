"""Write an evaluation's results: ``<task>.json`` (incrementally), ``<task>.md`` and PNG figures."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from criticalkv.eval import plots, summary
from criticalkv.eval.io import write_json, write_text
from criticalkv.eval.runner import strip_arrays
from criticalkv.eval.specs import PolicyRun
from criticalkv.policy import KVPolicy


def rounded(obj, digits: int = 4):
    """Floats (and arrays) rounded to ``digits`` significant digits, for compact JSON."""
    if isinstance(obj, np.ndarray):
        return rounded(obj.tolist(), digits)
    if isinstance(obj, dict):
        return {k: rounded(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [rounded(v, digits) for v in obj]
    if isinstance(obj, (float, np.floating)):
        x = float(obj)
        if x == 0 or not math.isfinite(x):
            return x
        return round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))
    return obj


class Writer:
    def __init__(self, task: str, out: Path, meta: dict, runs: Sequence[PolicyRun], lengths: Sequence[int],
                 tasks: Sequence[str] | None):
        self.task = task
        self.out = Path(out)
        self.meta = meta
        self.runs = list(runs)
        self.lengths = list(lengths)
        self.tasks = list(tasks or [])
        self.json_path = self.out / f"{task}.json"

    def partial(self, records: list[dict]) -> None:
        """Rewrite the JSON after each prompt (``complete: false``) so that a stopped run can resume."""
        write_json(self.json_path, {"task": self.task, "complete": False, **self.meta,
                                    "records": rounded(strip_arrays(records), 6)})

    def final(self, records: list[dict], meta: dict) -> str:
        """Summarise the records into ``<task>.json`` (``complete: true``), then render it (``render``)."""
        meta = {**meta, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "compute_s": float(sum(r["total_s"] for r in records))}
        timing = summary.timing(records, self.runs)
        if self.task == "perturbation":
            body = self._perturbation(records)
        else:
            body = self._scores(records)
        doc = rounded({"task": self.task, "complete": True, **meta, "timing": timing, **body,
                       "records": strip_arrays(records)}, 6)
        write_json(self.json_path, doc)
        return render(doc, self.out)

    def _scores(self, records: list[dict]) -> dict:
        return score_body(self.task, records, self.runs, self.lengths, self.tasks)

    def _perturbation(self, records: list[dict]) -> dict:
        scopes = {"all": summary.perturbation_summary(records, self.runs)}
        for L in self.lengths:
            sub = [r for r in records if r["length"] == L]
            if sub:
                scopes[str(L)] = {"pairs": summary.perturbation_summary(sub, self.runs)["pairs"]}
        return {"perturbation": rounded(scopes, 4)}


def score_body(task: str, records: list[dict], runs: Sequence[PolicyRun], lengths: Sequence[int],
               tasks: Sequence[str]) -> dict:
    """The summaries of a needle or RULER-style run: scores per run, paired comparisons, grid or tasks.
    They need only the per-prompt scores, which the results JSON keeps, so they can be recomputed."""
    body = {"scores": summary.run_scores(records, runs, lengths), "pairs": summary.pair_summaries(records, runs, lengths)}
    if task == "needle":
        body["grid"] = summary.needle_grid(records, runs)
    else:
        body["tasks"] = summary.ruler_tasks(records, runs, list(tasks), lengths)
    return body


def refresh(json_path: Path) -> str:
    """``criticalkv eval report``: re-render a finished run's markdown and figures from its JSON. For
    needle and RULER-style runs the summaries are first recomputed from the stored per-prompt scores
    (so a change to the statistics reaches committed results without re-running the model) and the
    JSON is rewritten with them; the perturbation analysis keeps only its summaries, so it is redrawn."""
    json_path = Path(json_path)
    try:
        doc = json.loads(json_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{json_path}: no such results file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{json_path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("task") not in ("needle", "ruler", "perturbation") or "config" not in doc:
        raise ValueError(f"{json_path}: not a criticalkv eval results file")
    if not doc.get("complete"):
        raise ValueError(f"{json_path}: the run is not complete ({len(doc.get('records', []))} of "
                         f"{doc.get('prompt_count', '?')} prompts done); finish it with --resume first")
    if doc["task"] != "perturbation":
        cfg = doc["config"]
        body = score_body(doc["task"], doc["records"], runs_of(doc), cfg["lengths"], cfg.get("tasks") or [])
        doc = rounded({**doc, **body}, 6)
        write_json(json_path, doc)
    return render(doc, json_path.parent)


def runs_of(doc: dict) -> list[PolicyRun]:
    """The (policy, budget) runs of a results document, from its ``config``."""
    return [PolicyRun(spec=r["spec"], budget=r["budget"], policy=KVPolicy.from_dict(r["policy"]))
            for r in doc["config"]["runs"].values()]


def render(doc: dict, out: Path) -> str:
    """Write ``<task>.md`` and the task's PNG figures from a finished results document (the content of
    ``<task>.json``) into ``out``; return the one-line headline. ``criticalkv eval report DIR`` calls this
    to redraw committed results without recomputing them."""
    out = Path(out)
    task = doc["task"]
    runs = runs_of(doc)
    lengths = list(doc["config"]["lengths"])
    model = doc["config"]["model"]
    n = len(doc["records"])
    if task == "perturbation":
        md, headline = _render_perturbation(doc["perturbation"], runs, out, model, n)
    else:
        md, headline = _render_scores(doc, task, runs, lengths, out, model, n)
    env = doc["environment"]
    resumed = ", resumed" if "resumed" in doc else ""
    compute = doc.get("compute_s", sum(r["total_s"] for r in doc["records"]))
    header = [f"# criticalkv eval {task}", "", "```", doc["command"], "```", "",
              f"model `{model}`, {doc['prompt_count']} prompts, compute {compute / 60:.1f} min (sum over "
              f"prompts; wall time of this invocation {doc['wall_s'] / 60:.1f} min{resumed}), {env['cpu']} "
              f"({env['torch_threads']} threads), torch {env['torch']}, transformers {env['transformers']}", ""]
    write_text(out / f"{task}.md", "\n".join(header) + md + "\n")
    return headline


def _render_scores(doc: dict, task: str, runs: list[PolicyRun], lengths: list[int], out: Path, model: str, n: int):
    scores, pairs = doc["scores"], doc["pairs"]
    md: list[str] = []
    if task == "needle":
        md.append(summary.score_table({k: v["score"] for k, v in scores.items()}, runs,
                                      f"Needle accuracy (%), all lengths ({n} prompts per cell)"))
        for L in lengths:
            md += ["", summary.score_table({k: v["by_length"].get(str(L), float("nan")) for k, v in scores.items()},
                                           runs, f"Needle accuracy (%), {L} tokens")]
        plots.needle_heatmap(doc["grid"], scores, runs, out / "needle_heatmap.png", f"Needle-in-a-haystack ({model})")
    else:
        tasks = doc["tasks"]
        md.append(summary.score_table({k: v["average"] for k, v in tasks.items()}, runs,
                                      f"RULER-style average (%), all lengths ({n} prompts per cell)"))
        for L in lengths:
            md += ["", summary.score_table({k: v["by_length"].get(str(L), {}).get("average", float("nan"))
                                            for k, v in tasks.items()}, runs, f"RULER-style average (%), {L} tokens")]
        md += ["", _task_table(tasks, runs, list(doc["config"]["tasks"] or []))]
        plots.ruler_bars(tasks, runs, lengths, out / "ruler.png", f"RULER-style average ({model})")
    md += ["", summary.pair_table(pairs, "all", "CriticalKV variant vs its base (paired, all prompts)")]
    for L in lengths:
        md += ["", summary.pair_table(pairs, str(L), f"CriticalKV variant vs its base, {L} tokens")]
    worse = [p for p in pairs if p["all"]["mean_diff"] < 0]
    headline = (f"{task}: {n} prompts x {len(runs)} runs; "
                f"{len(pairs) - len(worse)}/{len(pairs)} CriticalKV runs >= their base; results in {out}")
    return "\n".join(md), headline


def _task_table(tasks: dict, runs: list[PolicyRun], names: list[str]) -> str:
    lines = ["**RULER-style score per task (%), all lengths**", "",
             "| run | " + " | ".join(names) + " | average |", "|---|" + "---:|" * (len(names) + 1)]
    for run in runs:
        entry = tasks[run.key]
        cells = [summary.fmt(entry["tasks"].get(t, float("nan"))) for t in names]
        lines.append(f"| `{run.key}` | " + " | ".join(cells) + f" | {summary.fmt(entry['average'])} |")
    return "\n".join(lines)


def _render_perturbation(scopes: dict, runs: list[PolicyRun], out: Path, model: str, n: int):
    plots.perturbation_heads(scopes["all"], out / "perturbation_heads.png",
                             f"Head-wise perturbation, first decoding token ({model}, {n} prompts)")
    plots.perturbation_layers(scopes["all"], runs, out / "perturbation_layers.png",
                              f"Layer-wise perturbation of the hidden state ({model}, {n} prompts)")
    md = ["**Fraction of heads where the CriticalKV variant's output perturbation is below its base's** "
          "(head perturbation averaged over prompts; ×ratio = mean head L1 variant / base)", "",
          summary.head_fraction_table(scopes, runs), "", _pair_details(scopes["all"])]
    fr = [p["frac_heads_lower"] for p in scopes["all"]["pairs"]]
    headline = (f"perturbation: {n} prompts; CriticalKV lowers the head perturbation in "
                f"{100 * min(fr):.0f}-{100 * max(fr):.0f}% of heads; results in {out}")
    return "\n".join(md), headline


def _pair_details(summ: dict) -> str:
    lines = ["**Per pair, all prompts**", "",
             "| variant | base | heads lower | per prompt mean [min, max] | mean head L1 ratio | last hidden state: "
             "prompts lower, L1 ratio | σ>0.5 (heads) | heads lower where σ>0.5 / σ≤0.5 |",
             "|---|---|---:|---|---:|---|---:|---|"]
    for p in summ["pairs"]:
        pp = p["per_prompt"]
        sig = (f"{p['sigma_above_half'] * 100:.0f}%" if "sigma_above_half" in p else "–")
        split = (f"{summary.fmt(p['frac_lower_where_sigma_above_half'], 100, 0)}% / "
                 f"{summary.fmt(p['frac_lower_where_sigma_at_most_half'], 100, 0)}%" if "sigma_above_half" in p else "–")
        lines.append(
            f"| `{p['variant']}` | `{p['base']}` | {p['frac_heads_lower'] * 100:.0f}% | "
            f"{pp['mean'] * 100:.0f}% [{pp['min'] * 100:.0f}, {pp['max'] * 100:.0f}] | {p['mean_head_l1_ratio']:.3f} | "
            f"{p['final_lower'] * 100:.0f}%, ×{p['final_l1_ratio']:.3f} | {sig} | {split} |"
        )
    return "\n".join(lines)
