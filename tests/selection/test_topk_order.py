"""The top-k rule's order of special floats is the same whatever sort runs it.

torch's CPU sort ranks NaN of either sign above +inf and -0.0 equal to +0.0; its CUDA radix sort (rows longer than
its bitonic path) orders by the raw bits instead, putting a negative NaN below -inf and -0.0 below +0.0
(pytorch/pytorch#190781). That made ``topk_mask`` on CUDA disagree with the kernels (and with itself on CPU) at k = 1
in tests/plugins/test_plugin_gpu.py::test_radix_top_k_with_nan_infinities_and_k_zero. Here the radix order is
reproduced on the CPU by sorting the bit keys the way CUB does.
"""

import pytest
import torch

from criticalkv.methods import lazy
from criticalkv.methods.topk import topk_mask


def radix_order_sort(scores, dim=-1, descending=False, stable=False):
    """torch.sort's indices in the order of CUB's radix sort of float bits (sign bit set: all bits flipped; else
    the sign bit set), stable: what torch's CUDA sort returns for long rows."""
    assert dim == -1
    bits = scores.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    keys = torch.where(bits >= 0x80000000, ~bits & 0xFFFFFFFF, bits | 0x80000000)
    order = torch.sort(keys, dim=-1, descending=descending, stable=True).indices
    return torch.return_types.sort((torch.gather(scores, -1, order), order))


def special_rows(seed=3, rows=6, n=5000):
    """The GPU test's rows: normal scores with a growing share of NaN, -NaN, +-inf, +-0."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, n, generator=g)
    specials = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0])
    for row, fraction in enumerate((0.001, 0.01, 0.1, 0.5, 0.9, 1.0)):
        where = torch.rand(n, generator=g) < fraction
        scores[row, where] = specials[torch.randint(0, len(specials), (int(where.sum()),), generator=g)]
    return scores


def expected_mask(scores, k):
    """The rule written out: NaN (any sign) first, then by value with -0 == +0, ties to the lower index."""
    out = torch.zeros(scores.shape, dtype=torch.bool)
    for r, row in enumerate(scores.tolist()):
        order = sorted(range(len(row)), key=lambda i: (row[i] == row[i], -row[i] if row[i] == row[i] else 0, i))
        out[r, order[:k]] = True
    return out


@pytest.mark.parametrize("k", [0, 1, 5, 777, 4999, 5000])
def test_topk_mask_under_the_cuda_radix_order_equals_the_rule(monkeypatch, k):
    scores = special_rows()
    want = expected_mask(scores, k)
    assert torch.equal(topk_mask(scores, k), want), "torch's CPU sort"
    lazy.torch.sort  # noqa: B018 (the handle keeps a name once read: patch that)
    monkeypatch.setattr(lazy.torch, "sort", radix_order_sort)
    assert torch.equal(topk_mask(scores, k), want), "CUB's radix order"
