"""CriticalKV's pruned stage 2 (criticalkv/methods/pruned.py) keeps exactly what the unpruned stage 2 keeps."""


import pytest
import torch

from criticalkv import KVPolicy, select_layer
from criticalkv.methods import pruned
from criticalkv.methods.pruned import BoundTerms, l1_norms_rows, pruned_topk_row, stop_margin
from criticalkv.selection.scores import head_output_projection, value_projection_norms
from helpers import random_layer
from policies import POLICY_CASES, make_policy

IDS = [c[0] for c in POLICY_CASES]


def unpruned():
    return pruned.pruning(False)


def both(policy, q, k, v, o, layer_idx=0, num_layers=1, lengths=None):
    """(pruned, unpruned) selections and the fraction of exact norms the pruned one computed."""
    pruned.STATS.reset()
    a = select_layer(policy, q, k, v, o, layer_idx, num_layers, lengths)
    fraction = pruned.STATS.fraction()
    with unpruned():
        b = select_layer(policy, q, k, v, o, layer_idx, num_layers, lengths)
    return a, b, fraction


def assert_identical(a, b):
    assert torch.equal(a.indices, b.indices) and torch.equal(a.lengths, b.lengths), "pruned stage 2 kept other entries"


@pytest.mark.parametrize("case", POLICY_CASES, ids=IDS)
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4)], ids=["gqa9x3", "mha4"])
def test_policy_table_identical_to_unpruned(case, heads, kv_heads):
    q, k, v, o = random_layer(batch=2, heads=heads, kv_heads=kv_heads, n=420, head_dim=16, hidden=96, window=8, seed=5)
    lengths = torch.tensor([420, 311])
    for budget, (layer_idx, num_layers) in ((40, (0, 1)), (72, (1, 4)), (200, (3, 4))):
        policy = make_policy(case[1], budget=budget, window=8)
        a, b, fraction = both(policy, q, k, v, o, layer_idx, num_layers, lengths)
        assert_identical(a, b)
        if policy.method.refine is not None and policy.value_norm == "l1" and policy.alpha < 1:
            assert 0 < fraction < 0.8, f"pruning computed {fraction:.0%} of the norms: it pruned nothing"
        else:
            assert fraction == 0


@pytest.mark.parametrize("seed", range(6))
def test_random_gqa_and_mha_cases(seed):
    g = torch.Generator().manual_seed(seed)
    kv_heads = int(torch.randint(1, 4, (1,), generator=g))
    group = int(torch.randint(1, 4, (1,), generator=g))
    n = int(torch.randint(100, 900, (1,), generator=g))
    q, k, v, o = random_layer(batch=2, heads=kv_heads * group, kv_heads=kv_heads, n=n, head_dim=8,
                              hidden=int(torch.randint(16, 200, (1,), generator=g)), window=16, seed=seed)
    lengths = torch.tensor([n, int(torch.randint(17, n, (1,), generator=g))])
    for name, extra in (("criticalkv", {}), ("ada-criticalkv", {}), ("pyramid-criticalkv", dict(stage2_scores="raw")),
                        ("criticalkv", dict(gqa_reduce="kvpress", alpha=0.0))):
        policy = KVPolicy(name, budget=int(torch.randint(20, n, (1,), generator=g)), window=16, **extra)
        a, b, _ = both(policy, q, k, v, o, 1, 3, lengths)
        assert_identical(a, b)


