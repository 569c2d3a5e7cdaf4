"""Model-level selection in the prefill graph (``layer-defensivekv``): per-layer score nodes, one select node after
the last layer.

A model-level method (``BaseMethod.model_level``) ranks the older tokens of every head of every layer together, so
no layer can decide alone what it keeps. The ONNX Runtime prefill graph expresses it with two node types of the
``ai.criticalkv`` domain, each with a model-local function body in standard operators (like ``CriticalKVSelect``):

* ``CriticalKVScore``, one per layer, where ``CriticalKVSelect`` would be, with the same six inputs and attributes
  (every ``KVPolicy`` knob, ``layer_idx``, ``num_layers``, ``capacity``, ``layer_budgets``): steps 1-4 of
  docs/operator.md, then the method's per-layer ranking (``DefensiveKV.onnx_priority``: the defensive score, + 2 for
  the stage-1 tokens). Output ``ranking`` [B, H_kv, m] float (m = n - min(window, n); zeros when n <= budget, where
  nothing is ranked).
* ``CriticalKVSelectModel``, once, after the last layer. Inputs: ``ranking.{l}``, ``keys.{l}``, ``values.{l}`` of every
  layer (the full post-RoPE K/V of the prompt, alive as graph tensors until here, as during any prefill),
  ``prompt_lengths``, ``kv_budget``. Attributes: the knobs, ``num_layers`` and ``capacities`` (ints, per layer).
  Body, for a prompt longer than the request's budget b (an ``If``; otherwise every layer keeps it whole):
  the rankings concatenated over layers [B, L * H_kv, m]; r = min(valid older tokens, b - window); the method's
  ``onnx_model_allocate`` (``layer-defensivekv``: the per-head floor f from an export-time table, ``head_floor``; every
  head keeps its own top f and the model's remaining L * H_kv * (r - f) slots go to the top of the flattened ranking,
  ties to the lower flattened index: lower layer, then head, then position; with ``head_cap_ratio`` set, the nested
  capped allocation, a ``Loop`` over the levels 1 .. r: ``onnx_nested_capped_mask``), the window of every head kept. The mask is split per layer and step 7 (``emit_kept``)
  writes ``present.{l}.key/value/lengths/indices`` at each layer's static capacity.

Top-k is ``_Body.topk_mask``: ``TopK`` supplies only the k-th largest value, ties resolved by an exclusive
``CumSum`` over the equal scores, so the tie rule is exact whatever a runtime's ``TopK`` does with ties; this is
``criticalkv.selection.select_model`` exactly.

The TensorRT flavour holds the same two nodes without function bodies: the library's CriticalKVScore and
CriticalKVSelectModel plugins run them (plugins/README.md; the model-wide top-k has no TensorRT form in standard
operators: TensorRT's ``TopK`` takes k <= 3840, while the model keeps L * H_kv * (b - window) entries, 20,160 for
SmolLM2-135M at budget 256). ``check_tensorrt_flavour`` refuses what still has none (``tensorrt_refusal``).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from criticalkv.export.graph import BOOL, FLOAT, INT32, INT64, IR_VERSION, OPSET, GraphBuilder, live_nodes, value_info
from criticalkv.export.select_function import _Body, emit_kept, selection_node, selection_opset
from criticalkv.node import (
    DOMAIN,
    INPUTS,
    LAYER_ATTRIBUTES,
    MODEL_OP_TYPE,
    OUTPUTS,
    SCORE_OP_TYPE,
    node_inputs,
    policy_from_attributes,
)
from criticalkv.policy import KVPolicy

SCORE_OP = SCORE_OP_TYPE
MODEL_OP = MODEL_OP_TYPE
SCORE_OUTPUTS = ("ranking",)
#: The score node's outputs for a policy with CriticalKV's two stages (a refined model-level method): the ranking and the
#: critical score, every older entry's (not pruned: the model-wide allocation fixes the heads' counts after the last layer).
REFINED_SCORE_OUTPUTS = ("ranking", "critical")
#: Attributes of the model-level node beyond the policy knobs.
MODEL_ATTRIBUTES = ("num_layers", "capacities")


def score_outputs(policy: KVPolicy) -> tuple[str, ...]:
    """The ``CriticalKVScore`` node's outputs: the ranking, and the critical score when the policy refines."""
    return REFINED_SCORE_OUTPUTS if policy.method.refine is not None else SCORE_OUTPUTS


