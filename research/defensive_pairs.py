#!/usr/bin/env python3
"""Paired statistics of the DefensiveKV results (reads the committed JSON only; no model is run).

``criticalkv eval`` prints paired statistics for a CriticalKV variant against its base; DefensiveKV is not a
refinement of a base, so its comparisons are computed here with the suite's own functions
(``criticalkv.eval.scoring.paired_comparison``: bootstrap 95% CI over prompts and the sign test; "better" /
"worse" only when the CI excludes 0 and p < 0.05):

* needle and RULER-style: per budget, all prompts and per length, for
  ``defensivekv`` vs ``ada-criticalkv``, ``layer-defensivekv`` vs ``defensivekv``, ``layer-defensivekv`` vs
  ``ada-criticalkv`` and ``defensivekv`` vs ``adakv``, plus each policy's mean over the budgets;
* perturbation: per budget, the fraction of the 30 x 9 heads where the policy's head perturbation (L1 of the
  attention output at the first decoding token, averaged over the prompts) is below ``ada-criticalkv``'s
  (and below ``adakv``'s), the mean head-L1 ratio, and the fraction of prompts whose final hidden state moved less.

    python research/defensive_pairs.py --out results/defensive_pairs.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's criticalkv, installed or not

from criticalkv.eval.scoring import paired_comparison  # noqa: E402

PAIRS = [("defensivekv", "ada-criticalkv"), ("layer-defensivekv", "defensivekv"),
         ("layer-defensivekv", "ada-criticalkv"), ("defensivekv", "adakv")]


def fmt(c: dict) -> str:
    verdict = "within noise" if c["within_noise"] else ("**better**" if c["mean_diff"] > 0 else "**worse**")
    return (f"{100 * c['mean_diff']:+.1f} [{100 * c['ci95'][0]:+.1f}, {100 * c['ci95'][1]:+.1f}] "
            f"({c['wins']}/{c['losses']}, p={c['sign_test_p']:.2f}) {verdict}")


def scores(records, key, length=None):
    return [r["results"][key]["score"] for r in records if length is None or r["length"] == length]


def score_section(paths: list[Path]) -> list[str]:
    """Tables and paired statistics over the records of one or more runs of the same task and policies (runs
    with different seeds are different prompts: their records are pooled)."""
    docs = [json.loads(p.read_text()) for p in paths]
    doc = docs[0]
    records = [r for d in docs for r in d["records"]]
    path = ", ".join(f"`{p.relative_to(ROOT)}`" for p in paths)
    keys = list(records[0]["results"])
    budgets = sorted({int(k.split("@")[1]) for k in keys if "@" in k})
    policies = list(dict.fromkeys(k.split("@")[0] for k in keys if "@" in k))
    lengths = sorted({r["length"] for r in records})
    out = [f"### {doc['task']} ({len(records)} prompts; {path})", "",
           "| policy | " + " | ".join(f"b={b}" for b in budgets) + " | mean |",
           "|---|" + "---:|" * (len(budgets) + 1)]
    for p in policies:
        cells = [100 * np.mean(scores(records, f"{p}@{b}")) for b in budgets]
        out.append(f"| `{p}` | " + " | ".join(f"{c:.1f}" for c in cells) + f" | {np.mean(cells):.1f} |")
    for L in lengths:
        out += ["", f"{L} tokens:", "", "| policy | " + " | ".join(f"b={b}" for b in budgets) + " |",
                "|---|" + "---:|" * len(budgets)]
        for p in policies:
            out.append(f"| `{p}` | " + " | ".join(f"{100 * np.mean(scores(records, f'{p}@{b}', L)):.1f}" for b in budgets) + " |")
    out += ["", "Paired (variant - base, points; 95% bootstrap CI; wins/losses; sign-test p):", ""]
    for scope in [None, *lengths]:
        name = "all prompts" if scope is None else f"{scope} tokens"
        out += [f"{name}:", "", "| variant vs base | " + " | ".join(f"b={b}" for b in budgets) + " |",
                "|---|" + "---|" * len(budgets)]
        for v, b in PAIRS:
            if v not in policies or b not in policies:
                continue
            cells = [fmt(paired_comparison(scores(records, f"{v}@{x}", scope), scores(records, f"{b}@{x}", scope)))
                     for x in budgets]
            out.append(f"| `{v}` vs `{b}` | " + " | ".join(cells) + " |")
        out.append("")
    return out


def perturbation_section(path: Path) -> list[str]:
    doc = json.loads(path.read_text())
    runs = doc["perturbation"]["all"]["runs"]
    budgets = sorted({int(k.split("@")[1]) for k in runs})
    out = [f"### perturbation ({len(doc['records'])} prompts; `{path.relative_to(ROOT)}`)", "",
           "Fraction of heads (30 layers x 9 query heads; head L1 averaged over the prompts) where the variant's "
           "perturbation is below the base's; (×r) the mean head L1 ratio; final: fraction of prompts whose final "
           "hidden state moved less.", "",
           "| variant vs base | " + " | ".join(f"b={b}" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for v, b in [("defensivekv", "ada-criticalkv"), ("layer-defensivekv", "ada-criticalkv"),
                 ("layer-defensivekv", "defensivekv"), ("defensivekv", "adakv"), ("ada-criticalkv", "adakv")]:
        cells = []
        for x in budgets:
            rv, rb = runs.get(f"{v}@{x}"), runs.get(f"{b}@{x}")
            if rv is None or rb is None:
                cells.append("-")
                continue
            hv, hb = np.asarray(rv["head_l1_mean"]), np.asarray(rb["head_l1_mean"])
            fv, fb = np.asarray(rv["final_l1"]), np.asarray(rb["final_l1"])
            cells.append(f"{100 * (hv < hb).mean():.0f}% (×{hv.mean() / hb.mean():.2f}); final {100 * (fv < fb).mean():.0f}%")
        out.append(f"| `{v}` vs `{b}` | " + " | ".join(cells) + " |")
    return out + [""]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--needle", type=Path, nargs="+", default=[ROOT / "results/needle_defensive/needle.json",
                                                             ROOT / "results/needle_defensive_seed1/needle.json"])
    p.add_argument("--ruler", type=Path, nargs="+", default=[ROOT / "results/ruler_defensive/ruler.json"])
    p.add_argument("--perturbation", type=Path, default=ROOT / "results/perturbation_defensive/perturbation.json")
    p.add_argument("--out", type=Path, help="also write the markdown here")
    args = p.parse_args()
    lines = ["# DefensiveKV: paired statistics", "", "`python research/defensive_pairs.py --out results/defensive_pairs.md`", ""]
    for paths in (args.needle, args.ruler):
        found = [p.resolve() for p in paths if p.is_file()]
        lines += score_section(found) if found else ["(no results)", ""]
    if args.perturbation.is_file():
        lines += perturbation_section(args.perturbation.resolve())
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
