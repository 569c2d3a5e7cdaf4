"""Generation from a built engine directory: ``Engine.load(dir).generate(...)`` over ONNX Runtime
(TensorRT backends register in ``criticalkv.runtime.backend.BACKENDS``)."""

from criticalkv.runtime.backend import BACKENDS, Backend, PrefillOutputs, create_backend
from criticalkv.runtime.engine import Engine, GenerationResult
from criticalkv.runtime.manifest import FORMAT_VERSION, MANIFEST_FILE, EngineError, read_manifest

__all__ = [
    "BACKENDS",
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "Backend",
    "Engine",
    "EngineError",
    "GenerationResult",
    "PrefillOutputs",
    "create_backend",
    "read_manifest",
]
