"""kvzip_score=surrogate: KVzip's score predicted from the prefill's hidden states (criticalkv.methods.surrogate),
trained by ridge regression on the re-read's own scores (criticalkv.hf.surrogate), on the PyTorch path, the ONNX
Runtime engine (its extend graphs' S_hat outputs) and the shipped surrogate of the bundled model."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from criticalkv import KVPolicy
from criticalkv.hf import generate, prefill_and_compress
from criticalkv.hf import compress as compress_module
from criticalkv.hf.surrogate import Samples, collect, fit, rank_agreement, spearman
from criticalkv.methods.surrogate import (
    FOLDER_FILE,
    PACKAGED_DIR,
    KVzipSurrogate,
    find_surrogate,
    fingerprint,
    mask_opening,
)
from criticalkv.methods.kvzip import ReconstructionPrompt
from criticalkv.request import Request
from criticalkv.runtime import Engine
from export.tiny_engine import export_tiny_engine, load_engine
from hf.conftest import tiny_model


def prompt(n, seed=1):
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def kept(selection, head):
    return [i for i in selection.indices[0, head].tolist() if i >= 0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model whose folder holds a surrogate trained on its own re-read scores (as `criticalkv train-surrogate`
    leaves it), and that surrogate."""
    model = tiny_model("llama", seed=5)
    folder = tmp_path_factory.mktemp("model")
    model.config._name_or_path = str(folder)
    samples = collect(model, [prompt(160, seed=s) for s in range(6)], 64, KVPolicy("kvzip", kvzip_chunk=64))
    weight, bias, metrics = fit(samples, ridge=1e-3, held_out=0.34)
    surrogate = KVzipSurrogate(weight, bias, fingerprint(model), metrics)
    surrogate.save(folder / FOLDER_FILE)
    return model, surrogate


def test_fit_recovers_a_linear_map_and_measures_it_on_held_out_contexts():
    rng = np.random.default_rng(0)
    layers, n, d, heads = 2, 600, 12, 3
    x = rng.normal(size=(layers, n, d)).astype(np.float32)
    w = rng.normal(size=(layers, d, heads))
    b = rng.normal(size=(layers, heads))
    y = np.einsum("lnd,ldh->lnh", x, w) + b[:, None] + 1e-3 * rng.normal(size=(layers, n, heads))
    samples = Samples(x, y.astype(np.float32), np.repeat(np.arange(6), 100).astype(np.int32))
    weight, bias, metrics = fit(samples, ridge=1e-8, held_out=1 / 3)
    np.testing.assert_allclose(weight, w, atol=1e-3)
    np.testing.assert_allclose(bias, b, atol=1e-3)
    assert metrics["train_contexts"] == 4 and metrics["held_out_contexts"] == 2 and metrics["samples"] == 400
    assert min(metrics["held_out_spearman"]) > 0.99
    # a heavy penalty shrinks the weights towards 0: the bias becomes the mean
    weight, bias, _ = fit(samples, ridge=1e6, held_out=1 / 3)
    assert np.abs(weight).max() < 1e-4
    np.testing.assert_allclose(bias, y[:, :400].mean(1), atol=1e-3)


def test_fit_reports_the_held_out_agreement_per_group():
    """Contexts from two sources: one follows the fitted map, the other an unrelated one; the per-group metric tells
    them apart (what train-surrogate --domains prints per domain), and ``rank_agreement`` measures any surrogate."""
    rng = np.random.default_rng(1)
    layers, n, d, heads = 1, 800, 6, 2
    x = rng.normal(size=(layers, n, d)).astype(np.float32)
    w = rng.normal(size=(layers, d, heads))
    y = np.einsum("lnd,ldh->lnh", x, w)
    y[:, 700:] = rng.normal(size=(layers, 100, heads))  # context 7 (held out): noise
    samples = Samples(x, y.astype(np.float32), np.repeat(np.arange(8), 100).astype(np.int32))
    groups = ["a", "b"] * 4  # contexts 6 (a) and 7 (b) held out
    weight, bias, metrics = fit(samples, ridge=1e-8, held_out=0.25, groups=groups)
    assert metrics["held_out_spearman_by_group"]["a"] > 0.99
    assert abs(metrics["held_out_spearman_by_group"]["b"]) < 0.3
    assert rank_agreement(samples, weight, bias, samples.context == 6)[0] == pytest.approx(
        metrics["held_out_spearman_by_group"]["a"], abs=1e-4)