def is_model_level(policy: KVPolicy, num_layers: int) -> bool:
    """Whether the prefill graph selects ``policy`` after the last layer (a model-level method, several layers)."""
    return policy.method.base.model_level and num_layers > 1


def tensorrt_refusal(policy: KVPolicy, num_layers: int) -> str | None:
    """Why ``policy`` has no TensorRT flavour (None when it has one): a per-layer method the CriticalKVSelect plugin
    refuses (its ``cpp_refusal``), or scores the TensorRT graphs do not compute (the method's ``graph_refusal``: a
    context reconstruction's). A model-level policy's flavour holds the CriticalKVScore / CriticalKVSelectModel plugin
    nodes; an ``external_scores`` policy whose method names a ``graph_stream`` has its scores computed in its prefill
    graph (``DecoderGraphBuilder.graph_scores``) and taken as an input of its select graph."""
    base = policy.method.base
    if not base.native and not is_model_level(policy, num_layers):
        return f"the CriticalKVSelect plugin refuses {policy.name}: it {base.cpp_refusal}"
    if base.external_scores and base.graph_stream(policy) is None:
        return base.graph_refusal(policy)
    return None


def check_tensorrt_flavour(policy: KVPolicy, num_layers: int) -> None:
    """Refuse the TensorRT flavour of a policy that has none, with the reason (``tensorrt_refusal``)."""
    refusal = tensorrt_refusal(policy, num_layers)
    if refusal:
        raise ValueError(f"{policy.name}: no TensorRT flavour: {refusal}")


class _ScoreBody(_Body):
    """The ``CriticalKVScore`` body: steps 1-4 and the method's ranking of one layer."""

    exact_critical = True  # every older entry's critical score: the heads' counts come after the last layer

    def build(self) -> None:
        g = self.g
        ctx = self.context()
        n_s = g.squeeze(ctx["n"], 0)
        then = g.child()
        scores, eligible, r, w = self.window_scores(then, ctx)
        ranked = [self.policy.method.base.onnx_priority(self, then, scores, eligible, r)]
        if self.policy.method.refine is not None:
            ranked.append(scores["critical"])
        otherwise = g.child()
        m = otherwise.Max(otherwise.Sub(ctx["n"], otherwise.Min(otherwise.i64(self.policy.window), ctx["n"])),
                          otherwise.i64(0))
        zeros = otherwise.Expand(otherwise.const(0.0, np.float32),
                                 otherwise.concat(ctx["batch"], otherwise.i64(self.kv_heads), m))
        outputs = score_outputs(self.policy)
        g.op("If", g.Greater(n_s, ctx["budget"]),
             then_branch=then.graph("rank", [], [value_info(x, FLOAT, None) for x in ranked]),
             else_branch=otherwise.graph("unranked", [], [value_info(otherwise.Identity(zeros), FLOAT, None)
                                                          for _ in outputs]),
             outputs=list(outputs))


def score_function(policy: KVPolicy, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int) -> onnx.FunctionProto:
    """The model-local function ``ai.criticalkv::CriticalKVScore`` for ``policy`` and this attention shape."""
    g = GraphBuilder("ckvs/")
    _ScoreBody(g, policy, num_layers, num_heads, num_kv_heads, head_dim).build()
    return helper.make_function(
        DOMAIN, SCORE_OP, list(node_inputs(policy)), list(score_outputs(policy)), live_nodes(g.nodes, score_outputs(policy)),
        opset_imports=[helper.make_opsetid("", OPSET)],
        attributes=list(KVPolicy.knob_names()) + list(LAYER_ATTRIBUTES),
        doc_string=f"CriticalKVScore body (per-layer ranking of a model-level selection) for policy {policy.to_json()} "
        f"(H={num_heads}, H_kv={num_kv_heads}, d_h={head_dim}, layers={num_layers}).",
    )


def score_node(policy: KVPolicy, layer_idx: int, num_layers: int, capacity: int, inputs: list[str],
               outputs: list[str]) -> onnx.NodeProto:
    """One layer's ``CriticalKVScore`` node (the attributes of ``CriticalKVSelect``); ``outputs``: its ranking's name,
    then its critical score's for a policy that refines (``score_outputs``)."""
    node = selection_node(policy, layer_idx, num_layers, capacity, inputs, list(outputs), f"criticalkv_score_{layer_idx}")
    node.op_type = SCORE_OP
    return node


