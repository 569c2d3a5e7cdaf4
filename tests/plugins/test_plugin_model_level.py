"""The model-level selection's TensorRT plugins on CPU: CriticalKVScore (one per layer, launchLayerRanking) and
CriticalKVSelectModel (once after the last layer, launchModelSelect), the nodes of criticalkv/export/model_select.py.

Host side only, through the real IPluginV3 interfaces (plugins/testing/plugin_harness.cpp): creators, fields,
serialization, clone, refusals, output types and shapes, formats, workspace sizes, shape validation. What enqueue
launches equals the reference in the CPU emulation of the kernels (test_model_level_emulation.py) and on the torch
ops (tests/selection/test_select_op.py); enqueue itself needs a GPU and TensorRT."""

import pytest

from ckv_native import TRT_DATA_TYPES, TRT_FORMAT_CHW2, TRT_FORMAT_LINEAR, encode_fields, node_fields
from criticalkv import KVPolicy
from criticalkv.export.model_select import score_outputs

F, H, BF, I32 = (TRT_DATA_TYPES[t] for t in ("kFLOAT", "kHALF", "kBF16", "kINT32"))
SCORE, MODEL = 2, 4  # creator indices ("" namespace; + 1: "ai.criticalkv")
MODEL_POLICIES = [KVPolicy("layer-defensivekv", budget=96, window=32),
                  KVPolicy("layer-kvzip", budget=96, window=32, head_cap_ratio=2.0, sink_tokens=4),
                  KVPolicy("layer-kvzip-criticalkv", budget=96, window=32, kvzip_score="surrogate")]
#: one layer's inputs: B 2, H 8, H_kv 2, n 700, d_h 64, hidden 512; m = 700 - 32
LAYER = [(2, 8, 32, 64), (2, 2, 700, 64), (2, 2, 700, 64), (512, 512), (2,), (1,)]
M = 668


def layer_inputs(policy, n=700):
    shapes = [(2, 8, 32, 64), (2, 2, n, 64), (2, 2, n, 64), (512, 512), (2,), (1,)]
    return shapes + [(2, 2, n)] if policy.method.base.external_scores else shapes


def score_plugin(harness, policy, creator=SCORE, layer=1, layers=4):
    handle = harness.create(encode_fields(node_fields(policy, layer, layers, 256)), creator=creator)
    assert handle >= 0, harness.logs()
    return handle


def model_fields(policy, capacities):
    return {**policy.attributes(), "num_layers": len(capacities), "capacities": list(capacities)}


def model_plugin(harness, policy, capacities=(256, 300, 200), creator=MODEL):
    handle = harness.create(encode_fields(model_fields(policy, capacities)), creator=creator)
    assert handle >= 0, harness.logs()
    return handle


def model_inputs(policy, layers=3, n=700, m=M):
    refined = policy.method.refine is not None
    ranked = [(2, 2, m)] * layers * (2 if refined else 1)
    return ranked + [(2, 2, n, 64)] * (2 * layers) + [(2,), (1,)]


# ------------------------------------------------------------------------------------------------ CriticalKVScore

@pytest.mark.parametrize("policy", MODEL_POLICIES, ids=lambda p: p.name)
def test_score_plugin_is_created_serialized_and_cloned(harness, policy):
    for creator in (SCORE, SCORE + 1):
        handle = score_plugin(harness, policy, creator)
        described = harness.describe(handle)
        assert (described["name"], described["version"]) == ("CriticalKVScore", "1")
        assert described["namespace"] == ("", "ai.criticalkv")[creator - SCORE]
        assert described["outputs"] == len(score_outputs(policy)), "ranking, and critical when the policy refines"
        assert {f["name"]: f["value"] for f in described["fields"]} == node_fields(policy, 1, 4, 256)
        for other in (harness.round_trip(handle, SCORE), harness.round_trip(handle, SCORE + 1), harness.clone(handle),
                      harness.clone(handle, attach=True)):
            assert other >= 0, harness.logs()
            again = harness.describe(other)
            assert (again["name"], again["fields"], again["metadata"]) == ("CriticalKVScore", described["fields"],
                                                                         described["metadata"])
            harness.destroy(other)
    assert harness.logs() == []


