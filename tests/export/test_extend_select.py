"""extend.onnx and select.onnx (issue 19): chunked prefill through extend chunks + select is bitwise the one-shot
prefill, an extend of N tokens is the same N tokens through decode, and the TensorRT flavours.

The graphs are driven with plain ONNX Runtime sessions (tests/export/graph_runs.py), not the runtime's Engine.
"""

import numpy as np
import onnx
import pytest

from criticalkv import KVPolicy
from criticalkv.export import BuildConfig, export_model
from criticalkv.export.select_function import selection_function
from criticalkv.export.tensorrt_rules import check_tensorrt_file
from criticalkv.export.validate import validate_export
from export.graph_runs import KVBuffers, chunked_prefill, decode, extend, prefill, run, session
from hf.conftest import tiny_model
from policies import POLICY_CASES, make_policy

#: every policy of tests/policies.py, and the model-level one (CriticalKVScore + CriticalKVSelectModel nodes)
CASES = POLICY_CASES + [("layer-defensivekv", dict(name="layer-defensivekv"))]
LAYERS, KV_HEADS, HEAD_DIM = 3, 2, 16
BUDGET, WINDOW, CHUNK = 40, 8, 32
MAX_INPUT = 240


def bitwise(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", seed=11)


@pytest.mark.parametrize("case_id", [c[0] for c in CASES])
def test_chunked_prefill_is_bitwise_the_prefill_for_every_policy(llama, tmp_path, case_id):
    # attention_chunk 32 stands for the built 256: extend chunks of 32 and 64 (1x and 2x the block) from an empty
    # full-size buffer, then select.onnx, against one prefill.onnx run. Prompt lengths: several blocks with a last
    # chunk shorter than the window (the runtime concatenates the last window queries across chunks), a last chunk
    # of exactly the window, one token past a chunk, shorter than the window, and within the budget (kept whole)
    policy = make_policy(dict(CASES)[case_id], budget=BUDGET, window=WINDOW)
    export_model(llama, policy, tmp_path, BuildConfig(max_input_len=MAX_INPUT, attention_chunk=CHUNK))
    prefill_s, extend_s, select_s = (session(tmp_path, f) for f in ("prefill.onnx", "extend.onnx", "select.onnx"))
    rng = np.random.default_rng(len(case_id))
    for n in (2 * 64 + 3, 64 + WINDOW, 97, 65, 5, BUDGET - 1):
        ids = rng.integers(1, 128, (2, n))
        for budget in (BUDGET, 24):  # the built budget and a per-request one below it
            reference = prefill(prefill_s, ids, budget)
            for chunk in (CHUNK, 2 * CHUNK):
                kept, logits, buffers = chunked_prefill(extend_s, select_s, ids, chunk, MAX_INPUT, LAYERS, KV_HEADS,
                                                        HEAD_DIM, WINDOW, budget)
                where = f"{case_id}: n={n}, budget {budget}, chunks of {chunk}"
                assert bitwise(logits, reference["logits"]), where
                assert kept.keys() == {k for k in reference if k != "logits"}
                for name, value in reference.items():
                    if name != "logits":
                        assert bitwise(kept[name], value), f"{where}: {name}"
                for layer in range(LAYERS):  # the chunks' K/V at the kept positions are the prefill's kept K/V
                    indices, lengths = reference[f"present.{layer}.indices"], reference[f"present.{layer}.lengths"]
                    for b, h in np.ndindex(lengths.shape):
                        at = indices[b, h, :lengths[b, h]]
                        assert bitwise(buffers.keys[layer][b, h, at], reference[f"present.{layer}.key"][b, h, :len(at)])
                        assert bitwise(buffers.values[layer][b, h, at], reference[f"present.{layer}.value"][b, h, :len(at)])
            if n <= budget:  # kept whole: every position, in order
                assert (reference["present.0.indices"][0, 0] == np.arange(n)).all()


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_chunks_of_256_and_512_over_the_attention_block_of_256(tmp_path, model_type):
    # the built default attention_chunk (256), a 600-token prompt: chunks 256 + 256 + 88 and 512 + 88 (Qwen3: its q/k
    # norm in the extend graph too)
    model = tiny_model(model_type, seed=4)
    policy = KVPolicy("ada-criticalkv", budget=64, window=16)
    export_model(model, policy, tmp_path, BuildConfig(max_input_len=700))
    prefill_s, extend_s, select_s = (session(tmp_path, f) for f in ("prefill.onnx", "extend.onnx", "select.onnx"))
    ids = np.random.default_rng(0).integers(1, 128, (1, 600))
    reference = prefill(prefill_s, ids, 64)
    for chunk in (256, 512):
        kept, logits, _ = chunked_prefill(extend_s, select_s, ids, chunk, 700, LAYERS, KV_HEADS, HEAD_DIM, 16, 64)
        assert bitwise(logits, reference["logits"]), chunk
        assert all(bitwise(kept[k], v) for k, v in reference.items() if k != "logits"), chunk


@pytest.fixture(scope="module")
def adakv_engine(tmp_path_factory):
    """A tiny Qwen2 exported with adakv (per-head kept lengths differ), decode buffers for 80 new tokens."""
    folder = tmp_path_factory.mktemp("adakv")
    result = export_model(tiny_model("qwen2", seed=1), KVPolicy("adakv", budget=BUDGET, window=WINDOW), folder,
                          BuildConfig(max_input_len=MAX_INPUT, max_new_tokens=80, attention_chunk=CHUNK))
    sessions = {f: session(folder, f"{f}.onnx") for f in ("prefill", "extend", "extend_tensorrt", "decode")}
    return result, sessions


@pytest.mark.parametrize("flavour", ["extend", "extend_tensorrt"])
@pytest.mark.parametrize("new", [1, 5, CHUNK, CHUNK + 1, 2 * CHUNK + 7])
def test_extend_equals_the_same_tokens_one_by_one_through_decode(adakv_engine, flavour, new):
    # a compressed cache whose heads hold different lengths; the new tokens at absolute positions n + t (RoPE ignores
    # eviction); the extend's entries written at each head's length like decode's. Measured on this CPU: logits within
    # ~3e-7 relative, K/V within ~2e-7 absolute; asserted: 1e-4 relative, then 8 greedy tokens identical
    result, sessions = adakv_engine
    rng = np.random.default_rng(new)
    n = 150
    ids = rng.integers(1, 128, (2, n))
    reference = prefill(sessions["prefill"], ids, BUDGET)
    lengths = [reference[f"present.{layer}.lengths"] for layer in range(LAYERS)]
    assert any(len(np.unique(x)) > 1 for x in lengths), "the cache should hold different lengths per head"
    extended = KVBuffers.from_prefill(reference, result.decode_capacities)
    stepped = extended.copy()
    tokens = rng.integers(1, 128, (2, new))
    positions = n + np.arange(new)[None].repeat(2, 0)
    out = extend(sessions[flavour], extended, tokens, positions)
    for t in range(new):
        logits = decode(sessions["decode"], stepped, tokens[:, t], positions[:, t])
    assert np.abs(out["logits"] - logits).max() <= 1e-4 * np.abs(logits).max()
    for layer in range(LAYERS):
        assert (extended.lengths[layer] == stepped.lengths[layer]).all()
        assert (extended.lengths[layer] == lengths[layer] + new).all()
        np.testing.assert_allclose(extended.keys[layer], stepped.keys[layer], rtol=0, atol=1e-5)
        np.testing.assert_allclose(extended.values[layer], stepped.values[layer], rtol=0, atol=1e-5)
        assert out[f"present.{layer}.window_queries"].shape == (2, 6, min(new, WINDOW), HEAD_DIM)
    greedy = []
    for buffers, last in ((extended, out["logits"]), (stepped, logits)):
        seq = []
        for t in range(8):
            token = last.argmax(-1)
            seq.append(token.tolist())
            last = decode(sessions["decode"], buffers, token, np.full(2, n + new + t))
        greedy.append(seq)
    assert greedy[0] == greedy[1]


def test_one_extend_graph_runs_over_slot_buffers_and_full_size_buffers(adakv_engine):
    # the capacity dim is dynamic: the same tokens over the decode slot's buffers (capacity_l + 80) and over buffers
    # of another capacity holding the same entries give bitwise the same outputs
    result, sessions = adakv_engine
    ids = np.random.default_rng(3).integers(1, 128, (2, 120))
    reference = prefill(sessions["prefill"], ids, BUDGET)
    tokens, positions = ids[:, :9], 120 + np.arange(9)[None].repeat(2, 0)
    outs = []
    for capacities in (result.decode_capacities, [MAX_INPUT + 80] * LAYERS):
        outs.append(extend(sessions["extend"], KVBuffers.from_prefill(reference, capacities), tokens, positions))
    assert outs[0].keys() == outs[1].keys()
    assert all(bitwise(outs[0][k], outs[1][k]) for k in outs[0])


def test_graph_io_and_tensorrt_flavours(tmp_path):
    model = tiny_model("llama", seed=6)
    policy = KVPolicy("criticalkv", budget=BUDGET, window=WINDOW)
    result = export_model(model, policy, tmp_path, BuildConfig(max_input_len=MAX_INPUT, attention_chunk=CHUNK))
    report = validate_export(result)
    for key in ("extend_tensorrt", "select_tensorrt", "decode", "prefill_tensorrt"):
        assert "passed" in report[key]["tensorrt_rules"], key
        assert check_tensorrt_file(tmp_path / report[key]["file"]) == []
    assert report["select"]["selection_nodes"] == LAYERS and report["extend"]["selection_nodes"] == 0
    graphs = {name: onnx.load(str(tmp_path / f"{name}.onnx"), load_external_data=False)
              for name in ("extend", "extend_tensorrt", "select", "select_tensorrt")}

    def dims(value):
        return [d.dim_value or d.dim_param for d in value.type.tensor_type.shape.dim]

    for name in ("extend", "extend_tensorrt"):
        g = graphs[name].graph
        assert [i.name for i in g.input][:5] == ["input_ids", "position_ids", "past_key_values.0.key",
                                                 "past_key_values.0.value", "past_key_values.0.lengths"]
        assert dims(g.input[0]) == ["batch", "new_tokens"] and dims(g.input[2]) == ["batch", 2, "capacity_0", 16]
        assert [o.name for o in g.output][:4] == ["logits", "present.0.key", "present.0.value", "present.0.window_queries"]
        assert dims(g.output[1]) == ["batch", 2, "new_tokens", 16] and dims(g.output[3]) == ["batch", 6, "window_tokens", 16]
        assert not graphs[name].functions
    assert not any(n.op_type == "Loop" for n in graphs["extend_tensorrt"].graph.node)
    for name in ("select", "select_tensorrt"):
        g = graphs[name].graph
        assert [i.name for i in g.input][:4] == ["window_queries.0", "past_key_values.0.key", "past_key_values.0.value",
                                                 "past_key_values.0.lengths"]
        assert g.input[-1].name == "kv_budget" and len(g.input) == 4 * LAYERS + 1
        assert [o.name for o in g.output][:4] == ["present.0.key", "present.0.value", "present.0.lengths", "present.0.indices"]
        assert sum(n.op_type == "CriticalKVSelect" for n in g.node) == LAYERS
    assert len(graphs["select"].functions) == 1 and not graphs["select_tensorrt"].functions
    for m in graphs.values():
        assert not any(n.domain == "com.microsoft" for n in m.graph.node)
        for init in m.graph.initializer:  # the one weights file of the engine
            assert {e.key: e.value for e in init.external_data}["location"] == "weights.bin"

    # the TensorRT select flavour takes buffers of exactly the prompt (no data-dependent slice: docs/gpu.md)
    assert dims(graphs["select_tensorrt"].graph.input[1]) == ["batch", 2, "prompt_tokens", 16]
    assert dims(graphs["select"].graph.input[1]) == ["batch", 2, "capacity_0", 16]
    assert not any(n.op_type == "ReduceMax" for n in graphs["select_tensorrt"].graph.node)

    # the TensorRT flavours run on ONNX Runtime (select with the body put back) to the onnxruntime flavours' results;
    # the TensorRT runtime prefills into a buffer of the prompt's length, so the TensorRT chunks run over one here
    trt = graphs["select_tensorrt"]
    trt.functions.append(selection_function(policy, LAYERS, 6, KV_HEADS, HEAD_DIM))
    onnx.save(trt, str(tmp_path / "select_with_body.onnx"))
    n = 100
    ids = np.random.default_rng(8).integers(1, 128, (2, n))
    extend_s, trt_extend_s = session(tmp_path, "extend.onnx"), session(tmp_path, "extend_tensorrt.onnx")
    a, _, buffers = chunked_prefill(extend_s, session(tmp_path, "select.onnx"), ids, CHUNK, MAX_INPUT, LAYERS,
                                    KV_HEADS, HEAD_DIM, WINDOW, BUDGET)
    b, logits_trt, trt_buffers = chunked_prefill(trt_extend_s, session(tmp_path, "select_with_body.onnx"), ids, CHUNK,
                                                 n, LAYERS, KV_HEADS, HEAD_DIM, WINDOW, BUDGET)
    for layer in range(LAYERS):
        assert not buffers.keys[layer][:, :, n:].any()  # nothing beyond the prompt
        np.testing.assert_allclose(trt_buffers.keys[layer], buffers.keys[layer][:, :, :n], rtol=0, atol=1e-5)
    for name, value in a.items():
        if value.dtype == np.int32:
            assert (b[name] == value).all(), name
        else:
            np.testing.assert_allclose(b[name], value, rtol=0, atol=1e-5)
    feeds = {"kv_budget": np.array([BUDGET]), **buffers.feeds()}
    feeds.update({f"window_queries.{layer}": np.zeros((2, 6, WINDOW, HEAD_DIM), np.float32) for layer in range(LAYERS)})
    trimmed = {k: v[:, :, :n] if k.endswith((".key", ".value")) else v for k, v in feeds.items()}
    assert all(bitwise(x, y) for x, y in zip(run(session(tmp_path, "select.onnx"), feeds).values(),
                                             run(session(tmp_path, "select_with_body.onnx"), trimmed).values()))


def test_a_model_level_policy_has_tensorrt_flavours_of_plugin_nodes(tmp_path):
    policy = KVPolicy("layer-defensivekv", budget=BUDGET, window=WINDOW)
    result = export_model(tiny_model("llama", seed=2), policy, tmp_path, BuildConfig(max_input_len=MAX_INPUT))
    written = sorted(p.name for p in tmp_path.glob("*.onnx"))
    assert written == ["decode.onnx", "decode_ort.onnx", "extend.onnx", "extend_heads_ort.onnx", "extend_ort.onnx",
                       "extend_tensorrt.onnx",
                       "prefill.onnx", "prefill_ort.onnx", "prefill_tensorrt.onnx", "select.onnx", "select_tensorrt.onnx"]
    report = validate_export(result)
    for key in ("prefill_tensorrt", "select_tensorrt"):  # the CriticalKVScore / CriticalKVSelectModel plugins' nodes
        assert "refused" not in report[key] and report[key]["functions"] == [] and "tensorrt_rules" in report[key]
        assert report[key]["score_nodes"] == LAYERS and report[key]["selection_nodes"] == 1
    assert "refused" not in report["extend_tensorrt"] and report["extend_tensorrt"]["selection_nodes"] == 0
    assert report["select"]["score_nodes"] == LAYERS and report["select"]["selection_nodes"] == 1


@pytest.mark.slow
def test_chunked_prefill_of_the_bundled_model_is_bitwise_the_prefill(tmp_path):
    # SmolLM2-135M (30 layers, GQA 9/3, d_h 64), criticalkv at budget 256, a 1,100-token prompt, the built attention
    # block of 256: extend chunks of 256 (4 x 256 + 76) and 512 (2 x 512 + 76) from an empty full-size buffer, then
    # select.onnx, give the prefill's logits and kept K/V, lengths and indices bitwise. One thread per session, as
    # tests/runtime/test_bundled_parity.py (2 shared vCPUs); the thread count does not change what is compared
    from pathlib import Path

    from criticalkv.hf import load_model

    model, tokenizer = load_model()
    text = (Path(__file__).resolve().parents[2] / "examples" / "needle_2k.txt").read_text()
    ids = np.array([tokenizer(text)["input_ids"][:1100]])
    assert ids.shape == (1, 1100)
    policy = KVPolicy("criticalkv", budget=256)
    result = export_model(model, policy, tmp_path, BuildConfig(max_input_len=1100, max_new_tokens=8))
    spec = result.spec
    prefill_s, extend_s, select_s = (session(tmp_path, f, threads=1) for f in ("prefill.onnx", "extend.onnx", "select.onnx"))
    reference = prefill(prefill_s, ids, 256)
    for chunk in (256, 512):
        kept, logits, _ = chunked_prefill(extend_s, select_s, ids, chunk, 1100, spec.num_layers, spec.num_kv_heads,
                                          spec.head_dim, policy.window, 256)
        assert bitwise(logits, reference["logits"]), chunk
        for name, value in reference.items():
            if name != "logits":
                assert bitwise(kept[name], value), f"chunks of {chunk}: {name}"
