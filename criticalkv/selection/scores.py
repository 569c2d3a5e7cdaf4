"""Per-token scores of the selection operator: window attention, projected-value norms.

All functions take post-RoPE tensors in any floating dtype (fp32/fp16/bf16) on any device
and accumulate in fp32. Shapes use: B batch, H query heads, H_kv KV heads, G = H / H_kv,
w window, n prompt length (padded), m = n - w older tokens, d_h head dim, d hidden size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from criticalkv.policy import KVPolicy

#: Tokens per chunk when projecting values through W_O: memory stays O(chunk * G * d), not O(n * H * d).
VALUE_NORM_CHUNK = 1024


def head_output_projection(o_proj_weight: torch.Tensor, head: int, head_dim: int) -> torch.Tensor:
    """W_O^h: the slice of ``o_proj.weight`` [d, H*d_h] acting on query head ``head``, as [d_h, d] fp32."""
    return o_proj_weight[:, head * head_dim : (head + 1) * head_dim].float().t()


def value_projection_norms(
    values: torch.Tensor,
    o_proj_weight: torch.Tensor,
    num_heads: int,
    kind: str = "l1",
    heads: range | None = None,
    chunk_size: int = VALUE_NORM_CHUNK,
) -> torch.Tensor:
    """Norms of the values projected through each query head's slice of the output matrix.

    Parameters
    ----------
    values : [B, H_kv, n, d_h]
    o_proj_weight : [d, H * d_h] (``o_proj.weight`` of the attention layer)
    num_heads : H, the number of query heads
    kind : ``"l1"`` (||V_i W_O^h||_1, the paper's) or ``"l2"`` (through the d_h x d_h Gram matrix
        W_O^h W_O^h^T: d / d_h times fewer FLOPs)
    heads : query heads to compute (default all)

    Returns
    -------
    [B, len(heads), n] fp32: entry [b, j, i] = ||V[b, g(h), i] W_O^h|| for h = heads[j], g(h) = h // G.
    """
    batch, num_kv_heads, n, head_dim = values.shape
    group = num_heads // num_kv_heads
    heads = list(range(num_heads) if heads is None else heads)
    if kind not in ("l1", "l2"):
        raise ValueError(f"value_norm: unknown kind {kind!r}")
    out = torch.empty(batch, len(heads), n, dtype=torch.float32, device=values.device)
    for g in sorted({h // group for h in heads}):  # the heads of one KV group share V: one matmul
        cols = [j for j, h in enumerate(heads) if h // group == g]
        v = values[:, g]
        if kind == "l2":
            vf = v.float()
            for j in cols:  # sqrt(v^T (W W^T) v): a d_h x d_h Gram matrix instead of the n x d product
                w = head_output_projection(o_proj_weight, heads[j], head_dim)
                out[:, j] = ((vf @ (w @ w.t())) * vf).sum(-1).clamp_min(0).sqrt()
            continue
        w_o = torch.cat([head_output_projection(o_proj_weight, heads[j], head_dim) for j in cols], dim=1)  # [d_h, k*d]
        for start in range(0, n, chunk_size):
            chunk = v[:, start : start + chunk_size].float() @ w_o  # [B, c, k*d]
            norms = chunk.abs().view(batch, chunk.shape[1], len(cols), -1).sum(-1)  # [B, c, k]
            out[:, cols, start : start + chunk_size] = norms.transpose(1, 2)
    return out


def window_attention(
    queries: torch.Tensor, keys: torch.Tensor, valid_start: torch.Tensor | None = None
) -> torch.Tensor:
    """Softmax attention of the window queries over every key, causal inside the window.

    Parameters
    ----------
    queries : [B, Hq, w, d_h] post-RoPE queries of the last w prompt positions
    keys : [B, Hq, n, d_h] post-RoPE keys already expanded to the query heads
    valid_start : [B] int64, first non-padding position of each (left-padded) sequence

    Returns
    -------
    [B, Hq, w, n] fp32; window query j (position n - w + j) sees keys <= n - w + j. A padded
    query that sees no valid key gets a uniform row (it is never used).
    """
    batch, _, w, head_dim = queries.shape
    n = keys.shape[2]
    logits = (queries.float() @ keys.float().transpose(-1, -2)) / math.sqrt(head_dim)
    pos = torch.arange(n, device=keys.device)
    query_pos = torch.arange(n - w, n, device=keys.device)
    blocked = pos[None, :] > query_pos[:, None]  # [w, n]
    if valid_start is not None:
        blocked = blocked[None] | (pos[None, None, :] < valid_start[:, None, None])  # [B, w, n]
        blocked = blocked[:, None]
    logits = logits.masked_fill(blocked, torch.finfo(torch.float32).min)
    return torch.softmax(logits, dim=-1)


def max_pool_positions(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """Max-pool over the last (token) axis, stride 1, same padding (borders see fewer tokens)."""
    if kernel == 1:
        return scores
    shape = scores.shape
    pooled = F.max_pool1d(scores.reshape(-1, 1, shape[-1]), kernel, stride=1, padding=kernel // 2)
    return pooled.reshape(shape)


@dataclass(frozen=True)
class LayerScores:
    """Scores of the m = n - w older tokens of every KV head of one layer (fp32, [B, H_kv, m]).

    attention : S, the pooled window attention, averaged over the heads of each GQA group
    critical : C, CriticalKV's stage-2 score (None unless the policy is two-stage)
    laprox : LaProx importance sum_h ||A_h[:, i]||_2 ||V_i W_O^h||_2 (None unless laprox)
    """

    attention: torch.Tensor
    critical: torch.Tensor | None = None
    laprox: torch.Tensor | None = None


def layer_scores(
    policy: KVPolicy,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    o_proj_weight: torch.Tensor,
    valid_start: torch.Tensor | None = None,
) -> LayerScores:
    """Compute the scores ``policy`` needs for the older tokens of one layer.

    ``queries`` [B, H, w, d_h] are the last w prompt positions (w <= n); keys and values are
    [B, H_kv, n, d_h]. Memory peaks at O(B * G * w * n) for the window attention of one KV head's
    group and O(B * chunk * d) for the value projection.
    """
    batch, num_heads, w, _ = queries.shape
    num_kv_heads, n = keys.shape[1], keys.shape[2]
    group = num_heads // num_kv_heads
    m = n - w
    attention = torch.empty(batch, num_kv_heads, m, dtype=torch.float32, device=keys.device)
    critical = torch.empty_like(attention) if policy.two_stage else None
    laprox = torch.empty_like(attention) if policy.base == "laprox" else None
    for g in range(num_kv_heads):
        heads = range(g * group, (g + 1) * group)
        k = keys[:, g : g + 1].expand(batch, group, n, keys.shape[-1])
        probs = window_attention(queries[:, heads.start : heads.stop], k, valid_start)[..., :m]  # [B, G, w, m]
        raw = probs.mean(dim=2)  # Ā, [B, G, m]
        pooled = max_pool_positions(raw, policy.pool_kernel)  # Ā'
        attention[:, g] = pooled.mean(dim=1)
        if critical is not None:
            norms = value_projection_norms(values[..., :m, :], o_proj_weight, num_heads, policy.value_norm, heads)
            p = pooled if policy.stage2_scores == "pooled" else raw
            if policy.gqa_reduce == "mean":
                critical[:, g] = ((p + policy.epsilon) * norms).mean(dim=1)
            else:  # kvpress: mean over the group of each factor, then the product
                critical[:, g] = (p.mean(dim=1) + policy.epsilon) * norms.mean(dim=1)
        if laprox is not None:
            norms = value_projection_norms(values[..., :m, :], o_proj_weight, num_heads, "l2", heads)
            laprox[:, g] = (probs.norm(dim=2) * norms).sum(dim=1)
    return LayerScores(attention=attention, critical=critical, laprox=laprox)
