"""criticalkv: compressed KV caches for long-context LLM serving (CriticalKV and its base methods).

``from criticalkv import KVPolicy, select_layer`` works as always, but this file imports nothing when the package is
imported: every ``criticalkv.*`` import runs it first, and a process that serves from ONNX Runtime (the Triton
model) must not load torch through it. ``KVPolicy`` and ``POLICIES`` load ``criticalkv.policy`` on first use, the
PyTorch reference (``select_layer``, ...) loads ``criticalkv.selection`` (and torch) on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_POLICY_NAMES = ("POLICIES", "KVPolicy")
_SELECTION_NAMES = ("LayerSelection", "gather_kv", "select_layer", "select_model")

__all__ = [*_POLICY_NAMES, *_SELECTION_NAMES, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _POLICY_NAMES:
        value = getattr(importlib.import_module("criticalkv.policy"), name)
    elif name in _SELECTION_NAMES:
        value = getattr(importlib.import_module("criticalkv.selection"), name)
    else:
        raise AttributeError(f"module 'criticalkv' has no attribute {name!r}")
    globals()[name] = value  # later reads are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
