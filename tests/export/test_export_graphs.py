"""Exported prefill/decode graphs of tiny random Llama, Mistral and Qwen2 models against the PyTorch path."""

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from criticalkv import KVPolicy
from criticalkv.export import BuildConfig, export_model
from criticalkv.export.decoder import layer_capacities, model_spec
from criticalkv.export.validate import validate_export
from criticalkv.hf import generate, prefill_and_compress
from criticalkv.runtime import Engine
from export.tiny_engine import export_tiny_engine
from hf.conftest import tiny_model
from policies import POLICY_CASES, make_policy

IDS = [c[0] for c in POLICY_CASES]


def prompt(n, seed=1, batch=1):
    return torch.randint(1, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def kept(selection, row, head):
    return [i for i in selection.indices[row, head].tolist() if i >= 0]


@pytest.fixture(scope="module")
def llama_engines(tmp_path_factory):
    """One tiny Llama and an engine directory per policy of tests/policies.py (weights shared)."""
    model = tiny_model("llama")
    root = tmp_path_factory.mktemp("engines")
    engines, weights = {}, None
    for case_id, kwargs in POLICY_CASES:
        folder = root / case_id
        policy = make_policy(kwargs, budget=40, window=8)
        export_tiny_engine(model, policy, folder)
        engines[case_id] = (policy, Engine.load(folder))
    yield model, engines
    for _, engine in engines.values():
        engine.close()


@pytest.mark.parametrize("case_id", IDS)
def test_generation_is_token_identical_to_pytorch(llama_engines, case_id):
    model, engines = llama_engines
    policy, engine = engines[case_id]
    ids = prompt(150, seed=3)
    ref = generate(model, ids, policy, max_new_tokens=12)
    got = engine.generate(ids.numpy(), max_new_tokens=12, stop_token_ids=[])
    assert got.tokens[0] == ref.tokens[0]
    for layer, selection in enumerate(ref.prefill.selections):
        assert got.kept_lengths[layer].tolist() == selection.lengths.tolist()
        for head in range(2):
            assert got.kept(layer, 0, head) == kept(selection, 0, head), f"layer {layer} head {head}"
    assert got.kv_bytes_full == ref.kv_bytes_full and got.kv_bytes_kept == ref.kv_bytes_kept


@pytest.mark.parametrize("case_id", ["full", "snapkv", "criticalkv", "adakv", "ada-criticalkv", "laprox", "streamingllm"])
def test_left_padded_batch_equals_the_pytorch_batch(llama_engines, case_id):
    model, engines = llama_engines
    policy, engine = engines[case_id]
    a, b, c = prompt(120, seed=6)[0], prompt(75, seed=7)[0], prompt(33, seed=8)[0]
    ids = torch.zeros(3, 120, dtype=torch.int64)
    mask = torch.zeros(3, 120, dtype=torch.int64)
    for row, seq in enumerate((a, b, c)):
        ids[row, 120 - len(seq):], mask[row, 120 - len(seq):] = seq, 1
    ref = generate(model, ids, policy, max_new_tokens=8, attention_mask=mask)
    got = engine.generate([a.tolist(), b.tolist(), c.tolist()], max_new_tokens=8, stop_token_ids=[])
    assert got.tokens == ref.tokens
    for layer, selection in enumerate(ref.prefill.selections):
        for row in range(3):
            for head in range(2):
                assert got.kept(layer, row, head) == kept(selection, row, head)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_prefill_logits_and_selection_match_transformers(tmp_path, model_type):
    model = tiny_model(model_type, seed=2)
    policy = KVPolicy("ada-criticalkv", budget=40, window=8)
    engine = Engine.load(export_tiny_engine(model, policy, tmp_path / "e"))
    ids = prompt(130, seed=4)
    pre = prefill_and_compress(model, ids, policy)
    got = engine.backend.prefill(ids.numpy(), np.ones_like(ids.numpy()), np.arange(130)[None])
    np.testing.assert_allclose(got.logits, pre.logits.numpy(), atol=1e-4, rtol=1e-4)
    for layer, selection in enumerate(pre.selections):
        assert got.lengths[layer].tolist() == selection.lengths.tolist()
        idx = got.indices[layer]
        assert [[i for i in row if i >= 0] for row in idx[0].tolist()] == [kept(selection, 0, h) for h in range(2)]
    out = engine.generate(ids.numpy(), max_new_tokens=10, stop_token_ids=[])
    assert out.tokens[0] == generate(model, ids, policy, max_new_tokens=10).tokens[0]
    engine.close()


@pytest.mark.parametrize("n", [1, 7, 31, 32, 33, 64, 97])
def test_attention_blocks_at_every_boundary(tmp_path_factory, n):
    # chunk 32: prompts shorter than, equal to and one past a block, several blocks
    model = tiny_model("qwen2", seed=5)
    folder = tmp_path_factory.mktemp("chunk")
    engine = Engine.load(export_tiny_engine(model, KVPolicy("full"), folder, attention_chunk=32))
    ids = prompt(n, seed=n)
    with torch.no_grad():
        ref = model(ids).logits[:, -1].numpy()
    got = engine.backend.prefill(ids.numpy(), np.ones_like(ids.numpy()), np.arange(n)[None])
    np.testing.assert_allclose(got.logits, ref, atol=1e-4, rtol=1e-4)
    engine.close()


def test_no_node_holds_n_by_n_attention_scores(tmp_path):
    # profile a prefill of n = 512 in blocks of 32: no node output may hold H x n x n scores
    model = tiny_model("llama", seed=1, layers=1)
    folder = export_tiny_engine(model, KVPolicy("criticalkv", budget=40, window=8), tmp_path / "e", max_input_len=512,
                                attention_chunk=32)
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "prof")
    session = ort.InferenceSession(str(folder / "prefill.onnx"), options, providers=["CPUExecutionProvider"])
    n = 512
    session.run(None, {"input_ids": prompt(n).numpy(), "attention_mask": np.ones((1, n), np.int64),
                       "position_ids": np.arange(n)[None], "kv_budget": np.array([40])})
    events = json.loads(open(session.end_profiling()).read())
    largest = 0
    for event in events:
        for out in event.get("args", {}).get("output_type_shape", []):
            for shape in out.values():
                largest = max(largest, int(np.prod(shape)))
    assert 0 < largest < 6 * n * n / 4, f"a node produced {largest} elements (H * n * n = {6 * n * n})"


