"""The interface between ``Engine`` (generation loop, sampling, stop tokens, streaming) and a backend
that runs the prefill and decode graphs (ONNX Runtime here; TensorRT beside it on GPUs).

A backend owns the KV buffers: it allocates them once for the built maximum batch, fills them from
the prefill outputs in ``begin_decode`` and updates them in place in every ``decode`` step.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np


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

    def read_shapes(self, manifest: dict[str, Any]) -> None:
        spec = manifest["model"]["spec"]
        self.num_layers = spec["num_layers"]
        self.kv_heads = spec["num_kv_heads"]
        self.head_dim = spec["head_dim"]
        self.vocab = spec["vocab_size"]
        self.max_batch = manifest["build"]["max_batch_size"]
        self.capacities = manifest["shapes"]["decode_capacity"]


class Backend(Protocol):
    """What ``Engine`` needs of a backend."""

    name: str

    def prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> PrefillOutputs:
        """Run the prompt ([B, n] int64 each, left-padded)."""

    def begin_decode(self, prefill: PrefillOutputs) -> None:
        """Copy the kept K/V and lengths into the decode buffers (batch = prefill's B)."""

    def decode(self, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """One step: tokens and absolute positions [B] int64 -> logits [B, vocab] (valid until the next call)."""

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