def model_inputs(num_layers: int, refined: bool = False) -> list[str]:
    """The formal inputs of ``CriticalKVSelectModel``: every layer's ranking, (``refined``: every layer's critical
    score,) then keys, then values, then the rest."""
    critical = [f"critical.{i}" for i in range(num_layers)] if refined else []
    return ([f"ranking.{i}" for i in range(num_layers)] + critical + [f"keys.{i}" for i in range(num_layers)]
            + [f"values.{i}" for i in range(num_layers)] + ["prompt_lengths", "kv_budget"])


def model_outputs(num_layers: int) -> list[str]:
    return [f"{name}.{i}" for i in range(num_layers) for name in OUTPUTS]


def _model_body(g: GraphBuilder, policy: KVPolicy, num_layers: int, num_kv_heads: int) -> None:
    p = policy
    heads = num_layers * num_kv_heads
    keys0 = "keys.0"
    batch = g.shape_of(keys0, 0, 1)
    n = g.shape_of(keys0, 2, 3)
    n_s = g.squeeze(n, 0)
    lens = g.Cast("prompt_lengths", to=INT64)
    pos = g.Range(g.scalar(0), n_s, g.scalar(1))
    valid = g.GreaterOrEqual(g.unsqueeze(pos, 0), g.unsqueeze(g.Sub(n, lens), 1))  # [B, n]
    valid_all = g.Expand(g.unsqueeze(valid, 1), g.concat(batch, g.i64(heads), n))  # [B, L * H_kv, n]
    requested = g.Cast(g.reshape("kv_budget", [-1]), to=INT64)
    budget = g.squeeze(g.slice_axis(g.Min(g.Max(requested, g.i64(p.min_budget)), g.i64(p.budget)), 0, 1, axis=0), 0)

    t = g.child()
    w = t.Min(t.i64(p.window), n)
    m = t.Sub(n, w)
    eligible = t.slice_axis(valid_all, 0, m, axis=2)  # [B, L * H_kv, m]
    ranking = t.concat(*[f"ranking.{i}" for i in range(num_layers)], axis=1)  # [B, L * H_kv, m]
    r = t.Min(t.Max(t.Sub(lens, w), t.scalar(0)), t.Sub(budget, t.scalar(p.window)))  # [B]
    model = _Body(t, policy, num_layers, heads, heads, 1)  # the model's L * H_kv heads as one layer's: top-k, floor table
    older = p.method.base.onnx_model_allocate(model, t, ranking, eligible, r, budget)
    if p.method.refine is not None:
        older = _model_refine(t, model, p, num_layers, ranking, older, eligible, n, lens)
    window = t.Expand(t.const(True, np.bool_), t.concat(batch, t.i64(heads), w))
    compress = t.reshape(t.Greater(lens, budget), [-1, 1, 1])
    then_keep = _Body.where_bool(t, compress, t.concat(older, window, axis=-1), valid_all)
    e = g.child()
    else_keep = e.Identity(valid_all)
    keep = g.op("If", g.Greater(n_s, budget),
                then_branch=t.graph("compress_model", [], [value_info(then_keep, BOOL, None)]),
                else_branch=e.graph("keep_all", [], [value_info(else_keep, BOOL, None)]), hint="keep")
    capacities = g.attribute_const("capacities", "ints")
    outputs = model_outputs(num_layers)
    for i in range(num_layers):
        layer_keep = g.slice_axis(keep, i * num_kv_heads, (i + 1) * num_kv_heads, axis=1)
        capacity = g.Gather(capacities, g.scalar(i))
        emit_kept(g, layer_keep, f"keys.{i}", f"values.{i}", capacity, outputs[4 * i: 4 * i + 4])


def _model_refine(t: GraphBuilder, model: _Body, p: KVPolicy, num_layers: int, ranking: str, allocated: str,
                  eligible: str, n: str, lens: str) -> str:
    """CriticalKV's two stages inside the model-wide allocation (``criticalkv.selection.layer.model_level_refine``):
    each head keeps as many older entries as ``allocated`` gives it, its sinks first, then ceil(alpha * rest) by the
    ranking (the base's score: the sinks' offset no longer counts once they are out) and the others by the critical
    score."""
    critical = t.concat(*[f"critical.{i}" for i in range(num_layers)], axis=1)  # [B, L * H_kv, m]
    sinks = p.method.base.sinks(p)
    if sinks:
        m = t.shape_of(eligible, 2, 3)
        positions = t.Range(t.scalar(0), t.squeeze(m, 0), t.scalar(1))
        first = t.Less(t.unsqueeze(positions, 0), t.unsqueeze(t.Add(t.Sub(t.squeeze(n, 0), lens), t.scalar(sinks)), 1))
        sink = t.And(t.And(eligible, t.unsqueeze(first, 1)), allocated)
        eligible = t.And(eligible, t.Not(sink))
    counts = t.ReduceSum(t.Cast(t.And(allocated, eligible), to=INT64), t.i64(-1), keepdims=0)  # [B, L * H_kv]
    first_count = model.stage1_count(t, counts)
    stage1 = model.topk_mask(t, ranking, first_count, eligible)
    stage2 = model.topk_mask(t, critical, t.Sub(counts, first_count), t.And(eligible, t.Not(stage1)))
    older = t.Or(stage1, stage2)
    return t.Or(older, sink) if sinks else older


