"""The fused decode graph (decode_ort.onnx: com.microsoft GroupQueryAttention + SkipSimplifiedLayerNormalization, the
KV buffers shared in place, prepacked weights) against the portable decode.onnx and a float64 oracle.

Its floats differ from the portable graph's (another summation order in the attention, the norms and MLAS's packed
GEMMs), so it is held to the flash-attention rule: its logits may be at most twice as far from a float64 oracle
(tests/naive_decode.py, the same kept entries) as the portable fp32 graph's; greedy tokens, lengths and the kept entries
must be the portable graph's. Heads that keep different lengths (adakv-style policies) are masked by the graph's
attention bias and the runtime moves each shorter head's new entry to its own length: the slot API (save, restore,
move, extend) then reads the same layout as after a portable step.
"""

import os

import numpy as np
import pytest
import torch

from criticalkv import KVPolicy
from criticalkv.errors import EngineError
from criticalkv.export.decoder import collect_weights, model_spec
from criticalkv.runtime import Engine
from criticalkv.runtime.onnxruntime_backend import DECODE_ENV, THREADS_ENV
from export.tiny_engine import export_tiny_engine, padded
from model_families import FAMILIES, family, random_checkpoint, random_prompt
from naive_decode import decode_step
from policies import POLICY_CASES, make_policy

LENGTHS = (150, 97)  # a left-padded batch of two prompts, both compressed at budget 48


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    os.environ[THREADS_ENV] = "1"
    yield
    os.environ.pop(THREADS_ENV, None)


def engines(model, policy, folder, **limits):
    """(fused, portable) engines of one export."""
    export_tiny_engine(model, policy, folder, **{"max_input_len": 160, "max_new_tokens": 8, "max_batch_size": 2, **limits})
    fused, portable = Engine.load(folder), Engine.load(folder, decode="portable")
    assert fused.backend.decode_form == "fused" and portable.backend.decode_form == "portable"
    return fused, portable


@pytest.mark.parametrize("fam_id", ["llama3-gqa", "qwen2", "qwen3", "llama32-tied"])
@pytest.mark.parametrize("name", ["criticalkv", "ada-criticalkv"])
def test_fused_logits_are_within_twice_the_portable_error_of_a_float64_oracle(fam_id, name, tmp_path):
    fam = family(fam_id)
    model = random_checkpoint(fam, seed=FAMILIES.index(fam))
    spec = model_spec(model)
    arrays = collect_weights(model, spec).arrays
    fused, portable = engines(model, KVPolicy(name, budget=48, window=8), tmp_path / "e")
    try:
        ids, mask, positions = padded([random_prompt(n, seed=n) for n in LENGTHS])
        pre = portable.backend.prefill(ids, mask, positions)
        if name == "ada-criticalkv":  # the per-head case this test is for: heads of a row hold different lengths
            assert any(int(x.min()) != int(x.max()) for x in pre.lengths)
        fused.backend.begin_decode(pre)
        portable.backend.begin_decode(pre)
        tokens, at = pre.logits.argmax(-1), mask.sum(1)
        errors = {"fused": [], "portable": []}
        for _ in range(3):  # the new entries the fused graph wrote take part in the next steps
            state = [[x[:2].copy() for x in buffers] for buffers in (portable.backend.keys, portable.backend.values,
                                                                     portable.backend.lengths)]
            reference = decode_step(arrays, spec, tokens, at, *state)
            got = {"fused": fused.backend.decode(tokens, at).copy(), "portable": portable.backend.decode(tokens, at).copy()}
            for form, logits in got.items():
                errors[form].append(float(np.abs(logits - reference).max()))
            assert (got["fused"].argmax(-1) == got["portable"].argmax(-1)).all()
            tokens, at = got["portable"].argmax(-1), at + 1
        assert 0 < max(errors["fused"]) <= 2 * max(errors["portable"]), errors
        for layer in range(spec.num_layers):  # decode does not select: each head's kept entries stay as loaded
            lengths = portable.backend.lengths[layer][:2]
            assert (fused.backend.lengths[layer][:2] == lengths).all()
            assert (lengths == pre.lengths[layer] + 3).all()
            for row in range(2):
                for head in range(spec.num_kv_heads):
                    kept, n = int(pre.lengths[layer][row, head]), int(lengths[row, head])
                    for buffers, prefilled, other in ((fused.backend.keys, pre.keys, portable.backend.keys),
                                                      (fused.backend.values, pre.values, portable.backend.values)):
                        entries = buffers[layer][row, head]
                        assert np.array_equal(entries[:kept], prefilled[layer][row, head, :kept])
                        np.testing.assert_allclose(entries[kept:n], other[layer][row, head, kept:n], rtol=0, atol=1e-4)
    finally:
        fused.close()
        portable.close()


