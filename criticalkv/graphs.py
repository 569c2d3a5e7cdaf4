"""The engine's ONNX graphs and their inputs and outputs, named once: the exporter writes these names, every backend
reads them (ONNX Runtime, TensorRT), and ``validate`` checks that a written graph uses no other.

The names follow onnxruntime-genai's decoder (``input_ids``, ``attention_mask``, ``position_ids``,
``past_key_values.{l}.key`` / ``.value`` [batch, kv_heads, past, head_dim], ``logits``, ``present.{l}.key`` /
``.value``); eviction adds each head's kept length and the kept positions, the chunked prefill its window queries, and
a method's phases (``criticalkv.methods.phases``) the re-read's scores and the streams.

Graphs (``FILES``): ``prefill`` (the prompt, selection inside), ``extend`` (N tokens over a row or a prompt's buffer),
``select`` (the selection over a prompt prefilled in chunks), ``select_context`` (the same with the context policy),
``decode`` (one token per row), ``reread`` (``extend`` that also scores the past entries: a method's re-read pass), each
in the portable form (what TensorRT parses), some also in ONNX Runtime's fused form (``_ort``), TensorRT's
(``_tensorrt``) or OpenVINO's (``_openvino``: the selection bodies inlined, attention without a Loop).
"""

from __future__ import annotations

import re

#: Graph name -> its file in an engine directory.
FILES: dict[str, str] = {
    "prefill": "prefill.onnx",
    "prefill_ort": "prefill_ort.onnx",
    "prefill_tensorrt": "prefill_tensorrt.onnx",
    "decode": "decode.onnx",
    "decode_ort": "decode_ort.onnx",
    "extend": "extend.onnx",
    "extend_ort": "extend_ort.onnx",
    "extend_heads_ort": "extend_heads_ort.onnx",
    "extend_tensorrt": "extend_tensorrt.onnx",
    "select": "select.onnx",
    "select_tensorrt": "select_tensorrt.onnx",
    "select_context": "select_context.onnx",
    "reread": "reread.onnx",
    "reread_ort": "reread_ort.onnx",
    "prefill_openvino": "prefill_openvino.onnx",
    "extend_openvino": "extend_openvino.onnx",
    "select_openvino": "select_openvino.onnx",
    "decode_openvino": "decode_openvino.onnx",
    "select_context_openvino": "select_context_openvino.onnx",
}

# ---------------------------------------------------------------------- inputs and outputs that every layer shares
INPUT_IDS = "input_ids"  # [B, n] int64
ATTENTION_MASK = "attention_mask"  # [B, n] int64, 1 for a real token (left padding)
POSITION_IDS = "position_ids"  # [B, n] int64, absolute (after eviction a new token sits at n + t)
KV_BUDGET = "kv_budget"  # [1] int64, the request's budget (tokens per KV head)
SCORE_RANGE = "score_range"  # [4] int64 (sinks, start, end, n) of a re-read pass
LOGITS = "logits"  # [B, vocab] float32 of each sequence's last token


# ---------------------------------------------------------------------- per layer
def past_key(layer: int) -> str:
    """[B, H_kv, past, d_h] the keys a graph reads (post-RoPE)."""
    return f"past_key_values.{layer}.key"


def past_value(layer: int) -> str:
    return f"past_key_values.{layer}.value"


def past_lengths(layer: int) -> str:
    """[B, H_kv] int32 valid entries per head."""
    return f"past_key_values.{layer}.lengths"


def present_key(layer: int) -> str:
    """The new or kept keys a graph returns."""
    return f"present.{layer}.key"


def present_value(layer: int) -> str:
    return f"present.{layer}.value"


def present_lengths(layer: int) -> str:
    """[B, H_kv] int32 entries each head kept."""
    return f"present.{layer}.lengths"


def present_indices(layer: int) -> str:
    """[B, H_kv, cap] int32 kept positions into the prompt, -1 padded."""
    return f"present.{layer}.indices"


def present_window_queries(layer: int) -> str:
    """[B, H, min(N, window), d_h] post-RoPE queries of an extend's last tokens (the chunked prefill's selection)."""
    return f"present.{layer}.window_queries"


def present_scores(layer: int) -> str:
    """[B, H_kv, P] a re-read pass's score of every past entry."""
    return f"present.{layer}.scores"


def present_stream(layer: int, name: str) -> str:
    """[B, H_kv, N] stream ``name`` of the N new entries (``criticalkv.methods.phases.Stream``)."""
    return f"present.{layer}.stream.{name}"


def window_queries(layer: int) -> str:
    """select's input: [1, H, w, d_h] the prompt's last window queries."""
    return f"window_queries.{layer}"


def scores(layer: int) -> str:
    """select's input of a method that ranks by scores computed apart: [1, H_kv, n], or [1, H_kv, 0] for none."""
    return f"scores.{layer}"


#: What a selection returns per layer (prefill, select).
SELECTED = (present_key, present_value, present_lengths, present_indices)
#: What a graph reads per layer of its past (extend, decode, select, reread).
PAST = (past_key, past_value, past_lengths)

_LAYER_NAMES = re.compile(
    r"(past_key_values\.\d+\.(key|value|lengths)|present\.\d+\.(key|value|lengths|indices|window_queries|scores)"
    r"|present\.\d+\.stream\.[A-Za-z_]\w*|window_queries\.\d+|scores\.\d+)")
_NAMES = {INPUT_IDS, ATTENTION_MASK, POSITION_IDS, KV_BUDGET, SCORE_RANGE, LOGITS}


def is_contract_name(name: str) -> bool:
    """Whether ``name`` is a graph input or output this module names (``validate`` refuses any other)."""
    return name in _NAMES or _LAYER_NAMES.fullmatch(name) is not None