@pytest.mark.parametrize("policy, layers, message", [
    (KVPolicy("criticalkv", budget=96, window=32), 4, "does not select at model level"),
    (KVPolicy("layer-defensivekv", budget=96, window=32), 1, "does not select at model level"),
    (KVPolicy("expected-attention", budget=96, window=32), 4, "RoPE"),
], ids=["per-layer", "one-layer", "expected-attention"])
def test_score_plugin_refuses_what_does_not_select_at_model_level(harness, policy, layers, message):
    assert harness.create(encode_fields(node_fields(policy, 0, layers, 256)), creator=SCORE) == -1
    assert message in harness.logs()[-1][1]


@pytest.mark.parametrize("policy", MODEL_POLICIES, ids=lambda p: p.name)
def test_score_plugin_types_shapes_and_formats(harness, policy):
    handle = score_plugin(harness, policy)
    outputs = len(score_outputs(policy))
    inputs = layer_inputs(policy)
    count = len(inputs)
    for t in (F, H, BF):
        types = [t, t, t, t, I32, I32, F][:count]
        assert harness.output_types(handle, types, outputs) == (0, [F] * outputs), "fp32 rankings whatever T"
        linear = [TRT_FORMAT_LINEAR] * (count + outputs)
        good = types + [F] * outputs
        for pos in range(count + outputs):
            assert harness.supports(handle, pos, good, linear, count), (t, pos)
            assert not harness.supports(handle, pos, good, [TRT_FORMAT_CHW2] * (count + outputs), count)
        for pos in range(count, count + outputs):
            for bad_type in (H, I32):
                bad = list(good)
                bad[pos] = bad_type
                assert not harness.supports(handle, pos, bad, linear, count), "the rankings are fp32"
    dynamic = [(-1, 8, 32, 64), (-1, 2, -1, 64), (-1, 2, -1, 64), (512, 512), (-1,), (1,), (-1, 2, -1)][:count]
    assert harness.output_shapes(handle, dynamic, outputs) == {"status": 0,
                                                              "shapes": [["B", "2", "max(sub(n,32),0)"]] * outputs}
    for n, m in ((700, M), (33, 1), (32, 0), (20, 0)):
        got = harness.output_shapes(handle, layer_inputs(policy, n), outputs)
        assert got == {"status": 0, "shapes": [["2", "2", str(m)]] * outputs}, n
    harness.logs()
    wrong_count = count - 1 if policy.method.base.external_scores else count + 1
    shapes = inputs[:wrong_count] if wrong_count < count else inputs + [(2, 2, 700)]
    assert harness.output_shapes(handle, shapes, outputs)["status"] != 0
    assert "inputs" in harness.logs()[-1][1]


@pytest.mark.parametrize("policy, per_layer", list(zip(MODEL_POLICIES, ["defensivekv", "kvzip", "kvzip-criticalkv"])),
                         ids=lambda x: getattr(x, "name", x))
def test_score_workspace_is_the_per_layer_operator_s(harness, policy, per_layer):
    """launchLayerRanking runs in launchCriticalKVSelect's workspace of the same config and shape: the per-layer
    policy with the same knobs (its CriticalKVSelect node) needs the same bytes."""
    import dataclasses

    handle = score_plugin(harness, policy)
    twin = dataclasses.replace(policy, name=per_layer, head_cap_ratio=0.0)
    select = harness.create(encode_fields(node_fields(twin, 1, 4, 256)))
    assert select >= 0, harness.logs()
    sizes = []
    for n in (700, 5000):
        size = harness.workspace(handle, layer_inputs(policy, n), len(score_outputs(policy)))
        assert size == harness.workspace(select, layer_inputs(twin, n)) and size > 0, n
        sizes.append(size)
    assert sizes[0] < sizes[1]