def test_graph_interface_and_validation(tmp_path):
    model = tiny_model("qwen2")
    policy = KVPolicy("pyramid-criticalkv", budget=40, window=8)
    config = BuildConfig(max_input_len=200, max_new_tokens=16, attention_chunk=32)
    result = export_model(model, policy, tmp_path, config)
    report = validate_export(result)
    assert set(report) == {"prefill", "prefill_tensorrt", "decode", "decode_ort", "extend", "extend_tensorrt", "select",
                           "select_tensorrt", "prefill_ort", "extend_ort", "prefill_openvino", "extend_openvino",
                           "select_openvino", "decode_openvino", "select_context_openvino"}
    assert report["select_context_openvino"] == {"file": None}  # no context policy of its own
    assert all(report[k]["openvino_rules"] for k in ("prefill_openvino", "extend_openvino", "select_openvino",
                                                      "decode_openvino"))
    spec = model_spec(model)
    assert result.prefill_capacities == layer_capacities(policy, spec, 200)
    # decode buffers: the selection capacity + room for a question after a cached context + the new tokens
    assert result.decode_capacities == [c + config.max_question_len + 16 for c in result.prefill_capacities]
    prefill = onnx.load(str(tmp_path / "prefill.onnx"), load_external_data=False)
    decode = onnx.load(str(tmp_path / "decode.onnx"), load_external_data=False)
    trt = onnx.load(str(tmp_path / "prefill_tensorrt.onnx"), load_external_data=False)
    assert [i.name for i in prefill.graph.input] == ["input_ids", "attention_mask", "position_ids", "kv_budget"]
    outs = [o.name for o in prefill.graph.output]
    assert outs[0] == "logits" and outs[1:5] == ["present.0.key", "present.0.value", "present.0.lengths", "present.0.indices"]
    assert [i.name for i in decode.graph.input][:5] == [
        "input_ids", "position_ids", "past_key_values.0.key", "past_key_values.0.value", "past_key_values.0.lengths"]
    dims = [d.dim_value or d.dim_param for d in decode.graph.input[2].type.tensor_type.shape.dim]
    assert dims == ["batch", 2, result.decode_capacities[0], 16]
    assert [o.name for o in decode.graph.output][:3] == ["logits", "present.0.key", "present.0.value"]
    for m in (prefill, decode, trt):
        assert {op.domain: op.version for op in m.opset_import}[""] == 21
        assert not any(n.domain == "com.microsoft" for n in m.graph.node)
        for init in m.graph.initializer:  # one weights file shared by every graph
            assert init.data_location == onnx.TensorProto.EXTERNAL
            assert {e.key: e.value for e in init.external_data}["location"] == "weights.bin"
    assert len(prefill.functions) == 1 and not trt.functions
    assert sum(n.op_type == "CriticalKVSelect" for n in trt.graph.node) == 3