def model_function(policy: KVPolicy, num_layers: int, num_kv_heads: int) -> onnx.FunctionProto:
    """The model-local function ``ai.criticalkv::CriticalKVSelectModel`` for ``policy`` and this model."""
    g = GraphBuilder("ckvm/")
    _model_body(g, policy, num_layers, num_kv_heads)
    return helper.make_function(
        DOMAIN, MODEL_OP, model_inputs(num_layers, policy.method.refine is not None), model_outputs(num_layers),
        live_nodes(g.nodes, model_outputs(num_layers)),
        opset_imports=[helper.make_opsetid("", OPSET)],
        attributes=list(KVPolicy.knob_names()) + list(MODEL_ATTRIBUTES),
        doc_string=f"CriticalKVSelectModel body (model-level selection after the last layer) for policy {policy.to_json()} "
        f"(H_kv={num_kv_heads}, layers={num_layers}).",
    )


def model_node(policy: KVPolicy, capacities: list[int], inputs: list[str], outputs: list[str]) -> onnx.NodeProto:
    """The ``CriticalKVSelectModel`` node: every KVPolicy knob + num_layers + capacities."""
    node = helper.make_node(MODEL_OP, inputs, outputs, name="criticalkv_select_model", domain=DOMAIN)
    attributes = {**policy.attributes(), "num_layers": len(capacities), "capacities": list(capacities)}
    node.attribute.extend(
        helper.make_attribute(k, v, attr_type=onnx.AttributeProto.INTS if isinstance(v, list) else None)
        for k, v in attributes.items()
    )
    return node


def model_attributes(node: onnx.NodeProto) -> tuple[KVPolicy, int, list[int]]:
    """(policy, num_layers, capacities) of a ``CriticalKVSelectModel`` node (inverse of ``model_node``)."""
    values = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    capacities = [int(c) for c in values.pop("capacities")]
    policy, _, num_layers, _ = policy_from_attributes({**values, "layer_idx": 0, "capacity": 0})
    return policy, num_layers, capacities


def model_selection_model(policy: KVPolicy, num_layers: int, num_kv_heads: int, head_dim: int,
                          capacities: list[int]) -> onnx.ModelProto:
    """A model holding one ``CriticalKVSelectModel`` node (tests): inputs ``ranking.{l}`` [batch, H_kv, m] float,
    ``keys.{l}`` / ``values.{l}`` [batch, H_kv, n, d_h] float, ``prompt_lengths`` [batch] int32, ``kv_budget`` [1]
    int32; outputs the node's (``kept_keys.{l}``, ...)."""
    refined = policy.method.refine is not None
    inputs = model_inputs(num_layers, refined)
    outputs = model_outputs(num_layers)
    node = model_node(policy, capacities, inputs, outputs)
    scored = num_layers * (2 if refined else 1)
    infos = ([value_info(x, FLOAT, ["batch", num_kv_heads, "older"]) for x in inputs[:scored]]
             + [value_info(x, FLOAT, ["batch", num_kv_heads, "sequence", head_dim])
                for x in inputs[scored:scored + 2 * num_layers]]
             + [value_info("prompt_lengths", INT32, ["batch"]), value_info("kv_budget", INT32, [1])])
    kinds = {"kept_keys": FLOAT, "kept_values": FLOAT, "kept_lengths": INT32, "kept_indices": INT32}
    out_infos = [value_info(x, kinds[x.split(".")[0]], None) for x in outputs]
    graph = helper.make_graph([node], "criticalkv_select_model", infos, out_infos)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), selection_opset()],
                             functions=[model_function(policy, num_layers, num_kv_heads)], ir_version=IR_VERSION,
                             producer_name="criticalkv")
