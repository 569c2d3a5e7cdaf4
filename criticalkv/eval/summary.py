"""Summaries of evaluation records: per-run scores, paired CriticalKV-vs-base comparisons, tables.

Pairs: every run of a CriticalKV policy is compared with the run of its base method (``snapkv`` for
``criticalkv``, ``pyramidkv`` for ``pyramid-criticalkv``, ``adakv`` for ``ada-criticalkv``) at the same
budget and allocation knobs, on the same prompts (see ``criticalkv.eval.scoring.paired_comparison``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import numpy as np

from criticalkv.eval.scoring import mean_ci, paired_comparison
from criticalkv.eval.specs import PolicyRun
from criticalkv.methods import same_selection, unrefined


def pairs(runs: Sequence[PolicyRun]) -> list[tuple[PolicyRun, PolicyRun]]:
    """(variant, base) run pairs present in ``runs``."""
    out = []
    for run in runs:
        base = unrefined(run.policy)
        if base is None:
            continue
        match = [r for r in runs if same_selection(base, r.policy)]
        if match:
            out.append((run, match[0]))
    return out


def _scores(records: list[dict], key: str, where=lambda rec: True) -> list[float]:
    return [rec["results"][key]["score"] for rec in records if where(rec)]


def run_scores(records: list[dict], runs: Sequence[PolicyRun], lengths: Sequence[int]) -> dict:
    """Mean score (with a bootstrap 95% interval) of every run, overall and per length."""
    out = {}
    for run in runs:
        s = _scores(records, run.key)
        mean, lo, hi = mean_ci(s)
        out[run.key] = {
            "spec": run.spec,
            "budget": run.budget,
            "n": len(s),
            "score": mean,
            "ci95": [lo, hi],
            "by_length": {str(L): float(np.mean(_scores(records, run.key, lambda r, L=L: r["length"] == L)))
                          for L in lengths if any(r["length"] == L for r in records)},
        }
    return out


def pair_summaries(records: list[dict], runs: Sequence[PolicyRun], lengths: Sequence[int]) -> list[dict]:
    """Paired comparison of each CriticalKV run with its base, overall and per length."""
    out = []
    for variant, base in pairs(runs):
        entry = {"variant": variant.key, "base": base.key, "budget": variant.budget,
                 "all": paired_comparison(_scores(records, variant.key), _scores(records, base.key))}
        for L in lengths:
            sel = lambda r, L=L: r["length"] == L
            if any(sel(r) for r in records):
                entry[str(L)] = paired_comparison(_scores(records, variant.key, sel), _scores(records, base.key, sel))
        out.append(entry)
    return out


def needle_grid(records: list[dict], runs: Sequence[PolicyRun]) -> dict:
    """run key -> length -> depth -> mean score over samples."""
    grid: dict = {}
    for run in runs:
        cells = defaultdict(list)
        for rec in records:
            cells[(rec["length"], rec["meta"]["depth"])].append(rec["results"][run.key]["score"])
        by_length: dict = defaultdict(dict)
        for (L, d), v in sorted(cells.items()):
            by_length[str(L)][f"{d:g}"] = float(np.mean(v))
        grid[run.key] = dict(by_length)
    return grid


def ruler_tasks(records: list[dict], runs: Sequence[PolicyRun], tasks: Sequence[str], lengths: Sequence[int]) -> dict:
    """run key -> {"tasks": {task: mean}, "average": mean of task means, "by_length": {L: same}}."""
    out = {}
    for run in runs:
        def block(where):
            per_task = {}
            for t in tasks:
                s = [r["results"][run.key]["score"] for r in records if r["task"] == t and where(r)]
                if s:
                    per_task[t] = float(np.mean(s))
            return {"tasks": per_task, "average": float(np.mean(list(per_task.values()))) if per_task else float("nan")}

        entry = block(lambda r: True)
        entry["by_length"] = {str(L): block(lambda r, L=L: r["length"] == L) for L in lengths
                              if any(r["length"] == L for r in records)}
        out[run.key] = entry
    return out


def timing(records: list[dict], runs: Sequence[PolicyRun]) -> dict:
    """Median seconds per prompt: prefill, and per run selection and decoding."""
    if not records:
        return {}
    out = {"prefill_s_median": float(np.median([r["prefill_s"] for r in records])),
           "prompt_total_s_median": float(np.median([r["total_s"] for r in records])),
           "runs": {}}
    for run in runs:
        res = [r["results"][run.key] for r in records]
        out["runs"][run.key] = {
            "selection_s_median": float(np.median([x["selection_s"] for x in res])),
            "decode_s_median": float(np.median([x["decode_s"] for x in res])),
            "kept_fraction_mean": float(np.mean([x["kept_fraction"] for x in res])),
        }
    return out


def fmt(x: float, scale: float = 100.0, digits: int = 1) -> str:
    return "–" if x is None or (isinstance(x, float) and np.isnan(x)) else f"{x * scale:.{digits}f}"


def specs_in_order(runs: Sequence[PolicyRun]) -> list[str]:
    seen = []
    for r in runs:
        if r.spec not in seen:
            seen.append(r.spec)
    return seen


def budgets_in_order(runs: Sequence[PolicyRun]) -> list[int]:
    return sorted({r.budget for r in runs if r.budget is not None})


def run_key(runs: Sequence[PolicyRun], spec: str, budget: int | None) -> str | None:
    for r in runs:
        if r.spec == spec and (r.budget == budget or r.budget is None):
            return r.key
    return None


def score_table(values: dict, runs: Sequence[PolicyRun], title: str) -> str:
    """Markdown: rows = policy specs, columns = budgets; ``values[run key]`` in [0, 1]."""
    budgets = budgets_in_order(runs)
    lines = [f"**{title}**", "", "| policy | " + " | ".join(f"b={b}" for b in budgets) + " |",
             "|---|" + "---:|" * len(budgets)]
    for spec in specs_in_order(runs):
        cells = [fmt(values.get(run_key(runs, spec, b))) for b in budgets]
        lines.append(f"| `{spec}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pair_table(pair_list: list[dict], scope: str, title: str) -> str:
    """Markdown table of paired comparisons (``scope`` = "all" or a length)."""
    lines = [f"**{title}**", "",
             "| variant | base | Δ score | 95% CI | wins / losses / ties | sign-test p | verdict |",
             "|---|---|---:|---|---|---:|---|"]
    for p in pair_list:
        c = p.get(scope)
        if c is None:
            continue
        verdict = "within noise" if c["within_noise"] else ("better" if c["mean_diff"] > 0 else "worse")
        if c["within_noise"] and c["mean_diff"] < 0:
            verdict += " (lower)"
        lines.append(
            f"| `{p['variant']}` | `{p['base']}` | {c['mean_diff'] * 100:+.1f} | "
            f"[{c['ci95'][0] * 100:+.1f}, {c['ci95'][1] * 100:+.1f}] | {c['wins']} / {c['losses']} / {c['ties']} | "
            f"{c['sign_test_p']:.3f} | {verdict} |"
        )
    return "\n".join(lines)


def _stack(records: list[dict], key: str, field: str) -> np.ndarray:
    return np.stack([np.asarray(r["results"][key][field], dtype=np.float64) for r in records])


def perturbation_summary(records: list[dict], runs: Sequence[PolicyRun]) -> dict:
    """Mean perturbations per run and, per (CriticalKV, base) pair, the fraction of heads it lowers.

    ``frac_heads_lower``: over the L x H heads, the fraction where the variant's head perturbation,
    averaged over prompts, is below the base's (the paper's Figure 2 count); ``per_prompt``: the same
    fraction computed prompt by prompt (mean, min, max). ``final_lower``: fraction of prompts whose last
    hidden state (cascade) moved less under the variant. ``sigma_*``: Assumption 1 (see
    ``criticalkv.eval.perturbation``).
    """
    out: dict = {"runs": {}, "pairs": []}
    if not records:
        return out
    for run in runs:
        heads = _stack(records, run.key, "head_l1")
        entry = {
            "head_l1_mean": heads.mean(axis=0),
            "head_l1_overall": float(heads.mean()),
            "kept_mass_mean": _stack(records, run.key, "kept_mass").mean(axis=0),
            "layer_l1_mean": _stack(records, run.key, "layer_l1").mean(axis=0),
            "layer_rel_mean": _stack(records, run.key, "layer_rel").mean(axis=0),
            "final_l1": [r["results"][run.key]["final_l1"] for r in records],
            "final_rel": [r["results"][run.key]["final_rel"] for r in records],
        }
        if "sigma" in records[0]["results"][run.key]:
            sigma = _stack(records, run.key, "sigma")
            entry["sigma_mean"] = sigma.mean(axis=0)
            entry["sigma_above_half"] = float((sigma > 0.5).mean())
        out["runs"][run.key] = entry
    for variant, base in pairs(runs):
        v = _stack(records, variant.key, "head_l1")  # [P, L, H]
        b = _stack(records, base.key, "head_l1")
        lower = v < b
        per_prompt = lower.reshape(len(records), -1).mean(axis=1)
        fv = np.array(out["runs"][variant.key]["final_l1"])
        fb = np.array(out["runs"][base.key]["final_l1"])
        entry = {
            "variant": variant.key,
            "base": base.key,
            "budget": variant.budget,
            "stage2_scores": variant.policy.stage2_scores,
            "prompts": len(records),
            "heads": int(v.shape[1] * v.shape[2]),
            "frac_heads_lower": float((v.mean(axis=0) < b.mean(axis=0)).mean()),
            "per_prompt": {"mean": float(per_prompt.mean()), "min": float(per_prompt.min()),
                           "max": float(per_prompt.max())},
            "per_layer_frac_lower": (v.mean(axis=0) < b.mean(axis=0)).mean(axis=1),
            "mean_head_l1_ratio": float(v.mean() / b.mean()) if b.mean() else float("nan"),
            "final_lower": float((fv < fb).mean()),
            "final_l1_ratio": float(fv.mean() / fb.mean()) if fb.mean() else float("nan"),
            "layer_l1_ratio": out["runs"][variant.key]["layer_l1_mean"] / np.maximum(out["runs"][base.key]["layer_l1_mean"], 1e-30),
        }
        if "sigma" in records[0]["results"][variant.key]:
            sigma = _stack(records, variant.key, "sigma")
            above = sigma > 0.5
            entry["sigma_above_half"] = float(above.mean())
            entry["frac_lower_where_sigma_above_half"] = float(lower[above].mean()) if above.any() else float("nan")
            entry["frac_lower_where_sigma_at_most_half"] = float(lower[~above].mean()) if (~above).any() else float("nan")
        out["pairs"].append(entry)
    return out


def head_fraction_table(by_scope: dict[str, dict], runs: Sequence[PolicyRun]) -> str:
    """Markdown: fraction of heads where each CriticalKV run beats its base, per scope and budget."""
    budgets = budgets_in_order(runs)
    lines = ["| variant (vs base) | scope | " + " | ".join(f"b={b}" for b in budgets) + " |",
             "|---|---|" + "---:|" * len(budgets)]
    for scope, summ in by_scope.items():
        rows: dict = {}
        for p in summ["pairs"]:
            spec = p["variant"].rsplit("@", 1)[0]
            base = p["base"].rsplit("@", 1)[0]
            rows.setdefault((spec, base), {})[p["budget"]] = p
        for (spec, base), cells in rows.items():
            vals = []
            for b in budgets:
                p = cells.get(b)
                vals.append("–" if p is None else
                            f"{p['frac_heads_lower'] * 100:.0f}% (L1 ×{p['mean_head_l1_ratio']:.2f})")
            lines.append(f"| `{spec}` (vs `{base}`) | {scope} | " + " | ".join(vals) + " |")
    return "\n".join(lines)
