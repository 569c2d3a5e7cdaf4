"""``torch`` for the method modules, imported when a method first runs PyTorch code.

The methods hold PyTorch code (their scores, budget sharing and top-k), and they sit on the ground floor: ``KVPolicy``
validates its knobs against their registry, and the ONNX Runtime side (``criticalkv.runtime``, the Triton model)
reads a policy from every manifest and checks every request's budget with it, in a process that has no use for torch
(a torch import costs seconds and hundreds of MB there). So the method modules read torch through this handle:
importing them imports nothing, and the first ``torch.<name>`` they evaluate imports torch (in a process without
torch, that line raises torch's own ImportError).

Why a handle and not ``importlib.util.LazyLoader``: a lazy loader must put a placeholder module in
``sys.modules["torch"]`` for the whole process, where any library that asks whether torch is loaded (``"torch" in
sys.modules``) then imports it by looking; this handle leaves ``sys.modules`` alone until torch is really needed.
"""

from __future__ import annotations

import importlib
from typing import Any


class LazyModule:
    """A module imported at the first read of one of its names; every name read is then kept on the handle."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        value = getattr(importlib.import_module(self._name), attr)
        setattr(self, attr, value)  # later reads of this name are plain attribute reads
        return value

    def __repr__(self) -> str:
        return f"<lazily imported module {self._name!r}>"


torch: Any = LazyModule("torch")
