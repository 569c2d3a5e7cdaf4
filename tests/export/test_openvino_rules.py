"""OpenVINO's rules (criticalkv/export/openvino_rules.py): the openvino flavour of every export passes them, each rule
catches the construct it names, and OpenVINO itself fails on (or computes something else than ONNX for) that construct,
so a rule that OpenVINO no longer needs shows here."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from criticalkv import KVPolicy
from criticalkv.export.openvino_rules import check_openvino_file, check_openvino_model
from criticalkv.runtime.manifest import read_manifest
from export.tiny_engine import export_tiny_engine
from hf.conftest import tiny_model

OPSET = 21


def model_of(nodes, inputs, outputs, initializers=(), functions=(), domains=()):
    graph = helper.make_graph(nodes, "rule", inputs, outputs, list(initializers))
    opsets = [helper.make_opsetid("", OPSET)] + [helper.make_opsetid(d, 1) for d in domains]
    return helper.make_model(graph, opset_imports=opsets, functions=list(functions), ir_version=10)


def rules(model) -> set[str]:
    return {v.rule for v in check_openvino_model(model)}


def openvino_run(model, feeds):
    """(outputs, None) of the model on OpenVINO's CPU plugin, or (None, the frontend's or plugin's message)."""
    ov = pytest.importorskip("openvino")
    core = ov.Core()
    try:
        compiled = core.compile_model(core.read_model(model.SerializeToString(), ov.Tensor(np.zeros(0, np.uint8))), "CPU")
    except RuntimeError as err:
        return None, str(err)
    result = compiled(feeds)
    return [np.asarray(result[out]) for out in compiled.outputs], None


X = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3])


def test_every_exported_openvino_graph_passes_the_rules(tmp_path):
    folder = export_tiny_engine(tiny_model("llama", seed=4), KVPolicy("ada-criticalkv", budget=40, window=8),
                                tmp_path / "engine", context_policy=KVPolicy("kvzip-criticalkv", budget=40, window=8))
    manifest = read_manifest(folder)
    info = manifest["onnx"]["openvino"]
    names = [info[k] for k in ("prefill", "extend", "select", "decode", "select_context")]
    for name in names:
        assert check_openvino_file(folder / name) == [], name
        model = onnx.load(str(folder / name), load_external_data=False)
        assert not model.functions and {o.domain for o in model.opset_import} == {""}
        assert manifest["onnx"]["validation"][name.replace(".onnx", "")]["openvino_rules"].startswith("OpenVINO")


def test_a_policy_the_cpu_plugin_cannot_compute_has_no_openvino_graphs(tmp_path):
    folder = export_tiny_engine(tiny_model("llama", seed=4), KVPolicy("defensivekv", budget=40, window=8), tmp_path / "e")
    info = read_manifest(folder)["onnx"]["openvino"]
    assert info["prefill"] is None and "int64 as int32" in info["refused"]
    assert not list(folder.glob("*_openvino.onnx"))


def test_function_rule():
    body = helper.make_function("ai.example", "Twice", ["a"], ["b"], [helper.make_node("Add", ["a", "a"], ["b"])],
                                [helper.make_opsetid("", OPSET)])
    model = model_of([helper.make_node("Twice", ["x"], ["y"], domain="ai.example")], [X],
                     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 3])], functions=[body],
                     domains=["ai.example"])
    assert {"function", "domain"} <= rules(model)
    _, error = openvino_run(model, {"x": np.ones((1, 2, 3), np.float32)})
    assert error is not None and "No conversion rule found" in error


def test_contrib_attention_without_past_rule():
    qkv = helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, 4, 64])
    node = helper.make_node("GroupQueryAttention", ["q", "q", "q", "", "", "seqlens", "total"], ["y", "pk", "pv"],
                            domain="com.microsoft", num_heads=4, kv_num_heads=4)
    model = model_of([node], [qkv], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                     [numpy_helper.from_array(np.array([3], np.int32), "seqlens"),
                      numpy_helper.from_array(np.array(4, np.int32), "total")], domains=["com.microsoft"])
    assert "domain" in rules(model)
    _, error = openvino_run(model, {"q": np.ones((1, 4, 64), np.float32)})
    assert error is not None and "past_key (input 3)" in error


