"""The backends an ``Engine`` can run on, by name, each imported only when asked for.

A backend module imports ``criticalkv.runtime.backend`` (the interface it implements); the registry lives apart
from it, so that the interface does not name its implementations (``tensorrt_backend`` imports torch and TensorRT,
which a CPU machine may not have).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from criticalkv.runtime.backend import Backend

#: Backend name -> "module:class", imported only when asked for (a TensorRT backend registers here).
BACKENDS: dict[str, str] = {
    "onnxruntime": "criticalkv.runtime.onnxruntime_backend:OnnxRuntimeBackend",
    "tensorrt": "criticalkv.runtime.tensorrt_backend:TensorRTBackend",
}


def create_backend(name: str, folder: Path, manifest: dict[str, Any], **options: Any) -> Backend:
    """The backend ``name`` over the engine directory ``folder`` (``options`` go to its constructor)."""
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r} is not one of {', '.join(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(folder, manifest, **options)
