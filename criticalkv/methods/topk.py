"""Top-k masks with the operator's tie rule: equal scores go to the lower index (PyTorch)."""

from __future__ import annotations

from criticalkv.methods.lazy import torch


def topk_mask(scores: torch.Tensor, k: torch.Tensor | int, eligible: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean mask of the ``k`` highest eligible scores along the last axis.

    Parameters
    ----------
    scores : [..., m] float
    k : int or int64 tensor broadcastable to ``scores.shape[:-1]``; must not exceed the number of
        eligible entries (callers clamp it)
    eligible : [..., m] bool, entries that may be chosen (default all)

    Returns
    -------
    [..., m] bool. Ties are broken toward the lower index (a stable descending sort), so the
    result is deterministic and identical on every backend. NaN of either sign ranks above +inf and -0.0 equals
    +0.0 (the order of torch's CPU sort and of the kernels' orderedKey): the signs are cleared before sorting,
    since torch's CUDA radix sort orders by the raw bits (a negative NaN below -inf, -0.0 below +0.0;
    pytorch/pytorch#190781).
    """
    scores = canonical_scores(scores)
    if eligible is not None:
        scores = scores.masked_fill(~eligible, float("-inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(scores.shape[-1], device=scores.device).expand_as(order))
    k = torch.as_tensor(k, device=scores.device)
    mask = ranks < k.unsqueeze(-1) if k.dim() > 0 else ranks < k
    return mask if eligible is None else mask & eligible


def canonical_scores(scores: torch.Tensor) -> torch.Tensor:
    """``scores`` with every NaN made positive and -0.0 made +0.0 (the same order under any comparison sort; a
    radix sort of the bits then agrees with it)."""
    return torch.where(torch.isnan(scores), scores.abs(), scores + 0.0)


def mask_to_indices(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ascending indices of the set entries of ``mask`` [..., n], padded with -1.

    Returns ``(indices [..., max_kept] int64, lengths [...] int64)``.
    """
    n = mask.shape[-1]
    lengths = mask.sum(dim=-1)
    positions = torch.arange(n, device=mask.device).expand_as(mask)
    keyed = torch.where(mask, positions, torch.full_like(positions, n))
    indices = torch.sort(keyed, dim=-1).values
    max_kept = int(lengths.max()) if lengths.numel() else 0
    indices = indices[..., :max_kept]
    return indices.masked_fill(indices == n, -1), lengths


def first_valid_mask(eligible, count: int):
    """[..., m] bool: each row's first ``count`` eligible positions from its first eligible one (a method's sink tokens,
    ``BaseMethod.sinks``; rows are left-padded sequences, so their valid positions are contiguous)."""
    first = eligible.int().argmax(-1, keepdim=True)
    pos = torch.arange(eligible.shape[-1], device=eligible.device)
    return eligible & (pos < first + count)
