"""Time spent in the selection nodes, read from an ONNX Runtime profile (``SessionOptions.enable_profiling``).

ONNX Runtime inlines the ``CriticalKVSelect`` function body: its nodes are named
``_inlfunc_CriticalKVSelect_*`` (a model-level policy's ``CriticalKVScore`` and ``CriticalKVSelectModel`` bodies
likewise; both count as selection). Nodes inside the body's ``If`` also appear on their own, nested in the
``If`` node's time span, so the selection time of a run is the length of the union of those spans.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from criticalkv.node import BRANCH_NODES, MODEL_OP_TYPE, OP_TYPE, SCORE_OP_TYPE

SELECTION_MARK = f"_inlfunc_{OP_TYPE}_"
SELECTION_MARKS = tuple(f"_inlfunc_{op}_" for op in (OP_TYPE, SCORE_OP_TYPE, MODEL_OP_TYPE))


@dataclass(frozen=True)
class RunProfile:
    """One ``InferenceSession.run``: its total time and the time of the selection nodes (seconds)."""

    total_s: float
    selection_s: float

    @property
    def selection_fraction(self) -> float:
        return self.selection_s / self.total_s if self.total_s else 0.0


def _union_length(spans: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for start, stop in sorted(spans):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def selection_profile(trace: str | Path) -> list[RunProfile]:
    """Per-run (total, selection) times of a profiled session, in run order."""
    events = json.loads(Path(trace).read_text())
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    spans: list[list[tuple[int, int]]] = [[] for _ in runs]
    for e in events:
        name = e.get("name", "")
        if e.get("cat") != "Node" or not any(mark in name for mark in SELECTION_MARKS) or not name.endswith("_kernel_time"):
            continue
        for i, run in enumerate(runs):
            if run["ts"] <= e["ts"] <= run["ts"] + run["dur"]:
                spans[i].append((e["ts"], e["ts"] + e["dur"]))
                break
    return [RunProfile(run["dur"] / 1e6, _union_length(s) / 1e6) for run, s in zip(runs, spans)]


def stage2_branches(trace: str | Path) -> dict[str, int]:
    """How often each branch of the pruned stage 2 ran in a profiled session (all runs, all layers): the counts of
    ``2k``, ``4k`` (the first candidates did not suffice) and ``all`` (every norm computed)."""
    events = json.loads(Path(trace).read_text())
    names = [e["name"] for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")]
    return {node.rsplit("_", 1)[1]: sum(f"/{node}_" in name for name in names) for node in BRANCH_NODES}
