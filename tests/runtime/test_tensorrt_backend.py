"""The TensorRT backend of the runtime. Its host logic runs everywhere; the engines need a GPU and TensorRT
(`pytest -m gpu tests/runtime/test_tensorrt_backend.py` on a GPU machine after `bash scripts/build_plugin.sh`).

Without TensorRT, the extend and select bookkeeping of the backend (its bindings by name, the entries written at each
head's length, the prompt's entries handed to select) drives the TensorRT flavours of the graphs on ONNX Runtime,
with torch CPU tensors where the backend holds CUDA ones."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from criticalkv import KVPolicy
from criticalkv.runtime import Engine, read_manifest
from criticalkv.runtime.manifest import EngineError
from criticalkv.runtime import Request
from criticalkv.runtime.tensorrt_backend import (
    append_entries,
    check_room,
    engine_files,
    extend_inputs,
    extend_outputs,
    prompt_entries,
    select_inputs,
    select_outputs,
    torch_dtype,
)
from export.graph_runs import KVBuffers
from export.tiny_engine import export_tiny_engine, save_tiny_checkpoint, words
from hf.conftest import tiny_model
from policies import POLICY_CASES, make_policy


class FakeDataType:  # TensorRT's DataType members expose .name
    def __init__(self, name):
        self.name = name


def test_tensorrt_types_map_to_torch():
    assert torch_dtype(FakeDataType("FLOAT")) is torch.float32
    assert torch_dtype(FakeDataType("HALF")) is torch.float16
    assert torch_dtype(FakeDataType("BF16")) is torch.bfloat16
    assert torch_dtype("DataType.INT64") is torch.int64
    with pytest.raises(EngineError, match="FP8 is not supported"):
        torch_dtype(FakeDataType("FP8"))


@pytest.fixture(scope="module")
def onnx_only_engine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trt") / "engine"
    return export_tiny_engine(tiny_model(), KVPolicy("criticalkv", budget=40, window=8), folder)


def test_an_engine_without_tensorrt_engines_says_why(onnx_only_engine):
    with pytest.raises(EngineError, match="no TensorRT engines in this engine directory"):
        Engine.load(onnx_only_engine, backend="tensorrt")


def test_cli_reports_a_missing_tensorrt_build_clearly(onnx_only_engine):
    run = subprocess.run(
        [sys.executable, "-m", "criticalkv.cli", "generate", "--engine-dir", str(onnx_only_engine), "--backend",
         "tensorrt", "--prompt", words(range(10, 70))],
        capture_output=True, text=True,
    )
    assert run.returncode == 2 and "no TensorRT engines" in run.stderr and "Traceback" not in run.stderr


def test_engine_files_come_from_the_manifest(tmp_path):
    folder = tmp_path / "engine"
    (folder / "tensorrt").mkdir(parents=True)
    for graph in ("prefill", "decode", "extend", "select"):
        (folder / "tensorrt" / f"{graph}.engine").write_bytes(b"x")
    recorded = {graph: f"tensorrt/{graph}.engine" for graph in ("prefill", "decode", "extend", "select")}
    files = engine_files(folder, {"tensorrt": {"built": True, "engines": recorded}})
    assert files == {graph: folder / path for graph, path in recorded.items()}
    # a directory built before extend and select: its manifest names no engines; prefill and decode by their names
    assert set(engine_files(folder, {"tensorrt": {"built": True}})) == {"prefill", "decode"}
    with pytest.raises(EngineError, match="only one of the extend and select engines"):
        engine_files(folder, {"tensorrt": {"built": True, "engines": {k: v for k, v in recorded.items() if k != "select"}}})
    (folder / "tensorrt" / "select.engine").unlink()
    with pytest.raises(EngineError, match="missing tensorrt/select.engine; rebuild"):
        engine_files(folder, {"tensorrt": {"built": True, "engines": recorded}})
    with pytest.raises(EngineError, match="no TensorRT decode engine"):
        engine_files(folder, {"tensorrt": {"built": True, "engines": {"prefill": recorded["prefill"]}}})


def test_new_entries_land_at_each_heads_length_like_the_onnxruntime_backend():
    # rows 1..2 of a 3-row buffer (the view extend_row binds), heads of different lengths, 4 new entries each: the
    # same writes as the ONNX Runtime backend's loop (tests/export/graph_runs.py KVBuffers.append), in place
    rng = np.random.default_rng(0)
    keys = torch.from_numpy(rng.standard_normal((3, 2, 20, 4)).astype(np.float32))
    values = torch.from_numpy(rng.standard_normal((3, 2, 20, 4)).astype(np.float32))
    lengths = torch.tensor([[3, 7], [0, 5], [9, 16]], dtype=torch.int32)
    new_k = rng.standard_normal((2, 2, 4, 4)).astype(np.float32)
    new_v = rng.standard_normal((2, 2, 4, 4)).astype(np.float32)
    expected = KVBuffers(2, 2, [20], 4)
    expected.keys[0][:], expected.values[0][:] = keys[1:].numpy(), values[1:].numpy()
    expected.lengths[0][:] = lengths[1:].numpy()
    expected.append({"present.0.key": new_k, "present.0.value": new_v})
    row0 = keys[0].clone(), values[0].clone(), lengths[0].clone()
    append_entries(keys[1:], values[1:], lengths[1:], torch.from_numpy(new_k), torch.from_numpy(new_v))
    assert np.array_equal(keys[1:].numpy(), expected.keys[0]) and np.array_equal(values[1:].numpy(), expected.values[0])
    assert lengths[1:].tolist() == expected.lengths[0].tolist() == [[4, 9], [13, 20]]
    assert torch.equal(keys[0], row0[0]) and torch.equal(values[0], row0[1]) and torch.equal(lengths[0], row0[2])


def test_the_capacity_check_is_the_onnxruntime_backends(onnx_only_engine):
    # ONNX Runtime reads the lengths it holds; the TensorRT backend checks the longest head it tracks on the host
    engine = Engine.load(onnx_only_engine)
    keys = [np.zeros((1, 2, 10, 16), np.float32) for _ in range(3)]
    lengths = [np.full((1, 2), used, np.int32) for used in (6, 3, 0)]
    with pytest.raises(EngineError) as ort_error:
        engine.backend.extend(keys, [k.copy() for k in keys], lengths, np.ones((1, 5), np.int64), np.ones((1, 5), np.int64))
    engine.close()
    with pytest.raises(EngineError) as trt_error:
        check_room([6, 3, 0], 5, [10, 10, 10])
    assert str(trt_error.value) == str(ort_error.value) == \
        "layer 0: 5 more entries do not fit the KV buffer (10 entries per head, 6 used)"
    check_room([6, 3, 0], 4, [10, 10, 10])  # exactly full fits


def test_select_reads_a_prompt_sized_buffer_in_place():
    exact = [torch.zeros(1, 2, 7, 4) for _ in range(2)]
    assert all(a is b for a, b in zip(prompt_entries(exact, 7), exact))  # no copy
    larger = [torch.arange(2 * 9 * 4, dtype=torch.float32).view(1, 2, 9, 4)]
    (copied,) = prompt_entries(larger, 7)
    assert copied.is_contiguous() and torch.equal(copied, larger[0][:, :, :7])
    with pytest.raises(EngineError, match="holds 7 entries per head, not 8"):
        prompt_entries(exact, 8)


def test_a_prefill_buffer_holds_the_prompt_alone(onnx_only_engine):
    # what the scheduler counts for a prompt under prefill (kv_bytes_full(n)), and what TensorRT's select reads
    engine = Engine.load(onnx_only_engine)
    job = engine.begin_prefill(Request(list(range(3, 53))))
    assert job.buffer.keys[0].shape == (1, 2, 50, 16) and job.nbytes == engine.kv_bytes_full(50)
    for bad in (0, 257):
        with pytest.raises(EngineError, match="1 to max_input_len = 256 tokens"):
            engine.backend.new_prefill_buffer(bad)
    assert engine.backend.new_prefill_buffer().keys[0].shape[2] == 256
    engine.close()


def test_the_backends_bindings_drive_the_tensorrt_graphs(onnx_only_engine):
    # a chunked prefill as the TensorRT backend runs it (a prompt-sized buffer, extend_inputs, append_entries, the
    # window queries kept across chunks, prompt_entries and select_inputs), with ONNX Runtime sessions of
    # extend_tensorrt.onnx and select_tensorrt.onnx (its selection body put back) in place of the engines: the kept
    # entries of the one-shot prefill, and every bound shape within the optimization profiles the build gives
    import onnx

    from criticalkv import KVPolicy
    from criticalkv.export.select_function import selection_function
    from criticalkv.tensorrt import engine_plan, onnx_graph_inputs, profile_shapes
    from export.graph_runs import run, session

    folder = onnx_only_engine
    manifest = read_manifest(folder, verify=False)
    policy, build = KVPolicy.from_dict(manifest["policy"]), manifest["build"]
    layers = manifest["model"]["spec"]["num_layers"]
    select_graph = onnx.load(str(folder / "select_tensorrt.onnx"), load_external_data=False)
    select_graph.functions.append(selection_function(policy, layers, 6, 2, 16))
    onnx.save(select_graph, str(folder / "select_with_body.onnx"))
    extend_s, select_s = session(folder, "extend_tensorrt.onnx"), session(folder, "select_with_body.onnx")
    assert [o.name for o in extend_s.get_outputs()] == extend_outputs(layers)
    assert [o.name for o in select_s.get_outputs()] == select_outputs(layers)
    plan = {p.graph: p for p in engine_plan(
        folder / "prefill_tensorrt.onnx", folder / "decode.onnx", folder / "tensorrt", build["max_batch_size"],
        build["max_input_len"], max(manifest["shapes"]["prefill_capacity"]),
        onnx_extend_path=folder / "extend_tensorrt.onnx", onnx_select_path=folder / "select_tensorrt.onnx",
        extend_chunk=build["extend_chunk"], window=policy.window,
        extend_capacities=[max(c, build["max_input_len"]) for c in manifest["shapes"]["decode_capacity"]])}
    profiles = {g: profile_shapes(onnx_graph_inputs(plan[g].onnx_path), plan[g].ranges) for g in ("extend", "select")}

    def feeds(graph, named):
        assert list(named) == [i.name for i in (extend_s if graph == "extend" else select_s).get_inputs()]
        for name, tensor in named.items():
            if name in profiles[graph]:
                low, _, high = profiles[graph][name]
                assert all(a <= d <= b for a, d, b in zip(low, tensor.shape, high)), (graph, name, tuple(tensor.shape))
        return {name: tensor.numpy() for name, tensor in named.items()}

    ids = np.random.default_rng(7).integers(1, 128, (1, 100))
    engine = Engine.load(folder)
    reference = engine.backend.prefill(ids, np.ones_like(ids), np.arange(100)[None])
    engine.close()
    n = ids.shape[1]
    keys = [torch.zeros(1, 2, n, 16) for _ in range(layers)]
    values = [torch.zeros(1, 2, n, 16) for _ in range(layers)]
    lengths = [torch.zeros(1, 2, dtype=torch.int32) for _ in range(layers)]
    queries = None
    for start in range(0, n, 32):
        part = torch.from_numpy(ids[:, start:start + 32])
        positions = torch.arange(start, start + part.shape[1])[None]
        out = dict(zip(extend_outputs(layers), extend_s.run(
            extend_outputs(layers), feeds("extend", extend_inputs(part, positions, keys, values, lengths)))))
        for i in range(layers):
            append_entries(keys[i], values[i], lengths[i], torch.from_numpy(out[f"present.{i}.key"]),
                           torch.from_numpy(out[f"present.{i}.value"]))
        new = [out[f"present.{i}.window_queries"] for i in range(layers)]
        queries = new if queries is None else [np.concatenate([a, b], 2)[:, :, -policy.window:] for a, b in zip(queries, new)]
    assert all(x.tolist() == [[n, n]] for x in lengths)
    named = select_inputs([torch.from_numpy(q) for q in queries], prompt_entries(keys, n), prompt_entries(values, n),
                          lengths, torch.tensor([policy.budget]))
    kept = run(select_s, feeds("select", named))
    for i in range(layers):
        assert np.array_equal(kept[f"present.{i}.lengths"], reference.lengths[i])
        assert np.array_equal(kept[f"present.{i}.indices"], reference.indices[i])
        np.testing.assert_allclose(kept[f"present.{i}.key"], reference.keys[i], rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["criticalkv", "ada-criticalkv"])
def test_the_backend_over_onnxruntime_stand_ins_answers_like_onnxruntime(tmp_path, monkeypatch, name):
    # TensorRTBackend's code on the CPU, ONNX Runtime sessions of the TensorRT graphs in place of its engines
    # (tests/runtime/engine_standins.py: they refuse shapes outside the build's profiles): a static batch, questions
    # after compressed contexts (extend_row in chunks of extend_chunk), a chunked prefill into a prompt-sized buffer
    # then select feeding load_row, a saved slot restored into another, and the capacity check, give ONNX Runtime's
    # tokens, kept entries and errors
    from runtime.engine_standins import standin_backend

    policy = make_policy(dict(POLICY_CASES)[name], budget=40, window=8)
    folder = export_tiny_engine(tiny_model("llama", seed=4), policy, tmp_path / "engine", extend_chunk=64,
                                max_question_len=80, max_batch_size=2)
    backend, manifest = standin_backend(folder, monkeypatch)
    engines = {"onnxruntime": Engine.load(folder), "tensorrt": Engine(folder, manifest, backend)}
    assert backend.has_extend and engines["tensorrt"].limits.max_question_len == 80
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 128, 120).tolist(), rng.integers(1, 128, 90).tolist()]
    questions = [rng.integers(1, 128, 9).tolist(), rng.integers(1, 128, 70).tolist()]
    overflow = rng.integers(1, 128, max(manifest["shapes"]["decode_capacity"]) + 1).tolist()
    got = {}
    for backend_name, engine in engines.items():
        batch = engine.generate(prompts, 10, stop_token_ids=[])
        asked = engine.generate(prompts, 10, stop_token_ids=[], questions=questions).tokens
        job = engine.begin_prefill(Request(prompts[0]))
        while not engine.prefill_step(job, 32):
            pass
        result = engine.finish_prefill(job, 0)
        engine.restore(1, engine.save(0))
        steps = [np.argmax(np.stack([result.logits] * 2), -1).tolist()]
        for _ in range(6):
            steps.append(np.argmax(engine.decode([0, 1], steps[-1]), -1).tolist())
        entries = snapshot_arrays(engine, 0)
        engine.release_all()
        engine.prefill(0, Request(prompts[1]))
        with pytest.raises(EngineError, match="more entries do not fit the KV buffer") as error:
            engine.extend(0, overflow)
        engine.release_all()
        got[backend_name] = batch, asked, result, steps, entries, str(error.value)
    ort, trt = got["onnxruntime"], got["tensorrt"]
    assert trt[0].tokens == ort[0].tokens
    for layer in range(len(ort[0].kept_indices)):
        assert np.array_equal(trt[0].kept_indices[layer], ort[0].kept_indices[layer])
    assert trt[1] == ort[1]
    assert trt[2].kept_entries == ort[2].kept_entries and np.abs(trt[2].logits - ort[2].logits).max() < 1e-4
    assert trt[3] == ort[3] and all(a == b for a, b in trt[3])
    for layer in range(len(ort[4][0])):
        assert np.array_equal(trt[4][2][layer], ort[4][2][layer])
        np.testing.assert_allclose(trt[4][0][layer], ort[4][0][layer], rtol=0, atol=1e-5)
    assert trt[5] == ort[5]
    for engine in engines.values():
        engine.close()


PROMPTS = [list(range(5, 125)), list(range(20, 110))]  # a left-padded batch of two


def build_tiny(tmp_path, name="criticalkv", dtype="float32", batch=2):
    pytest.importorskip("tensorrt")
    from criticalkv.export import BuildConfig
    from criticalkv.build import build_engine

    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt")
    config = BuildConfig(max_input_len=256, max_new_tokens=32, max_batch_size=batch, attention_chunk=32, dtype=dtype,
                         extend_chunk=64, max_question_len=80)
    folder = build_engine(tmp_path / "engine", KVPolicy(name, budget=40, window=8), config, model=str(checkpoint))
    manifest = read_manifest(folder, verify=False)
    assert manifest["tensorrt"]["built"], manifest["tensorrt"]
    assert set(manifest["tensorrt"]["engines"]) == {"prefill", "decode", "extend", "select"}
    return folder, checkpoint


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["criticalkv", "pyramidkv", "ada-criticalkv", "laprox", "full", "layer-defensivekv"])
def test_tensorrt_engine_generates_the_onnxruntime_tokens(tmp_path, name):
    # the fp32 parity build (strongly typed, TF32 cleared): token- and index-identical to ONNX Runtime
    # (layer-defensivekv: the CriticalKVScore / CriticalKVSelectModel plugins against the model node's function body)
    folder, _ = build_tiny(tmp_path, name, "float32")
    reference = Engine.load(folder, backend="onnxruntime").generate(PROMPTS, 24, stop_token_ids=[])
    for graphs in (True, False):
        engine = Engine.load(folder, backend="tensorrt", cuda_graphs=graphs)
        got = engine.generate(PROMPTS, 24, stop_token_ids=[])
        engine.close()
        assert got.tokens == reference.tokens, f"cuda_graphs={graphs}"
        for layer in range(len(reference.kept_lengths)):
            assert np.array_equal(got.kept_lengths[layer], reference.kept_lengths[layer])
            assert np.array_equal(got.kept_indices[layer], reference.kept_indices[layer])


def kept_sets(indices, lengths):
    """{(layer, row, head): set of kept positions} from per-layer [B, H_kv, cap] indices and [B, H_kv] lengths."""
    return {(layer, b, h): set(idx[b, h, : lengths[layer][b, h]].tolist())
            for layer, idx in enumerate(indices) for b in range(idx.shape[0]) for h in range(idx.shape[1])}


def missed_fraction(got, reference):
    """Share of the reference's kept entries (all layers, rows, heads) that ``got`` does not keep."""
    total = sum(len(v) for v in reference.values())
    return sum(len(reference[key] - got.get(key, set())) for key in reference) / total


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_engines_keep_what_the_fp32_reference_keeps(tmp_path, dtype):
    # flash-attention's tolerance rule (STYLE.md): a low-precision result may be at most twice as far from the
    # fp32 reference as PyTorch's own result in the same precision. Kept sets are compared by overlap (a
    # near-tie may swap one entry), logits by their largest absolute error; on a left-padded batch.
    import torch

    from criticalkv.hf import load_model, prefill_and_compress

    folder, checkpoint = build_tiny(tmp_path, "criticalkv", dtype)
    width = max(map(len, PROMPTS))
    ids = np.zeros((2, width), np.int64)
    mask = np.zeros((2, width), np.int64)
    for row, prompt in enumerate(PROMPTS):
        ids[row, width - len(prompt):], mask[row, width - len(prompt):] = prompt, 1
    positions = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    ort_engine = Engine.load(folder, backend="onnxruntime")
    reference = ort_engine.backend.prefill(ids, mask, positions)
    ort_engine.close()
    engine = Engine.load(folder, backend="tensorrt")
    got = engine.backend.prefill(ids, mask, positions)
    engine.close()
    model, _ = load_model(str(checkpoint), dtype=getattr(torch, dtype))
    policy = KVPolicy.from_dict(read_manifest(folder, verify=False)["policy"])
    low = prefill_and_compress(model.cuda(), torch.from_numpy(ids).cuda(), policy, torch.from_numpy(mask).cuda())
    low_indices = [s.indices.cpu().numpy() for s in low.selections]
    low_lengths = [s.lengths.cpu().numpy() for s in low.selections]

    ref_sets = kept_sets(reference.indices, reference.lengths)
    torch_missed = missed_fraction(kept_sets(low_indices, low_lengths), ref_sets)
    trt_missed = missed_fraction(kept_sets(got.indices, got.lengths), ref_sets)
    one_entry = 1 / sum(len(v) for v in ref_sets.values())
    assert trt_missed <= 2 * torch_missed + one_entry, (trt_missed, torch_missed)
    assert np.isfinite(got.logits).all()
    torch_error = np.abs(low.logits.float().cpu().numpy() - reference.logits).max()
    trt_error = np.abs(got.logits - reference.logits).max()
    assert trt_error <= 2 * torch_error + 1e-3, (trt_error, torch_error)


