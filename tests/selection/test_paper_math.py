"""The reference against the paper's mathematics (CriticalKV, Theorems 2 and 3; alpha = 1)."""

import itertools

import pytest
import torch

from criticalkv import KVPolicy, select_layer
from criticalkv.selection import layer_scores, topk_mask, value_projection_norms
from helpers import random_layer
from policies import TWO_STAGE_BASES


def single_query_case(n, head_dim=8, hidden=24, seed=0, sharpness=3.0):
    """One query head attending from the last position (w = 1) over n keys."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, 1, head_dim, generator=g, dtype=torch.float64) * sharpness
    k = torch.randn(1, 1, n, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(1, 1, n, head_dim, generator=g, dtype=torch.float64) * torch.rand(1, 1, n, 1, generator=g, dtype=torch.float64) * 4
    o = torch.randn(hidden, head_dim, generator=g, dtype=torch.float64) / head_dim**0.5
    attn = torch.softmax((q[0, 0, 0] @ k[0, 0].T) / head_dim**0.5, dim=-1)  # A, [n]
    projected = v[0, 0] @ o.T  # V W_O, [n, hidden]
    return q, k, v, o, attn, projected


def perturbation_and_bound(attn, projected, keep):
    """L = ||(A - A') V W_O||_1 (Theorem 1's A') and Theorem 2's bound theta."""
    kept_mass = (attn * keep).sum()
    attn_kept = attn * keep / kept_mass
    loss = ((attn - attn_kept) @ projected).abs().sum()
    norms = projected.abs().sum(-1)
    theta = (attn * norms).sum() - (2 - 1 / kept_mass) * (keep * attn * norms).sum()
    return loss, theta


@pytest.mark.parametrize("seed", range(20))
def test_theorem2_bound_holds_for_random_and_operator_selections(seed):
    n = 40
    q, k, v, o, attn, projected = single_query_case(n, seed=seed, sharpness=1.0 + seed % 4)
    g = torch.Generator().manual_seed(1000 + seed)
    keeps = [(torch.rand(n, generator=g) < frac).double() for frac in (0.1, 0.3, 0.6, 0.9)]
    for name in ("snapkv", "criticalkv"):
        sel = select_layer(KVPolicy(name, budget=12, window=1, pool_kernel=1), q, k, v, o)
        keeps.append(sel.mask(n)[0, 0].double())
    for keep in keeps:
        keep[-1] = 1.0  # at least one entry
        loss, theta = perturbation_and_bound(attn, projected, keep)
        assert loss <= theta + 1e-12
    # the operator's value norms are the ones the bound is built from
    norms = value_projection_norms(v, o, num_heads=1)[0, 0]
    torch.testing.assert_close(norms.double(), projected.abs().sum(-1), rtol=1e-5, atol=1e-6)


def test_theorem3_stage2_is_the_bound_minimising_subset():
    """Brute force: given stage 1 (sigma > 0.5), stage 2's picks minimise theta-hat over all subsets."""
    checked = 0
    for seed in range(60):
        n, budget = 12, 6
        q, k, v, o, attn, projected = single_query_case(n, seed=seed, sharpness=4.0)
        policy = KVPolicy("criticalkv", budget=budget, window=1, pool_kernel=1, alpha=0.4, epsilon=0.0, stage2_scores="raw")
        kept = set(select_layer(policy, q, k, v, o).indices[0, 0].tolist())
        m, r = n - 1, budget - 1
        b1 = 2  # ceil(0.4 * 5)
        stage1 = set(sorted(range(m), key=lambda i: (-attn[i].item(), i))[:b1]) | {n - 1}
        assert stage1 <= kept
        sigma = attn[sorted(stage1)].sum().item()
        if sigma <= 0.5:  # Assumption 1 fails; Theorem 3 says nothing
            continue
        norms = projected.abs().sum(-1)
        rest = [i for i in range(m) if i not in stage1]

        def theta_hat(subset):
            return -(2 - 1 / sigma) * sum(attn[i].item() * norms[i].item() for i in subset)

        best = min(itertools.combinations(rest, r - b1), key=theta_hat)
        assert kept - stage1 == set(best)
        checked += 1
    assert checked >= 20, f"only {checked} cases satisfied Assumption 1"


@pytest.mark.parametrize("two_stage, base", TWO_STAGE_BASES)
@pytest.mark.parametrize("seed", range(4))
def test_alpha_one_is_exactly_the_base_method(two_stage, base, seed):
    q, k, v, o = random_layer(batch=2, n=120, seed=seed)
    lengths = torch.tensor([120, 97])
    for layer in range(3):
        a = select_layer(KVPolicy(two_stage, budget=40, window=8, alpha=1.0), q, k, v, o, layer, 3, lengths)
        b = select_layer(KVPolicy(base, budget=40, window=8), q, k, v, o, layer, 3, lengths)
        assert torch.equal(a.indices, b.indices) and torch.equal(a.lengths, b.lengths)
    c = select_layer(KVPolicy(two_stage, budget=40, window=8), q, k, v, o, 0, 3, lengths)
    b = select_layer(KVPolicy(base, budget=40, window=8), q, k, v, o, 0, 3, lengths)
    assert not torch.equal(c.indices, b.indices), "stage 2 changed nothing: the test would not see a bug"


@pytest.mark.parametrize("alpha", [0.0, 0.25, 0.5, 0.9])
@pytest.mark.parametrize("seed", range(3))
def test_stage1_picks_are_always_kept(alpha, seed):
    q, k, v, o = random_layer(n=150, seed=seed)
    policy = KVPolicy("criticalkv", budget=48, window=8, alpha=alpha)
    kept = select_layer(policy, q, k, v, o).mask(150)[0, :, :142]
    scores = layer_scores(policy, q, k, v, o)
    b1 = {0.0: 0, 0.25: 10, 0.5: 20, 0.9: 36}[alpha]  # ceil(alpha * r), r = 40
    stage1 = topk_mask(scores.attention[0], b1)
    assert stage1.sum() == 3 * b1
    assert (kept | ~stage1).all()
    # stage 2 of the rest is the top (r - b1) by the critical score among the non-stage-1 tokens
    stage2 = topk_mask(scores.critical[0], 40 - b1, ~stage1)
    assert torch.equal(kept, stage1 | stage2)
