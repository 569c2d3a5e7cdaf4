"""The ONNX-TensorRT importer's rules (criticalkv.export.tensorrt_rules), checked without TensorRT: the checker
rejects the defects the review found (a Loop body reading an absent condition input, iteration-dependent
shapes in a loop body, contrib operators, a bad plugin node, an additive FLOAT32_MIN mask) and passes the
exported TensorRT graphs."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from criticalkv import KVPolicy
from criticalkv.export import BuildConfig, export_model
from criticalkv.export.select_function import FLOAT32_MIN, selection_function
from criticalkv.export.tensorrt_rules import check_tensorrt_file, check_tensorrt_model
from criticalkv.export.validate import validate_export
from hf.conftest import tiny_model


def rules(model):
    return {v.rule for v in check_tensorrt_model(model)}


def loop_model(condition_input: bool, body_reads_condition: bool) -> onnx.ModelProto:
    """out[i] = x * i for i < M, as ``Loop(M, cond?)``; the defect-1 form is (False, True)."""
    cond_out = helper.make_node("Identity", ["cond_in"], ["cond_out"]) if body_reads_condition else \
        helper.make_node("Constant", [], ["cond_out"], value=numpy_helper.from_array(np.array(True)))
    body = helper.make_graph(
        [cond_out,
         helper.make_node("Cast", ["i"], ["i_f"], to=TensorProto.FLOAT),
         helper.make_node("Mul", ["x", "i_f"], ["y"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    true = helper.make_node("Constant", [], ["true"], value=numpy_helper.from_array(np.array(True)))
    nodes = [true] if condition_input else []
    nodes.append(helper.make_node("Loop", ["M", "true" if condition_input else ""], ["ys"], body=body, name="blocks"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
                                           helper.make_tensor_value_info("M", TensorProto.INT64, [])],
                              [helper.make_tensor_value_info("ys", TensorProto.FLOAT, ["trips", 2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def run(model):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": np.array([1.0, 2.0], np.float32), "M": np.array(3, np.int64)})[0]


def test_defect_1_a_loop_body_reading_an_absent_condition_is_rejected():
    # ONNX Runtime runs all three forms to the same result; TensorRT's Loop importer registers the body's
    # condition input only when the node has one, so only the first form fails to parse there
    defect, wired, dropped = loop_model(False, True), loop_model(True, True), loop_model(False, False)
    for model in (defect, wired, dropped):
        onnx.checker.check_model(model, full_check=True)
        np.testing.assert_array_equal(run(model), [[0, 0], [1, 2], [2, 4]])
    violations = check_tensorrt_model(defect)
    assert [v.rule for v in violations] == ["loop"] and "cond_in" in violations[0].message
    assert check_tensorrt_model(wired) == [] and check_tensorrt_model(dropped) == []


def test_a_scan_output_needs_a_trip_count():
    model = loop_model(True, True)
    model.graph.node[1].input[0] = ""
    assert any(v.rule == "loop" and "trip count" in v.message for v in check_tensorrt_model(model))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rules")
    policy = KVPolicy("criticalkv", budget=40, window=8)
    config = BuildConfig(max_input_len=128, attention_chunk=32)
    result = export_model(tiny_model("llama", seed=3), policy, folder, config)
    return folder, policy, result


def load(folder, name):
    return onnx.load(str(folder / name), load_external_data=False)


def test_the_exported_tensorrt_graphs_pass(exported):
    folder, _, result = exported
    assert check_tensorrt_file(folder / "prefill_tensorrt.onnx") == []
    assert check_tensorrt_file(folder / "decode.onnx") == []
    assert check_tensorrt_file(folder / "extend_tensorrt.onnx") == []
    assert check_tensorrt_file(folder / "select_tensorrt.onnx") == []
    report = validate_export(result)
    assert "passed" in report["prefill_tensorrt"]["tensorrt_rules"] and "passed" in report["decode"]["tensorrt_rules"]
    assert "passed" in report["extend_tensorrt"]["tensorrt_rules"] and "passed" in report["select_tensorrt"]["tensorrt_rules"]


def test_the_graph_before_the_fix_fails(exported):
    # main's prefill graphs: a blocked-attention Loop(M, "") whose body returned Identity(cond_in), and slices
    # at offsets computed from the iteration number; rebuilt here from the ONNX Runtime flavour
    folder, _, _ = exported
    model = load(folder, "prefill.onnx")
    model.functions.pop()  # the TensorRT flavour carried no body
    loop = next(n for n in model.graph.node if n.op_type == "Loop")
    body = loop.attribute[0].g
    body.node.append(helper.make_node("Identity", [body.input[1].name], ["cond_identity"]))
    body.output[0].name = "cond_identity"
    violations = check_tensorrt_model(model)
    found = {v.rule for v in violations}
    assert {"loop", "loop-shape", "fp16-range"} <= found, found
    assert any("Node input was not registered" in v.message for v in violations)


def test_contrib_and_unsupported_operators_are_rejected(exported):
    folder, _, _ = exported
    model = load(folder, "decode.onnx")
    node = model.graph.node[-1]
    contrib = helper.make_node("GroupQueryAttention", list(node.output), ["gqa"], domain="com.microsoft")
    model.graph.node.append(contrib)
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    violations = check_tensorrt_model(model)
    assert any(v.rule == "opset" and "com.microsoft" in v.message for v in violations)
    model = load(folder, "decode.onnx")
    model.graph.node.append(helper.make_node("SequenceConstruct", list(node.output), ["seq"]))
    assert "op" in rules(model)


def test_slice_axes_must_be_constant(exported):
    folder, _, _ = exported
    model = load(folder, "prefill_tensorrt.onnx")
    node = next(n for n in model.graph.node if n.op_type == "Slice")
    node.input[3] = "input_ids"  # a runtime tensor as axes
    assert "constant-input" in rules(model)


def test_a_float32_min_mask_is_rejected(exported):
    # the additive FLOAT32_MIN mask became -inf in an fp16 engine (defect 3)
    folder, _, _ = exported
    model = load(folder, "prefill_tensorrt.onnx")
    masked = next(n for n in model.graph.node if n.op_type == "Constant"
                  and numpy_helper.to_array(n.attribute[0].t).tolist() == -30000.0)
    masked.attribute[0].t.CopyFrom(numpy_helper.from_array(np.array(FLOAT32_MIN, np.float32)))
    assert rules(model) == {"fp16-range"}


def plugin_node(model):
    return next(n for n in model.graph.node if n.op_type == "CriticalKVSelect")


@pytest.mark.parametrize("tamper, message", [
    (lambda n: n.attribute.append(helper.make_attribute("chunk", 4)), "not a field"),
    (lambda n: n.attribute.remove(next(a for a in n.attribute if a.name == "capacity")), "capacity"),
    (lambda n: next(a for a in n.attribute if a.name == "budget").CopyFrom(helper.make_attribute("budget", 40.0)),
     "kFLOAT32, the field is kINT32"),
    (lambda n: next(a for a in n.attribute if a.name == "window").CopyFrom(helper.make_attribute("window", [8, 8])),
     "is a list, the field INT takes one value"),
    (lambda n: next(a for a in n.attribute if a.name == "layer_budgets").CopyFrom(
        helper.make_attribute("layer_budgets", 24)), "is one value, the field INTS takes a list"),
    (lambda n: n.attribute.append(helper.make_attribute("names", [1.0])), "not a field"),
    (lambda n: next(a for a in n.attribute if a.name == "capacity").CopyFrom(helper.make_attribute("capacity", 2**31)),
     "does not fit"),
])
def test_plugin_attributes_must_match_the_creator_fields(exported, tamper, message):
    folder, _, _ = exported
    model = load(folder, "prefill_tensorrt.onnx")
    tamper(plugin_node(model))
    violations = check_tensorrt_model(model)
    assert violations and all(v.rule == "plugin" for v in violations)
    assert any(message in v.message for v in violations), violations


def test_a_function_body_next_to_the_plugin_is_rejected(exported):
    folder, policy, _ = exported
    model = load(folder, "prefill_tensorrt.onnx")
    model.functions.append(selection_function(policy, 3, 6, 2, 16))
    assert rules(model) == {"plugin"}


def test_if_branches_must_match_the_node_outputs():
    def branch(value):
        constant = numpy_helper.from_array(np.array([value], np.float32))
        return helper.make_graph([helper.make_node("Constant", [], [f"c{value}"], value=constant)], f"b{value}", [],
                                 [helper.make_tensor_value_info(f"c{value}", TensorProto.FLOAT, [1])])

    node = helper.make_node("If", ["flag"], ["out"], then_branch=branch(1), else_branch=branch(2))
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    assert check_tensorrt_model(model) == []
    model.graph.node[0].output.append("extra")
    assert "if" in rules(model)


def test_shapes_from_input_values_are_rejected(exported):
    # TensorRT sizes every tensor of the graphs it runs from the input shapes; the ONNX Runtime flavours slice the
    # buffers to the largest length (a value of the lengths input) and are not TensorRT's. The select graph's
    # slice before the TensorRT fix was the same (docs/gpu.md)
    folder, _, _ = exported
    for name in ("select.onnx", "extend.onnx"):
        model = load(folder, name)
        model.ClearField("functions")
        found = [v for v in check_tensorrt_model(model) if v.rule == "data-dependent-shape"]
        assert found and all("values of a graph input" in v.message for v in found), name
    model = load(folder, "decode.onnx")  # lengths feed a mask: values, not shapes
    assert check_tensorrt_model(model) == []
    lengths = model.graph.input[4].name
    assert lengths == "past_key_values.0.lengths"
    model.graph.node.append(helper.make_node("NonZero", [lengths], ["nonzero"]))
    assert "data-dependent-shape" in rules(model)
    model = load(folder, "decode.onnx")
    model.graph.node.append(helper.make_node("Shape", [lengths], ["lengths_shape"]))  # a shape: allowed
    model.graph.node.append(helper.make_node("ConstantOfShape", ["lengths_shape"], ["zeros"]))
    assert check_tensorrt_model(model) == []
    model.graph.node.append(helper.make_node("Cast", [lengths], ["lengths64"], to=TensorProto.INT64))
    model.graph.node.append(helper.make_node("ReduceMax", ["lengths64"], ["longest"], keepdims=1))
    model.graph.node.append(helper.make_node("ConstantOfShape", ["longest"], ["by_value"]))
    assert [v.rule for v in check_tensorrt_model(model)] == ["data-dependent-shape"]


def test_dynamic_inputs_need_named_dimensions(exported):
    folder, _, _ = exported
    model = load(folder, "decode.onnx")
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = ""
    assert "profile" in rules(model)


@pytest.mark.slow
def test_the_bundled_model_graphs_pass():
    from criticalkv.export.decoder import (build_decode, build_extend, build_prefill, build_select, collect_weights,
                                         layer_capacities, model_spec)
    from criticalkv.hf import load_model

    model, _ = load_model()
    spec = model_spec(model)
    store = collect_weights(model, spec)
    store.layout()
    policy = KVPolicy("criticalkv", budget=256)
    capacities = layer_capacities(policy, spec, 4096)
    assert check_tensorrt_model(build_prefill(spec, store, policy, capacities, flavour="tensorrt")) == []
    assert check_tensorrt_model(build_decode(spec, store, [c + 256 for c in capacities])) == []
    assert check_tensorrt_model(build_extend(spec, store, policy, flavour="tensorrt")) == []
    assert check_tensorrt_model(build_select(spec, store, policy, capacities, flavour="tensorrt")) == []


def test_o_proj_is_stored_once(exported):
    # weights.bin holds every weight once (all three graphs point into it), and the TensorRT flavour multiplies
    # by o_proj through Gemm(transB=1): no Transpose of a weight that TensorRT would fold into a second copy
    # beside the one the plugin reads
    folder, _, result = exported
    size = (folder / "weights.bin").stat().st_size
    spans = {}
    for name in ("prefill.onnx", "prefill_tensorrt.onnx", "decode.onnx", "extend.onnx", "extend_tensorrt.onnx",
                 "select.onnx", "select_tensorrt.onnx"):
        for init in load(folder, name).graph.initializer:
            info = {e.key: e.value for e in init.external_data}
            span = (int(info["offset"]), int(info["length"]))
            assert spans.setdefault(init.name, span) == span and info["location"] == "weights.bin"
    starts = sorted(spans.values())
    assert all(a[0] + a[1] <= b[0] for a, b in zip(starts, starts[1:])) and starts[-1][0] + starts[-1][1] == size
    assert size - sum(length for _, length in starts) < 4096 * len(starts)  # only alignment padding besides
    model = load(folder, "prefill_tensorrt.onnx")
    weights = {i.name for i in model.graph.initializer}
    assert not [n.name for n in model.graph.node if n.op_type == "Transpose" and n.input[0] in weights]
    o_proj = "layers.0.o_proj"
    readers = sorted(n.op_type for n in model.graph.node if o_proj in n.input)
    assert readers == ["CriticalKVSelect", "Gemm"]
    for name, expected in (("extend_tensorrt.onnx", ["Gemm"]), ("select_tensorrt.onnx", ["CriticalKVSelect"])):
        model = load(folder, name)
        weights = {i.name for i in model.graph.initializer}
        assert not [n.name for n in model.graph.node if n.op_type == "Transpose" and n.input[0] in weights]
        assert sorted(n.op_type for n in model.graph.node if o_proj in n.input) == expected
