"""Tables of a shared-context evaluation, generated from its per-question records (no model run).

``criticalkv eval shared-context report DIR`` (and the evaluation itself when it ends) reads ``DIR/records.jsonl``
(criticalkv's answers) and ``DIR/kvpress/records.jsonl`` (kvpress's, ``python -m criticalkv.bench.peers.kvpress
shared-context``) and writes ``DIR/tables.md`` and ``DIR/summary.json``.

Statistics. A cell (setting, policy, budget) scores every question it answered; its accuracy is the mean score of the
questions whose kind has a reference answer (``open`` questions never count: they are scored against ``full``'s own
answer, in the fidelity columns). Questions about one document are not independent (they share its compression), so
every interval is a **cluster bootstrap over documents**: documents are drawn with replacement (``RESAMPLES`` times,
a fixed seed), each bringing all its questions, and the 2.5th and 97.5th percentiles of the resampled statistic are
the 95 % interval. Two cells are compared on the questions both answered (paired): the mean of the per-question
differences with its cluster-bootstrap interval, the questions one wins and the other wins, and the exact sign test.

Fidelity to ``full`` (same questions, same implementation's full cache): the share of answers whose tokens are
``full``'s (``same``), the mean share of ``full``'s answer tokens repeated before the first difference, and the mean KL
divergence of the first answer token's distribution from ``full``'s (nats); ``open`` questions: the word F1 of the
answer against ``full``'s.

"Lost at a larger budget": questions a policy answered right (score 1) at one budget and not at a larger one.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from criticalkv.eval.scoring import sign_test
from criticalkv.eval.shared_context import overlap_f1

RESAMPLES = 2000
SEED = 0
#: Kinds never counted in an accuracy (no reference answer: scored against full's).
UNSCORED_KINDS = ("open",)


def load_records(paths: Iterable[Path]) -> list[dict]:
    out = []
    for path in paths:
        path = Path(path)
        if not path.exists():
            continue
        with open(path, encoding="utf-8") as f:
            out += [json.loads(line) for line in f if line.endswith("\n")]
    return out


class Cells:
    """Records grouped by (setting, run): ``scores[cell][question] = score`` and the fidelity fields."""

    def __init__(self, records: Sequence[dict], kinds: Sequence[str] | None = None):
        self.by_cell: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)
        self.doc_of: dict[str, str] = {}
        self.kind_of: dict[str, str] = {}
        self.domain_of: dict[str, str] = {}
        for r in records:
            self.by_cell[(r["setting"], r["run"])][r["question"]] = r
            self.doc_of[r["question"]] = r["doc"]
            self.kind_of[r["question"]] = r["kind"]
            self.domain_of[r["question"]] = r["domain"]
        self.kinds = tuple(kinds) if kinds is not None else tuple(sorted({k for k in self.kind_of.values()
                                                                         if k not in UNSCORED_KINDS}))

    def cells(self, setting: str | None = None) -> list[tuple[str, str]]:
        return [c for c in self.by_cell if setting is None or c[0] == setting]

    def scored(self, cell, where=None) -> dict[str, float]:
        """question -> score of a cell's questions with a reference answer (optionally only those ``where`` keeps)."""
        return {q: r["score"] for q, r in self.by_cell.get(cell, {}).items()
                if self.kind_of[q] in self.kinds and r.get("score") is not None and (where is None or where(q))}

    def full_cell(self, setting: str, run: str) -> tuple[str, str]:
        """The full cache of the same implementation (criticalkv's, or kvpress's for a kvpress run)."""
        return ("agnostic", "kvpress full") if run.startswith("kvpress ") else ("agnostic", "full")


def _cluster_resample(doc_ids: np.ndarray, rng: np.random.Generator, resamples: int) -> np.ndarray:
    """[resamples, D] counts of how often each of the D documents is drawn (with replacement)."""
    d = len(doc_ids)
    draws = rng.integers(0, d, size=(resamples, d))
    counts = np.zeros((resamples, d), dtype=np.int64)
    np.add.at(counts, (np.repeat(np.arange(resamples), d), draws.ravel()), 1)
    return counts


