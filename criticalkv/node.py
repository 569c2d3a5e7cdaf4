"""The ``CriticalKVSelect`` node: the contract shared by the ONNX export, ONNX Runtime and TensorRT.

One node per attention layer, in domain ``ai.criticalkv`` (opset version 1). Its attributes are the
``KVPolicy`` knobs (generated from the dataclass, so they cannot drift) plus the layer's position,
the static output capacity and ``layer_budgets`` (the layer's r_l for every per-request budget
b = window .. budget). See ``docs/operator.md`` for shapes and semantics.

Inputs (left-padded batch, post-RoPE):
  0 ``queries``        [B, H, w, d_h]   float  the last w = min(window, n) prompt queries
  1 ``keys``           [B, H_kv, n, d_h] float
  2 ``values``         [B, H_kv, n, d_h] float
  3 ``o_proj_weight``  [d, H * d_h]     float  the layer's o_proj.weight (an initializer)
  4 ``prompt_lengths`` [B]              int32  valid tokens of each sequence (right-aligned)
  5 ``kv_budget``      [1]              int32  the request's budget b, clamped to [min_budget, budget]
                                               (``KVPolicy.min_budget``); the attribute ``budget`` is the
                                               largest (it fixed the capacity). With b: a sequence is
                                               compressed iff its length > b, r_l = layer_budgets[b - window].
Outputs (cap = min(n, capacity)):
  0 ``kept_keys``      [B, H_kv, cap, d_h] float  kept keys in ascending position order, zero padded
  1 ``kept_values``    [B, H_kv, cap, d_h] float
  2 ``kept_lengths``   [B, H_kv]           int32  kept entries of each KV head
  3 ``kept_indices``   [B, H_kv, cap]      int32  their positions in [0, n), -1 padded

The TensorRT plugin's creator fields are these attributes (``plugin_field_specs``), and an ONNX Runtime profile
tells the pruned stage 2's branches apart by the names of their nodes (``BRANCH_NODES``): both are part of the
contract, so the runtime and the plugin tools read them here, not from the exporter or the code generator.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from criticalkv import methods as _methods
from criticalkv.methods.budget import layer_budget_table, max_kept_per_head
from criticalkv.policy import KVPolicy

DOMAIN = "ai.criticalkv"
OP_TYPE = "CriticalKVSelect"
#: The model-level selection's two node types (``criticalkv.export.model_select``): per-layer ranking, then one
#: selection over every layer after the last one.
SCORE_OP_TYPE = "CriticalKVScore"
MODEL_OP_TYPE = "CriticalKVSelectModel"
OPSET_VERSION = 1
INPUTS = ("queries", "keys", "values", "o_proj_weight", "prompt_lengths", "kv_budget")
OUTPUTS = ("kept_keys", "kept_values", "kept_lengths", "kept_indices")
#: The seventh input of a node whose method reads RoPE's rotation tables (``BaseMethod.needs_rotation``:
#: expected-attention): [2, window, d_h] float32, ``criticalkv.methods.expected_attention.rotation_tables``.
ROTATION_INPUT = "rotation"


#: The seventh input of a node whose method ranks by a score computed outside the layer (``BaseMethod.external_scores``:
#: kvzip): [1 or B, H_kv, n] float32 (the context reconstruction's max attention, ``criticalkv.methods.kvzip``), or
#: [1 or B, H_kv, 0] (none: the method's own fallback, kvzip's window max attention).
SCORES_INPUT = "scores"


def node_inputs(policy: KVPolicy) -> tuple[str, ...]:
    """The inputs of ``policy``'s ``CriticalKVSelect`` node (its function body's signature)."""
    base = policy.method.base
    return INPUTS + ((ROTATION_INPUT,) if base.needs_rotation else ()) + ((SCORES_INPUT,) if base.external_scores else ())
#: Attributes beyond the policy knobs.
LAYER_ATTRIBUTES = ("layer_idx", "num_layers", "capacity", "layer_budgets")
#: Names (prefixes) of the body's nodes that accept the pruned stage 2's result: 2 k_max candidates, 4 k_max, every
#: token (``criticalkv.export.select_function`` names them; ``criticalkv.runtime.profiling`` counts them).
BRANCH_NODES = ("stage2_accept_2k", "stage2_accept_4k", "stage2_accept_all")

#: Python field type -> (kind in the header, TensorRT PluginFieldType the ONNX parser passes for it, C++ type)
KINDS = {
    "str": ("STRING", "kCHAR", "std::string"),
    "int": ("INT", "kINT32", "int32_t"),
    "float": ("FLOAT", "kFLOAT32", "double"),
    "ints": ("INTS", "kINT32", "std::vector<int32_t>"),
}

#: Layer attributes of the node (beyond the knobs): kind and default; capacity 0 means "not given".
LAYER_FIELDS = {"layer_idx": ("int", 0), "num_layers": ("int", 1), "capacity": ("int", 0), "layer_budgets": ("ints", ())}


class PluginFieldSpec(NamedTuple):
    """One creator field: its name, kind (STRING/INT/FLOAT/INTS), TensorRT field type and default."""

    name: str
    kind: str
    trt_type: str
    default: object


def knob_type_name(f: dataclasses.Field) -> str:
    """``"int"``, ``"float"`` or ``"str"``: the type of a ``KVPolicy`` field (a string under postponed annotations)."""
    return f.type if isinstance(f.type, str) else f.type.__name__


def knob_fields() -> list[dataclasses.Field]:
    """The dataclass field of every knob (``KVPolicy.knob_names``: name, budget, window, then the methods' knobs)."""
    own = {f.name: f for f in dataclasses.fields(KVPolicy)}
    methods = _methods.knob_fields()
    return [own[n] if n in own else methods[n] for n in KVPolicy.knob_names()]


def plugin_field_specs() -> list[PluginFieldSpec]:
    """Every creator field in order: the KVPolicy knobs (declaration order), then the layer attributes."""
    specs = []
    default = KVPolicy()
    for f in knob_fields():
        kind, trt_type, _ = KINDS[knob_type_name(f)]
        specs.append(PluginFieldSpec(f.name, kind, trt_type, getattr(default, f.name)))
    for name in LAYER_ATTRIBUTES:
        type_name, value = LAYER_FIELDS[name]
        kind, trt_type, _ = KINDS[type_name]
        specs.append(PluginFieldSpec(name, kind, trt_type, value))
    return specs


def node_capacity(policy: KVPolicy, max_prompt_len: int, num_kv_heads: int, layer_idx: int, num_layers: int) -> int:
    """Static per-head output capacity of layer ``layer_idx`` for prompts up to ``max_prompt_len``.

    A prompt of at most ``budget`` tokens is kept whole, so a layer whose own budget is below the
    average (PyramidKV's deep layers) may still hold ``budget`` entries; beyond that the kept count
    does not decrease with n.
    """
    return max(
        min(max_prompt_len, policy.budget),
        max_kept_per_head(policy, max_prompt_len, num_kv_heads, layer_idx, num_layers),
    )


def node_attributes(policy: KVPolicy, layer_idx: int, num_layers: int, capacity: int) -> dict[str, Any]:
    """Attribute dict of one layer's node: every KVPolicy knob + layer_idx, num_layers, capacity and
    layer_budgets (this layer's r_l for every budget b = window .. budget, ``layer_budget_table``)."""
    return {**policy.attributes(), "layer_idx": layer_idx, "num_layers": num_layers, "capacity": capacity,
            "layer_budgets": layer_budget_table(policy, layer_idx, num_layers)}


def float32_to_decimal(value: float) -> float:
    """Undo ONNX's float32 storage of float attributes: 0.30000001192092896 -> 0.3.

    The shortest decimal that round-trips through float32 is what the user wrote (for any value that
    has at most ~7 significant digits), so budget arithmetic such as ceil(alpha * r) matches Python's.
    """
    return float(str(np.float32(value)))


def policy_from_attributes(attributes: dict[str, Any]) -> tuple[KVPolicy, int, int, int]:
    """Inverse of ``node_attributes``: (policy, layer_idx, num_layers, capacity).

    Accepts attribute values as read back from an ONNX node (bytes strings, float32-rounded floats).
    """
    knobs = {}
    for k, v in attributes.items():
        if k in LAYER_ATTRIBUTES:
            continue
        knobs[k] = v.decode() if isinstance(v, bytes) else float32_to_decimal(v) if isinstance(v, float) else v
    return (
        KVPolicy.from_dict(knobs),
        int(attributes["layer_idx"]),
        int(attributes["num_layers"]),
        int(attributes["capacity"]),
    )