def test_score_plugin_checks_its_concrete_shapes(harness):
    policy = MODEL_POLICIES[2]  # layer-kvzip-criticalkv: scores in, ranking and critical out
    handle = score_plugin(harness, policy)
    inputs = layer_inputs(policy)
    good = [(2, 2, M), (2, 2, M)]
    assert harness.configure(handle, inputs + good, 7, on_shape_change=False) == 0
    assert harness.configure(handle, inputs + good, 7, on_shape_change=True) == 0
    harness.logs()
    assert harness.configure(handle, inputs + [(2, 2, M), (2, 2, M + 1)], 7, on_shape_change=True) == -1
    assert "critical: expected shape [2, 2, 668]" in harness.logs()[-1][1]
    assert harness.configure(handle, inputs[:6] + [(2, 2, 0)] + good, 7, on_shape_change=True) == -1
    assert "scores: 0 entries given" in harness.logs()[-1][1]
    assert harness.configure(handle, [(2, 8, 16, 64)] + inputs[1:] + good, 7, on_shape_change=True) == -1
    assert "window queries" in harness.logs()[-1][1]
    assert harness.configure(handle, inputs + good[:1], 7, on_shape_change=True) == -1
    assert "expected 2 outputs" in harness.logs()[-1][1]


def test_score_enqueue_checks_the_workspace_tensorrt_allocated(harness):
    """As CriticalKVSelect's enqueue (test_plugin_harness.py): the size getWorkspaceSize gave at the profile's largest
    shapes is recorded at configure, serialized (workspace_bytes) and checked at every enqueue, which refuses a size it
    does not know, shapes that need more, or a failed getWorkspaceSize, before launching anything."""
    policy = MODEL_POLICIES[2]  # layer-kvzip-criticalkv: scores in, ranking and critical out
    handle = score_plugin(harness, policy)
    inputs, outputs = layer_inputs(policy), [(2, 2, M), (2, 2, M)]
    assert harness.describe(handle)["workspace_bytes"] == -1
    harness.logs()
    assert harness.enqueue_refusal(handle, inputs + outputs, 7) == -1
    assert "the size of the workspace TensorRT allocated is not known" in harness.logs()[-1][1]
    assert harness.configure(handle, inputs + outputs, 7, on_shape_change=False) == 0  # the profile's maxima
    allocated = harness.describe(handle)["workspace_bytes"]
    assert allocated == harness.workspace(handle, inputs, 2) > 0
    runtime = harness.round_trip(handle, SCORE)
    assert runtime >= 0 and harness.describe(runtime)["workspace_bytes"] == allocated, harness.logs()
    assert harness.enqueue_refusal(runtime, inputs + outputs, 7) == -1
    assert harness.logs()[-1][1].endswith("null workspace"), "the size check passed; the harness gives no workspace"
    longer = layer_inputs(policy, 5000)
    need = harness.workspace(score_plugin(harness, policy), longer, 2)
    assert harness.enqueue_refusal(runtime, longer + [(2, 2, 4968)] * 2, 7) == -1
    assert f"these shapes need {need} bytes of workspace, TensorRT allocated {allocated}" in harness.logs()[-1][1]
    failed = score_plugin(harness, policy)
    too_wide = [(2, 8, 32, 512), (2, 2, 700, 512), (2, 2, 700, 512), (512, 4096), (2,), (1,), (2, 2, 700)]
    assert harness.workspace(failed, too_wide, 2) == 0 and harness.describe(failed)["workspace_bytes"] == 0
    harness.logs()
    assert harness.enqueue_refusal(harness.round_trip(failed, SCORE), inputs + outputs, 7) == -1
    assert "which failed when the engine was built" in harness.logs()[-1][1]
    assert harness.configure(failed, too_wide + outputs, 7, on_shape_change=False) == -1
    assert "head dim 512 is outside" in harness.logs()[-1][1]


# ------------------------------------------------------------------------------------------------ CriticalKVSelectModel