def cluster_mean_ci(values: dict[str, float], doc_of: dict[str, str], resamples: int = RESAMPLES,
                    seed: int = SEED) -> tuple[float, float, float, int]:
    """(mean, low, high, n) of per-question values, with a 95 % cluster-bootstrap interval over documents."""
    if not values:
        return float("nan"), float("nan"), float("nan"), 0
    docs = sorted({doc_of[q] for q in values})
    index = {d: i for i, d in enumerate(docs)}
    sums = np.zeros(len(docs))
    counts = np.zeros(len(docs))
    for q, v in values.items():
        sums[index[doc_of[q]]] += v
        counts[index[doc_of[q]]] += 1
    draws = _cluster_resample(np.arange(len(docs)), np.random.default_rng(seed), resamples)
    boot = (draws @ sums) / np.maximum(draws @ counts, 1)
    mean = float(sums.sum() / counts.sum())
    return mean, float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5)), int(counts.sum())


def paired(a: dict[str, float], b: dict[str, float], doc_of: dict[str, str]) -> dict:
    """a - b on the questions both answered: mean difference, its cluster-bootstrap 95 % interval, wins, sign test."""
    common = sorted(set(a) & set(b))
    diff = {q: a[q] - b[q] for q in common}
    mean, lo, hi, n = cluster_mean_ci(diff, doc_of)
    wins = sum(1 for v in diff.values() if v > 0)
    losses = sum(1 for v in diff.values() if v < 0)
    return {"n": n, "mean_diff": mean, "ci95": [lo, hi], "wins": wins, "losses": losses,
            "sign_test_p": sign_test(wins, losses)}


def fidelity(cells: Cells, cell) -> dict:
    """Fidelity of a cell's answers to its implementation's full cache (module docstring)."""
    records = cells.by_cell.get(cell, {})
    closed = [r for q, r in records.items() if "exact" in r]
    out: dict = {}
    if closed:
        same = {q: float(r["exact"]) for q, r in records.items() if "exact" in r}
        kl = {q: float(r["kl"]) for q, r in records.items() if "kl" in r}
        out["same"] = cluster_mean_ci(same, cells.doc_of)
        out["agree"] = float(np.mean([r["agree"] for r in closed]))
        out["kl"] = cluster_mean_ci(kl, cells.doc_of)
    full = cells.by_cell.get(cells.full_cell(*cell), {})
    f1 = {q: overlap_f1(r["text"], full[q]["text"]) for q, r in records.items()
          if cells.kind_of[q] in UNSCORED_KINDS and q in full}
    if f1:
        out["open_f1"] = cluster_mean_ci(f1, cells.doc_of)
    return out


def lost_at_larger_budget(cells: Cells, setting: str, policy: str, runs: dict[float, str]) -> dict:
    """Questions answered right (score 1) at a budget and not at the next larger one, for each consecutive pair of
    ``runs`` (fraction -> run key); and over all pairs."""
    fractions = sorted(runs)
    out, total, pairs = {}, 0, 0
    for small, large in zip(fractions, fractions[1:]):
        a = cells.scored((setting, runs[small]))
        b = cells.scored((setting, runs[large]))
        common = set(a) & set(b)
        lost = sorted(q for q in common if a[q] >= 1.0 and b[q] < 1.0)
        out[f"{small:g}->{large:g}"] = {"lost": len(lost), "of": len(common), "questions": lost}
        total += len(lost)
        pairs += len(common)
    return {"pairs": out, "lost": total, "of": pairs}


def _pct(x: float) -> str:
    return "-" if x != x else f"{100 * x:.1f}"


def _ci(m: tuple) -> str:
    mean, lo, hi = m[:3]
    return "-" if mean != mean else f"{100 * mean:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"


def _diff(p: dict) -> str:
    lo, hi = p["ci95"]
    return (f"{100 * p['mean_diff']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] "
            f"({p['wins']} won, {p['losses']} lost, p={p['sign_test_p']:.2g}, n={p['n']})")


