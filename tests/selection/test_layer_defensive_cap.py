"""``layer-defensivekv`` with and without ``head_cap_ratio`` against a loop-by-loop float64 oracle of the model-level
selection: stage 1 and the ranks per layer (tests/naive.py), then a greedy walk down the model-wide ranking that skips
the entries of a head already holding its cap (written from the definition, not from the reference's masked top-k)."""

import pytest
import torch

from criticalkv import KVPolicy, select_model
from criticalkv.selection import head_floor
from criticalkv.methods.budget import head_cap
from naive import naive_defensive_scores


def naive_model_select(p, layers):
    """Kept positions [layer][head] of one unpadded sequence; ``layers``: (q [H, w, d], k, v [H_kv, n, d], o) float64."""
    kv_heads, n, _ = layers[0][1].shape
    w = min(p.window, n)
    m = n - w
    r = min(p.budget - p.window, m)
    rank = {}
    for layer, (q, k, v, o) in enumerate(layers):
        D, M, window_mass = naive_defensive_scores(p, q, k, v, o)
        for g in range(kv_heads):
            total, first = 0.0, set()
            for i in sorted(range(m), key=lambda i: (-M[g, i], i)):
                total += M[g, i]
                if total >= p.stage1_mass - window_mass or len(first) == r:
                    break
                first.add(i)
            for i in range(m):
                rank[layer, g, i] = D[g, i] + (2.0 if i in first else 0.0)
    order = sorted(rank, key=lambda key: (-rank[key], key))  # ties: lower layer, head, position
    floor = head_floor(p.ada_floor, r)
    cap = head_cap(p.head_cap_ratio, p.budget) - w if p.head_cap_ratio else m
    kept = {(layer, g): set() for layer in range(len(layers)) for g in range(kv_heads)}
    for key in order:  # every head's own top floor
        if len(kept[key[:2]]) < floor:
            kept[key[:2]].add(key[2])
    slots = len(kept) * (r - floor)
    for key in order:  # then the model's remaining slots, skipping a full head
        if slots == 0:
            break
        head = kept[key[:2]]
        if key[2] not in head and len(head) < cap:
            head.add(key[2])
            slots -= 1
    return [[sorted(kept[layer, g] | set(range(m, n))) for g in range(kv_heads)] for layer in range(len(layers))]


def random_model(num_layers=3, heads=4, kv_heads=2, n=70, d=8, hidden=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for layer in range(num_layers):  # sharper attention in later layers, values of different scales per head
        q = torch.randn(1, heads, 8, d, generator=gen, dtype=torch.float64) * (1.5 + layer)
        k = torch.randn(1, kv_heads, n, d, generator=gen, dtype=torch.float64)
        v = torch.randn(1, kv_heads, n, d, generator=gen, dtype=torch.float64) * torch.rand(1, kv_heads, 1, 1, generator=gen, dtype=torch.float64) * 3
        o = torch.randn(hidden, heads * d, generator=gen, dtype=torch.float64)
        layers.append((q, k, v, o))
    return layers


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("ratio", [0.0, 1.0, 1.25, 2.0])
def test_model_level_selection_equals_the_greedy_oracle(seed, ratio):
    policy = KVPolicy("layer-defensivekv", budget=16, window=4, stage1_mass=0.3, head_cap_ratio=ratio)
    layers = random_model(seed=seed)
    got = select_model(policy, [tuple(t.float() for t in layer) for layer in layers])
    want = naive_model_select(policy, [tuple(t[0].numpy() if t.dim() == 4 else t.numpy() for t in layer) for layer in layers])
    for layer, selection in enumerate(got):
        for g in range(2):
            assert [i for i in selection.indices[0, g].tolist() if i >= 0] == want[layer][g], f"layer {layer} head {g}"
    lengths = torch.stack([s.lengths[0] for s in got])
    assert int(lengths.sum()) == 3 * 2 * 16
    if ratio:
        assert int(lengths.max()) <= head_cap(ratio, 16)


def test_the_cap_binds_on_this_case():
    """Guard of the test above: the uncapped selection gives some head more than 1.25 x budget."""
    layers = [tuple(t.float() for t in layer) for layer in random_model(seed=0)]
    uncapped = select_model(KVPolicy("layer-defensivekv", budget=16, window=4, stage1_mass=0.3), layers)
    capped = select_model(KVPolicy("layer-defensivekv", budget=16, window=4, stage1_mass=0.3, head_cap_ratio=1.25), layers)
    assert max(int(s.lengths.max()) for s in uncapped) > head_cap(1.25, 16) == 20
    assert max(int(s.lengths.max()) for s in capped) == 20
    assert sum(int(s.lengths.sum()) for s in capped) == 3 * 2 * 16
