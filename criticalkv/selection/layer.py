"""``select_layer``: the PyTorch reference of the KV selection operator for one attention layer.

Every backend (ONNX function body, CUDA kernels, host C++) is tested against this file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from criticalkv.methods.budget import layer_selectable_budget
from criticalkv.methods.expected_attention import policy_rotation
from criticalkv.methods.topk import first_valid_mask, mask_to_indices, topk_mask
from criticalkv.methods.two_stage import two_stage_mask
from criticalkv.policy import KVPolicy
from criticalkv.selection.scores import LayerScores, ScoreMemo, layer_scores


@dataclass(frozen=True)
class LayerSelection:
    """Kept KV entries of one layer.

    indices : [B, H_kv, max_kept] int64, positions into the (padded) prompt axis of the keys,
        ascending, padded with -1 where a head keeps fewer than ``max_kept``
    lengths : [B, H_kv] int64, number of kept entries of every KV head
    """

    indices: torch.Tensor
    lengths: torch.Tensor

    def mask(self, n: int) -> torch.Tensor:
        """[B, H_kv, n] bool: True where the entry is kept."""
        batch, heads, _ = self.indices.shape
        mask = torch.zeros(batch, heads, n + 1, dtype=torch.bool, device=self.indices.device)
        mask.scatter_(-1, self.indices.masked_fill(self.indices < 0, n), True)
        return mask[..., :n]


def _validate(
    policy: KVPolicy,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    o_proj_weight: torch.Tensor,
    layer_idx: int,
    num_layers: int,
    prompt_lengths: torch.Tensor | None,
    memo: ScoreMemo | None = None,
) -> None:
    if not isinstance(policy, KVPolicy):
        raise ValueError(f"policy: expected a KVPolicy, got {type(policy).__name__}")
    for name, t, dims in (("queries", queries, 4), ("keys", keys, 4), ("values", values, 4), ("o_proj_weight", o_proj_weight, 2)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dims:
            raise ValueError(f"{name}: expected {dims} dimensions, got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point tensor, got {t.dtype}")
        if t.device != keys.device:
            raise ValueError(f"{name}: on {t.device}, but keys are on {keys.device}")
    batch, num_kv_heads, n, head_dim = keys.shape
    num_heads = queries.shape[1]
    if n == 0:
        raise ValueError("keys: the prompt is empty (n = 0); there is nothing to select from")
    if values.shape != keys.shape:
        raise ValueError(f"values: shape {tuple(values.shape)} differs from keys {tuple(keys.shape)}")
    if queries.shape[0] != batch or queries.shape[3] != head_dim:
        raise ValueError(
            f"queries: shape {tuple(queries.shape)} does not match keys {tuple(keys.shape)} "
            "(expected [B, H, w, d_h] with the keys' B and d_h)"
        )
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"queries: {num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if o_proj_weight.shape[1] != num_heads * head_dim:
        raise ValueError(
            f"o_proj_weight: shape {tuple(o_proj_weight.shape)} does not match H * d_h = {num_heads} * {head_dim} "
            "(expected [hidden, H * d_h])"
        )
    w = min(policy.window, n)
    if queries.shape[2] < w:
        raise ValueError(
            f"queries: {queries.shape[2]} window queries given, the policy needs the last min(window, n) = {w}"
        )
    if not 0 <= layer_idx < num_layers:
        raise ValueError(f"layer_idx: {layer_idx} is outside [0, num_layers={num_layers})")
    if prompt_lengths is not None:
        if prompt_lengths.shape != (batch,):
            raise ValueError(f"prompt_lengths: expected shape ({batch},), got {tuple(prompt_lengths.shape)}")
        if prompt_lengths.min() < 1 or prompt_lengths.max() > n:
            raise ValueError(f"prompt_lengths: every length must lie in [1, {n}], got {prompt_lengths.tolist()}")
    def check_finite():
        for name, t in (("queries", queries), ("keys", keys), ("values", values), ("o_proj_weight", o_proj_weight)):
            if not torch.isfinite(t).all():
                raise ValueError(f"{name}: contains NaN or Inf")
        return True

    if memo is None:
        check_finite()
    else:  # the same prompt's tensors: checked once per layer and window
        memo.get(("finite", layer_idx, queries.shape[2]), check_finite)


def choose_older_tokens(policy: KVPolicy, scores: LayerScores, eligible: torch.Tensor, r_layer: int) -> torch.Tensor:
    """Which of the m older tokens every KV head keeps: [B, H_kv, m] bool.

    The policy's base method shares the layer's budget among its heads (``allocate``); a refinement
    (CriticalKV's two stages) then chooses inside each head's share, otherwise the base's own choice stands.
    A method's sink tokens (``BaseMethod.sinks``: the first valid tokens) are kept first, inside the budget.
    """
    method = policy.method
    sinks = method.base.sinks(policy)
    sink = None
    if sinks:
        sink = first_valid_mask(eligible, sinks)
        eligible = eligible & ~sink
        r_layer = max(r_layer - sinks, 0)
    r = torch.clamp(eligible[:, 0].sum(-1), max=r_layer)  # [B], never more than the valid older tokens
    older = _choose(policy, scores, eligible, r)
    return older if sink is None else older | sink


def _choose(policy: KVPolicy, scores: LayerScores, eligible: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    method = policy.method
    allocation = method.base.allocate(policy, scores, eligible, r)
    if method.refine is not None:
        counts = allocation.counts if allocation.counts is not None else allocation.mask.sum(-1)
        return method.refine.choose(policy, scores, counts, eligible)
    if allocation.mask is not None:
        return allocation.mask
    return topk_mask(scores[method.base.score_name], allocation.counts, eligible)


@torch.no_grad()
def select_layer(
    policy: KVPolicy,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    o_proj_weight: torch.Tensor,
    layer_idx: int = 0,
    num_layers: int = 1,
    prompt_lengths: torch.Tensor | None = None,
    memo: ScoreMemo | None = None,
    rotation=None,
    scores: torch.Tensor | None = None,
) -> LayerSelection:
    """Choose the KV entries one attention layer keeps after the prompt.

    Parameters
    ----------
    policy : the KVPolicy (name, budget, window, ...)
    queries : [B, H, w', d_h] post-RoPE queries of the last w' >= min(window, n) prompt positions
    keys, values : [B, H_kv, n, d_h] post-RoPE keys and the values of the whole prompt
    o_proj_weight : [d, H * d_h], the layer's ``o_proj.weight``
    layer_idx, num_layers : position of this layer (PyramidKV budgets depend on it)
    prompt_lengths : [B] int64 or None. A batch of prompts of different lengths is given
        **left-padded**: sequence b occupies positions ``n - prompt_lengths[b] .. n - 1`` so that the
        window queries of every sequence are the last positions. Padding is never selected.
    memo : a ``ScoreMemo`` shared by calls on the same prompt (every policy and budget of an evaluation):
        its scores are computed once; the selection is the same with or without it.
    rotation : RoPE's rotation tables [2, >= window, d_h] (``criticalkv.methods.expected_attention.rotation_tables``
        of the model's ``inv_freq``), for a method that reads them (``expected-attention``; RoPE's default, base
        10000, when not given); ignored otherwise
    scores : [B, H_kv, n] the per-entry score of a method that ranks by one computed outside the layer
        (``BaseMethod.external_scores``: ``kvzip``, the largest attention of a context reconstruction,
        ``criticalkv.hf.reconstruct``); None: the method's own fallback (kvzip: the window's max attention); ignored
        by other methods

    Returns
    -------
    LayerSelection with ascending ``indices`` [B, H_kv, max_kept] (-1 padded) into the n axis and
    ``lengths`` [B, H_kv]. A sequence of at most ``budget`` tokens (or any under ``full``) is kept whole;
    otherwise the last ``window`` positions are always kept and the older ones are chosen by the policy.
    Inputs may be fp32/fp16/bf16 on CPU or CUDA; scores accumulate in fp32.
    """
    _validate(policy, queries, keys, values, o_proj_weight, layer_idx, num_layers, prompt_lengths, memo)
    rotation = policy_rotation(policy, rotation, queries.shape[-1])
    if policy.method.base.model_level and num_layers > 1:
        raise ValueError(f"{policy.name} shares the budget across all layers: select with select_model, not layer by layer")
    batch, num_kv_heads, n, _ = keys.shape
    device = keys.device
    lengths = torch.full((batch,), n, dtype=torch.int64, device=device)
    if prompt_lengths is not None:
        lengths = prompt_lengths.to(device=device, dtype=torch.int64)
    valid_start = n - lengths
    pos = torch.arange(n, device=device)
    valid = pos[None, :] >= valid_start[:, None]  # [B, n]
    keep = valid[:, None, :].expand(batch, num_kv_heads, n)
    compress = lengths > policy.budget
    method = policy.method
    if not method.base.evicts or not bool(compress.any()):
        return LayerSelection(*mask_to_indices(keep))

    if not method.base.scored:
        chosen = method.base.unscored_keep(policy, valid, valid_start, num_kv_heads)
    else:
        w = min(policy.window, n)
        m = n - w
        scores = layer_scores(policy, queries[:, :, -w:], keys, values, o_proj_weight, valid_start, memo, layer_idx,
                              rotation, scores)
        eligible = valid[:, None, :m].expand(batch, num_kv_heads, m)
        older = choose_older_tokens(policy, scores, eligible, layer_selectable_budget(policy, layer_idx, num_layers))
        window = torch.ones(batch, num_kv_heads, w, dtype=torch.bool, device=device)
        chosen = torch.cat([older, window], dim=-1)
    keep = torch.where(compress[:, None, None], chosen, keep)
    return LayerSelection(*mask_to_indices(keep))


def select_model(
    policy: KVPolicy,
    layers: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    prompt_lengths: torch.Tensor | None = None,
    memo: ScoreMemo | None = None,
    rotation=None,
    scores: Sequence[torch.Tensor] | None = None,
) -> list[LayerSelection]:
    """``select_layer`` over every layer of a model: ``layers[l] = (queries, keys, values, o_proj_weight)``;
    ``scores[l]``: layer l's external scores (``select_layer``'s ``scores``) or None.

    A model-level method (``layer-defensivekv``) ranks the older tokens of every layer and head together: each
    head keeps its stage-1 tokens and its floor, and the model's L * H_kv * r remaining slots go to the highest
    ranks over all layers (the window of every head kept), so the kept total is L * H_kv * budget per sequence.
    With ``head_cap_ratio`` set, a head keeps at most ``head_cap(head_cap_ratio, budget)`` entries (window included),
    the allocation nested in the budget (``criticalkv.methods.defensivekv.nested_capped_mask``).
    """
    if not policy.method.base.model_level or len(layers) == 1:
        return [
            select_layer(policy, q, k, v, o, layer_idx=i, num_layers=len(layers), prompt_lengths=prompt_lengths, memo=memo,
                         rotation=rotation, scores=None if scores is None else scores[i])
            for i, (q, k, v, o) in enumerate(layers)
        ]
    return _select_model_level(policy, layers, prompt_lengths, memo, scores)


def model_level_mask(policy: KVPolicy, ranking: torch.Tensor, eligible: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """The model-level allocation: [B, L * H_kv, m] bool, from every head's ``ranking`` [B, L * H_kv, m] (layer-major),
    ``eligible`` [B, L * H_kv, m] and r [B] (the method's ``model_allocate``; ``layer-defensivekv``: each head its own
    top floor, the other L * H_kv * (r - floor) slots over the flattened ranking, ties to the lower layer, head and
    position, a head never beyond ``head_cap_ratio``'s cap)."""
    return policy.method.base.model_allocate(policy, ranking, eligible, r)


def model_level_refine(policy: KVPolicy, per_layer: Sequence[LayerScores], allocated: torch.Tensor,
                       eligible: torch.Tensor) -> torch.Tensor:
    """CriticalKV's two stages inside the model-level allocation (``layer-kvzip-criticalkv``): every head keeps as many
    older entries as the model-wide ranking gave it (``allocated`` [B, L * H_kv, m], layer-major), its sink tokens
    (``BaseMethod.sinks``) first, then ceil(alpha * rest) by the base's score and the others by the critical score, as
    ``ada-criticalkv`` does inside AdaKV's shares. ``per_layer``: each layer's ``LayerScores``."""
    name = policy.method.base.score_name
    attention = torch.cat([s[name] for s in per_layer], dim=1)
    critical = torch.cat([s["critical"] for s in per_layer], dim=1)
    sinks = policy.method.base.sinks(policy)
    sink = first_valid_mask(eligible, sinks) & allocated if sinks else torch.zeros_like(eligible)
    counts = (allocated & ~sink).sum(-1)
    return two_stage_mask(attention, critical, counts, policy.alpha, eligible & ~sink) | sink


@torch.no_grad()
def _select_model_level(policy, layers, prompt_lengths, memo, external=None) -> list[LayerSelection]:
    num_layers = len(layers)
    for i, (q, k, v, o) in enumerate(layers):
        _validate(policy, q, k, v, o, i, num_layers, prompt_lengths, memo)
        if k.shape != layers[0][1].shape:
            raise ValueError(f"layers[{i}]: keys of shape {tuple(k.shape)} differ from layer 0's {tuple(layers[0][1].shape)}")
    batch, num_kv_heads, n, _ = layers[0][1].shape
    device = layers[0][1].device
    lengths = torch.full((batch,), n, dtype=torch.int64, device=device)
    if prompt_lengths is not None:
        lengths = prompt_lengths.to(device=device, dtype=torch.int64)
    valid_start = n - lengths
    valid = torch.arange(n, device=device)[None, :] >= valid_start[:, None]
    keep = valid[:, None, :].expand(batch, num_kv_heads, n)
    compress = lengths > policy.budget
    if not bool(compress.any()):
        return [LayerSelection(*mask_to_indices(keep)) for _ in layers]
    w = min(policy.window, n)
    m = n - w
    eligible = valid[:, None, :m].expand(batch, num_kv_heads, m)
    r = torch.clamp(eligible[:, 0].sum(-1), max=policy.selectable_budget)  # [B]
    ranks, per_layer = [], []
    for i, (q, k, v, o) in enumerate(layers):
        scores = layer_scores(policy, q[:, :, -w:], k, v, o, valid_start, memo, i,
                              scores=None if external is None else external[i])
        ranks.append(policy.method.base.priority(policy, scores, eligible, r))
        per_layer.append(scores)
    eligible_all = eligible.repeat(1, num_layers, 1)
    older = model_level_mask(policy, torch.cat(ranks, dim=1), eligible_all, r)
    if policy.method.refine is not None:
        older = model_level_refine(policy, per_layer, older, eligible_all)
    window = torch.ones(batch, num_kv_heads, w, dtype=torch.bool, device=device)
    out = []
    for i in range(num_layers):
        chosen = torch.cat([older[:, i * num_kv_heads : (i + 1) * num_kv_heads], window], dim=-1)
        out.append(LayerSelection(*mask_to_indices(torch.where(compress[:, None, None], chosen, keep))))
    return out


def gather_kv(selection: LayerSelection, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Compressed keys and values [B, H_kv, max_kept, d_h]; padded slots (index -1) are zero."""
    idx = selection.indices.clamp_min(0)[..., None].expand(-1, -1, -1, keys.shape[-1])
    pad = (selection.indices < 0)[..., None]
    return (
        torch.gather(keys, 2, idx).masked_fill(pad, 0),
        torch.gather(values, 2, idx).masked_fill(pad, 0),
    )