@pytest.mark.parametrize("policy", MODEL_POLICIES, ids=lambda p: p.name)
def test_model_plugin_is_created_serialized_and_cloned(harness, policy):
    capacities = [256, 300, 200]
    for creator in (MODEL, MODEL + 1):
        handle = model_plugin(harness, policy, capacities, creator)
        described = harness.describe(handle)
        assert (described["name"], described["version"], described["outputs"]) == ("CriticalKVSelectModel", "1", 12)
        assert {f["name"]: f["value"] for f in described["fields"]} == model_fields(policy, capacities)
        assert described["metadata"].endswith("capacities=[256,300,200]")
        for other in (harness.round_trip(handle, MODEL), harness.round_trip(handle, MODEL + 1), harness.clone(handle),
                      harness.clone(handle, attach=True)):
            assert other >= 0, harness.logs()
            again = harness.describe(other)
            assert (again["fields"], again["metadata"]) == (described["fields"], described["metadata"])
            harness.destroy(other)
    assert harness.logs() == []


@pytest.mark.parametrize("fields, message", [
    ({**model_fields(MODEL_POLICIES[0], [256, 256])} | {"capacities": [256]}, "capacities: 1 values for num_layers 2"),
    ({k: v for k, v in model_fields(MODEL_POLICIES[0], [256, 256]).items() if k != "capacities"},
     "capacities: missing"),
    (model_fields(MODEL_POLICIES[0], [256, 0]), "capacities[1]: 0"),
    (model_fields(MODEL_POLICIES[0], [256]), "does not select at model level"),
    (model_fields(KVPolicy("snapkv", budget=96, window=32), [256, 256]), "does not select at model level"),
    (model_fields(MODEL_POLICIES[1], [256, 256]) | {"layer_idx": 0}, "unknown field 'layer_idx'"),
    (model_fields(MODEL_POLICIES[1], [256, 256]) | {"window": 200}, "window"),
], ids=["count", "missing", "zero", "one-layer", "per-layer", "layer_idx", "bad-knob"])
def test_model_plugin_refuses_bad_fields(harness, fields, message):
    assert harness.create(encode_fields(fields), creator=MODEL) == -1
    assert message in harness.logs()[-1][1], harness.logs()


@pytest.mark.parametrize("policy", MODEL_POLICIES, ids=lambda p: p.name)
def test_model_plugin_types_shapes_and_formats(harness, policy):
    handle = model_plugin(harness, policy)
    inputs = model_inputs(policy)
    count, ranked = len(inputs), len(inputs) - 8
    for t in (F, H, BF):
        types = [F] * ranked + [t] * 6 + [I32, I32]
        assert harness.output_types(handle, types, 12) == (0, [t, t, I32, I32] * 3)
        good = types + [t, t, I32, I32] * 3
        linear = [TRT_FORMAT_LINEAR] * len(good)
        for pos in range(len(good)):
            assert harness.supports(handle, pos, good, linear, count), (t, pos)
            assert not harness.supports(handle, pos, good, [TRT_FORMAT_CHW2] * len(good), count)
            bad = list(good)
            bad[pos] = I32 if good[pos] != I32 else t
            assert not harness.supports(handle, pos, bad, linear, count), (t, pos)
    harness.logs()
    status, _ = harness.output_types(handle, [H] * ranked + [H] * 6 + [I32, I32], 12)
    assert status != 0 and "rankings: expected fp32" in harness.logs()[-1][1]
    for n, caps in ((700, (256, 300, 200)), (250, (250, 250, 200))):
        got = harness.output_shapes(handle, model_inputs(policy, n=n, m=max(n - 32, 0)), 12)
        want = []
        for cap in caps:
            want += [["2", "2", str(cap), "64"]] * 2 + [["2", "2"], ["2", "2", str(cap)]]
        assert got == {"status": 0, "shapes": want}, n
    if ranked >= 5:  # the harness names the axes of inputs 5 on "in<i>.<axis>"
        symbolic = harness.output_shapes(handle, [(-1, 2, -1)] * ranked + [(-1, 2, -1, 64)] * 6 + [(-1,), (1,)], 12)
        first_keys = f"in{ranked}"
        assert symbolic["shapes"][8] == [f"{first_keys}.0", "2", f"min({first_keys}.2,200)", "64"]
    assert harness.output_shapes(handle, inputs[:-1], 12)["status"] != 0
    assert f"expected {count} inputs" in harness.logs()[-1][1]


