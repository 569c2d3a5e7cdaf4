"""A larger budget keeps a superset of what a smaller one kept, on the same scores (issue 39).

The model-level allocation under ``head_cap_ratio`` (``nested_capped_mask``) against a level-by-level oracle written
from its definition; the nesting property on random scores for it and for the selections the context cache runs
(``layer-kvzip(-criticalkv)`` capped and not, ``kvzip(-criticalkv)``, ``ada-criticalkv``); and the case that made the
issue: the greedy walk that skips a full head (the rule before) keeps at budget 12 an entry it drops at 13."""

import pytest
import torch

from criticalkv import KVPolicy, select_model
from criticalkv.methods.adakv import shared_allocation_mask
from criticalkv.methods.budget import head_cap, head_floor
from criticalkv.methods.defensivekv import nested_capped_mask
from criticalkv.selection import mask_to_indices


def level_oracle(ranking, r, ada_floor, ratio, window):
    """Kept positions per head of one sequence: levels t = 1..r, each head's own top floor(t), then the walk down the
    flattened ranking (ties: lower head, then position) adds entries of heads below their cap at t until N * t."""
    heads, m = ranking.shape
    order = sorted(((h, i) for h in range(heads) for i in range(m)), key=lambda k: (-float(ranking[k]), k))
    kept = [set() for _ in range(heads)]
    for t in range(1, r + 1):
        cap = head_cap(ratio, t + window) - window
        for h in range(heads):
            own = [i for (g, i) in order if g == h]
            kept[h] |= set(own[:head_floor(ada_floor, t)])
        for h, i in order:
            if sum(map(len, kept)) >= heads * t:
                break
            if i not in kept[h] and len(kept[h]) < cap:
                kept[h].add(i)
    return kept


def greedy_walk(ranking, r, ratio, window):
    """The rule before issue 39: one walk down the ranking at the final budget, skipping a head at its cap."""
    heads, m = ranking.shape
    order = sorted(((h, i) for h in range(heads) for i in range(m)), key=lambda k: (-float(ranking[k]), k))
    cap = head_cap(ratio, r + window) - window
    kept = [set() for _ in range(heads)]
    for h, i in order:
        if sum(map(len, kept)) == heads * r:
            break
        if len(kept[h]) < cap:
            kept[h].add(i)
    return kept


def allocate(ranking, r, ada_floor, ratio, window=4):
    policy = KVPolicy("layer-defensivekv", budget=r + window, window=window, ada_floor=ada_floor, head_cap_ratio=ratio)
    eligible = torch.ones_like(ranking, dtype=torch.bool)
    return nested_capped_mask(policy, ranking[None], eligible[None], torch.tensor([r]))[0]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("ada_floor, ratio", [(0.0, 1.0), (0.0, 1.5), (0.2, 2.0), (0.0, 3.0)])
def test_nested_allocation_equals_its_level_oracle_and_nests(seed, ada_floor, ratio):
    gen = torch.Generator().manual_seed(seed)
    heads, m = 6, 40
    # a few heads with much larger scores (the ones a cap binds on), integer ties elsewhere
    ranking = torch.randint(0, 5, (heads, m), generator=gen).float() + 10 * (torch.rand(heads, 1, generator=gen) > 0.6)
    previous = None
    for r in range(1, 25):
        got = allocate(ranking, r, ada_floor, ratio)
        want = level_oracle(ranking, r, ada_floor, ratio, 4)
        assert [set(torch.nonzero(row).flatten().tolist()) for row in got] == want, f"r={r}"
        assert int(got.sum()) == heads * r
        assert int(got.sum(-1).max()) <= head_cap(ratio, r + 4) - 4
        if previous is not None:
            assert bool((previous & ~got).sum() == 0), f"r={r} drops entries kept at r={r - 1}"
        previous = got


