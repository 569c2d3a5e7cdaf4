"""The host C++ version's pruned stage 2 (plugins/include/criticalkv/pruned_stage2.h, plugins/host/select_host.cpp)
keeps what the PyTorch reference keeps, pruned or not, on inputs where pruning matters and on adversarial ones."""

import pytest
import torch

from criticalkv import KVPolicy, select_layer
from criticalkv.methods import pruned
from criticalkv.selection import topk_mask
from criticalkv.selection.scores import head_output_projection
from ckv_native import PRUNED_ROW_KINDS, pruned_row
from helpers import random_layer


def reference(policy, q, k, v, o, lengths, unpruned=False):
    with pruned.pruning(not unpruned):
        return select_layer(policy, q, k, v, o, 1, 3, prompt_lengths=lengths)


def adversarial(kind, q, k, v, o):
    if kind == "equal":  # every score ties: the lowest positions win
        return q, torch.zeros_like(k), torch.ones_like(v), o
    if kind == "equal-values":  # every bound ties, the attention orders the exact scores
        return q, k, torch.ones_like(v), o
    if kind == "aligned":  # values along each KV head's first query head's top singular direction
        v = v.clone()
        for g in range(k.shape[1]):
            u = torch.linalg.svd(head_output_projection(o, g * (q.shape[1] // k.shape[1]), k.shape[3]),
                                 full_matrices=False).U[:, 0]
            v[:, g] = u * v[:, g].norm(dim=-1, keepdim=True)
        return q, k, v, o
    if kind == "flat":  # ||v W||_1 = sqrt(d) ||v W||_2: the bound is tight
        o = torch.sign(torch.randn(o.shape, generator=torch.Generator().manual_seed(1))) * 0.1
        v = torch.zeros_like(v)
        v[..., 0] = torch.rand(v.shape[:3], generator=torch.Generator().manual_seed(2))
        return q, k, v, o
    if kind == "mixed":  # half the tokens project flat (L1 = sqrt(d) L2), half onto one output (L1 = L2) with 3x
        # the L2: the best bounds are the wrong tokens, so the first candidates never suffice
        return (q, k) + mixed_values(v, o)
    return q, k, v, o


def mixed_values(v, o):
    hidden, width = o.shape
    o = torch.zeros(hidden, width)
    o[:, 0::v.shape[3]] = torch.sign(torch.randn(hidden, width // v.shape[3], generator=torch.Generator().manual_seed(3)))
    o[0, 1::v.shape[3]] = 1.0
    g = torch.Generator().manual_seed(5)
    size = torch.rand(v.shape[:3], generator=g) + 1
    flat = torch.rand(v.shape[:3], generator=g) < 0.5
    v = torch.zeros_like(v)
    v[..., 0] = torch.where(flat, size, 0)
    v[..., 1] = torch.where(flat, 0, 3 * size * hidden ** 0.5)
    return v, o


@pytest.mark.parametrize("kind", ["random", "equal", "equal-values", "aligned", "flat", "mixed"])
@pytest.mark.parametrize("name, extra", [("criticalkv", {}), ("criticalkv", {"gqa_reduce": "kvpress", "stage2_scores": "raw"}),
                                         ("ada-criticalkv", {}), ("pyramid-criticalkv", {})])
def test_host_pruned_stage2_equals_the_reference(host_lib, kind, name, extra):
    q, k, v, o = adversarial(kind, *random_layer(batch=2, heads=6, kv_heads=2, n=360, head_dim=16, hidden=48, window=8, seed=4))
    lengths = torch.tensor([360, 251])
    for budget in (24, 72):
        policy = KVPolicy(name, budget=budget, window=8, **extra)
        want = reference(policy, q, k, v, o, lengths)
        assert torch.equal(want.indices, reference(policy, q, k, v, o, lengths, unpruned=True).indices)
        indices, got_lengths = host_lib.select_layer(policy, q, k, v, o, 1, 3, prompt_lengths=lengths)[:2]
        assert torch.equal(got_lengths, want.lengths)
        width = want.indices.shape[-1]
        assert torch.equal(indices[..., :width], want.indices), (kind, name, budget)


@pytest.mark.parametrize("kind", PRUNED_ROW_KINDS)
@pytest.mark.parametrize("seed", range(5))
def test_host_pruned_row_keeps_the_unpruned_top_k(host_lib, kind, seed):
    """The host driver's executor of prunedStage2 (ckv_host_pruned_row, the rows the GPU test gives the kernel)."""
    margin = pruned.stop_margin(576, 3)
    bound, exact, flags, valid_start, k = pruned_row(kind, 700, seed, margin)
    got, done = host_lib.pruned_row(bound, exact, flags, valid_start, k, margin)
    eligible = (flags == 0) & (torch.arange(700) >= valid_start)
    want = flags.clone()
    want[topk_mask(torch.where(eligible, exact, torch.tensor(-float("inf"))), k) & eligible] = 2
    assert torch.equal(got, want), (kind, seed, k)
    assert k < done <= int(eligible.sum())


@pytest.mark.parametrize("kind", ["random", "aligned", "flat", "mixed"])
def test_host_l1_bounds_bound_the_norms_and_match_the_reference(host_lib, kind):
    """host::l1UpperBounds (what the pipeline's bound kernels give bit for bit, tests/plugins/test_plugin_gpu.py) is an
    upper bound of the exact L1 norm (fp64), tight where every output has the same magnitude, and equals the PyTorch
    reference's bound up to fp32 rounding."""
    q, k, v, o = adversarial(kind, *random_layer(batch=2, heads=6, kv_heads=2, n=200, head_dim=16, hidden=48, seed=7))
    heads, d_h = q.shape[1], v.shape[3]
    bounds = host_lib.l1_bounds(v, o, heads)
    exact = torch.stack([(v[:, h // 3].double() @ head_output_projection(o, h, d_h).double()).abs().sum(-1)
                         for h in range(heads)], 1)
    margin = pruned.stop_margin(o.shape[0], heads // v.shape[1])
    assert (exact <= bounds.double() * (1 + margin)).all(), kind
    if kind == "flat":  # ||x||_1 = sqrt(d) ||x||_2: only the rounding terms separate the bound from the norm
        assert (bounds.double() <= exact * (1 + 1e-4) + 1e-30).all()
    reference = torch.stack([pruned.BoundTerms.of(head_output_projection(o, h, d_h)[None]).upper(v[:, h // 3])[:, 0]
                             for h in range(heads)], 1)
    torch.testing.assert_close(bounds, reference, rtol=1e-5, atol=1e-30)
