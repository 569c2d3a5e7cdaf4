"""Lower-precision projection weights for the ONNX Runtime flavour's fused graphs (``BuildConfig.weights``).

A CPU user compares an engine with OpenVINO at its default (bf16 compute) or onnxruntime-genai's int4 model, not only
with fp32. ONNX Runtime's CPU kernels (MLAS) have int8 GEMMs for AVX2, AVX-512 VNNI and AMX, none in bf16, so the
lower-precision settings are integer weights:

* ``int8``: per-token W8A8. Weights int8, symmetric, one scale per output column; each token's activations divided
  by their own largest magnitude m, quantized with the fixed scale 1/127 and zero point 128 (``QuantizeLinear``: codes
  1..255, symmetric, the token's own range), multiplied by ``com.microsoft.MatMulIntegerToFloat`` (MLAS's u8s8 GEMM:
  AVX2 / AVX-512 VNNI / AMX) and scaled back by m (the product is linear in each row). Every token's rounding depends on
  that token alone, so a sequence's output does not depend on the rest of its batch. Measured at a prefill's shapes
  (K 576, N 3,072, 2,048 tokens, one thread): 3.0x faster than the prepacked fp32 MatMul, 1.1 % relative error with an
  outlier token.
* ``int4``: ``com.microsoft.MatMulNBits`` with ``bits = 4``: weights in blocks of 32 along K, symmetric, and
  ``accuracy_level = 4``: the activations quantized to int8 per block of 32 of each row at run time, int8 compute
  (onnxruntime-genai's CPU default). Half the int8 weight bytes, but its prefill GEMM measured only ~1.2x faster than
  fp32 here.

Why not ``DynamicQuantizeMatMul`` (what ``onnxruntime.quantization.quantize_dynamic`` writes: ONE activation scale
for the whole [tokens, K] input, from its min and max): a prompt's attention-sink token (activations ~50x the others)
sets that scale for every token: 35 % relative error on the other rows of the same synthetic test, and on the bundled
model a KL divergence of 1.2 nats at the first generated token of a needle prompt; and in a decode batch one sequence's
activations would set the others' rounding. MatMulNBits with ``bits = 8`` (blockwise activations) is as accurate as
the per-token form but its prefill GEMM was only 1.35x faster than fp32 (3.0x for the per-token form).

What is quantized: every layer's QKV, output (o_proj), gate/up and down projections and the LM head; nothing else.
The float32 weights stay in ``weights.bin`` and every other graph reads them: the portable graphs (``prefill.onnx``,
``decode.onnx``, ``extend.onnx``, TensorRT's inputs), the embedding ``Gather`` and the selection node, whose value
norm ||V W_O^h|| reads the float32 o_proj (the quantized o_proj is a second copy for the projection only). The
selection itself stays float32 on the graph's activations: its K, V and window queries are the float32 outputs of the
quantized projections (the KV cache is never quantized).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from criticalkv.export.config import WEIGHT_FORMATS, check_weight_format  # noqa: F401 (their home: the light config)

#: MatMulNBits' block along K (onnxruntime-genai's default)
BLOCK = 32
#: MatMulNBits accuracy_level 4: int8 activations (blockwise) and int8 compute
ACCURACY_LEVEL = 4
#: bits per weight of each integer setting
BITS = {"int8": 8, "int4": 4}
#: com.microsoft operators each setting adds to the fused graphs
QUANTIZED_OPERATORS = {"fp32": set(), "int8": {"MatMulIntegerToFloat"}, "int4": {"MatMulNBits"}}
#: the int8 activations: a token divided by its largest magnitude, then codes round(x * 127) + 128 in 1..255
ACTIVATION_SCALE = np.float32(1.0 / 127.0)
ACTIVATION_ZERO_POINT = np.uint8(128)
#: the smallest normal float32: a token whose activations are all zero divides by this (and stays zero)
_TINY = float(np.finfo(np.float32).tiny)


@dataclass(frozen=True)
class QuantizedWeight:
    """A [k, n] matrix (``x [.., k] @ W -> [.., n]``) in integer form: ``codes`` and ``scales`` are names in the weight
    store. int8: codes [k, n] int8 in [-127, 127], scales [n] float32 (per output column). int4 (MatMulNBits' layout):
    codes [n, blocks, 16] uint8 (two codes per byte, low nibble first, offset 8), scales [n * blocks] float32, blocks =
    ceil(k / 32)."""

    format: str
    k: int
    n: int
    codes: str
    scales: str


def quantize_columns(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-column int8 of ``matrix`` [k, n]: (codes [k, n] int8 in [-127, 127], scales [n] float32)."""
    peak = np.abs(matrix).max(axis=0).astype(np.float32)
    scales = np.where(peak > 0, peak / np.float32(127.0), np.float32(1.0)).astype(np.float32)
    return np.clip(np.rint(matrix / scales), -127, 127).astype(np.int8), scales


def quantize_blockwise(matrix: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric blockwise int8 / int4 of ``matrix`` [k, n] in MatMulNBits' layout, by ONNX Runtime's own quantizer
    kernels (those ``onnxruntime.quantization.matmul_nbits_quantizer`` calls): (codes [n, blocks, 32 * bits / 8]
    uint8, scales [n * blocks] float32)."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    k, n = matrix.shape
    blocks = -(-k // BLOCK)
    padded = np.zeros((blocks * BLOCK, n), np.float32)
    padded[:k] = matrix
    codes = np.zeros((n, blocks, BLOCK * bits // 8), np.uint8)
    scales = np.zeros((n, blocks), np.float32)
    zero_points = np.zeros((n, -(-blocks * bits // 8)), np.uint8)  # unused: symmetric
    kernel = quantize_matmul_8bits if bits == 8 else quantize_matmul_4bits
    kernel(codes, padded, scales, zero_points, BLOCK, n, blocks * BLOCK, True)
    return codes, scales.reshape(-1)


def dequantize(q: QuantizedWeight, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """The float32 [k, n] matrix the integer form stands for (what the operator multiplies by)."""
    codes, scales = arrays[q.codes], arrays[q.scales]
    if q.format == "int8":
        return (codes.astype(np.float32) * scales[None, :]).astype(np.float32)
    low, high = (codes & 0x0F).astype(np.int32) - 8, (codes >> 4).astype(np.int32) - 8
    values = np.stack([low, high], axis=-1).reshape(q.n, -1)  # low nibble first
    per_block = np.repeat(scales.reshape(q.n, -1), BLOCK, axis=1)
    return (values[:, : q.k] * per_block[:, : q.k]).T.astype(np.float32)


def projection_matrices(store, spec) -> dict[str, np.ndarray]:
    """Every matrix the fused graphs multiply by, keyed by its float32 weight's name, as [k, n] (o_proj and the LM head
    are stored [n, k]: transposed here)."""
    arrays = store.arrays
    out = {}
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        out[p + "qkv_proj"] = arrays[p + "qkv_proj"]
        out[p + "o_proj"] = arrays[p + "o_proj"].T
        out[p + "gate_up_proj"] = arrays[p + "gate_up_proj"]
        out[p + "down_proj"] = arrays[p + "down_proj"]
    head = "lm_head" if "lm_head" in arrays else "embed_tokens"
    out[head] = arrays[head].T
    return out


def quantize_store(store, spec, weights: str) -> dict:
    """Add the integer forms of ``projection_matrices`` to ``store`` (``store.quantized``); returns the manifest's
    description of the setting. ``weights="fp32"`` adds nothing."""
    check_weight_format(weights)
    info = {"format": weights}
    if weights == "fp32":
        return info
    added = 0
    for name, matrix in projection_matrices(store, spec).items():
        matrix = np.ascontiguousarray(matrix, dtype=np.float32)
        codes, scales = quantize_columns(matrix) if weights == "int8" else quantize_blockwise(matrix, BITS[weights])
        q = QuantizedWeight(weights, matrix.shape[0], matrix.shape[1], f"{name}.{weights}", f"{name}.{weights}_scales")
        store.add(q.codes, codes, dtype=codes.dtype)
        store.add(q.scales, scales)
        store.quantized[name] = q
        added += codes.nbytes + scales.nbytes
    if weights == "int8":
        info.update({"operator": "MatMulIntegerToFloat", "weights": "int8 per output column",
                     "activations": "per token: x / max|x| as uint8 (scale 1/127, zero point 128)"})
    else:
        info.update({"operator": "MatMulNBits", "bits": 4, "block_size": BLOCK, "accuracy_level": ACCURACY_LEVEL})
    info.update({"matrices": len(store.quantized), "bytes": added})
    return info


def quantized_matmul(g, x: str, q: QuantizedWeight, outputs: list[str] | None = None) -> str:
    """x [.., k] float32 @ the quantized matrix -> [.., n] float32 (``g``: a GraphBuilder). int8: the per-token form
    (module docstring): m = max |x| over k (at least the smallest normal float), codes = QuantizeLinear(x / m, 1/127,
    128), MatMulIntegerToFloat(codes, W, 1/127, scales, 128) * m. int4: one MatMulNBits node."""
    if q.format == "int8":
        magnitude = g.Max(g.ReduceMax(g.Abs(x), g.i64(-1), keepdims=1), g.const(_TINY, np.float32))  # [.., 1]
        scale, zero = g.const(ACTIVATION_SCALE, hint="activation_scale"), g.const(ACTIVATION_ZERO_POINT, hint="zero")
        codes = g.QuantizeLinear(g.Div(x, magnitude), scale, zero)
        product = g.op("MatMulIntegerToFloat", codes, q.codes, scale, q.scales, zero, domain="com.microsoft")
        return g.op("Mul", product, magnitude, outputs=outputs or 1)
    return g.op("MatMulNBits", x, q.codes, q.scales, domain="com.microsoft", outputs=outputs or 1, K=q.k, N=q.n,
                bits=BITS[q.format], block_size=BLOCK, accuracy_level=ACCURACY_LEVEL)