def test_validation_rejects_a_tampered_node(tmp_path):
    model = tiny_model("llama")
    result = export_model(model, KVPolicy("snapkv", budget=40, window=8), tmp_path, BuildConfig(max_input_len=128))
    path = tmp_path / "prefill.onnx"
    graph = onnx.load(str(path), load_external_data=False)
    node = next(n for n in graph.graph.node if n.op_type == "CriticalKVSelect")
    next(a for a in node.attribute if a.name == "capacity").i = 7
    onnx.save(graph, str(path))
    with pytest.raises(ValueError, match="do not match"):
        validate_export(result)


def test_decode_buffers_grow_with_the_budget_not_the_prompt():
    model = tiny_model("llama")
    spec = model_spec(model)
    for name in ("snapkv", "criticalkv", "pyramidkv", "adakv", "laprox", "streamingllm"):
        small, large = (KVPolicy(name, budget=b, window=8) for b in (40, 80))
        assert layer_capacities(small, spec, 1000) == layer_capacities(small, spec, 8000), name
        assert sum(layer_capacities(large, spec, 8000)) > sum(layer_capacities(small, spec, 8000)), name


def test_unsupported_models_are_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(ValueError, match="gpt2"):
        model_spec(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)))
    model = tiny_model("mistral")
    model.config.sliding_window = 64
    with pytest.raises(ValueError, match="sliding window"):
        export_model(model, KVPolicy("snapkv", budget=40, window=8), tmp_path / "e",
                     BuildConfig(max_input_len=100, max_new_tokens=8))
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("name", ["ada-criticalkv", "laprox"])
def test_tensorrt_flavour_computes_the_same_with_the_body_put_back(tmp_path, name):
    # the TensorRT flavour differs by its attention (one causal block without a Loop, finite mask through
    # Where, output projection as Gemm) and the missing body; with the body added back ONNX Runtime runs it
    # to the same outputs as the ONNX Runtime flavour, on a left-padded batch
    from criticalkv.export.select_function import selection_function

    model = tiny_model("llama", seed=6)
    policy = KVPolicy(name, budget=40, window=8)
    export_model(model, policy, tmp_path, BuildConfig(max_input_len=200, attention_chunk=32))
    trt = onnx.load(str(tmp_path / "prefill_tensorrt.onnx"), load_external_data=False)
    assert not any(n.op_type == "Loop" for n in trt.graph.node)
    trt.functions.append(selection_function(policy, 3, 6, 2, 16))
    onnx.save(trt, str(tmp_path / "trt_with_body.onnx"))
    n = 150
    feeds = {"input_ids": prompt(n, seed=9, batch=2).numpy(), "attention_mask": np.ones((2, n), np.int64),
             "kv_budget": np.array([24])}  # a per-request budget below 40
    feeds["attention_mask"][0, :20] = 0
    feeds["attention_mask"][1, :97] = 0
    feeds["position_ids"] = np.clip(np.cumsum(feeds["attention_mask"], 1) - 1, 0, None)
    a = ort.InferenceSession(str(tmp_path / "prefill.onnx")).run(None, feeds)
    b = ort.InferenceSession(str(tmp_path / "trt_with_body.onnx")).run(None, feeds)
    assert np.isfinite(b[0]).all()
    np.testing.assert_allclose(a[0], b[0], atol=1e-5)
    for x, y in zip(a[1:], b[1:]):
        if x.dtype == np.int32:
            assert np.array_equal(x, y)
        else:
            np.testing.assert_allclose(x, y, atol=1e-5)
