"""Why defensivekv computes every exact value norm while CriticalKV's pruned stage 2 computes a few.

CriticalKV ranks a head's tokens by (P + eps) ||v W_O||_1: an entry it does not keep never changes the scores of the
others, so its exact norm is needed only where a bound cannot rule it out (criticalkv.methods.pruned). defensivekv
scores a token by its defended attention times its norm divided by the sum of the norms of every older token of its
head, and the heads share the layer's slots: the norms of entries it does not keep set the scale of a head against
the others. Here the values of half the entries a selection does not keep in one head are zeroed: CriticalKV keeps
exactly the same entries, defensivekv moves slots between the heads, so no exact-norm pruning can promise
defensivekv's kept entries (only faster full norms can speed it up)."""

import torch

from criticalkv import KVPolicy, select_layer


def layer(seed=0, n=600, heads=4, kv_heads=2, head_dim=16, hidden=64, window=8):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, kv_heads, n, head_dim, generator=generator)
    queries = 3.0 * torch.randn(1, heads, window, head_dim, generator=generator)  # peaked attention
    values = torch.randn(1, kv_heads, n, head_dim, generator=generator)
    o_proj = torch.randn(hidden, heads * head_dim, generator=generator) / hidden ** 0.5
    return queries, keys, values, o_proj


def kept(policy, q, k, v, o):
    selection = select_layer(policy, q, k, v, o)
    return [set(row[: int(length)].tolist()) for row, length in zip(selection.indices[0], selection.lengths[0])]


def test_the_norms_of_entries_not_kept_change_defensivekvs_kept_entries_but_not_criticalkvs():
    q, k, v, o = layer()
    older = k.shape[2] - 8
    # defensivekv's stage 1 (by attention mass) off, so its defensive scores share every slot
    for policy in (KVPolicy("criticalkv", budget=40, window=8), KVPolicy("defensivekv", budget=40, window=8,
                                                                          stage1_mass=0.0)):
        name = policy.name
        before = kept(policy, q, k, v, o)
        dropped = v.clone()
        outside = torch.tensor(sorted(set(range(older)) - before[0]))
        dropped[0, 0, outside[::2]] = 0.0  # every second older entry of head 0 the selection does not keep: norm 0
        after = kept(policy, q, k, dropped, o)
        if name == "criticalkv":
            assert after == before
        else:  # head 0's sum of norms shrinks: its entries now weigh more against head 1's in the shared slots
            assert len(after[0]) > len(before[0]) and len(after[1]) < len(before[1]), ([len(e) for e in before],
                                                                                       [len(e) for e in after])