def split_run(run: str) -> tuple[str, str | None]:
    """``"spec@25%"`` -> ("spec", "25%"); ``"full"`` -> ("full", None)."""
    if "@" not in run:
        return run, None
    spec, rule = run.rsplit("@", 1)
    return spec, rule


def fraction_of(rule: str | None) -> float | None:
    if rule is None or not rule.endswith("%") or rule.startswith("t"):
        return None
    return float(rule[:-1]) / 100


# ------------------------------------------------------------------------------------------------ the tables
#: The default context policy (the engines' ``--context-policy`` default): the rows every comparison starts from.
DEFAULT_CONTEXT_POLICY = "layer-kvzip-criticalkv:kvzip_score=surrogate:head_cap_ratio=6"
#: The knobs kvpress's SnapKV-based presses get beside criticalkv: criticalkv's observation window and pooling kernel
#: (the policies' defaults, 32 and 7). kvpress's own defaults, a 64-token window and a 5-wide pool, lose the later
#: digits of a number its window points at (3996 read as 399 at 25 % and at 50 %), which criticalkv's 7-wide pool keeps;
#: the pools still differ in kind (kvpress averages, criticalkv takes the maximum, as SnapKV's reference code does).
SNAPKV_MATCHED = ":window_size=32:kernel_size=7"
#: (setting, ours, theirs, what the target asks of ours - theirs) pairs the tables always compare, when present.
COMPARISONS = (
    ("agnostic", DEFAULT_CONTEXT_POLICY, "kvpress KVzipPress", "target: interval above -2 points at 12.5 % and 25 %"),
    ("agnostic", DEFAULT_CONTEXT_POLICY, "full", "target: within 3 points at 25 %"),
    ("agnostic", "keydiff", "kvpress KeyDiffPress", "the same method in both implementations"),
    ("aware", "criticalkv", f"kvpress CriticalKVPress(SnapKVPress){SNAPKV_MATCHED}", "target: interval above 0"),
    ("aware", "criticalkv", "snapkv", "target: interval above 0"),
    ("aware", "ada-criticalkv", f"kvpress CriticalAdaKVPress(SnapKVPress){SNAPKV_MATCHED}", ""),
    ("aware", "snapkv", f"kvpress SnapKVPress{SNAPKV_MATCHED}", ""),
    ("aware", "criticalkv", "kvpress CriticalKVPress(SnapKVPress)", "kvpress's own window and pool"),
)


def _runs_by_spec(cells: Cells, setting: str) -> dict[str, dict]:
    """spec -> {fraction: run key} of the fixed budgets, and {"adaptive": [run keys]}."""
    out: dict[str, dict] = {}
    for s, run in cells.cells(setting):
        spec, rule = split_run(run)
        entry = out.setdefault(spec, {"fixed": {}, "adaptive": []})
        f = fraction_of(rule)
        if rule is None:
            entry["full"] = run
        elif f is not None:
            entry["fixed"][f] = run
        else:
            entry["adaptive"].append(run)
    return out


def _order(specs: Sequence[str]) -> list[str]:
    def key(spec):
        return (spec.startswith("kvpress "), spec not in ("full", "kvpress full"), spec != DEFAULT_CONTEXT_POLICY, spec)

    return sorted(specs, key=key)