def test_exact_norms_do_not_depend_on_the_other_rows():
    # the same token's L1 norm is the same float alone, among candidates, or with the whole prompt
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(1000, 64, generator=g)
    w = torch.randn(64, 3 * 576, generator=g) / 24
    full = l1_norms_rows(rows, w, 3)
    for size in (1, 2, 63, 64, 65, 333):
        index = torch.randperm(1000, generator=g)[:size]
        assert torch.equal(l1_norms_rows(rows[index], w, 3), full[index])
    # and value_projection_norms (the unpruned path) goes through the same blocks
    o = torch.randn(48, 4 * 16, generator=g)
    v = torch.randn(2, 2, 300, 16, generator=g)
    norms = value_projection_norms(v, o, 4, "l1")
    w_cat = torch.cat([head_output_projection(o, h, 16) for h in (2, 3)], dim=1)
    assert torch.equal(l1_norms_rows(v[1, 1, [5, 77, 299]], w_cat, 2).t(), norms[1, 2:, [5, 77, 299]])


def computed_l1(v, w):
    return l1_norms_rows(v, torch.cat(list(w), dim=1), w.shape[0]).t()  # [k, c]


@pytest.mark.parametrize("kind", ["gaussian", "top-singular", "flat", "sparse", "tiny", "cancelling"])
def test_the_bound_holds_for_computed_norms(kind):
    # fl(||v W||_1) <= bound * (1 + margin) for every head, including where L1 equals sqrt(d) * L2 (a flat x)
    g = torch.Generator().manual_seed(1)
    d_h, d, heads = 16, 256, 2
    w = torch.randn(heads, d_h, d, generator=g) / 16
    v = torch.randn(500, d_h, generator=g)
    if kind == "top-singular":  # values along W_O's top left singular direction: ||v W||_2 maximal
        u = torch.linalg.svd(w[0], full_matrices=False).U[:, 0]
        v = u[None] * torch.linspace(0.1, 10, 500)[:, None]
    elif kind == "flat":  # x = v W with all |x_j| equal: ||x||_1 = sqrt(d) ||x||_2, the bound is tight
        sign = torch.sign(torch.randn(d_h, d, generator=g))
        w = torch.stack([sign, sign * 0.5])
        v = torch.zeros(500, d_h)
        v[:, 0] = torch.linspace(0.5, 3, 500)
    elif kind == "sparse":  # x with one large entry: L1 = L2, far below sqrt(d) L2
        w = torch.zeros(heads, d_h, d)
        w[:, torch.arange(d_h), torch.arange(d_h)] = 1.0
    elif kind == "tiny":
        v = v * 1e-18
    elif kind == "cancelling":  # x nearly zero: v in the direction W's rows cancel
        w[:, 1] = -w[:, 0] * (1 + 1e-6)
        v = torch.zeros(500, d_h)
        v[:, 0] = 1.0
        v[:, 1] = 1.0 + torch.randn(500, generator=g) * 1e-7
    exact = computed_l1(v, w)
    bound = BoundTerms.of(w).upper(v)
    ratio = exact / bound
    assert (ratio <= 1 + stop_margin(d, 2)).all(), float(ratio.max())
    if kind == "flat":
        assert ratio.max() > 0.999  # the adversarial case does reach the bound
    # the group bound (one quadratic form with the mean Gram matrix) bounds the heads' mean computed norm
    group_ratio = exact.mean(0) / BoundTerms.of(w).group_upper(v)
    assert (group_ratio <= 1 + stop_margin(d, 2)).all(), float(group_ratio.max())
    assert (BoundTerms.of(w).group_upper(v) >= bound.mean(0) * (1 - 1e-6)).all()  # never tighter than the heads'


def test_stop_rule_rows_match_topk_on_ties_and_near_ties():
    from criticalkv.methods.topk import topk_mask

    g = torch.Generator().manual_seed(2)
    m = 400
    for trial in range(40):
        exact = torch.rand(m, generator=g)
        if trial % 4 == 0:  # many exact ties at the threshold
            exact = torch.round(exact * 5) / 5
        elif trial % 4 == 1:  # near ties: one ulp apart
            exact = torch.full((m,), 0.5) + torch.randint(0, 3, (m,), generator=g) * torch.finfo(torch.float32).eps / 4
        elif trial % 4 == 2:  # the bound exactly equals the exact score (tight): every candidate round is needed
            pass
        slack = torch.rand(m, generator=g) * (0 if trial % 4 == 2 else 0.5)
        bound = exact * (1 + slack)
        eligible = torch.rand(m, generator=g) > 0.2
        k = int(torch.randint(0, int(eligible.sum()) + 2, (1,), generator=g))
        mask, computed, _ = pruned_topk_row(bound, lambda idx: exact[idx], k, eligible, 1e-6)
        assert torch.equal(mask, topk_mask(exact, min(k, int(eligible.sum())), eligible)), trial
        assert computed <= int(eligible.sum())


