"""`python -m benchmarks.profile`: op classes, FLOPs and bytes read from real ONNX Runtime profiles of tiny graphs, and
the floors' arithmetic (the bundled model's engines are profiled by the command itself, not in CI)."""

import json
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import benchmarks
from benchmarks import profile
from criticalkv.bench import floors

#: A toy Llama spec: qkv 8 -> 16, o_proj 8 -> 8, gate-up 8 -> 24, down 12 -> 8, vocab 32.
SPEC = {"hidden_size": 8, "num_heads": 2, "num_kv_heads": 1, "head_dim": 4, "intermediate_size": 12,
        "vocab_size": 32, "num_layers": 2}


def _model(with_loop: bool):
    """x [1, n, 8] -> qkv MatMul, an activation x activation MatMul, Softmax, gate-up MatMul, LM-head Gemm of row 0;
    with_loop: the activation MatMul inside a 3-trip Loop body instead."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
             for name, shape in (("qkv", (8, 16)), ("gate_up", (8, 24)), ("lm_head", (32, 8)))]
    inits += [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("trips", 3), ("zero", [0]), ("one", [1]),
                                                                           ("axis1", [1]), ("flat", [-1, 8]))]
    nodes = [helper.make_node("MatMul", ["x", "qkv"], ["q"]),
             helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1])]
    if with_loop:
        body = helper.make_graph(
            [helper.make_node("MatMul", ["x", "xt"], ["s_body"]), helper.make_node("Identity", ["c_in"], ["c_out"])],
            "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                     helper.make_tensor_value_info("c_in", TensorProto.BOOL, [])],
            [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
             helper.make_tensor_value_info("s_body", TensorProto.FLOAT, None)])
        nodes += [helper.make_node("Loop", ["trips", ""], ["s_all"], body=body),
                  helper.make_node("Gather", ["s_all", "zero"], ["s0"], axis=0),
                  helper.make_node("Squeeze", ["s0", "zero"], ["s"])]
    else:
        nodes.append(helper.make_node("MatMul", ["x", "xt"], ["s"]))
    nodes += [helper.make_node("Softmax", ["s"], ["p"], axis=-1),
              helper.make_node("MatMul", ["x", "gate_up"], ["g"]),
              helper.make_node("Slice", ["x", "zero", "one", "axis1"], ["row"]),
              helper.make_node("Reshape", ["row", "flat"], ["row2"]),
              helper.make_node("Gemm", ["row2", "lm_head"], ["logits"], transB=1)]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("q", "p", "g", "logits")]
    graph = helper.make_graph(nodes, "toy", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "n", 8])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _profile(tmp_path, with_loop: bool, n: int = 5, runs: int = 2, prepack: bool = True) -> list[dict]:
    options = ort.SessionOptions()
    if not prepack:  # as the engines' shared weights: the weights are listed among the MatMul inputs
        options.add_session_config_entry("session.disable_prepacking", "1")
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "toy")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep the toy's nodes as written
    session = ort.InferenceSession(_model(with_loop).SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = np.ones((1, n, 8), np.float32)
    for _ in range(runs):
        session.run(None, {"x": x})
    path = session.end_profiling()
    trace = json.loads(Path(path).read_text())
    os.remove(path)
    return trace


@pytest.mark.parametrize("prepack", [True, False])
def test_projections_are_told_apart_by_their_weight_and_counted_in_flops(tmp_path, prepack):
    result = profile.breakdown(_profile(tmp_path, with_loop=False, prepack=prepack), SPEC)
    c = result["classes"]
    assert result["runs"] == 2
    assert c["qkv_proj"]["nodes"] == 1 and c["qkv_proj"]["flops"] == 2 * 5 * 8 * 16
    assert c["qkv_proj"]["bytes"] == 4 * 8 * 16  # the weight it reads
    assert c["gate_up_proj"]["flops"] == 2 * 5 * 8 * 24
    assert c["lm_head"]["nodes"] == 1 and c["lm_head"]["flops"] == 2 * 1 * 8 * 32 and c["lm_head"]["bytes"] == 4 * 32 * 8
    assert c["attention"]["nodes"] == 2  # the activation x activation MatMul and the Softmax
    assert c["attention"]["flops"] == 2 * 5 * 8 * 5 and c["attention"]["bytes"] == 4 * 8 * 5
    assert c["o_proj"]["nodes"] == 0 and c["selection"]["nodes"] == 0
    assert 0 < sum(v["seconds"] for v in c.values()) <= result["run_s"]


def test_nodes_nested_in_a_loop_count_in_its_class(tmp_path):
    result = profile.breakdown(_profile(tmp_path, with_loop=True), SPEC)
    attention = result["classes"]["attention"]
    assert attention["nodes"] == 2  # the Loop itself and the Softmax, not the body's MatMul
    assert attention["flops"] == 3 * 2 * 5 * 8 * 5  # the body's MatMul, three trips
    last = profile.breakdown(_profile(tmp_path, with_loop=True, runs=3), SPEC, first=-1)
    assert last["runs"] == 1 and last["classes"]["attention"]["flops"] == attention["flops"]


def test_a_profile_without_runs_is_refused():
    with pytest.raises(ValueError, match="no model_run"):
        profile.breakdown([], SPEC)


def test_matmul_flops_and_weights_read_transposed_operands():
    event = {"args": {"op_name": "FusedMatMul", "input_type_shape": [{"float": [1, 3, 36, 64]}, {"float": [1, 3, 512, 64]}],
                      "output_type_shape": [{"float": [1, 3, 36, 512]}]}}  # transB
    assert profile.matmul_flops(event) == 2 * 3 * 36 * 64 * 512 and profile.weight_shape(event) is None
    gemm = {"args": {"op_name": "Gemm", "parameter_size": str(4 * 576 * 49152),
                     "input_type_shape": [{"float": [1, 576]}, {"float": [49152, 576]}],
                     "output_type_shape": [{"float": [1, 49152]}]}}
    assert profile.matmul_flops(gemm) == 2 * 576 * 49152 and profile.weight_shape(gemm) == (576, 49152)


def test_model_flops_and_decode_bytes_of_the_bundled_shapes():
    spec = {"hidden_size": 576, "num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "intermediate_size": 1536,
            "vocab_size": 49152, "num_layers": 30}
    flops = profile.model_flops(spec, 2025)
    assert sum(flops.values()) / 1e9 == pytest.approx(572, abs=1)  # the issue's ~570 GFLOP
    assert flops["attention"] == pytest.approx(4 * 9 * 64 * 2025 * 2026 / 2 * 30)
    b = profile.decode_bytes(spec, capacity=[512] * 30, kept=[256] * 30)
    assert b["weights"] == floors.LayerShapes.from_spec(spec).weight_bytes()
    assert b["weights"] / 1e6 == pytest.approx(538, abs=1)  # the issue's ~540 MB per step
    assert b["kv_read_by_graph"] == 2 * b["kv_held"] == 2 * 3 * 64 * 4 * 512 * 30


def test_floors_run_on_onnx_runtime_at_the_given_shapes():
    gemm = floors.gemm_rate(floors.LayerShapes.from_spec(SPEC), tokens=16, repeats=2)
    assert set(gemm["per_shape"]) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert gemm["per_shape"]["down_proj"]["k"] == 12 and gemm["gflops"] > 0
    gemv = floors.gemv_bandwidth(floors.LayerShapes.from_spec(SPEC), repeats=2)
    assert gemv["bytes"] == 4 * (2 * (8 * 16 + 8 * 8 + 8 * 24 + 12 * 8) + 32 * 8) and gemv["gbps"] > 0


def test_render_gives_one_table_per_phase(tmp_path):
    trace = _profile(tmp_path, with_loop=False)
    engine = {"engine_dir": "engines/toy", "policy": "criticalkv", "budget": 4, "prompt_tokens": 5, "decode_steps": 2,
              "kept_per_layer_max": [4, 4], "decode_capacity": [6, 6], "prefill_wall_s": 0.01, "spec": SPEC,
              "prefill": profile.breakdown(trace, SPEC, first=-1), "decode": profile.breakdown(trace, SPEC),
              "python": {"step_ms": 1.0, "ort_run_ms": 0.8, "kv_writes_and_binding_ms": 0.15, "sampling_ms": 0.05}}
    results = {"command": "python -m benchmarks.profile", "commit": None, "versions": {"python": "3"},
               "machine": {"cpu": "c", "logical_cpus": 2, "load_average_start": [0.5, 0.5, 0.5]},
               "floors": {"gemm": {"gflops": 100.0, "tokens": 5}, "gemv": {"gbps": 10.0}, "copy": {"gbps": 12.0}},
               "engines": [engine]}
    text = profile.render(results)
    assert "## criticalkv b=4 (engines/toy): prefill of 5 tokens" in text
    assert "| qkv_proj |" in text and "| lm_head |" in text and "| o_proj |" not in text
    assert "KV writes / length updates / binding 0.15 ms" in text and "load average [0.5, 0.5, 0.5]" in text


@pytest.mark.parametrize("argv, message", [
    (["--engine-dir", "{tmp}/none"], "{tmp}/none: not an engine directory"),
    (["--engine-dir", "{tmp}/e", "--steps", "0"], "--steps >= 1"),
])
def test_bad_arguments_give_one_line(tmp_path, capsys, argv, message):
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "manifest.json").write_text(json.dumps({}))
    assert benchmarks.run("profile", profile.main, [a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message.format(tmp=tmp_path) in err
    assert err.startswith("python -m benchmarks.profile: error: ")