@pytest.mark.parametrize("name", ["full", "streamingllm", "pyramidkv", "criticalkv", "adakv", "ada-criticalkv",
                                  "layer-defensivekv"])
def test_fused_decode_generates_the_portable_tokens(name, tmp_path):
    model = random_checkpoint(family("llama3-gqa"), seed=0)
    policy = KVPolicy(name) if name == "full" else KVPolicy(name, budget=48, window=8)
    fused, portable = engines(model, policy, tmp_path / "e", max_new_tokens=16)
    prompts = [random_prompt(n, seed=n + 1) for n in LENGTHS]
    try:
        a = fused.generate(prompts, max_new_tokens=16, stop_token_ids=[])
        b = portable.generate(prompts, max_new_tokens=16, stop_token_ids=[])
        assert a.tokens == b.tokens
        for layer in range(len(a.kept_lengths)):
            assert (fused.backend.lengths[layer][:2] == portable.backend.lengths[layer][:2]).all()
    finally:
        fused.close()
        portable.close()


@pytest.mark.parametrize("name", ["criticalkv", "ada-criticalkv"])
def test_the_slot_api_reads_the_same_entries_after_fused_steps(name, tmp_path):
    """Slots decoded by the fused graph, then saved, released (the last row moves into the freed one), restored,
    extended by a question and decoded again: the same greedy tokens as the portable graph, step for step."""
    from criticalkv.request import Request, SamplingParams

    model = random_checkpoint(family("qwen2"), seed=3)
    fused, portable = engines(model, KVPolicy(name, budget=48, window=8), tmp_path / "e", max_batch_size=3)
    params = SamplingParams(max_tokens=8)
    prompts = [random_prompt(n, seed=n) for n in (140, 120, 90)]
    streams, snapshots = {}, {}
    try:
        for form, engine in (("fused", fused), ("portable", portable)):
            tokens = [int(engine.prefill(slot, Request(p, params)).logits.argmax()) for slot, p in enumerate(prompts)]
            out = []

            def step(slots):
                logits = engine.decode(slots, [tokens[s] for s in slots])
                for s, row in zip(slots, logits):
                    tokens[s] = int(row.argmax())
                out.append([tokens[s] for s in slots])

            for _ in range(3):
                step([0, 1, 2])
            saved = engine.save(1)
            snapshots[form] = saved.row
            engine.release(0)  # row 2 moves into row 0
            step([1, 2])
            engine.release(1)
            engine.restore(0, saved)  # slot 1's entries as saved, into another row
            tokens[0] = int(engine.extend(0, random_prompt(12, seed=5)).argmax())  # a question after the context
            step([2, 0])
            step([0, 2])
            streams[form] = out
            engine.release_all()
        assert streams["fused"] == streams["portable"]
        for layer, (keys, values, lengths) in enumerate(zip(*(vars(snapshots["fused"])[k] for k in ("keys", "values", "lengths")))):
            # the same entries and the same padding after each head's length (the fused step zeroes the slot it wrote)
            assert (lengths == snapshots["portable"].lengths[layer]).all()
            np.testing.assert_allclose(keys, snapshots["portable"].keys[layer], rtol=0, atol=1e-4)
            np.testing.assert_allclose(values, snapshots["portable"].values[layer], rtol=0, atol=1e-4)
    finally:
        fused.close()
        portable.close()