def test_topk_rule():
    k = helper.make_tensor_value_info("k", TensorProto.INT64, ["m"])
    model = model_of([helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=2)], [X, k],
                     [helper.make_tensor_value_info("v", TensorProto.FLOAT, None)])
    assert "topk" in rules(model)
    _, error = openvino_run(model, {"x": np.ones((1, 2, 3), np.float32), "k": np.array([2], np.int64)})
    assert error is not None


def test_reduce_rule():
    mask = helper.make_tensor_value_info("m", TensorProto.BOOL, [1, 3])
    model = model_of([helper.make_node("ReduceSum", ["m", "axes"], ["y"])], [mask],
                     [helper.make_tensor_value_info("y", TensorProto.BOOL, None)],
                     [numpy_helper.from_array(np.array([1], np.int64), "axes")])
    assert "reduce" in rules(model)
    _, error = openvino_run(model, {"m": np.ones((1, 3), bool)})
    assert error is not None and "Unsupported input type" in error


def test_an_empty_tensor_sliced_off_a_constant_broadcasts_as_onnx_says():
    # the form the flavour uses instead of an empty constant (DecoderGraphBuilder.no_scores): its Expand to [B, 2, 1]
    # gives ONNX's [B, 2, 0] on OpenVINO too
    nodes = [helper.make_node("Slice", ["c", "zero", "zero", "two"], ["e"]),
             helper.make_node("Shape", ["x"], ["sx"], start=0, end=1),
             helper.make_node("Concat", ["sx", "tail"], ["shape"], axis=0),
             helper.make_node("Expand", ["e", "shape"], ["y"])]
    inits = [numpy_helper.from_array(np.zeros((1, 2, 1), np.float32), "c"),
             numpy_helper.from_array(np.array([0], np.int64), "zero"), numpy_helper.from_array(np.array([2], np.int64), "two"),
             numpy_helper.from_array(np.array([2, 1], np.int64), "tail")]
    model = model_of(nodes, [X], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    assert rules(model) == set()
    feeds = {"x": np.ones((1, 2, 3), np.float32)}
    got, _ = openvino_run(model, feeds)
    assert ReferenceEvaluator(model).run(None, feeds)[0].shape == got[0].shape == (1, 2, 0)


def test_empty_constant_rule():
    nodes = [helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.zeros((1, 2, 0), np.float32))),
             helper.make_node("Shape", ["c"], ["sc"]), helper.make_node("Shape", ["x"], ["sx"]),
             helper.make_node("Concat", ["sc", "sx"], ["y"], axis=0)]
    model = model_of(nodes, [X], [helper.make_tensor_value_info("y", TensorProto.INT64, None)])
    assert "empty-constant" in rules(model)
    feeds = {"x": np.ones((1, 2, 3), np.float32)}
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    got, error = openvino_run(model, feeds)
    assert want.tolist() == [1, 2, 0, 1, 2, 3] and (error is not None or got[0].tolist() != want.tolist())


def test_int64_rule():
    nodes = [helper.make_node("Mul", ["x", "scale"], ["m"]), helper.make_node("Floor", ["m"], ["f"]),
             helper.make_node("Cast", ["f"], ["y"], to=TensorProto.INT64)]
    model = model_of(nodes, [X], [helper.make_tensor_value_info("y", TensorProto.INT64, None)],
                     [numpy_helper.from_array(np.array(2.0 ** 48, np.float32), "scale")])
    assert "int64" in rules(model)
    feeds = {"x": np.full((1, 2, 3), 0.75, np.float32)}
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    got, _ = openvino_run(model, feeds)
    assert int(want.flat[0]) == 3 * 2**46 and not np.array_equal(got[0], want)  # int32 inside the CPU plugin
    wide = model_of([helper.make_node("Add", ["i", "big"], ["y"])],
                    [helper.make_tensor_value_info("i", TensorProto.INT64, [1])],
                    [helper.make_tensor_value_info("y", TensorProto.INT64, None)],
                    [numpy_helper.from_array(np.array([2**40], np.int64), "big")])
    assert rules(wide) == {"int64"}
    bounds = model_of([helper.make_node("Min", ["i", "big"], ["y"])],
                      [helper.make_tensor_value_info("i", TensorProto.INT64, [1])],
                      [helper.make_tensor_value_info("y", TensorProto.INT64, None)],
                      [numpy_helper.from_array(np.array([np.iinfo(np.int64).max], np.int64), "big")])
    assert rules(bounds) == set()
