"""The CriticalKVSelect node on ONNX Runtime (its function body) against the PyTorch reference."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from criticalkv import KVPolicy, gather_kv, select_layer
from criticalkv.export.select_function import selection_model
from criticalkv.export.validate import same_policy
from criticalkv.node import DOMAIN, INPUTS, LAYER_ATTRIBUTES, OP_TYPE, OUTPUTS, node_capacity, policy_from_attributes
from criticalkv.policy import KVPolicy as Policy
from helpers import random_layer
from policies import POLICY_CASES, make_policy

IDS = [c[0] for c in POLICY_CASES]


def run_node(policy, q, k, v, o, lengths, layer_idx=0, num_layers=1, max_prompt_len=None):
    model = selection_model(policy, o.numpy(), q.shape[1], k.shape[1], layer_idx=layer_idx, num_layers=num_layers,
                            max_prompt_len=max_prompt_len or k.shape[2])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"queries": q.numpy(), "keys": k.numpy(), "values": v.numpy(), "prompt_lengths": lengths.numpy().astype(np.int32)}
    return dict(zip(OUTPUTS, session.run(None, feeds))), model


def assert_same_as_reference(policy, q, k, v, o, lengths, layer_idx=0, num_layers=1, max_prompt_len=None):
    out, model = run_node(policy, q, k, v, o, lengths, layer_idx, num_layers, max_prompt_len)
    ref = select_layer(policy, q, k, v, o, layer_idx, num_layers, lengths.to(torch.int64))
    batch, heads, n, _ = k.shape
    capacity = node_capacity(policy, max_prompt_len or n, heads, layer_idx, num_layers)
    cap = min(n, capacity)
    assert out["kept_indices"].shape == (batch, heads, cap) and out["kept_indices"].dtype == np.int32
    assert out["kept_lengths"].dtype == np.int32 and out["kept_keys"].shape == (batch, heads, cap, k.shape[3])
    width = ref.indices.shape[-1]
    assert np.array_equal(out["kept_lengths"], ref.lengths.numpy())
    assert np.array_equal(out["kept_indices"][..., :width], ref.indices.numpy()), "kept indices differ from select_layer"
    assert (out["kept_indices"][..., width:] == -1).all()
    ref_k, ref_v = gather_kv(ref, k, v)
    assert np.array_equal(out["kept_keys"][:, :, :width], ref_k.numpy())
    assert np.array_equal(out["kept_values"][:, :, :width], ref_v.numpy())
    assert not out["kept_keys"][:, :, width:].any() and not out["kept_values"][:, :, width:].any()
    return out, model


@pytest.mark.parametrize("case", POLICY_CASES, ids=IDS)
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4)], ids=["gqa9x3", "mha4"])
def test_node_equals_select_layer_on_padded_batches(case, heads, kv_heads):
    # a left-padded batch: one long, one compressed shorter, one at most the budget (kept whole)
    q, k, v, o = random_layer(batch=3, heads=heads, kv_heads=kv_heads, n=160, head_dim=16, hidden=48, window=8, seed=3)
    lengths = torch.tensor([160, 97, 40], dtype=torch.int32)
    for layer_idx, num_layers in ((0, 1), (1, 4), (3, 4)):
        policy = make_policy(case[1], budget=40, window=8)
        assert_same_as_reference(policy, q, k, v, o, lengths, layer_idx, num_layers, max_prompt_len=200)


@pytest.mark.parametrize("case", POLICY_CASES, ids=IDS)
@pytest.mark.parametrize("seed", range(3))
def test_node_equals_select_layer_on_random_inputs(case, seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(50, 300, (1,), generator=g))
    q, k, v, o = random_layer(batch=2, n=n, head_dim=8, hidden=24, window=16, seed=seed + 10)
    lengths = torch.tensor([n, int(torch.randint(1, n, (1,), generator=g))], dtype=torch.int32)
    policy = make_policy(case[1], budget=48, window=16)
    assert_same_as_reference(policy, q, k, v, o, lengths, seed % 3, 3)


@pytest.mark.parametrize("case", POLICY_CASES, ids=IDS)
@pytest.mark.parametrize("n", [5, 8, 20, 32, 33])
def test_short_prompts_window_and_budget_edges(case, n):
    # n < window, n == window, n <= budget (kept whole: the If's else branch), n == budget + 1
    q, k, v, o = random_layer(batch=2, n=n, window=8, seed=n)
    lengths = torch.tensor([n, max(1, n // 2)], dtype=torch.int32)
    assert_same_as_reference(make_policy(case[1], budget=32, window=8), q, k, v, o, lengths, 2, 4)


def test_exact_ties_go_to_the_lower_index():
    # Zero keys: uniform attention, so every older token has the same pooled score; zero values: the
    # same critical score. Every stage must keep the lowest positions, whatever TopK does with ties.
    q, k, v, o = random_layer(n=64, window=8, seed=0)
    k, v = torch.zeros_like(k), torch.zeros_like(v)
    lengths = torch.tensor([64], dtype=torch.int32)
    for name in ("snapkv", "criticalkv", "pyramidkv", "pyramid-criticalkv"):
        out, _ = assert_same_as_reference(KVPolicy(name, budget=24, window=8), q, k, v, o, lengths)
        if name in ("snapkv", "criticalkv"):
            assert out["kept_indices"][0, 0].tolist() == list(range(16)) + list(range(56, 64))
    for name in ("adakv", "ada-criticalkv", "laprox"):
        out, _ = assert_same_as_reference(KVPolicy(name, budget=24, window=8, ada_floor=0.25), q, k, v, o, lengths)
    # r = 16, floor 4 per head; all 3 * 12 shared slots go to the lowest head
    out, _ = run_node(KVPolicy("adakv", budget=24, window=8, ada_floor=0.25), q, k, v, o, lengths)
    assert out["kept_lengths"][0].tolist() == [48, 12, 12]


def test_partial_ties_in_blocks_of_equal_keys():
    # Keys repeated in blocks of 4: the attention scores tie inside each block (exactly equal dot
    # products), so the k-th score often falls inside a run of equal values.
    q, k, v, o = random_layer(batch=2, n=128, window=8, seed=7)
    k = k[:, :, ::4].repeat_interleave(4, dim=2)
    v = v[:, :, ::4].repeat_interleave(4, dim=2)
    lengths = torch.tensor([128, 90], dtype=torch.int32)
    for case in POLICY_CASES:
        assert_same_as_reference(make_policy(case[1], budget=30, window=8), q, k, v, o, lengths, 1, 3)


def test_onnx_reference_evaluator_runs_the_function_body_too():
    # the body is plain ONNX: onnx.reference (pure NumPy) evaluates it to the same selection
    from onnx.reference import ReferenceEvaluator

    q, k, v, o = random_layer(batch=2, n=100, window=8, seed=2)
    lengths = torch.tensor([100, 61], dtype=torch.int32)
    for name in ("criticalkv", "ada-criticalkv", "laprox", "streamingllm"):
        policy = KVPolicy(name, budget=32, window=8)
        out, model = run_node(policy, q, k, v, o, lengths, 1, 3)
        feeds = {"queries": q.numpy(), "keys": k.numpy(), "values": v.numpy(), "prompt_lengths": lengths.numpy()}
        ref = dict(zip(OUTPUTS, ReferenceEvaluator(model).run(None, feeds)))
        for key in OUTPUTS:
            assert np.array_equal(ref[key], out[key]), (name, key)


@pytest.mark.parametrize("case", POLICY_CASES, ids=IDS)
def test_polygraphy_onnxruntime_equals_the_reference_oracle(case):
    from criticalkv.export.reference import compare_with_reference

    q, k, v, o = random_layer(batch=2, n=140, window=8, seed=11)
    policy = make_policy(case[1], budget=40, window=8)
    model = selection_model(policy, o.numpy(), 9, 3, layer_idx=2, num_layers=4, max_prompt_len=160)
    feeds = [
        {"queries": q.numpy(), "keys": k.numpy(), "values": v.numpy(), "prompt_lengths": np.array(lengths, np.int32)}
        for lengths in ([140, 140], [140, 57], [30, 12])
    ]
    assert compare_with_reference(model, feeds)


def test_polygraphy_comparison_catches_a_wrong_body():
    # a body generated for snapkv under a node that says criticalkv: ORT runs the body, the oracle the attributes
    from criticalkv.export.reference import compare_with_reference
    from criticalkv.export.select_function import selection_function

    q, k, v, o = random_layer(batch=1, n=140, window=8, seed=12)
    model = selection_model(KVPolicy("criticalkv", budget=40, window=8), o.numpy(), 9, 3, max_prompt_len=160)
    model.functions[0].CopyFrom(selection_function(KVPolicy("snapkv", budget=40, window=8), 1, 9, 3, 16))
    feeds = [{"queries": q.numpy(), "keys": k.numpy(), "values": v.numpy(), "prompt_lengths": np.array([140], np.int32)}]
    assert not compare_with_reference(model, feeds)


def test_node_contract_names_types_and_attributes():
    policy = KVPolicy("pyramid-criticalkv", budget=40, window=8, alpha=0.3)
    model = selection_model(policy, np.zeros((48, 144), np.float32), 9, 3, layer_idx=2, num_layers=4, max_prompt_len=500)
    onnx.checker.check_model(model, full_check=True)
    (node,) = model.graph.node
    assert (node.domain, node.op_type) == (DOMAIN, OP_TYPE)
    assert list(node.input) == list(INPUTS) and list(node.output) == list(OUTPUTS)
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert set(attributes) == set(Policy.knob_names()) | set(LAYER_ATTRIBUTES)
    back, layer_idx, num_layers, capacity = policy_from_attributes(attributes)
    assert (layer_idx, num_layers, capacity) == (2, 4, node_capacity(policy, 500, 3, 2, 4))
    assert same_policy(back, policy)  # float knobs are float32 in ONNX
    assert back.alpha == pytest.approx(0.3) and back.epsilon == pytest.approx(1e-4)
    (function,) = model.functions
    assert (function.domain, function.name) == (DOMAIN, OP_TYPE)
    assert set(function.attribute) == set(attributes)
    assert {n.domain for n in function.node} == {""}, "the body uses standard operators only"
    bare = selection_model(policy, np.zeros((48, 144), np.float32), 9, 3, with_body=False)
    assert not bare.functions
    onnx.checker.check_model(bare, full_check=True)


def test_prompt_lengths_may_be_all_equal_or_the_batch_one():
    q, k, v, o = random_layer(batch=1, n=90, window=8, seed=4)
    for case in POLICY_CASES:
        assert_same_as_reference(make_policy(case[1], budget=24, window=8), q, k, v, o, torch.tensor([90], dtype=torch.int32))


def test_model_level_policy_is_refused_by_the_per_layer_node_with_the_reason():
    from criticalkv.export.select_function import check_exportable, selection_function

    policy = KVPolicy("layer-defensivekv", budget=32, window=8)
    with pytest.raises(ValueError, match="shares the budget across all layers.*CriticalKVSelectModel"):
        selection_function(policy, 3, 6, 2, 16)
    with pytest.raises(ValueError, match="shares the budget across all layers"):
        check_exportable(policy)
    selection_function(policy, 1, 6, 2, 16)  # one layer: the model-level choice is the layer's own
    check_exportable(KVPolicy("defensivekv"))


def test_tensorrt_step_skips_a_method_the_plugin_has_no_flow_for(tmp_path):
    from types import SimpleNamespace

    from criticalkv.build import tensorrt_step

    messages = []
    result = SimpleNamespace(policy=KVPolicy("expected-attention"), spec=SimpleNamespace(num_layers=3))
    out = tensorrt_step(tmp_path, result, messages.append)
    # the export wrote no TensorRT flavour: the step is skipped with the plugin's refusal
    assert out == {"built": False, "skipped_reason": "the CriticalKVSelect plugin refuses expected-attention: it reads "
                   "RoPE's rotation averaged over the next future_positions positions, an input the CriticalKVSelect "
                   "plugin does not take; select it on the PyTorch path or ONNX Runtime"}
    assert "SKIPPED because the CriticalKVSelect plugin refuses expected-attention" in messages[0]
    # kvzip's re-read scores: no TensorRT flavour either
    result = SimpleNamespace(policy=KVPolicy("layer-kvzip"), spec=SimpleNamespace(num_layers=3))
    assert "context reconstruction" in tensorrt_step(tmp_path, result, messages.append)["skipped_reason"]


def test_live_nodes_drops_unread_nodes_also_inside_branches():
    from onnx import helper

    from criticalkv.export.graph import GraphBuilder, live_nodes
    from criticalkv.export.select_function import _Body
    from criticalkv.node import OUTPUTS

    then = helper.make_graph([helper.make_node("Neg", ["x"], ["dead_inner"]), helper.make_node("Abs", ["x"], ["y_then"])],
                             "then", [], [helper.make_tensor_value_info("y_then", onnx.TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Identity", ["read_by_branch"], ["y_else"])],
                              "else", [], [helper.make_tensor_value_info("y_else", onnx.TensorProto.FLOAT, None)])
    nodes = [helper.make_node("Relu", ["x"], ["read_by_branch"]), helper.make_node("Exp", ["x"], ["dead"]),
             helper.make_node("Sqrt", ["dead"], ["dead2"]),
             helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)]
    kept = live_nodes(nodes, ["y"])
    assert [n.op_type for n in kept] == ["Relu", "If"]  # the dead chain goes, the branch's outer read stays
    branches = {a.name: [n.op_type for n in a.g.node] for a in kept[1].attribute}
    assert branches == {"then_branch": ["Abs"], "else_branch": ["Identity"]}

    def count(graph_nodes):
        return sum(1 + sum(count(a.g.node) for a in n.attribute if a.HasField("g")) for n in graph_nodes)

    # criticalkv reads no window-attention rows nor the older values' copy: the body loses their slices
    g = GraphBuilder("ckv/")
    _Body(g, KVPolicy("criticalkv", budget=40, window=8), 1, 9, 3, 16).build()
    before = count(g.nodes)
    assert count(live_nodes(g.nodes, OUTPUTS)) < before
