"""PNG figures drawn from the summaries (written next to their JSON, atomically)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from criticalkv.eval.io import save_figure
from criticalkv.eval.specs import PolicyRun
from criticalkv.eval.summary import budgets_in_order, run_key, specs_in_order


def _plt():
    import matplotlib  # optional (the eval / bench extras): needed only for figures

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _short(spec: str) -> str:
    return spec.replace(":stage2_scores=", " ").replace("criticalkv", "ckv")


def needle_heatmap(grid: dict, scores: dict, runs: Sequence[PolicyRun], path: Path, title: str) -> None:
    """Figure 8 of the paper: for each policy (columns) and budget (rows) a heatmap of needle
    accuracy over context length (x) and depth (y), green = found. Budget-free policies (``full``)
    appear once, in the first row."""
    plt = _plt()
    specs = specs_in_order(runs)
    budgets = budgets_in_order(runs) or [None]
    fig, axes = plt.subplots(len(budgets), len(specs), figsize=(1.75 * len(specs) + 1.2, 2.3 * len(budgets) + 0.5),
                             squeeze=False, layout="constrained")
    image = None
    for i, b in enumerate(budgets):
        for j, spec in enumerate(specs):
            ax = axes[i][j]
            run = next(r for r in runs if r.spec == spec)
            if run.budget is None and i > 0:
                ax.axis("off")
                continue
            key = run_key(runs, spec, b)
            cells = grid.get(key, {})
            lengths = sorted(cells, key=int)
            depths = sorted({d for L in lengths for d in cells[L]}, key=float)
            data = np.array([[cells[L].get(d, np.nan) for L in lengths] for d in depths])
            image = ax.imshow(data, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto", origin="upper")
            ax.set_xticks(range(len(lengths)), [f"{int(L) / 1024:g}k" if int(L) % 1024 == 0 else L for L in lengths],
                          fontsize=6)
            ax.set_yticks(range(len(depths)), [f"{float(d):g}" for d in depths], fontsize=5)
            label = _short(spec) if run.budget is None else f"{_short(spec)}\nb={b}"
            ax.set_title(f"{label}: {scores[key]['score'] * 100:.0f}", fontsize=7)
            if j == 0:
                ax.set_ylabel("depth (%)", fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.colorbar(image, ax=axes, shrink=0.5, label="accuracy")
    save_figure(fig, path)


def ruler_bars(tasks_summary: dict, runs: Sequence[PolicyRun], lengths: Sequence[int], path: Path, title: str) -> None:
    """RULER-style average per policy (bars) and budget (groups), one panel per length."""
    plt = _plt()
    specs = specs_in_order(runs)
    budgets = budgets_in_order(runs) or [None]
    fig, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 3.6), squeeze=False)
    width = 0.8 / len(specs)
    cmap = plt.get_cmap("tab20")
    for a, L in enumerate(lengths):
        ax = axes[0][a]
        for j, spec in enumerate(specs):
            vals = []
            for b in budgets:
                entry = tasks_summary.get(run_key(runs, spec, b), {}).get("by_length", {}).get(str(L))
                vals.append(np.nan if entry is None else entry["average"] * 100)
            ax.bar(np.arange(len(budgets)) + (j - len(specs) / 2 + 0.5) * width, vals, width, label=spec, color=cmap(j))
        ax.set_xticks(range(len(budgets)), [f"b={b}" for b in budgets])
        ax.set_ylabel("RULER-style average")
        ax.set_title(f"{L} tokens", fontsize=9)
        ax.set_ylim(0, 100)
    axes[0][-1].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)


def perturbation_heads(summary: dict, path: Path, title: str) -> None:
    """Figure 2 of the paper: per head, base perturbation (x) vs CriticalKV (y), averaged over prompts;
    points below the diagonal are heads where CriticalKV perturbs the output less."""
    plt = _plt()
    pairs = summary["pairs"]
    if not pairs:
        return
    groups: dict = {}
    for p in pairs:
        groups.setdefault((p["variant"].rsplit("@", 1)[0], p["base"].rsplit("@", 1)[0]), []).append(p)
    budgets = sorted({p["budget"] for p in pairs})
    fig, axes = plt.subplots(len(groups), len(budgets), figsize=(3.0 * len(budgets) + 1, 2.9 * len(groups)),
                             squeeze=False, layout="constrained")
    sc = None
    for i, ((spec, base), items) in enumerate(groups.items()):
        for j, b in enumerate(budgets):
            ax = axes[i][j]
            p = next((x for x in items if x["budget"] == b), None)
            if p is None:
                ax.axis("off")
                continue
            x = np.asarray(summary["runs"][p["base"]]["head_l1_mean"])
            y = np.asarray(summary["runs"][p["variant"]]["head_l1_mean"])
            layers = np.repeat(np.arange(x.shape[0]), x.shape[1])
            sc = ax.scatter(x.ravel(), y.ravel(), c=layers, cmap="viridis", s=5)
            lo = max(min(x.min(), y.min()), 1e-6)
            hi = max(x.max(), y.max())
            ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel(f"{base} (head L1)", fontsize=7)
            ax.set_ylabel(f"{_short(spec)} (head L1)", fontsize=7)
            ax.set_title(f"{_short(spec)} b={b}: lower in {p['frac_heads_lower'] * 100:.0f}%", fontsize=8)
            ax.tick_params(labelsize=6)
    if sc is not None:
        fig.colorbar(sc, ax=axes, shrink=0.4, label="layer")
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)


def perturbation_layers(summary: dict, runs: Sequence[PolicyRun], path: Path, title: str) -> None:
    """Figures 3a / 5 of the paper: per layer, the L1 perturbation of the layer's output hidden state
    (cascade) under each CriticalKV variant divided by its base's (below 1 = CriticalKV perturbs less),
    one panel per (base, budget)."""
    plt = _plt()
    pairs = summary["pairs"]
    if not pairs:
        return
    families: dict = {}
    for p in pairs:
        families.setdefault((p["base"].rsplit("@", 1)[0], p["budget"]), []).append(p)
    bases = sorted({k[0] for k in families})
    budgets = sorted({k[1] for k in families})
    fig, axes = plt.subplots(len(bases), len(budgets), figsize=(3.3 * len(budgets), 2.6 * len(bases)),
                             squeeze=False, layout="constrained", sharey=True)
    for i, base in enumerate(bases):
        for j, b in enumerate(budgets):
            ax = axes[i][j]
            items = families.get((base, b), [])
            if not items:
                ax.axis("off")
                continue
            base_curve = np.asarray(summary["runs"][items[0]["base"]]["layer_l1_mean"])
            for p in items:
                curve = np.asarray(summary["runs"][p["variant"]]["layer_l1_mean"]) / np.maximum(base_curve, 1e-30)
                ax.plot(curve, label=_short(p["variant"].rsplit("@", 1)[0]))
            ax.axhline(1.0, color="k", lw=0.8, ls="--")
            ax.set_title(f"vs {base}, b={b}", fontsize=8)
            ax.set_xlabel("layer", fontsize=7)
            if j == 0:
                ax.set_ylabel("hidden-state L1 / base", fontsize=7)
            ax.tick_params(labelsize=6)
            ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)
