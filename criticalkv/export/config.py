"""What an engine is built for (``BuildConfig``) and the build's names and defaults: a light module (no ONNX, no
transformers), so that ``scripts/build_engine.py --help`` and the command line answer at once."""

from __future__ import annotations

from dataclasses import asdict, dataclass

# the build's default context policy is the methods registry's choice (it says why): named here too
from criticalkv.methods import DEFAULT_CONTEXT_POLICY  # noqa: F401

#: The weight settings of an engine: float32 (the parity default) or the two integer forms of
#: ``criticalkv.export.quantize``.
WEIGHT_FORMATS = ("fp32", "int8", "int4")
#: Element types of the ONNX Runtime KV buffers (``BuildConfig.kv_dtype``): float32 (the default, exact parity
#: setting) or float16 (half the KV memory; only the fused decode graph reads them).
KV_DTYPE_NAMES = ("float32", "float16")


def check_weight_format(weights: str) -> None:
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights: {weights!r} is not one of {', '.join(WEIGHT_FORMATS)}")


#: Precision of the TensorRT engines (the ONNX graphs and ONNX Runtime are always fp32).
EXPORT_DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class BuildConfig:
    """The static limits an engine is built for.

    max_input_len : longest (padded) prompt; sizes every selection node's capacity
    max_new_tokens : tokens generated after the prompt at most; decode buffers hold capacity + this
    max_batch_size : largest batch (the runtime allocates its KV buffers for it once)
    dtype : precision of the TensorRT engines: float16 (default; tensor-core kernels), bfloat16, or float32
        (strongly typed, TF32 off: the parity build that matches ONNX Runtime token for token). The ONNX
        graphs and the ONNX Runtime path are fp32 whatever this says
    attention_chunk : query block size of the prompt attention (scores held: H * chunk * n per layer)
    extend_chunk : most new tokens per sequence in one run of the extend graph (a chunk of a chunked prefill, a
        question after a cached context). A prompt prefilled in extend chunks that are multiples of
        attention_chunk gets bitwise the one-shot prefill's K/V, logits and kept entries on ONNX Runtime
    max_question_len : most tokens asked after a compressed (cached) context: every slot's decode buffers hold the
        layer's selection capacity + max_question_len + max_new_tokens entries per head
    kv_dtype : element type of the ONNX Runtime decode buffers: float32 (default; the parity setting) or float16 (half
        the KV memory, so twice the sequences and cached contexts in one KV budget; only the fused decode graph
        ``decode_ort.onnx`` reads them, converting to float32 inside; prefill, extend and select stay float32). The
        TensorRT engines keep their own precision (``dtype``)
    weights : the projection weights of the ONNX Runtime flavour's fused graphs (``prefill_ort``, ``extend_ort``,
        ``decode_ort``): fp32 (default), int8 or int4 (``criticalkv.export.quantize``). The portable graphs, the
        TensorRT inputs, the embedding and the selection stay float32
    """

    max_input_len: int = 4096
    max_new_tokens: int = 256
    max_batch_size: int = 1
    dtype: str = "float16"
    attention_chunk: int = 256
    extend_chunk: int = 256
    max_question_len: int = 256
    kv_dtype: str = "float32"
    weights: str = "fp32"

    def __post_init__(self) -> None:
        for name in ("max_input_len", "max_new_tokens", "max_batch_size", "attention_chunk", "extend_chunk",
                     "max_question_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.dtype not in EXPORT_DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
        if self.kv_dtype not in KV_DTYPE_NAMES:
            raise ValueError(f"kv_dtype: {self.kv_dtype!r} is not one of {', '.join(KV_DTYPE_NAMES)}")
        check_weight_format(self.weights)

    def to_dict(self) -> dict:
        return asdict(self)
