"""Hugging Face Llama-family model -> ONNX prefill / decode graphs with the ``CriticalKVSelect`` node.

``export_model`` writes the graphs; ``criticalkv.build.build_engine`` (``scripts/build_engine.py``)
adds validation, a smoke test on ONNX Runtime, the TensorRT step and the manifest. The names below load their module
on first use (PEP 562): ``criticalkv.export.config`` (``BuildConfig``, the build's defaults) imports no ONNX, so the
command line's parsers read it at once.
"""

from __future__ import annotations

import importlib

_HOMES = {
    "BuildConfig": "criticalkv.export.config",
    "ExportResult": "criticalkv.export.exporter",
    "export_model": "criticalkv.export.exporter",
    "selection_function": "criticalkv.export.select_function",
    "selection_model": "criticalkv.export.select_function",
    "selection_node": "criticalkv.export.select_function",
}

__all__ = ["BuildConfig", "ExportResult", "export_model", "selection_function", "selection_model", "selection_node"]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'criticalkv.export' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
