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
import os
from pathlib import Path
from typing import Any

from criticalkv.runtime.backend import Backend
from criticalkv.runtime.manifest import default_backend, openvino_cannot_run

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


#: the backend ``criticalkv serve`` runs an engine on when --backend is not given (``served_backend``): a built-in
#: backend's name (``criticalkv.runtime.registry.BACKENDS``), or unset: the fastest CPU backend here
SERVE_BACKEND_ENV = "CRITICALKV_SERVE_BACKEND"


def served_backend(manifest: dict[str, Any]) -> tuple[str, str]:
    """The backend ``criticalkv serve`` runs an engine on when --backend is not given, and why (its log line).

    ``$CRITICALKV_SERVE_BACKEND`` when set. Else OpenVINO where it serves faster than ONNX Runtime: an exported engine
    with openvino graphs, the ``openvino`` package, and a CPU its plugin computes in bf16 (``INFERENCE_PRECISION_HINT``
    bf16: AVX-512 BF16 or AMX) at the backend's default precision. On the 2-vCPU Zen 4 of docs/openvino.md ("Served,
    beside ONNX Runtime and vLLM") that served a 2k chat's first token in 0.81x ONNX Runtime's time and 8 concurrent
    2k chats at 1.34x its output tokens/s. Else ``default_backend`` (ONNX Runtime, the fp32 parity path whose kept
    entries and tokens are checked against PyTorch's; torch for an engine built for it). The library's own default
    (``Engine.load``, ``generate``, a written model repository) stays ``default_backend``."""
    named = os.environ.get(SERVE_BACKEND_ENV)
    if named:
        if named not in BACKENDS:
            raise ValueError(f"${SERVE_BACKEND_ENV}={named!r} is not one of {', '.join(BACKENDS)}")
        return named, f"${SERVE_BACKEND_ENV}"
    base = default_backend(manifest)
    if base != "onnxruntime":
        return base, "the engine was built for it"
    reason = openvino_cannot_run(manifest)
    if reason:
        return base, reason
    if os.environ.get("CRITICALKV_OV_PRECISION", "default") != "default":  # openvino_backend.PRECISION_ENV
        return base, "$CRITICALKV_OV_PRECISION asks OpenVINO for f32, which serves no faster than ONNX Runtime"
    try:
        import openvino as ov

        hint = ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT")
    except Exception as err:  # noqa: BLE001 (not installed, or no CPU plugin: the parity path serves)
        return base, f"OpenVINO is not usable here ({type(err).__name__}: {err})"
    precision = hint.to_string() if hasattr(hint, "to_string") else str(hint)
    if precision != "bf16":
        return base, f"OpenVINO's CPU plugin computes in {precision} here (bf16 is what makes it the faster one)"
    return "openvino", "this CPU computes bf16, where OpenVINO serves fastest (--backend onnxruntime: the fp32 parity path)"
