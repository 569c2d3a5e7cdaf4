"""The backends an ``Engine`` can run on, by name, each imported only when asked for.

A backend module imports ``criticalkv.runtime.backend`` (the interface it implements); the registry lives apart
from it, so that the interface does not name its implementations (``tensorrt_backend`` imports torch and TensorRT,
which a CPU machine may not have).

A backend that needs units above the runtime's floor (the torch backend runs the model's own transformers layers and
the ``criticalkv::select_layer`` op, both on PyTorch's floors) registers through the package metadata instead: an entry
point of the group ``criticalkv.backends`` (pyproject.toml), ``name = "module:class"``. The runtime never names it, so
the staircase holds, and a third-party backend can plug in the same way.
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


#: The entry-point group of backends registered by package metadata.
ENTRY_POINT_GROUP = "criticalkv.backends"


def backend_names() -> dict[str, str]:
    """Every backend: name -> "module:class" (the built-in ones, then the entry points of ENTRY_POINT_GROUP)."""
    from importlib.metadata import entry_points

    names = dict(BACKENDS)
    for point in entry_points(group=ENTRY_POINT_GROUP):
        names.setdefault(point.name, point.value)
    return names


def create_backend(name: str, folder: Path, manifest: dict[str, Any], **options: Any) -> Backend:
    """The backend ``name`` over the engine directory ``folder`` (``options`` go to its constructor)."""
    names = backend_names()
    if name not in names:
        raise ValueError(f"backend {name!r} is not one of {', '.join(names)}")
    module, cls = names[name].split(":")
    return getattr(importlib.import_module(module), cls)(folder, manifest, **options)
