"""The backends an ``Engine`` can run on, by name, each imported only when asked for.

A backend module imports ``criticalkv.runtime.backend`` (the interface it implements); the registry lives apart
from it, so that the interface does not name its implementations (``tensorrt_backend`` imports torch and TensorRT,
which a CPU machine may not have).

Every built-in backend is registered here, in code: a copy of the repository on PYTHONPATH (no install, no package
metadata: what reaches an offline GPU machine) runs every one of them. The torch and TensorRT backends import torch;
the registry names them by string, so a process that serves an ONNX Runtime engine never imports it
(tests/test_layers.py: the ONNX Runtime side never reaches torch). A third-party backend plugs in through the package
metadata: an entry point of the group ``criticalkv.backends``, ``name = "module:class"`` (a built-in name wins).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from criticalkv.runtime.backend import Backend

#: Backend name -> "module:class", imported only when asked for.
BACKENDS: dict[str, str] = {
    "onnxruntime": "criticalkv.runtime.onnxruntime_backend:OnnxRuntimeBackend",
    "tensorrt": "criticalkv.runtime.tensorrt_backend:TensorRTBackend",
    "torch": "criticalkv.runtime.torch_backend:TorchBackend",
    "openvino": "criticalkv.runtime.openvino_backend:OpenVINOBackend",
}


#: The entry-point group of third-party backends registered by package metadata.
ENTRY_POINT_GROUP = "criticalkv.backends"


def backend_names() -> dict[str, str]:
    """Every backend: name -> "module:class" (the built-in ones, then the entry points of ENTRY_POINT_GROUP; metadata
    that cannot be read adds none)."""
    from importlib.metadata import entry_points

    names = dict(BACKENDS)
    try:
        points = list(entry_points(group=ENTRY_POINT_GROUP))
    except Exception:  # noqa: BLE001 (a broken third-party distribution must not hide the built-in backends)
        points = []
    for point in points:
        names.setdefault(point.name, point.value)
    return names


def create_backend(name: str, folder: Path, manifest: dict[str, Any], **options: Any) -> Backend:
    """The backend ``name`` over the engine directory ``folder`` (``options`` go to its constructor)."""
    names = backend_names()
    if name not in names:
        raise ValueError(f"backend {name!r} is not one of {', '.join(names)}")
    module, cls = names[name].split(":")
    return getattr(importlib.import_module(module), cls)(folder, manifest, **options)