def summarize(cells: Cells, documents: Sequence[dict] = ()) -> dict:
    """Every number the tables show (``summary.json``)."""
    summary: dict = {"kinds": list(cells.kinds), "settings": {}}
    timing = _scoring_ratios(documents)
    for setting in ("agnostic", "aware"):
        runs = _runs_by_spec(cells, setting)
        if setting == "aware":  # full answers the same either way: its row is the question-agnostic one
            runs.update({k: v for k, v in _runs_by_spec(cells, "agnostic").items() if k in ("full", "kvpress full")})
        if not runs:
            continue
        rows = {}
        for spec in _order(list(runs)):
            entry = runs[spec]
            row: dict = {"cells": {}}
            keys = {None: entry["full"]} if "full" in entry else dict(entry["fixed"])
            for f, run in keys.items():
                cell = ("agnostic" if run in ("full", "kvpress full") else setting, run)
                row["cells"]["full" if f is None else f"{f:g}"] = {
                    "run": run, "accuracy": cluster_mean_ci(cells.scored(cell), cells.doc_of),
                    "fidelity": fidelity(cells, cell),
                    "kept": float(np.mean([r["kept"] for r in cells.by_cell[cell].values()])),
                }
            if len(entry["fixed"]) > 1:
                row["lost"] = lost_at_larger_budget(cells, setting, spec, entry["fixed"])
            if spec in timing.get(setting, {}):
                row["scoring_over_prefill"] = timing[setting][spec]
            for run in sorted(entry["adaptive"]):
                cell = (setting, run)
                row.setdefault("adaptive", {})[run] = {
                    "accuracy": cluster_mean_ci(cells.scored(cell), cells.doc_of), "fidelity": fidelity(cells, cell),
                    "kept": float(np.mean([r["kept"] for r in cells.by_cell[cell].values()])),
                    "budget_fraction": float(np.mean([r["budget"] / r["n"] for r in cells.by_cell[cell].values()])),
                }
            rows[spec] = row
        comparisons = []
        for s, ours, theirs, note in COMPARISONS:
            if s != setting or ours not in runs or theirs not in runs:
                continue
            comparisons.append(_compare(cells, setting, ours, theirs, runs, note))
        for spec in rows:  # every policy against the default (agnostic) / criticalkv (aware) too
            anchor = DEFAULT_CONTEXT_POLICY if setting == "agnostic" else "criticalkv"
            if spec not in (anchor, "full", "kvpress full") and anchor in runs and not any(
                    c["ours"] == anchor and c["theirs"] == spec for c in comparisons):
                comparisons.append(_compare(cells, setting, anchor, spec, runs, ""))
        summary["settings"][setting] = {"rows": rows, "comparisons": comparisons,
                                        "adaptive": _adaptive(cells, setting, runs)}
        summary["settings"][setting]["by_kind"] = _breakdown(cells, setting, runs, cells.kind_of)
        summary["settings"][setting]["by_domain"] = _breakdown(cells, setting, runs, cells.domain_of)
    return summary


def _compare(cells, setting, ours, theirs, runs, note) -> dict:
    out = {"ours": ours, "theirs": theirs, "note": note, "by_fraction": {}}
    a, b = runs[ours], runs[theirs]
    for f in sorted(a["fixed"]):
        other = b["fixed"].get(f) if "full" not in b else b["full"]
        if other is None:
            continue
        other_cell = ("agnostic", other) if other in ("full", "kvpress full") else (setting, other)
        out["by_fraction"][f"{f:g}"] = paired(cells.scored((setting, a["fixed"][f])), cells.scored(other_cell),
                                              cells.doc_of)
    return out


def _adaptive(cells: Cells, setting: str, runs: dict) -> list[dict]:
    """Each adaptive run beside the same policy's fixed budgets: its accuracy and mean kept fraction, and the paired
    difference against each fixed budget that keeps more on average (``memory_ratio`` = its kept / theirs; the target
    asks for the fixed budget's accuracy at <= 0.8x its memory)."""
    out = []
    for spec, entry in runs.items():
        for run in sorted(entry["adaptive"]):
            cell = (setting, run)
            acc = cluster_mean_ci(cells.scored(cell), cells.doc_of)
            kept = float(np.mean([r["kept"] for r in cells.by_cell[cell].values()]))
            against = []
            for f, fixed in sorted(entry["fixed"].items()):
                mine, theirs = cells.by_cell[cell], cells.by_cell[(setting, fixed)]
                common = sorted(set(mine) & set(theirs))  # the same documents, in order (same sums)
                if not common:
                    continue
                own_kept = float(np.mean([mine[q]["kept"] for q in common]))
                fixed_kept = float(np.mean([theirs[q]["kept"] for q in common]))
                if own_kept <= fixed_kept:
                    against.append({"fixed": fixed, "fixed_kept": fixed_kept, "memory_ratio": own_kept / fixed_kept,
                                    "paired": paired(cells.scored(cell), cells.scored((setting, fixed)), cells.doc_of)})
            out.append({"run": run, "spec": spec, "accuracy": acc, "kept": kept, "against": against})
    return out


