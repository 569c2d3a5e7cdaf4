import pytest
import torch

from criticalkv import KVPolicy, select_layer
from criticalkv.selection import head_floor, pyramid_layer_budgets, stage1_count
from helpers import random_layer


@pytest.mark.parametrize("r", [1, 2, 5, 17, 96, 224, 1000])
@pytest.mark.parametrize("layers", [1, 2, 7, 30, 32])
@pytest.mark.parametrize("beta", [1.0, 4.0, 20.0])
def test_pyramid_layers_average_to_r(r, layers, beta):
    budgets = pyramid_layer_budgets(r, layers, beta)
    assert len(budgets) == layers and sum(budgets) == layers * r
    assert all(b >= 1 for b in budgets), "no layer is silently floored to zero"
    assert budgets == sorted(budgets, reverse=True)
    if layers > 1 and r >= 20 and beta == 20.0:
        assert budgets[0] > r > budgets[-1]
        assert abs(budgets[-1] - r / beta) <= 1 and abs(budgets[0] - (2 * r - r / beta)) <= 1


def test_small_budgets_never_floor_a_stage_to_zero():
    assert stage1_count(0.25, 1) == 1 and stage1_count(0.25, 3) == 1 and stage1_count(0.25, 8) == 2
    assert stage1_count(0.3, 10) == 3, "float noise (0.3 * 10 > 3) must not round up"
    assert stage1_count(0.0, 10) == 0 and stage1_count(1.0, 7) == 7
    assert head_floor(0.2, 3) == 1 and head_floor(0.2, 10) == 2 and head_floor(0.0, 10) == 0
    # budget 10, window 8: r = 2, stage 1 keeps 1 by attention, stage 2 keeps 1 by the critical score
    q, k, v, o = random_layer(n=50, window=8, seed=0)
    base = select_layer(KVPolicy("snapkv", budget=10, window=8), q, k, v, o)
    crit = select_layer(KVPolicy("criticalkv", budget=10, window=8), q, k, v, o)
    assert (crit.lengths == 10).all()
    shared = (base.mask(50) & crit.mask(50))[0, :, :42].sum(-1)
    assert (shared >= 1).all(), "stage 1 kept the top attention token"


@pytest.mark.parametrize("name", ["adakv", "ada-criticalkv", "laprox"])
@pytest.mark.parametrize("seed", range(3))
def test_shared_allocation_sums_per_layer_and_respects_the_floor(name, seed):
    q, k, v, o = random_layer(batch=2, n=300, window=16, seed=seed)
    policy = KVPolicy(name, budget=80, window=16, ada_floor=0.3)
    sel = select_layer(policy, q, k, v, o)
    assert (sel.lengths.sum(-1) == 3 * 80).all()
    assert (sel.lengths >= 16 + head_floor(0.3, 64)).all()


def test_pyramid_selection_follows_the_layer_budgets():
    q, k, v, o = random_layer(n=400, window=16, seed=1)
    policy = KVPolicy("pyramidkv", budget=80, window=16)
    kept = [select_layer(policy, q, k, v, o, layer, 6).lengths[0, 0].item() - 16 for layer in range(6)]
    assert kept == pyramid_layer_budgets(64, 6, 20.0) and sum(kept) == 6 * 64



@pytest.mark.parametrize("name", ["full", "streamingllm", "snapkv", "pyramidkv", "adakv", "laprox", "ada-criticalkv"])
def test_node_capacity_bounds_every_shorter_prompt(name):
    from criticalkv.node import node_capacity
    from criticalkv.selection import max_kept_per_head

    policy = KVPolicy(name, budget=64, window=16)
    for layer in (0, 5):
        for max_len in (40, 64, 65, 300):
            cap = node_capacity(policy, max_len, 4, layer, 6)
            kept = [max_kept_per_head(policy, n, 4, layer, 6) for n in range(1, max_len + 1)]
            assert cap == max(kept)