def test_policies_flagged_equal_lengths_keep_equal_lengths(tmp_path):
    """The fused graph of a policy whose heads keep equal lengths has no per-head mask (``equal_head_lengths``): every
    such policy of the shared table keeps equal lengths in every head of a row; the others are built with the mask."""
    model = random_checkpoint(family("llama3-gqa"), seed=0)
    ids, mask, positions = padded([random_prompt(n, seed=n + 7) for n in LENGTHS])
    for case_id, kwargs in POLICY_CASES:
        policy = make_policy(kwargs, budget=48, window=8)
        folder = export_tiny_engine(model, policy, tmp_path / case_id, max_input_len=160, max_new_tokens=4,
                                    max_batch_size=2)
        engine = Engine.load(folder)
        try:
            assert engine.backend.per_head_lengths == (not policy.method.base.equal_head_lengths), case_id
            if policy.method.base.equal_head_lengths:
                pre = engine.backend.prefill(ids, mask, positions)
                assert all((x == x[:, :1]).all() for x in pre.lengths), case_id
        finally:
            engine.close()


def test_a_policy_with_equal_lengths_refuses_a_ragged_row(tmp_path):
    model = random_checkpoint(family("llama3-gqa"), seed=0)
    fused, portable = engines(model, KVPolicy("criticalkv", budget=48, window=8), tmp_path / "e")
    try:
        assert not fused.backend.per_head_lengths
        ids, mask, positions = padded([random_prompt(120, seed=4)])
        pre = fused.backend.prefill(ids, mask, positions)
        pre.lengths[1][0, 1] -= 3  # as if a head had kept fewer entries
        with pytest.raises(EngineError, match="hold different lengths.*decode='portable'"):
            fused.backend.load_row(0, pre)
        portable.backend.load_row(0, pre)  # the portable graph masks any lengths
    finally:
        fused.close()
        portable.close()


def test_a_model_the_fused_graph_refuses_decodes_with_the_portable_graph(tmp_path, monkeypatch):
    """Ministral's head_dim 24 is not a multiple of 16 (ONNX Runtime's GroupQueryAttention): no decode_ort.onnx, the
    manifest says why, the default falls back to decode.onnx and asking for the fused decode names the reason."""
    model = random_checkpoint(family("ministral"), seed=5)
    folder = export_tiny_engine(model, KVPolicy("criticalkv", budget=48, window=8), tmp_path / "e", max_input_len=160,
                                max_new_tokens=4, max_batch_size=2)
    engine = Engine.load(folder)
    assert "decode_ort" not in engine.manifest["onnx"]["files"]
    assert "head_dim 24 is not a multiple of 16" in engine.manifest["onnx"]["fused_decode"]["refused"]
    assert engine.backend.decode_form == "portable" and "head_dim 24" in engine.backend.decode_fallback
    out = engine.generate([random_prompt(100, seed=2)], max_new_tokens=4, stop_token_ids=[])
    assert len(out.tokens[0]) == 4
    engine.close()
    with pytest.raises(EngineError, match="no fused decode graph.*head_dim 24"):
        Engine.load(folder, decode="fused")
    monkeypatch.setenv(DECODE_ENV, "fused")
    with pytest.raises(EngineError, match="no fused decode graph"):
        Engine.load(folder)


