"""Per-token scores of the selection operator: window attention, projected-value norms.

All functions take post-RoPE tensors in any floating dtype (fp32/fp16/bf16) on any device
and accumulate in fp32. Shapes use: B batch, H query heads, H_kv KV heads, G = H / H_kv,
w window, n prompt length (padded), m = n - w older tokens, d_h head dim, d hidden size.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from criticalkv.methods import METHODS, BaseMethod, GroupScoreInputs
from criticalkv.methods.expected_attention import policy_rotation
from criticalkv.methods.pruned import l1_norms_rows
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
        for start in range(0, n, chunk_size):  # fixed-shape GEMMs: a token's norm never depends on the others
            rows = v[:, start : start + chunk_size].reshape(-1, head_dim)
            norms = l1_norms_rows(rows, w_o, len(cols)).view(batch, -1, len(cols))  # [B, c, k]
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


class LayerScores:
    """Scores of the m = n - w older tokens of every KV head of one layer (fp32, [B, H_kv, m] each).

    ``attention`` (S, the pooled window attention averaged over the heads of each GQA group) is there for
    every scored method; the others are named by the methods that add them (``criticalkv.methods``):
    ``critical`` (CriticalKV's stage-2 score), ``laprox`` (LaProx importance). A score the policy does
    not use reads as None.
    """

    def __init__(self, scores: dict[str, torch.Tensor], deferred: dict[str, list] | None = None):
        self.scores = dict(scores)
        #: scores computed on demand, one object per KV group with ``full()`` -> [B, m] and ``rows(b, index)``
        #: (CriticalKV's pruned stage 2 reads a few rows; reading the score itself computes every row once)
        self.deferred = dict(deferred or {})

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.scores and name in self.deferred:
            self.scores[name] = torch.stack([group.full() for group in self.deferred[name]], dim=1)
        return self.scores[name]

    def __getattr__(self, name: str):
        if name in ("scores", "deferred"):
            raise AttributeError(name)
        if name in self.scores or name in self.deferred:
            return self[name]
        if any(name in m.score_names for m in METHODS.values()):
            return None
        raise AttributeError(f"LayerScores has no score {name!r}")


class ScoreMemo:
    """Memoised score inputs of one prompt (batch, padding and tensors fixed): window attention, pooled
    attention and projected-value norms per (layer, window, KV group), and whole ``LayerScores`` per scoring
    knobs. One memo serves every policy and budget of that prompt (``criticalkv.eval``); ``seconds`` is the
    time spent computing what was not memoised yet."""

    def __init__(self) -> None:
        self.entries: dict = {}
        self.seconds = 0.0

    def get(self, key, compute):
        if key not in self.entries:
            self.entries[key] = compute()
        return self.entries[key]


def scoring_key(policy: KVPolicy) -> tuple:
    """The knobs that determine a layer's scores (not the budget): the method's score names and knobs."""
    method = policy.method
    return (method.score_names, policy.window) + tuple(getattr(policy, k) for k in method.score_knobs)


@torch.no_grad()
def layer_scores(
    policy: KVPolicy,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    o_proj_weight: torch.Tensor,
    valid_start: torch.Tensor | None = None,
    memo: ScoreMemo | None = None,
    layer_idx: int = 0,
    rotation=None,
    scores: torch.Tensor | None = None,
) -> LayerScores:
    """Compute the scores ``policy`` needs for the older tokens of one layer.

    ``queries`` [B, H, w, d_h] are the last w prompt positions (w <= n); keys and values are
    [B, H_kv, n, d_h]. Memory peaks at O(B * G * w * n) for the window attention of one KV head's
    group and O(B * chunk * d) for the value projection. ``memo`` (with this layer's ``layer_idx``) reuses
    what an earlier call on the same prompt computed; the results are the same tensors either way. ``rotation``:
    RoPE's rotation tables for a method that reads them (``BaseMethod.needs_rotation``). ``scores`` [B, H_kv, n]: the
    per-entry score of a method that ranks by one computed outside the layer (``BaseMethod.external_scores``: kvzip's
    reconstruction attention), its "attention" (None: the method's ``attention_rows``).
    """
    method = policy.method
    batch, num_heads, w, _ = queries.shape
    num_kv_heads, n = keys.shape[1], keys.shape[2]
    group = num_heads // num_kv_heads
    m = n - w
    shared = memo is not None
    memo = memo if shared else ScoreMemo()
    external = scores if method.base.external_scores else None
    whole_key = ("scores", layer_idx, scoring_key(policy)) + (("external",) if external is not None else ())
    if whole_key in memo.entries:
        return memo.entries[whole_key]
    start = time.perf_counter()
    parts = [method.base] + ([method.refine] if method.refine is not None else [])
    positions = torch.arange(m, device=keys.device)
    valid = positions[None, :] >= (valid_start[:, None] if valid_start is not None else torch.zeros(batch, 1, dtype=torch.int64, device=keys.device))
    out = {name: torch.empty(batch, num_kv_heads, m, dtype=torch.float32, device=keys.device) for name in method.score_names}
    deferred: dict[str, list] = {}
    # the window's own attention is shared by every method that ranks by it; a method with its own (expected
    # attention) memoises it under its name and the knobs it depends on
    own = type(method.base).attention_rows is not BaseMethod.attention_rows
    rotation = policy_rotation(policy, rotation, queries.shape[-1])
    attention_key = (method.base.name,) + tuple(getattr(policy, k) for k in method.base.score_knobs) if own else ()
    if external is not None:
        if tuple(external.shape) != (batch, num_kv_heads, n):
            raise ValueError(f"scores: expected shape [{batch}, {num_kv_heads}, {n}] (B, H_kv, n), got {list(external.shape)}")
        attention_key += ("external",)
    for g in range(num_kv_heads):
        heads = range(g * group, (g + 1) * group)

        def probs_raw(g=g, heads=heads):
            k = keys[:, g : g + 1].expand(batch, group, n, keys.shape[-1])
            q = queries[:, heads.start : heads.stop]
            if external is not None:  # the score computed outside (the same for the group's heads)
                raw = external[:, g : g + 1, :m].float().expand(batch, group, m)
                return raw[:, :, None], raw
            own = method.base.attention_rows(policy, q, k, valid_start, rotation, m)  # a method's own attention
            if own is not None:
                return own
            probs = window_attention(q, k, valid_start)[..., :m]  # [B, G, w, m]
            return probs, probs.mean(dim=2)  # Ā, [B, G, m]

        probs, raw = memo.get(("probs", layer_idx, w, g) + attention_key, probs_raw)
        if not method.base.pools:
            pooled = raw
        else:
            pooled = memo.get(("pooled", layer_idx, w, policy.pool_kernel, g) + attention_key,
                              lambda: max_pool_positions(raw, policy.pool_kernel))

        def norms(kind, heads=heads, g=g):
            return memo.get(("norms", layer_idx, w, kind, g),
                            lambda: value_projection_norms(values[..., :m, :], o_proj_weight, num_heads, kind, heads))

        out["attention"][:, g] = pooled.mean(dim=1)
        w_heads = torch.stack([head_output_projection(o_proj_weight, h, keys.shape[-1]) for h in heads])  # [G, d_h, d]
        inputs = GroupScoreInputs(probs=probs, raw=raw, pooled=pooled, norms=norms, valid=valid,
                                  values=values[:, g, :m], w_heads=w_heads)
        for part in parts:
            for name, score in part.group_scores(policy, inputs).items():
                if isinstance(score, torch.Tensor):
                    out.setdefault(name, torch.empty(batch, num_kv_heads, m, dtype=torch.float32, device=keys.device))
                    out[name][:, g] = score
                else:  # computed on demand (CriticalKV's pruned stage 2)
                    deferred.setdefault(name, [None] * num_kv_heads)[g] = score
    for name in deferred:
        out.pop(name, None)
    result = LayerScores(out, deferred)
    if shared:  # kept for the next policy; a private memo holding it would make a cycle (memo -> scores -> their lazy
        # parts -> memo) that keeps the layer's K/V alive until Python's cycle collector runs, not until the call ends
        memo.entries[whole_key] = result
    memo.seconds += time.perf_counter() - start
    return result
