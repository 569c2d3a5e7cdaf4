"""The fused prompt graphs (prefill_ort.onnx, extend_ort.onnx: com.microsoft GroupQueryAttention over the prompt,
RotaryEmbedding, SkipSimplifiedLayerNormalization, prepacked weights) against the portable graphs and a float64 oracle.

Their floats differ from the portable graphs' (another attention kernel, the fused norms, MLAS's packed GEMMs), so they
are held to the flash-attention rule: the prompt's last logits and the K/V the selection reads may be at most twice as
far from the model run in float64 by transformers as the portable fp32 graph's; the kept entries and the greedy tokens
must be the portable graph's (and, through tests/runtime/test_model_families.py, which runs the default form, the
PyTorch path's). A left-padded batch of different lengths runs one group of equal lengths at a time; the chunked
prefill's chunks and a question after a context go through extend_ort.onnx in place when the sequence's heads hold
equal lengths in every layer, through extend_heads_ort.onnx (a bias over each head's hole) when they do not.
"""

import copy
import os

import numpy as np
import onnx
import pytest
import torch

from criticalkv import KVPolicy
from criticalkv.errors import EngineError
from criticalkv.request import Request, SamplingParams
from criticalkv.runtime import Engine
from criticalkv.runtime.onnxruntime_backend import PREFILL_ENV, THREADS_ENV
from export.tiny_engine import export_tiny_engine, padded
from model_families import FAMILIES, family, random_checkpoint, random_prompt

LENGTHS = (150, 97, 150)  # a left-padded batch: two groups of equal lengths
LIMITS = {"max_input_len": 160, "max_new_tokens": 8, "max_batch_size": 3}


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    os.environ[THREADS_ENV] = "1"
    yield
    os.environ.pop(THREADS_ENV, None)


def engines(model, policy, folder, **limits):
    """(fused, portable) engines of one export."""
    export_tiny_engine(model, policy, folder, **{**LIMITS, **limits})
    fused, portable = Engine.load(folder), Engine.load(folder, prefill="portable")
    assert fused.backend.prefill_form == "fused" and portable.backend.prefill_form == "portable"
    return fused, portable