def _breakdown(cells: Cells, setting: str, runs: dict, group_of: dict) -> dict:
    """Accuracy per kind (or domain) of each fixed-budget cell and full."""
    groups = sorted(set(group_of.values()))
    out: dict = {}
    for spec, entry in runs.items():
        keys = {"full": entry["full"]} if "full" in entry else {f"{f:g}": r for f, r in entry["fixed"].items()}
        for label, run in keys.items():
            cell = ("agnostic", run) if run in ("full", "kvpress full") else (setting, run)
            out.setdefault(spec, {})[label] = {}
            for g in groups:
                if group_of is cells.kind_of and g in UNSCORED_KINDS:
                    continue
                scored = {q: s for q, s in cells.by_cell.get(cell, {}).items() if group_of[q] == g}
                values = {q: r["score"] for q, r in scored.items() if r.get("score") is not None}
                if values:
                    out[spec][label][g] = [float(np.mean(list(values.values()))), len(values)]
    return out


def _scoring_ratios(documents: Sequence[dict]) -> dict:
    """setting -> spec -> median over documents of (time scoring the document) / (its prefill's time)."""
    ratios: dict = defaultdict(lambda: defaultdict(list))
    for d in documents:
        seen = set()
        for run, info in d.get("runs", {}).items():
            spec, _ = split_run(run)
            if d.get("prefill_s") and spec not in seen:  # one score per document, whatever the budgets
                seen.add(spec)
                ratios["agnostic"][spec].append(info.get("scores_s", 0.0) / d["prefill_s"])
    return {s: {spec: {"median": float(np.median(v)), "documents": len(v)}
                for spec, v in by.items()} for s, by in ratios.items()}


def targets(summary: dict) -> list[str]:
    """The targets the tables are read against, each met or not with its numbers (markdown bullets)."""
    out = []

    def comparison(setting, ours, theirs):
        for c in summary["settings"].get(setting, {}).get("comparisons", []):
            if c["ours"] == ours and c["theirs"] == theirs:
                return c
        return None

    def verdict(ok: bool) -> str:
        return "**met**" if ok else "**not met**"

    agnostic = summary["settings"].get("agnostic", {})
    c = comparison("agnostic", DEFAULT_CONTEXT_POLICY, "kvpress KVzipPress")
    if c:
        for f in ("0.125", "0.25"):
            p = c["by_fraction"].get(f)
            if p:
                out.append(f"- Question-agnostic at {_label(f)}: the default context policy - kvpress KVzipPress "
                           f"{_diff(p)}; interval above -2 points: {verdict(p['ci95'][0] > -0.02)}.")
    c = comparison("agnostic", DEFAULT_CONTEXT_POLICY, "full")
    if c and "0.25" in c["by_fraction"]:
        p = c["by_fraction"]["0.25"]
        out.append(f"- Within 3 points of `full` at 25 %: {_diff(p)}: {verdict(p['mean_diff'] >= -0.03)} (the point "
                   f"estimate; the interval's lower end {100 * p['ci95'][0]:+.1f}).")
    row = agnostic.get("rows", {}).get(DEFAULT_CONTEXT_POLICY, {})
    if "scoring_over_prefill" in row:
        r = row["scoring_over_prefill"]
        out.append(f"- Scoring time <= 0.05x a prefill: {r['median']:.3f}x (median over {r['documents']} documents, "
                   f"measured inside the evaluation): {verdict(r['median'] <= 0.05)}.")
    if "lost" in row:
        out.append(f"- 0 questions lost at a larger budget (the default): {row['lost']['lost']} of {row['lost']['of']}: "
                   f"{verdict(row['lost']['lost'] == 0)}.")
    for theirs in (f"kvpress CriticalKVPress(SnapKVPress){SNAPKV_MATCHED}", "snapkv"):
        c = comparison("aware", "criticalkv", theirs)
        if not c:
            continue
        for f in ("0.125", "0.25"):
            p = c["by_fraction"].get(f)
            if p:
                out.append(f"- Question-aware at {_label(f)}: criticalkv - {theirs} {_diff(p)}; interval above 0: "
                           f"{verdict(p['ci95'][0] > 0)}.")
    for a in agnostic.get("adaptive", []):
        for x in a["against"]:
            p = x["paired"]
            ok = p["mean_diff"] >= 0 and x["memory_ratio"] <= 0.8
            out.append(f"- Adaptive `{a['run']}` ({100 * a['kept']:.1f} % kept) against {x['fixed']} "
                       f"({100 * x['memory_ratio']:.0f} % of its memory): {_diff(p)}; its accuracy at <= 0.8x its "
                       f"memory: {verdict(ok)}.")
    return out