def test_model_workspace_holds_the_concatenated_rankings(harness):
    """The rankings [B, L H_kv, m] fp32 concatenated layer-major (and the critical scores when refined), 256-byte
    aligned, before launchModelSelect's own scratch (which does not depend on the refinement)."""
    plain_policy = KVPolicy("layer-kvzip", budget=96, window=32)
    refined_policy = KVPolicy("layer-kvzip-criticalkv", budget=96, window=32)
    plain, refined = model_plugin(harness, plain_policy), model_plugin(harness, refined_policy)
    sizes = []
    for n in (700, 5000):
        m = n - 32
        rows = 2 * 3 * 2 * m  # B L H_kv m
        size = harness.workspace(plain, model_inputs(plain_policy, n=n, m=m), 12)
        both = harness.workspace(refined, model_inputs(refined_policy, n=n, m=m), 12)
        assert both - size == (rows * 4 + 255) // 256 * 256, "the critical scores' copy"
        assert size >= (rows * 4 + 255) // 256 * 256 + rows, "the rankings' copy and the model's flags"
        sizes.append(size)
    assert sizes[0] < sizes[1]


def test_model_plugin_checks_its_concrete_shapes(harness):
    policy = MODEL_POLICIES[2]
    handle = model_plugin(harness, policy, (256, 256, 256))
    inputs = model_inputs(policy)
    outputs = [(2, 2, 256, 64), (2, 2, 256, 64), (2, 2), (2, 2, 256)] * 3
    count = len(inputs)
    assert harness.configure(handle, inputs + outputs, count, on_shape_change=False) == 0
    assert harness.configure(handle, inputs + outputs, count, on_shape_change=True) == 0
    harness.logs()
    cases = {
        "keys.1: shape [2, 2, 699, 64] differs from keys.0's [2, 2, 700, 64]": (7, (2, 2, 699, 64)),
        "values.2: shape [2, 2, 700, 32] differs": (11, (2, 2, 700, 32)),
        "ranking.1: expected shape [2, 2, 668]": (1, (2, 2, 669)),
        "critical.0: expected shape [2, 2, 668]": (3, (2, 3, 668)),
        "prompt_lengths: expected shape [B]": (12, (3,)),
        "kv_budget: expected shape [1]": (13, (2,)),
    }
    for message, (index, shape) in cases.items():
        bad = list(inputs)
        bad[index] = shape
        assert harness.configure(handle, bad + outputs, count, on_shape_change=True) == -1, message
        assert message in harness.logs()[-1][1], (message, harness.logs())
    short = [(2, 2, 256, 64), (2, 2, 256, 64), (2, 2), (2, 2, 255)] + outputs[4:]
    assert harness.configure(handle, inputs + short, count, on_shape_change=True) == -1
    assert "kept_indices.0: unexpected shape" in harness.logs()[-1][1]
    bad = list(inputs)
    bad[6] = (2, 3, 700, 64)  # keys.0 against the rankings' H_kv, while dims are still dynamic elsewhere
    dynamic = [(-1, 2, -1)] * 6 + [(-1, 3, -1, 64)] + [(-1, 2, -1, 64)] * 5 + [(-1,), (1,)]
    assert harness.configure(handle, dynamic + outputs, count, on_shape_change=False) == -1
    assert "does not match keys.0's" in harness.logs()[-1][1]


