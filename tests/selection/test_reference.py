"""Properties of the reference ``select_layer``: against the loop oracle, windows, budgets, ties, padding."""

import pytest
import torch

from criticalkv import KVPolicy, gather_kv, select_layer
from criticalkv.selection import max_kept_per_head
from helpers import random_layer
from naive import naive_select
from policies import POLICY_CASES, make_policy

IDS = [c[0] for c in POLICY_CASES]


@pytest.mark.parametrize("case", POLICY_CASES, ids=IDS)
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4)], ids=["gqa9x3", "mha4"])
@pytest.mark.parametrize("seed", range(2))
def test_matches_the_loop_oracle(case, heads, kv_heads, seed):
    q, k, v, o = random_layer(heads=heads, kv_heads=kv_heads, n=80, head_dim=8, hidden=24, window=8, seed=seed)
    for layer, num_layers in ((0, 1), (0, 4), (3, 4)):
        policy = make_policy(case[1], budget=24, window=8)
        sel = select_layer(policy, q, k, v, o, layer, num_layers)
        expect = naive_select(policy, q[0], k[0], v[0], o, layer, num_layers)
        got = [[i for i in row if i >= 0] for row in sel.indices[0].tolist()]
        assert got == expect
        assert sel.lengths[0].tolist() == [len(e) for e in expect]


@pytest.mark.parametrize("case", POLICY_CASES, ids=IDS)
def test_window_kept_budget_respected_and_deterministic(case):
    q, k, v, o = random_layer(batch=2, n=200, window=16, seed=3)
    policy = make_policy(case[1], budget=48, window=16)
    sel = select_layer(policy, q, k, v, o, 1, 4)
    again = select_layer(policy, q, k, v, o, 1, 4)
    assert torch.equal(sel.indices, again.indices)
    mask = sel.mask(200)
    if policy.name == "streamingllm":
        assert mask[..., :4].all() and mask[..., -44:].all() and (sel.lengths == 48).all()
    elif policy.name != "full":
        assert mask[..., -16:].all(), "the window must always be kept"
    valid = sel.indices >= 0
    assert (sel.indices[:, :, 1:][valid[:, :, 1:]] > sel.indices[:, :, :-1][valid[:, :, 1:]]).all(), "ascending"
    assert (valid.sum(-1) == sel.lengths).all()
    assert sel.lengths.max() <= max_kept_per_head(policy, 200, 3, 1, 4)
    if policy.base in ("snapkv", "streamingllm"):
        assert (sel.lengths == 48).all()
    if policy.base in ("adakv", "laprox"):
        assert (sel.lengths.sum(-1) == 3 * 48).all(), "a layer's heads share H_kv * budget"


@pytest.mark.parametrize("case", POLICY_CASES, ids=IDS)
def test_budget_at_least_prompt_keeps_everything(case):
    q, k, v, o = random_layer(n=40, window=8, seed=1)
    for budget in (40, 64):
        sel = select_layer(make_policy(case[1], budget=budget, window=8), q, k, v, o, 2, 4)
        assert sel.lengths.tolist() == [[40, 40, 40]]
        assert sel.indices[0, 0].tolist() == list(range(40))


def test_ties_go_to_the_lower_index():
    # Zero keys: uniform attention, so every older token has the same score; zero values: the same
    # critical score. Both stages must then keep the lowest positions.
    q, k, v, o = random_layer(n=64, window=8, seed=0)
    k, v = torch.zeros_like(k), torch.zeros_like(v)
    for name in ("snapkv", "criticalkv", "pyramidkv"):
        sel = select_layer(KVPolicy(name, budget=24, window=8), q, k, v, o)
        assert sel.indices[0, 0].tolist() == list(range(16)) + list(range(56, 64)), name
    sel = select_layer(KVPolicy("adakv", budget=24, window=8, ada_floor=0.25), q, k, v, o)
    # r = 16, floor 4 per head; all 3 * 12 shared slots go to the lowest head (52 candidates left)
    assert sel.lengths[0].tolist() == [8 + 4 + 36, 8 + 4, 8 + 4]
    assert sel.indices[0, 2, :4].tolist() == [0, 1, 2, 3]


def test_padded_batch_equals_each_sequence_alone():
    q, k, v, o = random_layer(batch=3, n=150, window=8, seed=5)
    lengths = torch.tensor([150, 101, 60])
    g = torch.Generator().manual_seed(9)
    for b, length in enumerate(lengths.tolist()):  # garbage in the padding must not matter
        k[b, :, : 150 - length] = torch.randn(3, 150 - length, 16, generator=g) * 50
        v[b, :, : 150 - length] = torch.randn(3, 150 - length, 16, generator=g) * 50
    for case in POLICY_CASES:
        policy = make_policy(case[1], budget=32, window=8)
        batched = select_layer(policy, q, k, v, o, 1, 3, prompt_lengths=lengths)
        for b, length in enumerate(lengths.tolist()):
            pad = 150 - length
            alone = select_layer(policy, q[b : b + 1], k[b : b + 1, :, pad:], v[b : b + 1, :, pad:], o, 1, 3)
            for g_ in range(3):
                got = batched.indices[b, g_, : batched.lengths[b, g_]] - pad
                want = alone.indices[0, g_, : alone.lengths[0, g_]]
                assert torch.equal(got, want), (case[0], b, g_)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs_accumulate_in_fp32(dtype):
    q, k, v, o = random_layer(n=120, window=8, seed=2, dtype=dtype)
    for name in ("criticalkv", "ada-criticalkv", "laprox"):
        policy = KVPolicy(name, budget=40, window=8)
        low = select_layer(policy, q, k, v, o)
        upcast = select_layer(policy, q.float(), k.float(), v.float(), o.float())
        assert torch.equal(low.indices, upcast.indices)


def test_gather_returns_the_kept_rows():
    q, k, v, o = random_layer(n=90, window=8, seed=4)
    sel = select_layer(KVPolicy("adakv", budget=24, window=8), q, k, v, o)
    kk, vv = gather_kv(sel, k, v)
    for g in range(3):
        idx = sel.indices[0, g, : sel.lengths[0, g]]
        assert torch.equal(kk[0, g, : len(idx)], k[0, g, idx]) and torch.equal(vv[0, g, : len(idx)], v[0, g, idx])
        assert (kk[0, g, len(idx) :] == 0).all()


@pytest.mark.gpu
def test_cuda_matches_cpu():
    q, k, v, o = random_layer(batch=2, n=2000, window=32, seed=7, heads=8, kv_heads=2, head_dim=64, hidden=512)
    for case in POLICY_CASES:
        policy = make_policy(case[1], budget=256, window=32)
        cpu = select_layer(policy, q, k, v, o)
        gpu = select_layer(policy, q.cuda(), k.cuda(), v.cuda(), o.cuda())
        # fp32 reductions differ in order between devices: near-ties may swap, nothing else
        overlap = (cpu.mask(2000) & gpu.mask(2000).cpu()).sum() / cpu.lengths.sum()
        assert overlap >= 0.99, case[0]