def test_without_a_binding_cap_it_is_the_shared_allocation():
    gen = torch.Generator().manual_seed(7)
    ranking = torch.rand(2, 8, 50, generator=gen)
    eligible = torch.ones_like(ranking, dtype=torch.bool)
    r = torch.tensor([20, 20])
    policy = KVPolicy("layer-defensivekv", budget=24, window=4, head_cap_ratio=40.0)  # a cap no head reaches
    got = nested_capped_mask(policy, ranking, eligible, r)
    floor = torch.tensor([head_floor(policy.ada_floor, 20)] * 2)
    assert torch.equal(got, shared_allocation_mask(ranking, r, floor, eligible))


def test_the_greedy_walk_was_not_nested_and_this_is():
    """Heads 0 and 1 rank every entry above head 2's. head_cap_ratio 1.25, window 4: a head may hold 9 older entries
    at r=7 and 11 at r=8, so the greedy walk gives heads 0 and 1 18 of 21 slots at r=7 (head 2 keeps 3) and 22 of 24
    at r=8 (head 2 keeps 2): the larger budget drops one of head 2's entries. The nested allocation keeps it."""
    m = 20
    steps = torch.arange(m, dtype=torch.float32)
    ranking = torch.stack([100 - 0.1 * steps, 99 - 0.1 * steps, 10 - steps])
    walk7, walk8 = greedy_walk(ranking, 7, 1.25, 4), greedy_walk(ranking, 8, 1.25, 4)
    assert (len(walk7[2]), len(walk8[2])) == (3, 2)  # the old rule: r=8 misses what r=7 kept
    nested7, nested8 = allocate(ranking, 7, 0.0, 1.25), allocate(ranking, 8, 0.0, 1.25)
    assert bool((nested7 & ~nested8).sum() == 0)
    assert nested8.sum(-1).tolist() == [11, 10, 3]  # head 1 waits a level for its cap: the walk's growth, nested
    assert int(nested8.sum(-1).max()) <= head_cap(1.25, 12) - 4


def random_layers(seed, num_layers=3, heads=4, kv_heads=2, n=90, d=8, hidden=16):
    gen = torch.Generator().manual_seed(seed)
    layers, scores = [], []
    for layer in range(num_layers):
        q = torch.randn(1, heads, 8, d, generator=gen) * (1 + layer)
        k = torch.randn(1, kv_heads, n, d, generator=gen)
        v = torch.randn(1, kv_heads, n, d, generator=gen) * torch.rand(1, kv_heads, 1, 1, generator=gen) * 3
        layers.append((q, k, v, torch.randn(hidden, heads * d, generator=gen)))
        # external scores (a KVzip score): a few sharp heads, as the surrogate's
        scores.append(torch.rand(1, kv_heads, n, generator=gen) ** (1 + 6 * torch.rand(1, kv_heads, 1, generator=gen)))
    return layers, scores


def kept_sets(policy, layers, scores):
    return [mask_to_indices(s.mask(layers[0][1].shape[2]))[0] for s in select_model(policy, layers, scores=scores)]


@pytest.mark.parametrize("spec", ["layer-kvzip-criticalkv:head_cap_ratio=2", "layer-kvzip-criticalkv",
                                  "layer-kvzip:head_cap_ratio=1.5", "kvzip-criticalkv", "kvzip", "ada-criticalkv"])
def test_a_larger_budget_keeps_what_a_smaller_kept(spec, seed=0):
    from criticalkv.policy import parse_policy_spec

    layers, scores = random_layers(seed)
    n = layers[0][1].shape[2]
    previous = None
    for budget in range(12, 60, 6):
        policy = parse_policy_spec(spec, KVPolicy(window=8)).replace(budget=budget)
        masks = torch.stack([s.mask(n)[0] for s in select_model(policy, layers, scores=scores)])  # [L, H_kv, n]
        if previous is not None:
            assert int((previous & ~masks).sum()) == 0, f"budget {budget} drops entries kept at {budget - 6}"
        previous = masks
