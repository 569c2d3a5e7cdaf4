"""The interface between ``Engine`` (generation loop, sampling, stop tokens, streaming) and a backend
that runs the prefill and decode graphs (ONNX Runtime here; TensorRT beside it on GPUs).

A backend owns the KV buffers: it allocates them once for the built maximum batch (one row per sequence
slot), fills them from the prefill outputs in ``begin_decode`` (or one slot at a time with ``load_slot``)
and updates them in place in every ``decode`` step, which runs over the first B rows. The serving
scheduler keeps its running sequences in those first B rows: it loads a new request's kept K/V into row
B with ``load_slot`` and, when a sequence ends, moves the last row into the freed one with ``move_slot``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from criticalkv.runtime.manifest import EngineError


@dataclass
class PrefillOutputs:
    """What the prefill graph returns (NumPy, host memory).

    logits : [B, vocab] float32, each sequence's last prompt token
    keys, values : per layer [B, H_kv, cap_l, d_h] float32, kept entries, zero padded
    lengths : per layer [B, H_kv] int32, kept entries per head
    indices : per layer [B, H_kv, cap_l] int32, kept positions into the padded prompt, -1 padded
    seconds : wall time of the prefill call
    """

    logits: np.ndarray
    keys: list[np.ndarray]
    values: list[np.ndarray]
    lengths: list[np.ndarray]
    indices: list[np.ndarray]
    seconds: float


class BuiltShapes:
    """The built shapes a backend sizes its buffers with, read from the engine's manifest."""

    num_layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_batch: int
    capacities: list[int]  # decode capacity per layer
    built_budget: int  # the policy's budget the engine was built with (the largest per-request budget)

    def read_shapes(self, manifest: dict[str, Any]) -> None:
        spec = manifest["model"]["spec"]
        self.num_layers = spec["num_layers"]
        self.kv_heads = spec["num_kv_heads"]
        self.head_dim = spec["head_dim"]
        self.vocab = spec["vocab_size"]
        self.max_batch = manifest["build"]["max_batch_size"]
        self.capacities = manifest["shapes"]["decode_capacity"]
        self.built_budget = manifest["policy"]["budget"]

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_batch:
            raise EngineError(f"slot {slot} is outside the engine's {self.max_batch} rows (max batch size)")


def budget_feed(kv_budget: int, input_type: str, rank: int) -> np.ndarray:
    """The value fed to a prefill graph's ``kv_budget`` input: its integer type, scalar or [1]."""
    dtype = {"tensor(int32)": np.int32, "tensor(int64)": np.int64}.get(input_type)
    if dtype is None:
        raise EngineError(f"the prefill graph's kv_budget input has type {input_type}; expected int32 or int64")
    value = np.array(kv_budget, dtype=dtype)
    return value.reshape((1,) * rank)


#: The error for a per-request budget on an engine whose prefill graph fixes the budget.
NO_BUDGET_INPUT = "this engine was built without a runtime budget input; rebuild it"


class Backend(Protocol):
    """What ``Engine`` needs of a backend."""

    name: str

    #: True when the prefill graph takes the budget as a runtime input (``kv_budget``).
    accepts_kv_budget: bool

    def prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                kv_budget: int | None = None) -> PrefillOutputs:
        """Run the prompt ([B, n] int64 each, left-padded) with the budget ``kv_budget`` (tokens per KV head,
        <= the built budget; the caller checks the range, see ``KVPolicy.with_budget``). None keeps the built
        budget; another budget needs a prefill graph with a ``kv_budget`` input (every engine built since the
        input exists has one)."""

    def begin_decode(self, prefill: PrefillOutputs) -> None:
        """Copy the kept K/V and lengths of the last prefill into rows 0..B-1 (B = prefill's batch)."""

    def load_slot(self, slot: int, prefill: PrefillOutputs, row: int = 0) -> None:
        """Copy row ``row`` of the last prefill's kept K/V and lengths into buffer row ``slot``."""

    def move_slot(self, source: int, target: int) -> None:
        """Copy buffer row ``source`` (K, V, lengths) into row ``target``."""

    def decode(self, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """One step over the first B = len(tokens) rows: tokens and absolute positions [B] int64 (one per
        row) -> logits [B, vocab] (valid until the next call). Each row is computed from that row's inputs only
        (bitwise only for one batch size: ONNX Runtime's CPU GEMM rounds M = 1 and M > 1 differently, ~1e-7)."""

    def kv_buffer_bytes(self) -> int:
        """Bytes of the K and V buffers (all max_batch rows)."""

    def close(self) -> None:
        """Release sessions and buffers."""


#: Backend name -> "module:class", imported only when asked for (a TensorRT backend registers here).
BACKENDS: dict[str, str] = {
    "onnxruntime": "criticalkv.runtime.onnxruntime_backend:OnnxRuntimeBackend",
    "tensorrt": "criticalkv.runtime.tensorrt_backend:TensorRTBackend",
}


def create_backend(name: str, folder: Path, manifest: dict[str, Any], **options: Any) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r} is not one of {', '.join(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(folder, manifest, **options)