def test_the_decode_form_is_chosen_by_option_or_environment(tmp_path, monkeypatch):
    import onnx

    model = random_checkpoint(family("llama3-gqa"), seed=0)
    folder = export_tiny_engine(model, KVPolicy("adakv", budget=48, window=8), tmp_path / "e", max_input_len=160,
                                max_new_tokens=4, max_batch_size=2)
    graph = onnx.load(str(folder / "decode_ort.onnx"), load_external_data=False)
    contrib = {n.op_type for n in graph.graph.node if n.domain == "com.microsoft"}
    assert contrib == {"GroupQueryAttention", "SkipSimplifiedLayerNormalization"}
    gqa = [n for n in graph.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 2 and all(n.input[10] for n in gqa)  # adakv: the per-head attention bias
    for name in ("decode.onnx", "prefill_tensorrt.onnx", "extend_tensorrt.onnx", "select_tensorrt.onnx", "prefill.onnx",
                 "extend.onnx", "select.onnx"):  # no contrib operator anywhere else, TensorRT's inputs above all
        assert not any(n.domain == "com.microsoft" for n in onnx.load(str(folder / name), load_external_data=False).graph.node)
    monkeypatch.setenv(DECODE_ENV, "portable")
    engine = Engine.load(folder)
    assert engine.backend.decode_form == "portable" and not engine.backend.prepack
    engine.close()
    engine = Engine.load(folder, decode="fused", prepack=False)
    assert engine.backend.decode_form == "fused" and not engine.backend.prepack
    engine.close()
    with pytest.raises(ValueError, match="decode: 'fast' is not one of auto, fused, portable"):
        Engine.load(folder, decode="fast")


@pytest.mark.parametrize("name", ["criticalkv", "ada-criticalkv"])
def test_float16_kv_buffers(name, tmp_path):
    """``kv_dtype="float16"``: half the KV bytes (the scheduler's budget counts them), decode_ort.onnx reads the buffers
    cast to float32. Its logits are within twice the portable float32 graph's error of the float64 oracle fed the state
    each engine holds (the float16-rounded entries for it); rounding the entries moves the oracle's own logits by a
    bounded amount; greedy tokens (after a question through the extend graph over a float16 slot too) are the float32
    engine's; the portable graph cannot read float16 buffers."""
    from criticalkv.request import Request, SamplingParams

    model = random_checkpoint(family("llama3-gqa"), seed=0)
    spec = model_spec(model)
    arrays = collect_weights(model, spec).arrays
    policy = KVPolicy(name, budget=48, window=8)
    limits = dict(max_input_len=160, max_new_tokens=8, max_batch_size=2)
    half = Engine.load(export_tiny_engine(model, policy, tmp_path / "half", kv_dtype="float16", **limits))
    full = Engine.load(export_tiny_engine(model, policy, tmp_path / "full", **limits), decode="portable")
    try:
        assert half.backend.decode_form == "fused" and half.backend.keys[0].dtype == np.float16
        assert half.manifest["shapes"]["kv_buffer_bytes"] * 2 == full.manifest["shapes"]["kv_buffer_bytes"]
        assert half.backend.kv_buffer_bytes() * 2 == full.backend.kv_buffer_bytes() and half.entry_bytes * 2 == full.entry_bytes
        ids, mask, positions = padded([random_prompt(n, seed=n) for n in LENGTHS])
        pre = full.backend.prefill(ids, mask, positions)
        half.backend.begin_decode(pre)
        full.backend.begin_decode(pre)
        tokens, at = pre.logits.argmax(-1), mask.sum(1)
        errors, rounding = {"half": [], "full": []}, []
        for _ in range(3):
            states = {form: [[x[:2].astype(np.float64) for x in buffers] for buffers in
                             (engine.backend.keys, engine.backend.values, engine.backend.lengths)]
                      for form, engine in (("half", half), ("full", full))}
            references = {form: decode_step(arrays, spec, tokens, at, *state) for form, state in states.items()}
            rounding.append(float(np.abs(references["half"] - references["full"]).max()))
            got = {form: engine.backend.decode(tokens, at).copy() for form, engine in (("half", half), ("full", full))}
            for form in got:
                errors[form].append(float(np.abs(got[form] - references[form]).max()))
            assert (got["half"].argmax(-1) == got["full"].argmax(-1)).all()
            tokens, at = got["full"].argmax(-1), at + 1
        assert 0 < max(errors["half"]) <= 2 * max(errors["full"]), errors
        scale = float(np.abs(references["full"]).max())
        assert 0 < max(rounding) < 1e-2 * scale, (rounding, scale)  # float16 keeps ~3 decimal digits of each entry
        streams = []
        for engine in (half, full):
            first = engine.prefill(0, Request(random_prompt(120, seed=11), SamplingParams(max_tokens=8)))
            token = int(engine.extend(0, random_prompt(10, seed=12)).argmax())  # extend over a float16 row
            stream = [int(first.logits.argmax()), token]
            for _ in range(6):
                token = int(engine.decode([0], [token])[0].argmax())
                stream.append(token)
            engine.release(0)
            streams.append(stream)
        assert streams[0] == streams[1]
    finally:
        half.close()
        full.close()
    with pytest.raises(EngineError, match="float16.*only decode='fused'"):
        Engine.load(tmp_path / "half", decode="portable")


@pytest.mark.slow
def test_bundled_model_fused_decode_against_the_portable_graph_and_a_float64_oracle(tmp_path):
    """SmolLM2-135M (30 layers, 9 / 3 heads, d_h 64), a 640-token prompt, ada-criticalkv at budget 256 (heads of
    different lengths) and criticalkv: the fused logits within twice the portable graph's distance from the float64
    oracle over 3 steps, and 8 greedy tokens equal to the portable graph's."""
    from criticalkv.build import export_engine
    from criticalkv.export import BuildConfig
    from criticalkv.hf import load_model
    from criticalkv.runtime import create_backend
    from pathlib import Path

    torch.set_num_threads(1)
    model, tokenizer = load_model()
    needle = Path(__file__).resolve().parents[2] / "examples" / "needle_2k.txt"
    ids = tokenizer(needle.read_text())["input_ids"][:640]
    spec = model_spec(model)
    arrays = collect_weights(model, spec).arrays
    for name in ("ada-criticalkv", "criticalkv"):
        folder = tmp_path / name
        _, manifest = export_engine(model, KVPolicy(name, budget=256), folder,
                                    BuildConfig(max_input_len=640, max_new_tokens=8), validate=False)
        fused = Engine(folder, manifest, create_backend("onnxruntime", folder, manifest))
        portable = Engine(folder, manifest, create_backend("onnxruntime", folder, manifest, decode="portable"))
        try:
            assert fused.backend.decode_form == "fused"
            a = fused.generate([ids], max_new_tokens=8, stop_token_ids=[])
            b = portable.generate([ids], max_new_tokens=8, stop_token_ids=[])
            assert a.tokens == b.tokens, name
            pre = portable.backend.prefill(np.array([ids]), np.ones((1, len(ids)), np.int64), np.arange(len(ids))[None])
            fused.backend.begin_decode(pre)
            portable.backend.begin_decode(pre)
            tokens, at = pre.logits.argmax(-1), np.array([len(ids)])
            errors = {"fused": [], "portable": []}
            for _ in range(3):
                state = [[x[:1].copy() for x in buffers] for buffers in (portable.backend.keys, portable.backend.values,
                                                                         portable.backend.lengths)]
                reference = decode_step(arrays, spec, tokens, at, *state)
                for form, engine in (("fused", fused), ("portable", portable)):
                    logits = engine.backend.decode(tokens, at)
                    errors[form].append(float(np.abs(logits - reference).max()))
                tokens, at = logits.argmax(-1), at + 1
            assert 0 < max(errors["fused"]) <= 2 * max(errors["portable"]), (name, errors)
        finally:
            fused.close()
            portable.close()
