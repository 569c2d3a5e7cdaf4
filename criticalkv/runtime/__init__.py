"""The runtime: ``Engine.load(dir)`` over ONNX Runtime (TensorRT backends register in
``criticalkv.runtime.registry.BACKENDS``): slots (prefill / decode / release) for serving, ``generate`` for a
static batch; ``Request`` and ``SamplingParams`` are what it serves."""

from criticalkv.runtime.backend import Backend, PrefillOutputs
from criticalkv.errors import RequestError
from criticalkv.request import Request, SamplingParams
from criticalkv.runtime.engine import Engine, GenerationResult, PrefillResult
from criticalkv.runtime.manifest import FORMAT_VERSION, MANIFEST_FILE, EngineError, read_manifest
from criticalkv.runtime.registry import BACKENDS, create_backend

__all__ = [
    "BACKENDS",
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "Backend",
    "Engine",
    "EngineError",
    "GenerationResult",
    "PrefillResult",
    "Request",
    "RequestError",
    "SamplingParams",
    "PrefillOutputs",
    "create_backend",
    "read_manifest",
]
