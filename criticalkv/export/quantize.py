"""Lower-precision projection weights for the ONNX Runtime flavour's fused graphs (``BuildConfig.weights``).

A CPU user compares an engine with OpenVINO at its default (bf16 compute) or onnxruntime-genai's int4 model, not only
with fp32. ONNX Runtime's CPU kernels (MLAS) have int8 GEMMs for AVX2, AVX-512 VNNI and AMX, none in bf16, so the
lower-precision settings are integer weights:

* ``int8``: ``com.microsoft.DynamicQuantizeMatMul``: weights int8, symmetric, one scale per output column; the
  activations quantized to uint8 per tensor at run time (the form ``onnxruntime.quantization.quantize_dynamic``
  writes), then MLAS's u8s8 GEMM (VNNI / AMX) with the result scaled back to float32.
* ``int4``: ``com.microsoft.MatMulNBits`` with ``bits = 4``, blocks of 32 along K, symmetric, ``accuracy_level = 4``
  (the activations quantized to int8 per block of 32: onnxruntime-genai's CPU default).

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

#: The weight settings of an engine: float32 (the parity default) or the two integer forms above.
WEIGHT_FORMATS = ("fp32", "int8", "int4")
#: MatMulNBits' block along K for int4 (onnxruntime-genai's default)
INT4_BLOCK = 32
#: MatMulNBits accuracy_level 4: int8 activations (blockwise) and int8 compute
INT4_ACCURACY_LEVEL = 4
#: com.microsoft operators each setting adds to the fused graphs
QUANTIZED_OPERATORS = {"fp32": set(), "int8": {"DynamicQuantizeMatMul"}, "int4": {"MatMulNBits"}}


@dataclass(frozen=True)
class QuantizedWeight:
    """A [k, n] matrix (``x [.., k] @ W -> [.., n]``) in integer form: ``codes`` and ``scales`` are names in the
    weight store. int8: codes [k, n] int8, scales [n] float32. int4: codes [n, k / 32, 16] uint8 (two 4-bit codes per
    byte, offset 8), scales [n * k / 32] float32."""

    format: str
    k: int
    n: int
    codes: str
    scales: str


def check_weight_format(weights: str) -> None:
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights: {weights!r} is not one of {', '.join(WEIGHT_FORMATS)}")


def quantize_int8(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-column int8 of ``matrix`` [k, n]: (codes [k, n] int8 in [-127, 127], scales [n] float32)."""
    peak = np.abs(matrix).max(axis=0).astype(np.float32)
    scales = np.where(peak > 0, peak / np.float32(127.0), np.float32(1.0)).astype(np.float32)
    codes = np.clip(np.rint(matrix / scales), -127, 127).astype(np.int8)
    return codes, scales


def quantize_int4(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric blockwise int4 of ``matrix`` [k, n] in MatMulNBits' layout (ONNX Runtime's own quantizer kernel, the
    one ``onnxruntime.quantization.matmul_nbits_quantizer`` calls): (codes [n, blocks, 16] uint8, scales
    [n * blocks] float32)."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits

    k, n = matrix.shape
    blocks = -(-k // INT4_BLOCK)
    padded = np.zeros((blocks * INT4_BLOCK, n), np.float32)
    padded[:k] = matrix
    codes = np.zeros((n, blocks, INT4_BLOCK // 2), np.uint8)
    scales = np.zeros((n, blocks), np.float32)
    zero_points = np.zeros((n, -(-blocks // 2)), np.uint8)  # unused: symmetric
    quantize_matmul_4bits(codes, padded, scales, zero_points, INT4_BLOCK, n, blocks * INT4_BLOCK, True)
    return codes, scales.reshape(-1)


def dequantize(q: QuantizedWeight, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """The float32 [k, n] matrix the integer form stands for (what the operator multiplies by)."""
    codes, scales = arrays[q.codes], arrays[q.scales]
    if q.format == "int8":
        return codes.astype(np.float32) * scales[None, :]
    low, high = (codes & 0x0F).astype(np.int32) - 8, (codes >> 4).astype(np.int32) - 8
    values = np.stack([low, high], axis=-1).reshape(q.n, -1)[:, : q.k]  # [n, k]: low nibble first
    per_block = np.repeat(scales.reshape(q.n, -1), INT4_BLOCK, axis=1)[:, : q.k]
    return (values * per_block).T.astype(np.float32)


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
    quantize = quantize_int8 if weights == "int8" else quantize_int4
    added = 0
    for name, matrix in projection_matrices(store, spec).items():
        codes, scales = quantize(np.ascontiguousarray(matrix, dtype=np.float32))
        q = QuantizedWeight(weights, matrix.shape[0], matrix.shape[1], f"{name}.{weights}", f"{name}.{weights}_scales")
        store.add(q.codes, codes, dtype=codes.dtype)
        store.add(q.scales, scales)
        store.quantized[name] = q
        added += codes.nbytes + scales.nbytes
    info.update({"operator": sorted(QUANTIZED_OPERATORS[weights])[0], "matrices": len(store.quantized),
                 "bytes": added})
    if weights == "int4":
        info.update({"block_size": INT4_BLOCK, "accuracy_level": INT4_ACCURACY_LEVEL})
    return info


def quantized_matmul(g, x: str, q: QuantizedWeight, outputs: list[str] | None = None) -> str:
    """x [.., k] float32 @ the quantized matrix -> [.., n] float32, one com.microsoft node (``g``: a GraphBuilder)."""
    out = outputs or 1
    if q.format == "int8":
        return g.op("DynamicQuantizeMatMul", x, q.codes, q.scales, domain="com.microsoft", outputs=out)
    return g.op("MatMulNBits", x, q.codes, q.scales, domain="com.microsoft", outputs=out, K=q.k, N=q.n, bits=4,
                block_size=INT4_BLOCK, accuracy_level=INT4_ACCURACY_LEVEL)