def _label(fraction: str) -> str:
    return f"{100 * float(fraction):g} %"


def render(summary: dict, meta: dict, others: Sequence[dict] = (), documents: Sequence[dict] = ()) -> str:
    """``tables.md``: every table of ``summary`` with how it was made (``meta``: the run's ``config.json``; ``others``:
    those of the runs beside it, kvpress's and an adaptive one)."""
    env = meta.get("environment", {})
    lines = ["# Shared context: one document compressed once, many questions (generated by `criticalkv eval report "
             "DIR` from the records)", ""]
    if meta:
        n_docs = len(documents) or meta.get("documents")
        lines += [f"Model {meta['config']['model']}; {n_docs} documents of {', '.join(meta['config']['domains'])} "
                  f"({meta['config']['split']} split), {', '.join(map(str, meta['config']['lengths']))} tokens "
                  f"in turn; question kinds {', '.join(meta['config']['kinds'])}. Machine: {env.get('cpu', '?')}, "
                  f"{env.get('cpu_count', '?')} CPUs, torch {env.get('torch', '?')}, transformers "
                  f"{env.get('transformers', '?')}, criticalkv {env.get('criticalkv', '?')}.", ""]
    if meta or others:
        lines += ["Commands (a resumed run's earlier commands first: the documents they finished keep all their "
                  "runs):", ""]
        lines += ["    " + c for m in ([meta] if meta else []) + list(others)
                  for c in list(m.get("earlier_commands", [])) + [m["command"]]]
        for m in others:
            if m.get("versions"):
                lines += ["", "kvpress ran in its own environment: " + ", ".join(f"{k} {v}" for k, v in
                                                                                m["versions"].items()) + "."]
        lines.append("")
    lines += ["Accuracy: the mean score of the questions with a reference answer (every kind but `open`), % with its "
              "95 % interval (a cluster bootstrap over documents, 2,000 resamples). *same*: answers whose tokens are "
              "the full cache's (of the same implementation: kvpress's rows against kvpress's full cache), %; "
              "*KL*: the mean KL divergence of the first answer token's distribution from the full cache's (nats); "
              "*open F1*: the word F1 of the open question's answer against the full cache's. Budgets are fractions "
              "of the tokens compressed (the context, or question-aware the whole prompt), per KV head on "
              "average.", ""]
    goals = targets(summary)
    if goals:
        lines += ["## Targets", ""] + goals + [""]
    for setting, title in (("agnostic", "Question-agnostic: the context compressed once, before any question"),
                           ("aware", "Question-aware: the document and the question compressed together")):
        block = summary["settings"].get(setting)
        if not block:
            continue
        rows = block["rows"]
        fractions = sorted({f for r in rows.values() for f in r["cells"] if f != "full"}, key=float)
        lines += [f"## {title}", ""]
        head = "| policy | " + " | ".join(f"{_label(f)}" for f in fractions) + " | questions |"
        lines += [head, "|---|" + "---:|" * (len(fractions) + 1)]
        for spec, row in rows.items():
            cells = row["cells"]
            if "full" in cells:
                acc = _ci(cells["full"]["accuracy"])
                lines.append(f"| `{spec}` | " + " | ".join(acc for _ in fractions) +
                             f" | {cells['full']['accuracy'][3]} |")
                continue
            n = max((c["accuracy"][3] for c in cells.values()), default=0)
            lines.append(f"| `{spec}` | " + " | ".join(_ci(cells[f]["accuracy"]) if f in cells else "-"
                                                      for f in fractions) + f" | {n} |")
        lines += ["", "Fidelity to the full cache, lost answers and cost:", "",
                  "| policy | " + " | ".join(f"same / KL / open F1 at {_label(f)}" for f in fractions) +
                  " | lost at a larger budget | scoring / prefill |",
                  "|---|" + "---|" * len(fractions) + "---:|---:|"]
        for spec, row in rows.items():
            cells = row["cells"]
            if "full" in cells:
                continue
            parts = []
            for f in fractions:
                fid = cells.get(f, {}).get("fidelity", {})
                same = _pct(fid["same"][0]) if "same" in fid else "-"
                kl = f"{fid['kl'][0]:.3f}" if "kl" in fid else "-"
                f1 = _pct(fid["open_f1"][0]) if "open_f1" in fid else "-"
                parts.append(f"{same} / {kl} / {f1}")
            lost = f"{row['lost']['lost']} of {row['lost']['of']}" if "lost" in row else "-"
            ratio = row.get("scoring_over_prefill")
            cost = "-" if spec.startswith("kvpress") or setting == "aware" else (
                "0" if ratio is None or ratio["median"] == 0 else f"{ratio['median']:.3f}x")
            if spec.startswith("kvpress KVzip"):
                cost = "its re-read"
            lines.append(f"| `{spec}` | " + " | ".join(parts) + f" | {lost} | {cost} |")
        lines += ["", "Paired differences (same questions; points, 95 % cluster-bootstrap interval, questions won and "
                  "lost, sign test):", "", "| ours - theirs | " + " | ".join(_label(f) for f in fractions) + " | |",
                  "|---|" + "---|" * len(fractions) + "---|"]
        for c in block["comparisons"]:
            parts = [_diff(c["by_fraction"][f]) if f in c["by_fraction"] else "-" for f in fractions]
            lines.append(f"| `{c['ours']}` - `{c['theirs']}` | " + " | ".join(parts) + f" | {c['note']} |")
        if block.get("adaptive"):
            lines += ["", "### Adaptive budget: what the score ranks above a threshold, at most a cap", "",
                      "| run | mean kept, % of the cache | accuracy | against each fixed budget keeping more |",
                      "|---|---:|---:|---|"]
            for a in block["adaptive"]:
                against = "; ".join(f"{x['fixed'].rsplit('@', 1)[1]} ({100 * x['memory_ratio']:.0f} % of its memory): "
                                    f"{_diff(x['paired'])}" for x in a["against"]) or "-"
                lines.append(f"| `{a['run']}` | {100 * a['kept']:.1f} | {_ci(a['accuracy'])} | {against} |")
        for name, key in (("kind", "by_kind"), ("domain", "by_domain")):
            table = block.get(key) or {}
            groups = sorted({g for spec in table.values() for cell in spec.values() for g in cell})
            if not groups:
                continue
            lines += ["", f"Accuracy by question {name} (%, questions):" if name == "kind" else
                      f"Accuracy by {name} (%, questions):", "",
                      f"| policy | budget | " + " | ".join(groups) + " |", "|---|---|" + "---:|" * len(groups)]
            for spec, by_budget in table.items():
                for label, cell in sorted(by_budget.items(), key=lambda kv: (kv[0] != "full", kv[0])):
                    shown = "-" if label == "full" else _label(label)
                    lines.append(f"| `{spec}` | {shown} | " + " | ".join(
                        f"{100 * cell[g][0]:.0f} ({cell[g][1]})" if g in cell else "-" for g in groups) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"