def float64_oracle(model, prompt):
    """transformers in float64 on one unpadded prompt: (last logits [vocab], per layer post-RoPE K, V [H_kv, n, d_h])."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
    cache = out.past_key_values
    kv = [(layer.keys[0].numpy(), layer.values[0].numpy()) for layer in cache.layers]
    return out.logits[0, -1].numpy(), kv


@pytest.mark.parametrize("fam_id", ["llama3-gqa", "qwen2", "qwen3", "llama32-tied"])
def test_fused_prefill_is_within_twice_the_portable_error_of_a_float64_oracle(fam_id, tmp_path):
    fam = family(fam_id)
    model = random_checkpoint(fam, seed=FAMILIES.index(fam))
    reference = copy.deepcopy(model).double()
    fused, portable = engines(model, KVPolicy("ada-criticalkv", budget=48, window=8), tmp_path / "e")
    try:
        prompts = [random_prompt(n, seed=n + row) for row, n in enumerate(LENGTHS)]
        ids, mask, positions = padded(prompts)
        got = {"fused": fused.backend.prefill(ids, mask, positions), "portable": portable.backend.prefill(ids, mask, positions)}
        errors = {form: {"logits": 0.0, "kv": 0.0} for form in got}
        n = ids.shape[1]
        for row, p in enumerate(prompts):
            logits, kv = float64_oracle(reference, p)
            for form, out in got.items():
                errors[form]["logits"] = max(errors[form]["logits"], float(np.abs(out.logits[row] - logits).max()))
                for layer, (keys, values) in enumerate(kv):  # the kept entries against the oracle's at their positions
                    for head in range(keys.shape[0]):
                        kept = int(out.lengths[layer][row, head])
                        at = out.indices[layer][row, head, :kept] - (n - len(p))
                        for entries, want in ((out.keys, keys), (out.values, values)):
                            diff = np.abs(entries[layer][row, head, :kept] - want[head, at]).max()
                            errors[form]["kv"] = max(errors[form]["kv"], float(diff))
        for what in ("logits", "kv"):
            assert 0 < errors["fused"][what] <= 2 * errors["portable"][what], (what, errors)
        a, b = got["fused"], got["portable"]
        for layer in range(len(a.indices)):  # the same kept entries, in the same padded layout
            assert np.array_equal(a.lengths[layer], b.lengths[layer])
            assert np.array_equal(a.indices[layer], b.indices[layer])
            assert a.keys[layer].shape == b.keys[layer].shape
        assert (a.logits.argmax(-1) == b.logits.argmax(-1)).all()
    finally:
        fused.close()
        portable.close()


@pytest.mark.parametrize("name", ["full", "criticalkv", "ada-criticalkv", "pyramidkv", "layer-defensivekv"])
def test_fused_prompt_graphs_generate_the_portable_tokens(name, tmp_path):
    """A left-padded batch through generate, then the chunked prefill (chunks of 40: not multiples of the attention
    block), decoding, a question through the extend graph and decoding again in a slot: the portable engine's tokens.
    The chunks run through extend_ort.onnx (a prefill buffer's heads hold equal lengths); the question too unless the
    slot's heads hold different lengths (ada-criticalkv here), which extend_heads_ort.onnx then takes."""
    model = random_checkpoint(family("llama3-gqa"), seed=1)
    policy = KVPolicy(name) if name == "full" else KVPolicy(name, budget=48, window=8)
    fused, portable = engines(model, policy, tmp_path / "e", max_new_tokens=12)
    prompts = [random_prompt(n, seed=n + 2) for n in LENGTHS]
    calls = {"fused": 0, "heads": 0}
    run = fused.backend._extend_fused

    def counted(*args, heads=False):
        calls["fused"] += 1
        calls["heads"] += heads
        return run(*args, heads=heads)

    fused.backend._extend_fused = counted
    try:
        a = fused.generate(prompts, max_new_tokens=12, stop_token_ids=[])
        b = portable.generate(prompts, max_new_tokens=12, stop_token_ids=[])
        assert a.tokens == b.tokens
        for layer in range(len(a.kept_indices)):
            assert np.array_equal(a.kept_indices[layer], b.kept_indices[layer])
        streams = {}
        for form, engine in (("fused", fused), ("portable", portable)):
            job = engine.begin_prefill(Request(prompts[0], SamplingParams(max_tokens=8)))
            while not engine.prefill_step(job, 40):
                pass
            tokens = [int(engine.finish_prefill(job, 0).logits.argmax())]
            for _ in range(3):
                tokens.append(int(engine.decode([0], [tokens[-1]])[0].argmax()))
            ragged = any(int(n[0].min()) != int(n[0].max()) for n in engine.backend.lengths)
            tokens.append(int(engine.extend(0, random_prompt(12, seed=5)).argmax()))
            for _ in range(3):
                tokens.append(int(engine.decode([0], [tokens[-1]])[0].argmax()))
            streams[form] = tokens
            engine.release_all()
        assert streams["fused"] == streams["portable"]
        assert ragged == (name == "ada-criticalkv")  # these prompts: ada's heads keep different lengths
        assert calls["fused"] == 4 + 1  # 150 tokens in chunks of 40, then the question
        assert calls["heads"] == (1 if ragged else 0)  # the question over heads of different lengths
    finally:
        fused.close()
        portable.close()


@pytest.mark.parametrize("name, kv_dtype", [("ada-criticalkv", "float32"), ("adakv", "float32"),
                                             ("ada-criticalkv", "float16")])
def test_an_extend_over_heads_of_different_lengths_leaves_the_portable_buffers(name, kv_dtype, tmp_path):
    """extend_heads_ort.onnx over a slot whose heads hold different lengths: the engine writes the new entries at each
    layer's longest head, masks the shorter heads' holes and moves their entries down, so the slot holds what
    extend.onnx leaves: the same lengths, each head's entries within float32 rounding of the portable graph's, the
    slots after them untouched, and the question's logits within the flash-attention rule's reach (twice the portable
    graph's own distance to a float64 run is checked for the prompt graphs above; here the two graphs' logits agree to
    1e-4 of their range and pick the same token). float16 buffers: both extend a float32 copy of the row."""
    model = random_checkpoint(family("llama3-gqa"), seed=3)
    fused, portable = engines(model, KVPolicy(name, budget=48, window=8), tmp_path / "e", max_new_tokens=12,
                              kv_dtype=kv_dtype)
    try:
        assert fused.backend.manifest["onnx"]["files"]["extend_heads_ort"] == "extend_heads_ort.onnx"
        state, logits = {}, {}
        for form, engine in (("fused", fused), ("portable", portable)):
            engine.prefill(0, Request(random_prompt(150, seed=7)))
            logits[form] = engine.extend(0, random_prompt(13, seed=8))
            b = engine.backend
            state[form] = ([n[0].copy() for n in b.lengths], [k[0].astype(np.float32) for k in b.keys],
                           [v[0].astype(np.float32) for v in b.values])
        assert any(int(n.min()) != int(n.max()) for n in state["fused"][0])  # heads of different lengths
        assert fused.backend._lazy_sessions.get("extend_heads_ort") is not None  # the question ran through it
        # float16 buffers: the new entries rounded to float16 from two float32 runs may differ by one rounding step
        tolerance = {"rtol": 0, "atol": 1e-4} if kv_dtype == "float32" else {"rtol": 2 ** -10, "atol": 1e-3}
        span = float(logits["portable"].max() - logits["portable"].min())
        np.testing.assert_allclose(logits["fused"], logits["portable"], rtol=0, atol=1e-4 * span)
        assert logits["fused"].argmax() == logits["portable"].argmax()
        for layer, (a, b) in enumerate(zip(state["fused"][0], state["portable"][0])):
            assert np.array_equal(a, b), layer
            for buffers in (1, 2):
                x, y = state["fused"][buffers][layer], state["portable"][buffers][layer]
                for head, n in enumerate(a):
                    np.testing.assert_allclose(x[head, :n], y[head, :n], **tolerance)
                    assert np.array_equal(x[head, n:], y[head, n:]), (layer, head)  # beyond: what extend.onnx leaves
    finally:
        fused.close()
        portable.close()


@pytest.mark.parametrize("reread", ["context", "chunk"])
def test_fused_reconstruction_is_within_twice_the_portable_error_of_a_float64_oracle(reread, tmp_path):
    """KVzip's context reconstruction through reread_ort.onnx (GroupQueryAttention's probabilities, the score's
    renormalisation over the chunk's keys in the graph) against reread.onnx and transformers in float64: scores
    at most twice as far from the oracle as the portable graph's, the same kept entries and tokens. Chunks of 40 with
    their repeat prompts over a 150-token context: several chunks, the sinks, runs over earlier runs' entries."""
    from criticalkv.hf.reconstruct import reconstruction_scores
    from criticalkv.methods.kvzip import ReconstructionPrompt

    model = random_checkpoint(family("llama3-gqa"), seed=0)
    reference = copy.deepcopy(model).double()
    policy = KVPolicy("kvzip", budget=48, window=8, kvzip_chunk=40, kvzip_reread=reread)
    fused, portable = engines(model, policy, tmp_path / "e")
    calls = {"fused": 0}
    run = fused.backend._extend_fused

    def counted(*args):
        calls["fused"] += args[-1] is not None  # a reconstruction run (score_range given)
        return run(*args)

    fused.backend._extend_fused = counted
    try:
        prompt = random_prompt(150, seed=3)
        with torch.no_grad():
            cache = reference(torch.tensor([prompt]), use_cache=True).past_key_values
        oracle = reconstruction_scores(reference, cache, prompt, policy,
                                       ReconstructionPrompt.from_dict(fused.method_data["kvzip"]["prompt"]))
        errors, kept = {}, {}
        for form, engine in (("fused", fused), ("portable", portable)):
            job = engine.begin_prefill(Request(prompt, SamplingParams(max_tokens=4)))
            engine.prefill_step(job, job.remaining)
            scores = engine._score(job)
            errors[form] = max(float(np.abs(a - b.numpy()).max()) for a, b in zip(scores, oracle))
            kept[form] = engine.generate([prompt], max_new_tokens=6, stop_token_ids=[])
        assert calls["fused"] >= 4  # every chunk's runs took the fused graph
        assert 0 < errors["fused"] <= 2 * errors["portable"], errors
        assert kept["fused"].tokens == kept["portable"].tokens
        for layer in range(len(kept["fused"].kept_indices)):
            assert np.array_equal(kept["fused"].kept_indices[layer], kept["portable"].kept_indices[layer])
    finally:
        fused.close()
        portable.close()


def test_graphs_forms_and_options(tmp_path, monkeypatch):
    """prefill_ort.onnx has no Loop and only its fused com.microsoft operators; no graph TensorRT parses has any; the
    form is chosen by option or environment; a bad one is refused; prepacking follows the form."""
    model = random_checkpoint(family("qwen3"), seed=2)
    folder = export_tiny_engine(model, KVPolicy("criticalkv", budget=48, window=8), tmp_path / "e", **LIMITS)
    for name, contrib in (("prefill_ort.onnx", {"GroupQueryAttention", "RotaryEmbedding", "SkipSimplifiedLayerNormalization"}),
                          ("extend_ort.onnx", {"GroupQueryAttention", "RotaryEmbedding", "SkipSimplifiedLayerNormalization"}),
                          ("prefill_tensorrt.onnx", set()), ("extend_tensorrt.onnx", set()), ("decode.onnx", set()),
                          ("prefill.onnx", set()), ("extend.onnx", set())):
        graph = onnx.load(str(folder / name), load_external_data=False).graph
        assert {n.op_type for n in graph.node if n.domain == "com.microsoft"} == contrib, name
        if contrib:
            assert not any(n.op_type == "Loop" for n in graph.node), name
    engine = Engine.load(folder)
    assert engine.backend.prefill_form == "fused" and engine.backend.prefill_prepack
    assert engine.manifest["onnx"]["fused_prompt"]["max_positions"] == 160 + 256 + 8
    engine.close()
    engine = Engine.load(folder, prefill="fused", prefill_prepack=False)
    assert engine.backend.prefill_form == "fused" and not engine.backend.prefill_prepack
    engine.close()
    monkeypatch.setenv(PREFILL_ENV, "portable")
    engine = Engine.load(folder)
    assert engine.backend.prefill_form == "portable" and engine.backend.extend_fused_session is None
    engine.close()
    with pytest.raises(ValueError, match="prefill: 'fast' is not one of auto, fused, portable"):
        Engine.load(folder, prefill="fast")


def test_a_model_the_fused_graphs_refuse_prefills_with_the_portable_graphs(tmp_path):
    model = random_checkpoint(family("ministral"), seed=5)  # head_dim 24: ONNX Runtime's GroupQueryAttention refuses it
    folder = export_tiny_engine(model, KVPolicy("criticalkv", budget=48, window=8), tmp_path / "e", **LIMITS)
    files = onnx_files = Engine.load(folder).manifest["onnx"]
    assert "prefill_ort" not in onnx_files["files"] and "head_dim 24" in files["fused_prompt"]["refused"]
    engine = Engine.load(folder)
    assert engine.backend.prefill_form == "portable" and "head_dim 24" in engine.backend.prefill_fallback
    assert len(engine.generate([random_prompt(100, seed=2)], max_new_tokens=2, stop_token_ids=[]).tokens[0]) == 2
    engine.close()
    with pytest.raises(EngineError, match="no fused prefill graph.*head_dim 24"):
        Engine.load(folder, prefill="fused")
    with pytest.raises(ValueError, match="weights int8: .*head_dim 24"):
        export_tiny_engine(model, KVPolicy("criticalkv", budget=48, window=8), tmp_path / "q", weights="int8", **LIMITS)


def test_a_padded_batch_must_be_left_padded(tmp_path):
    model = random_checkpoint(family("llama3-gqa"), seed=0)
    fused, portable = engines(model, KVPolicy("criticalkv", budget=48, window=8), tmp_path / "e")
    try:
        ids, mask, positions = padded([random_prompt(n, seed=n) for n in (120, 90)])
        with pytest.raises(EngineError, match="left padding"):
            fused.backend.prefill(ids, mask[:, ::-1].copy(), positions)
    finally:
        fused.close()
        portable.close()