def test_spearman_is_the_rank_correlation_with_average_ranks_for_ties():
    assert spearman(np.array([1.0, 2.0, 3.0, 4.0]), np.array([10.0, 20.0, 30.0, 40.0])) == pytest.approx(1.0)
    assert spearman(np.array([1.0, 2.0, 3.0, 4.0]), np.array([4.0, 3.0, 2.0, 1.0])) == pytest.approx(-1.0)
    a, c = np.array([1.0, 2.0, 2.0, 3.0]), np.array([1.0, 3.0, 2.0, 4.0])
    ra, rc = np.array([1, 2.5, 2.5, 4]), np.array([1, 3, 2, 4])  # ties share their average rank
    expected = np.corrcoef(ra, rc)[0, 1]
    assert spearman(a, c) == pytest.approx(expected)


def test_the_surrogate_score_is_exp_of_the_linear_map(trained):
    _, surrogate = trained
    h = torch.randn(1, 37, surrogate.hidden_size)
    got = surrogate.scores(1, h)
    want = np.exp(h[0].double().numpy() @ surrogate.weight[1].astype(np.float64) + surrogate.bias[1])
    assert got.shape == (1, surrogate.num_kv_heads, 37)
    np.testing.assert_allclose(got[0].T.numpy(), want, rtol=1e-5)
    scores = [torch.ones(1, 2, 10)]
    mask_opening(scores, ReconstructionPrompt(opening=(7, 8, 9, 10, 11, 12)), [7, 8, 9, 10, 11, 12, 1, 2, 3, 4], 2)
    assert scores[0][0, 0].tolist() == [1, 1, 0, 0, 0, 0, 1, 1, 1, 1]


def test_save_load_and_the_model_check(trained, tmp_path):
    model, surrogate = trained
    path = surrogate.save(tmp_path / "s.npz")
    back = KVzipSurrogate.load(path)
    np.testing.assert_array_equal(back.weight, surrogate.weight)
    np.testing.assert_array_equal(back.bias, surrogate.bias)
    assert back.model == surrogate.model and back.info == surrogate.info
    assert sorted(os.listdir(tmp_path)) == ["s.npz"]  # no temporary left behind
    assert oct(path.stat().st_mode & 0o777) != "0o600"
    back.check_model(model)
    with pytest.raises(ValueError, match="trained on another model"):
        back.check_model(tiny_model("llama", seed=6))
    (tmp_path / "bad.npz").write_bytes(b"not an npz")
    with pytest.raises(ValueError, match="not a KVzip surrogate"):
        KVzipSurrogate.load(tmp_path / "bad.npz")
    with pytest.raises(ValueError, match="criticalkv train-surrogate"):
        find_surrogate(tiny_model("llama", seed=6), tmp_path)
    with pytest.raises(ValueError, match="weight"):
        KVzipSurrogate(np.zeros((2, 3)), np.zeros((2, 3)), "x")