def test_model_enqueue_checks_the_workspace_tensorrt_allocated(harness):
    """CriticalKVSelectModel's workspace (the concatenated rankings, then launchModelSelect's scratch) checked as the
    layer nodes' are: recorded at configure from the profile's maxima, serialized, refused when unknown, too small or
    failed, before the rankings' copies or any launch."""
    policy = MODEL_POLICIES[2]
    handle = model_plugin(harness, policy, (256, 256, 256))
    inputs, outputs = model_inputs(policy), [(2, 2, 256, 64), (2, 2, 256, 64), (2, 2), (2, 2, 256)] * 3
    count = len(inputs)
    assert harness.describe(handle)["workspace_bytes"] == -1
    harness.logs()
    assert harness.enqueue_refusal(handle, inputs + outputs, count) == -1
    assert "the size of the workspace TensorRT allocated is not known" in harness.logs()[-1][1]
    dynamic = [(-1, 2, -1)] * 6 + [(-1, 2, -1, 64)] * 6 + [(-1,), (1,)]
    assert harness.configure(handle, dynamic + outputs, count, on_shape_change=False) == 0
    assert harness.describe(handle)["workspace_bytes"] == -1, "no maxima given: nothing recorded"
    assert harness.configure(handle, inputs + outputs, count, on_shape_change=False) == 0
    allocated = harness.describe(handle)["workspace_bytes"]
    assert allocated == harness.workspace(model_plugin(harness, policy, (256, 256, 256)), inputs, 12) > 0
    runtime = harness.round_trip(handle, MODEL)
    assert runtime >= 0 and harness.describe(runtime)["workspace_bytes"] == allocated, harness.logs()
    assert harness.enqueue_refusal(runtime, inputs + outputs, count) == -1
    assert harness.logs()[-1][1].endswith("null workspace"), "the size check passed; the harness gives no workspace"
    longer = model_inputs(policy, n=5000, m=4968)
    need = harness.workspace(model_plugin(harness, policy, (256, 256, 256)), longer, 12)
    assert harness.enqueue_refusal(runtime, longer + outputs, count) == -1
    assert f"these shapes need {need} bytes of workspace, TensorRT allocated {allocated}" in harness.logs()[-1][1]
    failed = model_plugin(harness, policy, (256, 256, 256))
    too_wide = [(2, 2, M)] * 6 + [(2, 2, 700, 512)] * 6 + [(2,), (1,)]
    assert harness.workspace(failed, too_wide, 12) == 0 and harness.describe(failed)["workspace_bytes"] == 0
    harness.logs()
    assert harness.enqueue_refusal(harness.round_trip(failed, MODEL), inputs + outputs, count) == -1
    assert "which failed when the engine was built" in harness.logs()[-1][1]
    assert harness.configure(failed, too_wide + outputs, count, on_shape_change=False) == -1
    assert "head dim 512 is outside" in harness.logs()[-1][1]


@pytest.mark.parametrize("policy", MODEL_POLICIES, ids=lambda p: p.name)
def test_the_exports_nodes_create_the_plugins(harness, policy):
    """The attributes of model_select's CriticalKVScore and CriticalKVSelectModel nodes, as the ONNX parser hands them
    to the creators (floats as float32, strings as chars, INTS as int32 arrays), create the plugins and come back."""
    from onnx import helper

    from criticalkv.export.model_select import model_inputs, model_node, model_outputs, score_node

    def fields_of(node):
        values = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        return {k: v.decode() if isinstance(v, bytes) else v for k, v in values.items()}

    capacities = [192, 160, 192]
    score = score_node(policy, 2, 3, 160, [f"in{i}" for i in range(7)], ["ranking"])
    handle = harness.create(encode_fields(fields_of(score), "float32"), creator=SCORE)
    assert handle >= 0, harness.logs()
    described = {f["name"]: f["value"] for f in harness.describe(handle)["fields"]}
    assert described == node_fields(policy, 2, 3, 160)
    refined = policy.method.refine is not None
    model = model_node(policy, capacities, model_inputs(3, refined), model_outputs(3))
    handle = harness.create(encode_fields(fields_of(model), "float32"), creator=MODEL + 1)
    assert handle >= 0, harness.logs()
    assert {f["name"]: f["value"] for f in harness.describe(handle)["fields"]} == model_fields(policy, capacities)
