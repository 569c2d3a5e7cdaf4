"""The CriticalKVSelect plugin's ``scores`` input (input 6, the kvzip pair): the per-entry scores the graph computed.

Host side only, through the real IPluginV3 interfaces (plugins/testing/plugin_harness.cpp): the input count a policy
takes, the types, formats and shapes of the scores, the outputs, the workspace, serialization. enqueue hands the
scores to launchCriticalKVSelect (``SelectTensors::scores``), whose result equals the reference in the GPU tests
(test_plugin_gpu.py, marked ``gpu``) and on the torch ops (tests/selection/test_select_op.py)."""

import pytest

from ckv_native import TRT_DATA_TYPES, TRT_FORMAT_CHW2, TRT_FORMAT_LINEAR, encode_fields, node_fields
from criticalkv import KVPolicy

F, H, BF, I32 = (TRT_DATA_TYPES[t] for t in ("kFLOAT", "kHALF", "kBF16", "kINT32"))
#: queries, keys, values, o_proj_weight, prompt_lengths, kv_budget: B 2, H 8, H_kv 2, n 700, d_h 64, hidden 512
LAYER = [(2, 8, 32, 64), (2, 2, 700, 64), (2, 2, 700, 64), (512, 512), (2,), (1,)]
SCORES = (2, 2, 700)
OUTPUTS = [(2, 2, 256, 64), (2, 2, 256, 64), (2, 2), (2, 2, 256)]
KVZIP_POLICIES = [KVPolicy("kvzip", budget=96, window=32, sink_tokens=4),
                  KVPolicy("kvzip-criticalkv", budget=96, window=32, kvzip_chunk=64),
                  KVPolicy("kvzip", budget=96, window=32, kvzip_score="surrogate"),
                  KVPolicy("kvzip-criticalkv", budget=96, window=32, kvzip_score="surrogate")]


def plugin(harness, policy, capacity=256):
    handle = harness.create(encode_fields(node_fields(policy, 1, 4, capacity)))
    assert handle >= 0, harness.logs()
    return handle


@pytest.mark.parametrize("policy", KVZIP_POLICIES, ids=[f"{p.name}-{p.kvzip_score}" for p in KVZIP_POLICIES])
def test_the_kvzip_pair_is_created_and_serialized(harness, policy):
    handle = plugin(harness, policy)
    described = harness.describe(handle)
    fields = {f["name"]: f["value"] for f in described["fields"]}
    assert (fields["name"], fields["kvzip_score"], fields["sink_tokens"]) == (policy.name, policy.kvzip_score,
                                                                             policy.sink_tokens)
    for other in (harness.round_trip(handle, 0), harness.round_trip(handle, 1), harness.clone(handle)):
        assert other >= 0, harness.logs()
        assert harness.describe(other)["fields"] == described["fields"]
        # the copy still takes the scores input (the policy says so, not a field of its own)
        assert harness.output_types(other, [F, F, F, F, I32, I32, F]) == (0, [F, F, I32, I32])
        harness.destroy(other)


@pytest.mark.parametrize("policy", KVZIP_POLICIES[:2], ids=lambda p: p.name)
def test_the_kvzip_pair_takes_seven_inputs_and_the_others_at_most_six(harness, policy):
    handle = plugin(harness, policy)
    for t in (F, H, BF):
        assert harness.output_types(handle, [t, t, t, t, I32, I32, F]) == (0, [t, t, I32, I32])
    harness.logs()
    for count in (4, 5, 6):
        status, _ = harness.output_types(handle, [F, F, F, F, I32, I32][:count])
        assert status != 0
        assert "expected 7 inputs (queries, keys, values, o_proj_weight, prompt_lengths, kv_budget, scores)" in \
            harness.logs()[-1][1]
        assert harness.output_shapes(handle, LAYER[:count])["status"] != 0
    other = plugin(harness, KVPolicy("ada-criticalkv", budget=96, window=32))
    status, _ = harness.output_types(other, [F, F, F, F, I32, I32, F])
    assert status != 0 and "expected 4 to 6 inputs" in harness.logs()[-1][1]
    assert harness.configure(other, LAYER + [SCORES] + OUTPUTS, 7, on_shape_change=True) == -1