@pytest.mark.gpu
def test_a_moved_engine_deserialises_in_a_fresh_process(tmp_path):
    # the manifest names the plugin relative to the engine directory: a moved directory loads in a new process
    folder, _ = build_tiny(tmp_path, "ada-criticalkv", "float16")
    in_process = Engine.load(folder, backend="tensorrt")
    expected = in_process.generate(PROMPTS, 8, stop_token_ids=[]).tokens
    in_process.close()
    moved = tmp_path / "moved" / "engine"
    moved.parent.mkdir()
    folder.rename(moved)
    code = (
        "import json, sys\n"
        "from criticalkv.runtime import Engine\n"
        "engine = Engine.load(sys.argv[1], backend='tensorrt')\n"
        "print(json.dumps(engine.generate(json.loads(sys.argv[2]), 8, stop_token_ids=[]).tokens))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CRITICALKV_PLUGIN_LIBRARY"}
    run = subprocess.run([sys.executable, "-c", code, str(moved), json.dumps(PROMPTS)], capture_output=True,
                         text=True, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == expected


def snapshot_arrays(engine, slot):
    """A slot's entries (``Engine.save``) as host float32 arrays: per layer keys, values [H_kv, n, d_h], lengths."""
    row = engine.save(slot).row
    host = lambda x: x.float().cpu().numpy() if hasattr(x, "cpu") else np.asarray(x, np.float32)  # noqa: E731
    return [host(k) for k in row.keys], [host(v) for v in row.values], [np.asarray(host(n), np.int64) for n in row.lengths]


def greedy_tokens(engine, slots, logits, steps):
    """Greedy tokens of ``slots`` (every occupied slot) decoded together from their logits [len(slots), vocab]."""
    tokens = [np.argmax(logits, axis=-1).tolist()]
    for _ in range(steps):
        tokens.append(np.argmax(engine.decode(slots, tokens[-1]), axis=-1).tolist())
    return tokens


def kept_of(outputs):
    """{(layer, row, head): kept positions} of a prefill's or a select's outputs (``PrefillOutputs``)."""
    return kept_sets(outputs.indices, outputs.lengths)


@pytest.mark.gpu
def test_tensorrt_extend_equals_onnxruntime_extend(tmp_path):
    # a question of 70 tokens (the engine splits it at extend_chunk = 64: 64 + 6) after a compressed context, on the
    # fp32 parity build: the extend engine's logits, the entries it writes at each head's length, and the greedy
    # tokens after it are ONNX Runtime's; a saved slot restored into another one continues the same; a question that
    # overflows the slot fails the same way on both
    folder, _ = build_tiny(tmp_path, "ada-criticalkv", "float32")
    overflow_tokens = max(read_manifest(folder, verify=False)["shapes"]["decode_capacity"]) + 1
    rng = np.random.default_rng(1)
    context, question = rng.integers(1, 128, 150).tolist(), rng.integers(1, 128, 70).tolist()
    results = {}
    for backend in ("onnxruntime", "tensorrt"):
        engine = Engine.load(folder, backend=backend)
        assert engine.backend.has_extend and engine.limits.max_question_len == 80
        engine.prefill(0, Request(context))
        logits = engine.extend(0, question)
        keys, values, lengths = snapshot_arrays(engine, 0)
        engine.restore(1, engine.save(0))
        tokens = greedy_tokens(engine, [0, 1], np.stack([logits, logits]), 8)
        engine.release_all()
        engine.prefill(0, Request(context))
        with pytest.raises(EngineError, match="more entries do not fit the KV buffer") as overflow:
            engine.extend(0, rng.integers(1, 128, overflow_tokens).tolist())
        engine.release_all()
        engine.close()
        results[backend] = logits, keys, values, lengths, tokens, str(overflow.value)
    ort, trt = results["onnxruntime"], results["tensorrt"]
    assert np.abs(trt[0] - ort[0]).max() <= 1e-4 * np.abs(ort[0]).max()
    for layer in range(len(ort[1])):
        assert np.array_equal(trt[3][layer], ort[3][layer])
        np.testing.assert_allclose(trt[1][layer], ort[1][layer], rtol=0, atol=1e-4)
        np.testing.assert_allclose(trt[2][layer], ort[2][layer], rtol=0, atol=1e-4)
    assert trt[4] == ort[4] and all(a == b for a, b in trt[4])  # the restored slot decodes as the saved one
    assert trt[5] == ort[5]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["criticalkv", "ada-criticalkv", "streamingllm"])
