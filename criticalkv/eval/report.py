"""Write an evaluation's results: ``<task>.json`` (incrementally), ``<task>.md`` and PNG figures."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from criticalkv.eval import plots, summary
from criticalkv.eval.io import write_json, write_text
from criticalkv.eval.runner import strip_arrays
from criticalkv.eval.specs import PolicyRun


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
        meta = {**meta, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "compute_s": float(sum(r["total_s"] for r in records))}
        timing = summary.timing(records, self.runs)
        if self.task == "perturbation":
            body, md, headline = self._perturbation(records)
        else:
            body, md, headline = self._scores(records)
        doc = {"task": self.task, "complete": True, **meta, "timing": timing, **body,
               "records": rounded(strip_arrays(records), 6)}
        write_json(self.json_path, rounded(doc, 6))
        header = [f"# criticalkv eval {self.task}", "", "```", meta["command"], "```", "",
                  f"model `{meta['config']['model']}`, {meta['prompt_count']} prompts, "
                  f"compute {meta['compute_s'] / 60:.1f} min (sum over prompts; wall time of this invocation "
                  f"{meta['wall_s'] / 60:.1f} min{', resumed' if 'resumed' in meta else ''}), {meta['environment']['cpu']} "
                  f"({meta['environment']['torch_threads']} threads), torch {meta['environment']['torch']}, "
                  f"transformers {meta['environment']['transformers']}", ""]
        write_text(self.out / f"{self.task}.md", "\n".join(header) + md + "\n")
        return headline

    # ------------------------------------------------------------------ needle / ruler
    def _scores(self, records: list[dict]):
        runs, lengths = self.runs, self.lengths
        scores = summary.run_scores(records, runs, lengths)
        pairs = summary.pair_summaries(records, runs, lengths)
        body = {"scores": scores, "pairs": pairs}
        md: list[str] = []
        if self.task == "needle":
            grid = summary.needle_grid(records, runs)
            body["grid"] = grid
            md.append(summary.score_table({k: v["score"] for k, v in scores.items()}, runs,
                                          f"Needle accuracy (%), all lengths ({len(records)} prompts per cell)"))
            for L in lengths:
                md += ["", summary.score_table({k: v["by_length"].get(str(L), float("nan")) for k, v in scores.items()},
                                               runs, f"Needle accuracy (%), {L} tokens")]
            plots.needle_heatmap(grid, scores, runs, self.out / "needle_heatmap.png",
                                 f"Needle-in-a-haystack ({self.meta['config']['model']})")
        else:
            tasks = summary.ruler_tasks(records, runs, self.tasks, lengths)
            body["tasks"] = tasks
            md.append(summary.score_table({k: v["average"] for k, v in tasks.items()}, runs,
                                          f"RULER-style average (%), all lengths ({len(records)} prompts per cell)"))
            for L in lengths:
                md += ["", summary.score_table({k: v["by_length"].get(str(L), {}).get("average", float("nan"))
                                                for k, v in tasks.items()}, runs, f"RULER-style average (%), {L} tokens")]
            md += ["", self._task_table(tasks)]
            plots.ruler_bars(tasks, runs, lengths, self.out / "ruler.png",
                             f"RULER-style average ({self.meta['config']['model']})")
        md += ["", summary.pair_table(pairs, "all", "CriticalKV variant vs its base (paired, all prompts)")]
        for L in lengths:
            md += ["", summary.pair_table(pairs, str(L), f"CriticalKV variant vs its base, {L} tokens")]
        worse = [p for p in pairs if p["all"]["mean_diff"] < 0]
        headline = (f"{self.task}: {len(records)} prompts x {len(runs)} runs; "
                    f"{len(pairs) - len(worse)}/{len(pairs)} CriticalKV runs >= their base; results in {self.out}")
        return body, "\n".join(md), headline

    def _task_table(self, tasks: dict) -> str:
        names = self.tasks
        lines = ["**RULER-style score per task (%), all lengths**", "",
                 "| run | " + " | ".join(names) + " | average |", "|---|" + "---:|" * (len(names) + 1)]
        for run in self.runs:
            entry = tasks[run.key]
            cells = [summary.fmt(entry["tasks"].get(t, float("nan"))) for t in names]
            lines.append(f"| `{run.key}` | " + " | ".join(cells) + f" | {summary.fmt(entry['average'])} |")
        return "\n".join(lines)

    # ------------------------------------------------------------------ perturbation
    def _perturbation(self, records: list[dict]):
        scopes = {"all": summary.perturbation_summary(records, self.runs)}
        for L in self.lengths:
            sub = [r for r in records if r["length"] == L]
            if sub:
                scopes[str(L)] = summary.perturbation_summary(sub, self.runs)
        model = self.meta["config"]["model"]
        plots.perturbation_heads(scopes["all"], self.out / "perturbation_heads.png",
                                 f"Head-wise perturbation, first decoding token ({model}, {len(records)} prompts)")
        plots.perturbation_layers(scopes["all"], self.runs, self.out / "perturbation_layers.png",
                                  f"Layer-wise perturbation of the hidden state ({model}, {len(records)} prompts)")
        body = {"perturbation": rounded({scope: (s if scope == "all" else {"pairs": s["pairs"]})
                                         for scope, s in scopes.items()}, 4)}
        md = ["**Fraction of heads where the CriticalKV variant's output perturbation is below its base's** "
              "(head perturbation averaged over prompts; ×ratio = mean head L1 variant / base)", "",
              summary.head_fraction_table(scopes, self.runs), "", self._pair_details(scopes["all"])]
        fr = [p["frac_heads_lower"] for p in scopes["all"]["pairs"]]
        headline = (f"perturbation: {len(records)} prompts; CriticalKV lowers the head perturbation in "
                    f"{100 * min(fr):.0f}-{100 * max(fr):.0f}% of heads; results in {self.out}")
        return body, "\n".join(md), headline

    @staticmethod
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