def test_the_pytorch_path_scores_from_the_prefill_and_never_re_reads(trained, monkeypatch):
    model, surrogate = trained
    ids = prompt(150, seed=7)
    policy = KVPolicy("layer-kvzip-criticalkv", budget=40, window=8, kvzip_score="surrogate")

    def no_reread(*args, **kwargs):
        raise AssertionError("kvzip_score=surrogate re-read the context")

    monkeypatch.setattr(compress_module, "reconstruction_scores", no_reread)
    got = prefill_and_compress(model, torch.tensor([ids]), policy)
    # the oracle: the same selection given S_hat of the hidden states (computed here, float64) as KVzip's scores
    hidden = {}

    def keep(i):
        def hook(module, args, kwargs, output):
            hidden.setdefault(i, kwargs["hidden_states"][0].double())  # the prefill's (returns None: output unchanged)

        return hook

    handles = [layer.self_attn.register_forward_hook(keep(i), with_kwargs=True) for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    oracle = [torch.exp(hidden[i] @ torch.from_numpy(surrogate.weight[i]).double()
                        + torch.from_numpy(surrogate.bias[i]).double()).T[None].float() for i in range(len(hidden))]
    monkeypatch.setattr(compress_module, "reconstruction_scores", lambda *a, **k: oracle)
    want = prefill_and_compress(model, torch.tensor([ids]), KVPolicy("layer-kvzip-criticalkv", budget=40, window=8))
    for layer, (a, b) in enumerate(zip(got.selections, want.selections)):
        assert a.lengths.tolist() == b.lengths.tolist(), f"layer {layer}"
        for head in range(2):
            assert kept(a, head) == kept(b, head), f"layer {layer} head {head}"


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
@pytest.mark.parametrize("own, context", [
    (KVPolicy("criticalkv", budget=40, window=8), KVPolicy("layer-kvzip-criticalkv", budget=40, window=8,
                                                           kvzip_score="surrogate", head_cap_ratio=3.0)),
    (KVPolicy("kvzip-criticalkv", budget=40, window=8, kvzip_score="surrogate"), None),
], ids=["context-policy", "engine-policy"])
def test_the_engine_keeps_what_the_pytorch_path_keeps_without_a_reconstruct_graph(trained, tmp_path, own, context,
                                                                                  backend):
    # ONNX Runtime: the extend graphs return the stream; torch: its layer loop computes it (no extra pass either)
    model, _ = trained
    folder = export_tiny_engine(model, own, tmp_path / "e", context_policy=context, extend_chunk=32, max_question_len=24)
    assert not (folder / "reread.onnx").exists() and not (folder / "reread_ort.onnx").exists()
    engine = load_engine(folder, backend, model, threads=1)
    assert engine.streams == {"kvzip_score"}
    policy = context or own
    try:
        assert engine.policy_for(context is not None) == policy
        ids = prompt(150, seed=23)
        got = engine.prefill(0, Request(ids), context=context is not None)
        engine.release(0)
        ref = prefill_and_compress(model, torch.tensor([ids]), policy)
        for layer, selection in enumerate(ref.selections):
            assert got.kept_lengths[layer].tolist() == selection.lengths[0].tolist()
            for head in range(2):
                kept_ids = got.kept_indices[layer][head]
                assert kept_ids[kept_ids >= 0].tolist() == kept(selection, head), f"layer {layer} head {head}"
        if context is None:  # and token for token through generate
            want = generate(model, torch.tensor([ids]), policy, max_new_tokens=6)
            out = engine.generate(np.array([ids]), max_new_tokens=6, stop_token_ids=[])
            assert out.tokens[0] == want.tokens[0]
    finally:
        engine.close()


def test_an_engine_without_the_surrogate_refuses_the_policy(trained, tmp_path):
    model, _ = trained
    folder = export_tiny_engine(model, KVPolicy("criticalkv", budget=40, window=8), tmp_path / "e",
                                context_policy=KVPolicy("kvzip", budget=40, window=8, kvzip_chunk=64),
                                extend_chunk=32, max_question_len=24)
    engine = Engine.load(folder, threads=1)
    try:
        engine.context_policy = KVPolicy("kvzip", budget=40, window=8, kvzip_score="surrogate")
        with pytest.raises(Exception, match="not built with"):
            engine.begin_prefill(Request(prompt(100)), context=True)
    finally:
        engine.close()


def test_the_train_command_checks_its_arguments():
    run = subprocess.run([sys.executable, "-m", "criticalkv.cli", "train-surrogate", "--contexts", "0"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "--contexts: must be >= 1" in run.stderr
    run = subprocess.run([sys.executable, "-m", "criticalkv.cli", "train-surrogate", "--text", "/nonexistent/x.txt"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "no such file" in run.stderr
    run = subprocess.run([sys.executable, "-m", "criticalkv.cli", "train-surrogate", "--domains", "docs,poetry"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "unknown domain 'poetry'" in run.stderr
    run = subprocess.run([sys.executable, "-m", "criticalkv.cli", "train-surrogate", "--domains", "docs", "--text",
                          __file__], capture_output=True, text=True)
    assert run.returncode == 2 and "--domains and --text exclude each other" in run.stderr


@pytest.mark.slow
def test_the_shipped_surrogate_is_the_bundled_models_and_ranks_a_fresh_context():
    # a Britannica context (the evaluations' haystack, never trained on): S_hat against the re-read's own score
    from criticalkv.eval.haystack import haystack_sentences
    from criticalkv.hf.loading import load_model
    from criticalkv.hf.reconstruct import cache_of, reconstruction_scores
    from criticalkv.methods.kvzip import ReconstructionPrompt

    model, tokenizer = load_model()
    surrogate = find_surrogate(model)
    assert sorted(p.name for p in PACKAGED_DIR.glob("*.npz")) == ["smollm2-135m.npz"]
    prompt_ = ReconstructionPrompt.from_tokenizer(tokenizer)
    ids = list(prompt_.opening) + tokenizer(" ".join(haystack_sentences()[:40]), add_special_tokens=False)["input_ids"]
    ids = ids[:512]
    hidden = {}

    def keep(i):
        def hook(module, args, kwargs, output):
            hidden.setdefault(i, kwargs["hidden_states"])

        return hook

    handles = [layer.self_attn.register_forward_hook(keep(i), with_kwargs=True) for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), use_cache=True)
    finally:
        for h in handles:
            h.remove()
    cache = out.past_key_values
    truth = reconstruction_scores(model, cache_of([layer.keys for layer in cache.layers],
                                                  [layer.values for layer in cache.layers], model.config),
                                  ids, KVPolicy("kvzip"), prompt_)
    skip = len(prompt_.opening)
    rho = [spearman(surrogate.scores(i, hidden[i])[0, g, skip:].numpy(), truth[i][0, g, skip:].numpy())
           for i in range(len(truth)) for g in range(surrogate.num_kv_heads)]
    assert np.mean(rho) > 0.5, np.mean(rho)


def test_the_default_context_policy_scores_with_the_models_surrogate(tmp_path):
    # build_engine's default context policy: the model folder's surrogate found, no reconstruct graph written, the
    # surrogate's identity in the manifest (without one it falls back: tests/runtime/test_engine_dir.py)
    from criticalkv.build import build_engine
    from criticalkv.export import BuildConfig
    from criticalkv.export.exporter import DEFAULT_CONTEXT_POLICY
    from criticalkv.hf.loading import load_model
    from criticalkv.policy import parse_policy_spec
    from criticalkv.runtime.manifest import read_manifest
    from export.tiny_engine import save_tiny_checkpoint

    folder = save_tiny_checkpoint(tmp_path / "model", "llama", seed=8)
    model, _ = load_model(str(folder))
    samples = collect(model, [prompt(120, seed=s) for s in range(3)], 32, KVPolicy("kvzip", kvzip_chunk=64))
    weight, bias, metrics = fit(samples, held_out=0.34)
    KVzipSurrogate(weight, bias, fingerprint(model), metrics).save(folder / FOLDER_FILE)
    policy = KVPolicy("criticalkv", budget=40, window=8)
    config = BuildConfig(max_input_len=256, max_new_tokens=16, max_batch_size=1, attention_chunk=32, extend_chunk=32,
                         max_question_len=24)
    messages = []
    output = build_engine(tmp_path / "engine", policy, config, model=str(folder), tensorrt=False, log=messages.append)
    manifest = read_manifest(output, verify=True)
    assert KVPolicy.from_dict(manifest["context_policy"]) == parse_policy_spec(
        DEFAULT_CONTEXT_POLICY, KVPolicy(budget=40, window=8))
    assert manifest["streams"]["kvzip_score"]["model"] == fingerprint(model)
    assert "reread" not in manifest["onnx"]["files"] and "reread_ort" not in manifest["onnx"]["files"]
    assert not any("no KVzip surrogate" in m for m in messages)
    assert any("KVzip surrogate (no re-read)" in m for m in messages)


@pytest.mark.parametrize("name", ["layer-kvzip-criticalkv", "kvzip"])
def test_the_tensorrt_flavour_computes_the_surrogate_scores_in_the_graph(trained, tmp_path, name):
    """kvzip_score=surrogate has TensorRT graphs: the prefill computes S_hat = exp(h W + b) of every entry from each
    layer's attention input and passes it to the plugin nodes' scores input (CriticalKVScore per layer and one
    CriticalKVSelectModel for a model-level policy, CriticalKVSelect otherwise); the select graph takes it as its
    scores.{l} inputs. The graph's scores of layer 1 (the plugin nodes cut off) equal the surrogate's on the
    PyTorch model's hidden states. kvzip_score=reread keeps no TensorRT flavour (a reconstruction pass)."""
    import onnx
    import onnxruntime as ort
    from onnx.utils import Extractor

    from criticalkv.export.model_select import tensorrt_refusal
    from criticalkv.export.tensorrt_rules import check_tensorrt_model

    model, surrogate = trained
    policy = KVPolicy(name, budget=40, window=8, kvzip_score="surrogate")
    folder = export_tiny_engine(model, policy, tmp_path / "e", extend_chunk=32)
    layers = model.config.num_hidden_layers
    model_level = name.startswith("layer-")
    expected = ["CriticalKVScore"] * layers + ["CriticalKVSelectModel"] if model_level else ["CriticalKVSelect"] * layers
    graphs = {}
    for graph in ("prefill_tensorrt", "select_tensorrt"):
        g = onnx.load(str(folder / f"{graph}.onnx"), load_external_data=False)
        nodes = [n for n in g.graph.node if n.domain == "ai.criticalkv"]
        assert [n.op_type for n in nodes] == expected, graph
        assert all(len(n.input) == 7 for n in nodes[:layers]), "queries .. kv_budget, scores"
        assert list(g.functions) == [] and check_tensorrt_model(g) == [], graph
        graphs[graph] = (g, nodes)
    select_inputs = [i.name for i in graphs["select_tensorrt"][0].graph.input]
    assert [n.input[6] for n in graphs["select_tensorrt"][1][:layers]] == [f"scores.{i}" for i in range(layers)]
    assert all(f"scores.{i}" in select_inputs for i in range(layers))
    # the prefill's scores of layer 1, computed by ONNX Runtime from the graph cut before the plugin nodes
    prefill = onnx.load(str(folder / "prefill_tensorrt.onnx"))
    scores_name = graphs["prefill_tensorrt"][1][1].input[6]
    prefill.graph.value_info.append(onnx.helper.make_tensor_value_info(scores_name, onnx.TensorProto.FLOAT, None))
    sub = Extractor(prefill).extract_model(["input_ids", "attention_mask", "position_ids"], [scores_name])
    ids = prompt(90, seed=4)
    run = ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, 90), np.int64),
             "position_ids": np.arange(90, dtype=np.int64)[None]}
    feeds = {i.name: feeds[i.name] for i in run.get_inputs()}
    (got,) = run.run(None, feeds)
    hidden = {}

    def keep(module, args, kwargs, output):
        hidden.setdefault(1, kwargs["hidden_states"][0].double())  # returns None: the output unchanged

    handle = model.model.layers[1].self_attn.register_forward_hook(keep, with_kwargs=True)
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        handle.remove()
    want = np.exp(hidden[1].numpy() @ surrogate.weight[1].astype(np.float64) + surrogate.bias[1]).T[None]
    assert got.shape == (1, model.config.num_key_value_heads, 90)
    np.testing.assert_allclose(got, want, rtol=2e-4)
    assert "context reconstruction" in tensorrt_refusal(KVPolicy(name, kvzip_score="reread"), layers)
