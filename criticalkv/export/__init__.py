"""Hugging Face Llama-family model -> ONNX prefill / decode graphs with the ``CriticalKVSelect`` node.

``export_model`` writes the graphs; ``criticalkv.build.build_engine`` (``scripts/build_engine.py``)
adds validation, a smoke test on ONNX Runtime, the TensorRT step and the manifest.
"""

from criticalkv.export.exporter import BuildConfig, ExportResult, export_model
from criticalkv.export.select_function import selection_function, selection_model, selection_node

__all__ = ["BuildConfig", "ExportResult", "export_model", "selection_function", "selection_model", "selection_node"]