def test_chunked_prefill_through_tensorrt_engines_equals_the_prefill(tmp_path, name):
    # the prompt in chunks of 32 and 64 through extend.engine into a prompt-sized buffer, then select.engine, against
    # one run of prefill.engine: TensorRT's attention over the chunks sums in another order than the one-shot prompt,
    # so logits are compared within 1e-4 and the kept sets by overlap (at most one entry apart: a near-tie), then the
    # greedy tokens after them; the chunked kept sets are also ONNX Runtime's chunked ones (within one entry)
    folder, _ = build_tiny(tmp_path, name, "float32")
    ids = np.random.default_rng(3).integers(1, 128, 150).tolist()
    n = len(ids)
    trt = Engine.load(folder, backend="tensorrt")
    ort = Engine.load(folder, backend="onnxruntime")
    one_kept = kept_of(trt.backend.prefill(np.array([ids]), np.ones((1, n), np.int64), np.arange(n)[None]))
    one_entry = 1 / sum(len(v) for v in one_kept.values())
    one = trt.prefill(0, Request(ids))
    one_tokens = greedy_tokens(trt, [0], one.logits[None], 6)
    trt.release(0)
    for chunk in (32, 64):
        chunked = {}
        for engine in (trt, ort):
            job = engine.begin_prefill(Request(ids))
            assert job.buffer.keys[0].shape[2] == n  # exactly the prompt: select reads it in place
            while not engine.prefill_step(job, chunk):
                pass
            kept = kept_of(engine.backend.select(job.buffer, job.queries))
            result = engine.finish_prefill(job, 0)
            chunked[engine.backend.name] = result, kept, greedy_tokens(engine, [0], result.logits[None], 6)
            engine.release(0)
        result, kept, tokens = chunked["tensorrt"]
        assert np.abs(result.logits - one.logits).max() <= 1e-4 * np.abs(one.logits).max(), chunk
        assert missed_fraction(kept, one_kept) <= one_entry and tokens == one_tokens, chunk
        _, ort_kept, ort_tokens = chunked["onnxruntime"]
        assert missed_fraction(kept, ort_kept) <= one_entry and tokens == ort_tokens, chunk
    trt.close()
    ort.close()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["criticalkv", "full"])
def test_generate_with_questions_on_tensorrt_equals_onnxruntime(tmp_path, name):
    # Engine.generate(questions=...): each context prefilled alone and compressed without its question, the question
    # through the extend engine, then the slots decode together: ONNX Runtime's tokens
    folder, _ = build_tiny(tmp_path, name, "float32")
    rng = np.random.default_rng(5)
    contexts = [rng.integers(1, 128, n).tolist() for n in (120, 90)]
    questions = [rng.integers(1, 128, n).tolist() for n in (9, 70)]
    tokens = {}
    for backend in ("onnxruntime", "tensorrt"):
        engine = Engine.load(folder, backend=backend)
        tokens[backend] = engine.generate(contexts, 16, stop_token_ids=[], questions=questions).tokens
        engine.close()
    assert tokens["tensorrt"] == tokens["onnxruntime"]