def test_scores_are_fp32_linear_whatever_the_layer_type(harness):
    handle = plugin(harness, KVZIP_POLICIES[1])
    linear = [TRT_FORMAT_LINEAR] * 11
    for t in (F, H, BF):
        good = [t, t, t, t, I32, I32, F, t, t, I32, I32]
        for pos in range(11):
            assert harness.supports(handle, pos, good, linear, 7), (t, pos)
            assert not harness.supports(handle, pos, good, [TRT_FORMAT_CHW2] * 11, 7), "linear layout only"
        for bad_type in {H, BF, I32} - {F}:
            bad = list(good)
            bad[6] = bad_type
            assert not harness.supports(handle, 6, bad, linear, 7), "scores are fp32"
        for pos in (9, 10):  # the outputs come after the seven inputs: lengths and indices int32
            bad = list(good)
            bad[pos] = t
            assert not harness.supports(handle, pos, bad, linear, 7)
    harness.logs()
    status, _ = harness.output_types(handle, [H, H, H, H, I32, I32, H])
    assert status != 0 and "scores: expected fp32" in harness.logs()[-1][1]


def test_output_shapes_and_workspace_with_the_scores_input(harness):
    kvzip = plugin(harness, KVZIP_POLICIES[1])
    dynamic = [(-1, 8, 32, 64), (-1, 2, -1, 64), (-1, 2, -1, 64), (512, 512), (-1,), (1,), (-1, 2, -1)]
    assert harness.output_shapes(kvzip, dynamic) == {
        "status": 0,
        "shapes": [["B", "2", "min(n,256)", "64"], ["B", "2", "min(n,256)", "64"], ["B", "2"], ["B", "2", "min(n,256)"]],
    }
    # the scores come in: the workspace is ada-criticalkv's (the same buffers, the window attention replaced)
    ada = plugin(harness, KVPolicy("ada-criticalkv", budget=96, window=32, kvzip_chunk=64))
    for n in (700, 5000):
        layer = [(2, 8, 32, 64), (2, 2, n, 64), (2, 2, n, 64), (512, 512), (2,), (1,)]
        size = harness.workspace(kvzip, layer + [(2, 2, n)])
        assert size > 0 and size == harness.workspace(ada, layer)


def test_scores_shapes_are_checked_with_clear_errors(harness):
    handle = plugin(harness, KVZIP_POLICIES[0])
    assert harness.configure(handle, LAYER + [SCORES] + OUTPUTS, 7, on_shape_change=False) == 0
    assert harness.configure(handle, LAYER + [SCORES] + OUTPUTS, 7, on_shape_change=True) == 0
    assert harness.configure(handle, LAYER + [(-1, 2, -1)] + OUTPUTS, 7, on_shape_change=False) == 0, "dynamic dims"
    harness.logs()
    wrong = {(2, 2, 699): "got [2, 2, 699]", (1, 2, 700): "got [1, 2, 700]", (2, 3, 700): "got [2, 3, 700]",
             (2, 2, 700, 1): "got 4 dimensions", (2, 1400): "got 2 dimensions"}
    for shape, detail in wrong.items():
        assert harness.configure(handle, LAYER + [shape] + OUTPUTS, 7, on_shape_change=True) == -1, shape
        message = harness.logs()[-1][1]
        assert "scores: expected shape [B, H_kv, n] = [2, 2, 700]" in message and detail in message, (shape, message)
    assert harness.configure(handle, LAYER + [(2, 3, -1)] + OUTPUTS, 7, on_shape_change=False) == -1
    assert "got [2, 3, -1]" in harness.logs()[-1][1]
    # the graph's "no scores" input [1, H_kv, 0] (the reference's window-attention fallback) has no kernel
    for on_shape_change in (False, True):
        assert harness.configure(handle, LAYER + [(1, 2, 0)] + OUTPUTS, 7, on_shape_change=on_shape_change) == -1
        assert "scores: 0 entries given (no scores computed)" in harness.logs()[-1][1]


@pytest.mark.parametrize("name", ["layer-kvzip", "layer-kvzip-criticalkv", "layer-defensivekv"])
def test_model_level_policies_stay_refused_by_the_per_layer_node(harness, name):
    assert harness.create(encode_fields(node_fields(KVPolicy(name, budget=96, window=32), 1, 4, 256))) == -1
    assert "shares the budget across all layers" in harness.logs()[-1][1]
