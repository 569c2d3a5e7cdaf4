"""``keydiff``: every KV head keeps the window + the older keys least like the head's average key.

KeyDiff (Park et al., 2025; kvpress's ``KeyDiffPress``) ranks a key by how far its direction is from the mean
direction of the head's keys: tokens whose keys point the way most keys point are redundant, the distinct ones are
kept. It reads no query and no attention, so it is question-agnostic by construction and costs one pass over the keys
(O(n d_h) per head against the window attention's O(w n d_h)). For one KV head, keys k_j post-RoPE (as the cache holds
them), the valid positions j (left padding excluded) and unit(x) = x / max(||x||_2, 1e-12):

    a = mean over the valid j of unit(k_j)            (the window included, as kvpress averages every key)
    score_i = 1 - unit(k_i) . unit(a)                  (in [0, 2]; 0 on left padding)

which orders the older tokens as kvpress's -cos(k_i, a) does. Every head then keeps the window and its top
r = budget - window older tokens by that score (SnapKV's per-head budget, no pooling).

C++: ``plugins/include/criticalkv/methods/keydiff.h`` (the anchor and the score, host and device) and its line in
``plugins/include/criticalkv/methods/registry.h``; the key-score pass around it (``key_scores.h``, the kernel template
``kernels/key_scores.cuh``, the host driver) is every key-scored method's, and the pipeline ranks its scores as kvzip's
external scores, so the CriticalKVSelect plugin, the torch ops and the kernels select it.
"""

from __future__ import annotations

import numpy as np

from criticalkv.methods.base import BaseMethod
from criticalkv.methods.lazy import torch

#: The floor of a norm before dividing by it (``torch.nn.functional.normalize``'s eps).
EPS = 1e-12


def keydiff_scores(keys, valid_start) -> "torch.Tensor":
    """[B, H, n] fp32 KeyDiff score of every key (0 on left padding).

    keys : [B, H, n, d_h] post-RoPE keys; valid_start : [B] int64 (None: no padding)."""
    k = keys.float()
    batch, _, n, _ = k.shape
    unit = k / k.norm(dim=-1, keepdim=True).clamp_min(EPS)
    pos = torch.arange(n, device=k.device)
    start = torch.zeros(batch, dtype=torch.int64, device=k.device) if valid_start is None else valid_start
    valid = pos[None, :] >= start[:, None]  # [B, n]
    weights = valid.to(torch.float32)
    anchor = (unit * weights[:, None, :, None]).sum(dim=2) / weights.sum(dim=1).clamp_min(1.0)[:, None, None]  # [B, H, d_h]
    anchor = anchor / anchor.norm(dim=-1, keepdim=True).clamp_min(EPS)
    score = 1.0 - (unit @ anchor[..., None])[..., 0]  # [B, H, n]
    return score.masked_fill(~valid[:, None, :], 0.0)


class KeyDiff(BaseMethod):
    name = "keydiff"
    cpp_enum = "kKeyDiff"
    description = ("question-agnostic: every KV head keeps the window + the older keys least like its average key "
                   "(1 - cos(k_i, mean unit key), kvpress's KeyDiff)")
    score_knobs = ()
    pools = False

    # ------------------------------------------------------------------ PyTorch
    def attention_rows(self, policy, queries, keys, valid_start, rotation, m):
        group = keys.shape[1]
        score = keydiff_scores(keys[:, :1], valid_start)[..., :m]  # the group's heads share their KV head's keys
        raw = score.expand(-1, group, -1)  # [B, G, m]
        return raw[:, :, None], raw

    # ------------------------------------------------------------------ ONNX function body
    def onnx_attention_rows(self, body, g, q, keys, ctx, w, m):
        """keys [B, H_kv, n, d_h] -> (probs [B, H_kv, G, 1, m], raw [B, H_kv, G, m]): the KeyDiff score, the same for
        the group's query heads."""
        eps = g.const(EPS, np.float32)
        unit = g.Div(keys, g.Max(g.ReduceL2(keys, g.i64(3), keepdims=1), eps))  # [B, H_kv, n, d_h]
        valid = g.Cast(ctx["valid"], to=g.FLOAT)  # [B, n]
        count = g.Max(g.ReduceSum(valid, g.i64(1), keepdims=1), g.const(1.0, np.float32))  # [B, 1]
        anchor = g.ReduceSum(g.Mul(unit, g.reshape(valid, [0, 1, -1, 1])), g.i64(2), keepdims=1)  # [B, H_kv, 1, d_h]
        anchor = g.Div(anchor, g.reshape(count, [-1, 1, 1, 1]))
        anchor = g.Div(anchor, g.Max(g.ReduceL2(anchor, g.i64(3), keepdims=1), eps))
        cos = g.ReduceSum(g.Mul(unit, anchor), g.i64(3), keepdims=0)  # [B, H_kv, n]
        score = g.Sub(g.const(1.0, np.float32), cos)
        score = g.Where(g.unsqueeze(ctx["valid"], 1), score, g.const(0.0, np.float32))
        older = g.unsqueeze(g.slice_axis(score, 0, m, axis=2), 2)  # [B, H_kv, 1, m]
        raw = g.Expand(older, g.i64(1, 1, body.group, 1))  # [B, H_kv, G, m]
        return g.unsqueeze(raw, 3), raw


METHOD = KeyDiff()
