"""transformers integration: compress a real model's cache after prefill and decode from it."""

from criticalkv.hf.cache import CompressedKVCache, CompressedLayer, packed_attention, packed_decoding
from criticalkv.hf.compress import PrefillResult, prefill_and_compress
from criticalkv.hf.generate import GenerationOutput, generate
from criticalkv.hf.loading import SUPPORTED_MODEL_TYPES, check_supported, load_model, resolve_model

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "CompressedKVCache",
    "CompressedLayer",
    "GenerationOutput",
    "PrefillResult",
    "check_supported",
    "generate",
    "load_model",
    "packed_attention",
    "packed_decoding",
    "prefill_and_compress",
    "resolve_model",
]
