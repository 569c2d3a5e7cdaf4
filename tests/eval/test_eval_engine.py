"""The shared prefill: scores, selections and generated tokens identical to the reference paths."""

import pytest
import torch

from criticalkv import KVPolicy, select_layer
from criticalkv.eval.engine import ScoreBank, SharedPrefill, decode, select_all_layers, select_from_bank, shared_prefill
from criticalkv.hf import generate
from criticalkv.selection import layer_scores
from helpers import random_layer
from policies import POLICY_CASES, make_policy

IDS = [c[0] for c in POLICY_CASES]
SCORED = [c for c in POLICY_CASES if c[1]["name"] not in ("full", "streamingllm")]  # policies that compute scores


def bank_for(q, k, v, o, layers=1):
    n = k.shape[2]
    prefill = SharedPrefill(
        input_ids=torch.zeros(1, n, dtype=torch.int64), logits=torch.zeros(1, 4), keys=[k] * layers,
        values=[v] * layers, queries={q.shape[2]: [q] * layers}, o_proj=[o] * layers, prefill_s=0.0,
    )
    return ScoreBank(prefill)


@pytest.mark.parametrize("case", SCORED, ids=[c[0] for c in SCORED])
def test_bank_scores_are_layer_scores_bit_for_bit(case):
    q, k, v, o = random_layer(n=120, window=8, seed=11)
    policy = make_policy(case[1], budget=40, window=8)
    bank = bank_for(q, k, v, o)
    got = bank.scores(policy, 0)
    want = layer_scores(policy, q, k, v, o, torch.zeros(1, dtype=torch.int64))
    assert torch.equal(got.attention, want.attention)
    for name in ("critical", "laprox"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))


@pytest.mark.parametrize("case", POLICY_CASES, ids=IDS)
@pytest.mark.parametrize("budget", [12, 40, 200])
def test_selection_from_the_bank_is_select_layer(case, budget):
    q, k, v, o = random_layer(n=150, window=8, seed=12)
    policy = make_policy(case[1], budget=budget, window=8)
    bank = bank_for(q, k, v, o, layers=3)
    for layer in range(3):  # pyramid budgets depend on the layer
        got = select_from_bank(policy, bank, layer)
        want = select_layer(policy, q, k, v, o, layer, 3)
        assert torch.equal(got.indices, want.indices) and torch.equal(got.lengths, want.lengths)


def test_one_bank_serves_many_policies_and_budgets():
    q, k, v, o = random_layer(n=150, window=8, seed=13)
    bank = bank_for(q, k, v, o)
    for budget in (16, 48):
        for case in POLICY_CASES:
            policy = make_policy(case[1], budget=budget, window=8)
            assert torch.equal(select_from_bank(policy, bank, 0).indices, select_layer(policy, q, k, v, o).indices)


@pytest.mark.parametrize("case", POLICY_CASES, ids=IDS)
def test_shared_prefill_decodes_the_tokens_of_generate(model, case):
    ids = torch.randint(2, len_vocab(model), (1, 140), generator=torch.Generator().manual_seed(7))
    policy = make_policy(case[1], budget=40, window=8)
    prefill = shared_prefill(model, ids, [8])
    out = decode(model, prefill, select_all_layers(policy, ScoreBank(prefill)), 12)
    ref = generate(model, ids, policy, max_new_tokens=12)
    assert out.tokens == ref.tokens[0]
    assert [torch.equal(a.indices, b.indices) for a, b in zip(select_all_layers(policy, ScoreBank(prefill)), ref.prefill.selections)] == [True] * 2


def test_stop_tokens_and_a_forced_first_step(model):
    ids = torch.randint(2, len_vocab(model), (1, 90), generator=torch.Generator().manual_seed(8))
    prefill = shared_prefill(model, ids, [8])
    sel = select_all_layers(KVPolicy("snapkv", budget=32, window=8), ScoreBank(prefill))
    free = decode(model, prefill, sel, 10).tokens
    stopped = decode(model, prefill, sel, 10, stop_token_ids=[free[2]]).tokens
    assert stopped == free[: free.index(free[2]) + 1]
    seen = []
    one = decode(model, prefill, sel, 1, first_step=lambda: _Counter(seen), force_first_step=True)
    assert one.tokens == free[:1] and one.steps == 1 and seen == [1]
    assert decode(model, prefill, sel, 1).steps == 0


class _Counter:
    def __init__(self, seen):
        self.seen = seen

    def __enter__(self):
        self.seen.append(1)

    def __exit__(self, *exc):
        return False


def len_vocab(model):
    return model.config.vocab_size


@pytest.mark.parametrize("case", POLICY_CASES, ids=IDS)
def test_question_agnostic_shared_prefill_decodes_the_tokens_of_generate(model, case):
    # the context compressed without its question, then the question through the cache: the shared-prefill
    # evaluation path == criticalkv.hf.generate(context, question_ids=question)
    ids = torch.randint(2, len_vocab(model), (1, 150), generator=torch.Generator().manual_seed(9))
    context, question = ids[:, :140], ids[:, 140:]
    policy = make_policy(case[1], budget=40, window=8)
    prefill = shared_prefill(model, context, [8])
    out = decode(model, prefill, select_all_layers(policy, ScoreBank(prefill)), 12, question_ids=question)
    assert out.tokens == generate(model, context, policy, max_new_tokens=12, question_ids=question).tokens[0]