@pytest.mark.parametrize("adversary", ["equal", "near-tie", "aligned", "flat-values", "mixed"])
def test_adversarial_layers_identical_to_unpruned(adversary):
    q, k, v, o = random_layer(batch=1, heads=4, kv_heads=2, n=600, head_dim=16, hidden=64, window=8, seed=7)
    if adversary == "equal":  # zero keys and equal values: every score ties, the lowest positions win
        k = torch.zeros_like(k)
        v = torch.ones_like(v)
    elif adversary == "near-tie":  # groups of values one ulp apart at every scale
        base = v[:, :, :1].expand_as(v).clone()
        steps = torch.randint(0, 4, v.shape[:3] + (1,), generator=torch.Generator().manual_seed(3))
        v = base * (1 + steps * torch.finfo(torch.float32).eps)
        k = torch.zeros_like(k)
    elif adversary == "aligned":  # values along the top singular direction of each head's W_O
        for h in range(2):
            u = torch.linalg.svd(head_output_projection(o, 2 * h, 16), full_matrices=False).U[:, 0]
            v[:, h] = u * torch.randn(1, 600, 1, generator=torch.Generator().manual_seed(h)).abs()
    elif adversary == "flat-values":  # ||v W||_1 = sqrt(d) ||v W||_2: the bound is tight for every token
        sign = torch.sign(torch.randn(64, 4 * 16, generator=torch.Generator().manual_seed(4)))
        o = sign * 0.1
        v = torch.zeros_like(v)
        v[..., 0] = torch.rand(1, 2, 600, generator=torch.Generator().manual_seed(5))
    elif adversary == "mixed":  # flat projections (L1 = sqrt(d) L2) and one-hot ones with 3x the L2: the best
        # bounds are the wrong tokens, so the first candidates never suffice (the stop rule must say so)
        o = torch.zeros(64, 4 * 16)
        o[:, 0::16] = torch.sign(torch.randn(64, 4, generator=torch.Generator().manual_seed(3)))
        o[0, 1::16] = 1.0
        size = torch.rand(1, 2, 600, generator=torch.Generator().manual_seed(5)) + 1
        flat = torch.rand(1, 2, 600, generator=torch.Generator().manual_seed(6)) < 0.5
        v = torch.zeros_like(v)
        v[..., 0] = torch.where(flat, size, 0)
        v[..., 1] = torch.where(flat, 0, 3 * size * 8)
    for name, extra in (("criticalkv", {}), ("criticalkv", dict(gqa_reduce="kvpress")), ("ada-criticalkv", {})):
        for budget in (40, 140):
            a, b, fraction = both(KVPolicy(name, budget=budget, window=8, **extra), q, k, v, o)
            assert_identical(a, b)
            if adversary == "mixed":
                assert max(c["rounds"] for c in pruned.STATS.calls) > 1, "the first candidates sufficed: no adversary"


def test_l2_and_unrefined_policies_compute_no_l1_norms():
    q, k, v, o = random_layer(n=300, window=8, seed=9)
    for policy in (KVPolicy("criticalkv", budget=40, window=8, value_norm="l2"), KVPolicy("snapkv", budget=40, window=8)):
        a, b, fraction = both(policy, q, k, v, o)
        assert_identical(a, b)
        assert fraction == 0 and not pruned.STATS.calls
