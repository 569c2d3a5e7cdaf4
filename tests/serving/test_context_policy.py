"""The context policy: contexts of the context cache compressed with another policy than the engine's (kvzip-criticalkv
re-reads each context through the reconstruct graph), against the PyTorch path token for token and entry for entry."""

import numpy as np
import pytest
import torch

from criticalkv import KVPolicy
from criticalkv.hf import generate, prefill_and_compress
from criticalkv.request import Request, SamplingParams
from criticalkv.runtime import Engine, EngineError
from criticalkv.serving import Scheduler
from export.tiny_engine import export_tiny_engine
from hf.conftest import tiny_model

ENGINE_POLICY = KVPolicy("criticalkv", budget=40, window=8)
CONTEXT_POLICY = KVPolicy("kvzip-criticalkv", budget=40, window=8, kvzip_chunk=64)


def prompt(n, seed=1):
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=4)


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
    folder = export_tiny_engine(model, ENGINE_POLICY, tmp_path_factory.mktemp("ctx"), context_policy=CONTEXT_POLICY,
                                max_batch_size=2, extend_chunk=32, max_question_len=24)
    engine = Engine.load(folder, threads=1)
    yield engine
    engine.close()


def context_request(context, question, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(question, params, None, context_token_ids=context)


def kept(selection, head):
    return [i for i in selection.indices[0, head].tolist() if i >= 0]


def test_a_context_is_kept_as_the_pytorch_path_keeps_it(engine, model):
    assert engine.context_policy == CONTEXT_POLICY and engine.policy_for(True) == CONTEXT_POLICY
    assert engine.policy_for(False) == ENGINE_POLICY and engine.method_data["kvzip"]["prompt"] is not None
    context = prompt(150, seed=21)
    got = engine.prefill(0, Request(context), context=True)
    engine.release(0)
    ref = prefill_and_compress(model, torch.tensor([context]), CONTEXT_POLICY)
    assert got.scoring_s > 0
    for layer, selection in enumerate(ref.selections):
        assert got.kept_lengths[layer].tolist() == selection.lengths[0].tolist()
        for head in range(2):
            ids = got.kept_indices[layer][head]
            assert ids[ids >= 0].tolist() == kept(selection, head), f"layer {layer} head {head}"
    # a prompt (no context) is still the engine's own policy, inside the prefill graph
    plain = engine.prefill(1, Request(context))
    engine.release(1)
    own = prefill_and_compress(model, torch.tensor([context]), ENGINE_POLICY)
    assert [x.tolist() for x in plain.kept_lengths] == [s.lengths[0].tolist() for s in own.selections]
    assert plain.kept_indices[0][0][plain.kept_indices[0][0] >= 0].tolist() == kept(own.selections[0], 0)


def test_the_scheduler_compresses_contexts_with_the_context_policy(engine, model):
    context, questions = prompt(150, seed=31), [prompt(9, seed=32), prompt(7, seed=33)]
    expected = [generate(model, torch.tensor([context]), CONTEXT_POLICY, 6, question_ids=torch.tensor([q])).tokens[0]
                for q in questions]
    assert [engine.generate([context], 6, stop_token_ids=[], questions=[q]).tokens[0] for q in questions] == expected
    scheduler = Scheduler(engine, prefill_chunk=32, context_cache_dtype="float32")  # exact copies: PyTorch's tokens
    try:
        assert scheduler.context_selection and scheduler.context_policy == CONTEXT_POLICY
        outs = [scheduler.submit(context_request(context, q, 6)).result(120) for q in questions]
        assert [o.token_ids for o in outs] == expected and [o.context_cache_hit for o in outs] == [False, True]
    finally:
        scheduler.close()
    # the engine's own policy, one prefill run; exact copies
    own = Scheduler(engine, prefill_chunk=0, context_policy="engine", context_cache_dtype="float32")
    try:
        assert not own.context_selection
        out = own.submit(context_request(context, questions[0], 6)).result(120)
        ref = generate(model, torch.tensor([context]), ENGINE_POLICY, 6, question_ids=torch.tensor([questions[0]]))
        assert out.token_ids == ref.tokens[0]
    finally:
        own.close()
    with pytest.raises(EngineError, match="rebuild it with --context-policy snapkv"):
        Scheduler(engine, context_policy="snapkv")
    named = Scheduler(engine, context_policy="kvzip-criticalkv")
    assert named.context_selection
    named.close()


def test_the_bench_reports_what_the_reconstruction_costs(engine):
    from benchmarks.cached import SCORING_GOAL, render, scoring_cost

    cost = scoring_cost(engine.folder, [prompt(150, seed=41), prompt(120, seed=42)], threads=1)
    # the context policy with the knobs it does not take at their defaults, which name it back
    assert cost["context_policy"] == "kvzip-criticalkv:kvzip_chunk=64" and len(cost["rounds"]) == 2
    from criticalkv.policy import parse_policy_spec

    assert parse_policy_spec(cost["context_policy"], KVPolicy(budget=40, window=8)) == CONTEXT_POLICY
    for row in cost["rounds"]:
        assert row["prefill_s"] > 0 and row["scoring_s"] > 0 and row["selection_s"] > 0
    assert cost["ratio"]["p50"] > 0 and cost["target"]["goal"] == SCORING_GOAL
    from criticalkv.bench import machine
    from benchmarks.cached import summarize_rounds

    results = machine.header("python -m benchmarks.cached --scoring-cost")
    results["settings"] = {"isl": 150, "question_tokens": 8, "osl": 2, "repeats": 2, "warmup": 0, "chat": False}
    results["runs"] = [{"engine": {"label": "criticalkv b=40"}, "scoring_cost": cost, "cached_context": summarize_rounds([])}]
    assert "| criticalkv b=40 | kvzip-criticalkv:kvzip_chunk=64 |" in render(results)


def test_a_context_that_starts_with_the_chat_opening_is_re_read_after_it(engine, model):
    # kvpress's prefix_length: the re-read graph scores [opening, n) with the first sink_tokens as sinks, the same
    # entries as the PyTorch path given the same prompt
    from criticalkv.methods.kvzip import ReconstructionPrompt

    context = prompt(140, seed=51)
    saved = engine.method_data
    engine.method_data = {"kvzip": {"prompt": ReconstructionPrompt(first=(3, 4), later=(5,), suffix=(6,),
                                                                   opening=tuple(context[:9])).to_dict()}}
    engine._scorings.clear()
    try:
        got = engine.prefill(0, Request(context), context=True)
        engine.release(0)
    finally:
        engine.method_data = saved
        engine._scorings.clear()
    ref = prefill_and_compress(model, torch.tensor([context]), CONTEXT_POLICY,
                               reconstruction=ReconstructionPrompt(first=(3, 4), later=(5,), suffix=(6,),
                                                                   opening=tuple(context[:9])))
    bare = prefill_and_compress(model, torch.tensor([context]), CONTEXT_POLICY)
    assert any(not np.array_equal(got.kept_indices[i][h][got.kept_indices[i][h] >= 0], kept(s, h))
               for i, s in enumerate(bare.selections) for h in range(2)), "the opening changed nothing"
    for layer, selection in enumerate(ref.selections):
        for head in range(2):
            ids = got.kept_indices[layer][head]
            assert ids[ids >= 0].tolist() == kept(selection, head), f"layer {layer} head {head}"


def test_the_context_policy_flag_names_one_the_engine_has():
    from criticalkv.serving.scheduler import check_context_policy

    assert check_context_policy("criticalkv", "kvzip", None) and check_context_policy("criticalkv", "kvzip", "kvzip")
    assert not check_context_policy("criticalkv", "kvzip", "engine")
    assert not check_context_policy("criticalkv", "kvzip", "criticalkv")
    assert not check_context_policy("criticalkv", None, None) and not check_context_policy("kvzip", None, "kvzip")
    with pytest.raises(EngineError, match="built with its own 'criticalkv' and the context policy 'kvzip'; rebuild"):
        check_context_policy("criticalkv", "kvzip", "defensivekv")
    with pytest.raises(EngineError, match="built with its own 'snapkv'; rebuild it with --context-policy kvzip"):
        check_context_policy("snapkv", None, "kvzip")


@pytest.mark.parametrize("name, knobs", [("layer-kvzip", dict()), ("layer-kvzip", dict(ada_floor=0.0, head_cap_ratio=2.0)),
                                         ("layer-kvzip-criticalkv", dict())])
def test_layer_kvzip_engine_keeps_what_the_pytorch_path_keeps(model, tmp_path, name, knobs):
    # the model-level allocation (CriticalKVScore nodes taking the reconstruction's scores, CriticalKVSelectModel; with
    # CriticalKV's two stages inside each head's share: the critical scores as the nodes' second output / inputs)
    policy = KVPolicy(name, budget=40, window=8, kvzip_chunk=64, **knobs)
    engine = Engine.load(export_tiny_engine(model, policy, tmp_path / "e", extend_chunk=32, max_question_len=24),
                         threads=1)
    try:
        ids = torch.tensor([prompt(150, seed=61)])
        ref = generate(model, ids, policy, max_new_tokens=8)
        got = engine.generate(ids.numpy(), max_new_tokens=8, stop_token_ids=[])
    finally:
        engine.close()
    assert got.tokens[0] == ref.tokens[0]
    for layer, selection in enumerate(ref.prefill.selections):
        for head in range(2):
            assert got.kept(layer, 0, head) == kept(selection, head), f"layer {layer} head {head}"
    assert len({tuple(s.lengths[0].tolist()) for s in ref.prefill.selections}) > 1  # shares differ across layers


@pytest.mark.parametrize("own, context", [
    (KVPolicy("layer-defensivekv", budget=40, window=8), KVPolicy("kvzip", budget=40, window=8, kvzip_chunk=64)),
    (KVPolicy("criticalkv", budget=40, window=8), KVPolicy("layer-kvzip", budget=40, window=8, kvzip_chunk=64,
                                                           head_cap_ratio=2.0)),
    (KVPolicy("criticalkv", budget=40, window=8), KVPolicy("layer-kvzip-criticalkv", budget=40, window=8,
                                                           kvzip_chunk=64)),
], ids=["model-level-engine", "model-level-context", "model-level-context-two-stage"])
def test_a_context_policy_of_the_other_level_exports_and_keeps_the_pytorch_paths_entries(model, tmp_path, own, context):
    # the context's select graph is validated as its own policy's kind (per-layer nodes, or the model-level pair)
    folder = export_tiny_engine(model, own, tmp_path / "e", context_policy=context, extend_chunk=32, max_question_len=24)
    engine = Engine.load(folder, threads=1)
    try:
        ids = prompt(150, seed=23)
        got = engine.prefill(0, Request(ids), context=True)
        engine.release(0)
    finally:
        engine.close()
    ref = prefill_and_compress(model, torch.tensor([ids]), context)
    for layer, selection in enumerate(ref.selections):
        for head in range(2):
            kept_ids = got.kept_indices[layer][head]
            assert kept_ids[kept_ids >= 0].tolist() == kept(selection, head), f"layer {layer} head {head}"


def test_a_context_threshold_keeps_what_the_score_ranks_above_it(engine, model):
    # the budget follows the context: KVzip's score (the PyTorch path's) above the threshold, at most the budget
    from criticalkv.eval.engine import ScoreBank, shared_prefill
    from criticalkv.methods.budget import adaptive_budget

    context, question = prompt(150, seed=41), prompt(8, seed=42)
    ids = torch.tensor([context])
    scores = ScoreBank(shared_prefill(model, ids, [8]), model).external_scores(CONTEXT_POLICY)
    older = np.concatenate([s[..., : 150 - 8].flatten().numpy() for s in scores])
    threshold = float(np.quantile(older, 0.93))
    budget = max(CONTEXT_POLICY.min_budget, adaptive_budget(scores, threshold, 8, 40))
    assert CONTEXT_POLICY.min_budget < budget < 40  # between: the threshold, not the cap, decides
    want = generate(model, ids, CONTEXT_POLICY.replace(budget=budget), 6, question_ids=torch.tensor([question]))
    scheduler = Scheduler(engine, prefill_chunk=32, context_cache_dtype="float32")  # exact copies: PyTorch's tokens
    try:
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        out = scheduler.submit(Request(question, params, None, context_token_ids=context,
                                       context_threshold=threshold)).result(120)
        assert out.token_ids == want.tokens[0]
        plain = scheduler.submit(Request(question, params, None, context_token_ids=context)).result(120)
        assert plain.context_cache_hit is False  # another budget rule: another cache entry
        assert 0 < out.kv_bytes_kept < plain.kv_bytes_kept
        capped = scheduler.submit(Request(question, params, None, context_token_ids=context,
                                          context_threshold=1e-12)).result(120)
        assert capped.token_ids == plain.token_ids  # everything scores above it: the budget itself
    finally:
        scheduler.close()
    with pytest.raises(Exception, match="context_threshold"):
        engine.check(Request(question, SamplingParams(max_tokens=2), None, context_threshold=0.1))
    with pytest.raises(Exception, match="context_threshold"):
        Request(question, SamplingParams(max_tokens=2), None, context_token_ids=context, context_threshold=1.5)
