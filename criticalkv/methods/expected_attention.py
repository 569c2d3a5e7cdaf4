"""``expected-attention``: question-agnostic scores from the statistics of the window's queries (arXiv 2510.00636).

Expected Attention (Devoto et al., NVIDIA kvpress's default press, ``ExpectedAttentionPress``) scores a key by the
attention the *next* queries are expected to pay it, in closed form, without seeing those queries: the queries are
modelled as Gaussian, q ~ N(mu, Sigma), estimated from the queries seen so far and carried to the next
``future_positions`` positions through RoPE; for a Gaussian q, E[exp(q.k / sqrt(d))] = exp(mu.k / sqrt(d) +
k^T Sigma k / (2 d)). This suits a context compressed before its question is known (the serving context cache).

For one layer, per query head h (w window queries, post-RoPE, at positions p_j = n - w + j; e_j = n - p_j = w - j):

1. Carry each query to the future: x_j = mean over t in [e_j, e_j + F) of R_t q_j, with R_t RoPE's rotation by t
   positions (F = ``future_positions``). As RoPE's rotations compose, R_t q_j = s R_{p_j + t} q~_j for the pre-RoPE
   query q~_j (s: RoPE's attention scaling), so x_j = s mean_{f in [n, n + F)} R_f q~_j: kvpress's averaged rotation
   applied to the pre-RoPE query. In closed form x_j = q_j * c_e + rotate_half(q_j) * s_e with the tables
   c_e[i] = mean_t cos(t theta_i), s_e[i] = mean_t sin(t theta_i) (``rotation_tables``: float64, then float32).
2. mu = mean_j x_j, Sigma = sum_j (x_j - mu)(x_j - mu)^T / w (the biased estimate, as kvpress).
3. logits_i = mu.k_i / sqrt(d) + k_i^T Sigma k_i / (2 d) over the keys that are neither left padding nor one of the
   ``sink_tokens`` first tokens; softmax over them: the head's expected attention P_h [n].
4. Per KV head g: the expected attention A_g = mean_{h in g} P_h (the base's "attention", what CriticalKV's stage 1
   ranks by and its stage 2 reads instead of the window's attention), and its own score A_g ||v_i||_2 (kvpress's
   ``use_vnorm``, epsilon 0).
5. The first ``sink_tokens`` tokens are always kept (kvpress gives them the maximum score), inside the budget;
   the window too, as in every scored method of criticalkv (kvpress does not keep a window).

The statistics come from the window's queries (``window``, 32 by default), which the selection node receives;
kvpress estimates them from every query after the sinks. Given the same queries the two compute the same scores
(``tests/selection/test_expected_attention.py`` checks it against kvpress's press where kvpress is installed).
q_proj biases (Qwen2) are part of the queries here; kvpress leaves them out of mu.

C++: not native. The plugin takes no RoPE input, so it refuses ``expected-attention`` and ``expected-criticalkv``
(``cpp_refusal``); they run on the PyTorch path and on ONNX Runtime.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from criticalkv.methods.base import BaseMethod
from criticalkv.methods.knobs import Knob, Knobs
from criticalkv.methods.streamingllm import SINK_TOKENS
from criticalkv.spec.rules import MAX_TOKENS, AtMost, Positive
from criticalkv.methods.lazy import torch


def rotation_tables(inv_freq, window: int, future: int) -> np.ndarray:
    """[2, window, d_h] float32: row e - 1 holds c_e and s_e, the means of cos(t theta) and sin(t theta) over
    t = e .. e + future - 1 (RoPE's angles, theta = ``inv_freq`` [d_h / 2], duplicated over both halves as
    transformers' RoPE). Computed in float64 from the float32 ``inv_freq``, so every backend reads the same floats."""
    theta = np.asarray(inv_freq, dtype=np.float32).astype(np.float64)
    e = np.arange(1, window + 1, dtype=np.float64)[:, None]
    t = np.arange(future, dtype=np.float64)[None, :]
    angles = (e[:, :, None] + t[:, :, None]) * theta[None, None, :]  # [window, future, d_h / 2]
    cos, sin = np.cos(angles).mean(axis=1), np.sin(angles).mean(axis=1)
    return np.stack([np.concatenate([cos, cos], -1), np.concatenate([sin, sin], -1)]).astype(np.float32)


def default_inv_freq(head_dim: int, base: float = 10000.0) -> np.ndarray:
    """RoPE's default angles [d_h / 2] (float32, transformers' formula): what ``select_layer`` assumes for a method
    that reads the rotation when the caller gives none (the PyTorch path and the export pass the model's own)."""
    return (1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))).astype(np.float32)


def policy_rotation(policy, rotation, head_dim: int):
    """The rotation tables a method that reads them uses (``BaseMethod.needs_rotation``): ``rotation`` checked, or
    RoPE's default (base 10000) when none is given (the PyTorch path and the export pass the model's own). None for
    the other methods."""
    if not policy.method.base.needs_rotation:
        return None
    if rotation is None:
        return torch.from_numpy(policy.method.base.rotation_table(policy, None, head_dim))
    shape = tuple(rotation.shape)
    if len(shape) != 3 or shape[0] != 2 or shape[1] < policy.window or shape[2] != head_dim:
        raise ValueError(f"rotation: expected shape [2, >= window {policy.window}, {head_dim}], got {list(shape)}")
    return rotation


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def expected_attention(queries, keys, rotation, valid_start, sink_tokens: int):
    """Expected attention [B, H, n] fp32 of every key (0 on left padding and sinks).

    queries : [B, H, w, d_h] post-RoPE queries of the last w positions; keys : [B, H, n, d_h] post-RoPE keys
    (expanded to the query heads); rotation : ``rotation_tables`` [2, >= w, d_h]; valid_start : [B] int64.
    """
    batch, heads, w, d = queries.shape
    n = keys.shape[2]
    table = torch.as_tensor(rotation, dtype=torch.float32, device=queries.device)
    distance = torch.arange(w, 0, -1, device=queries.device) - 1  # e_j - 1 = w - j - 1: the table row of query j
    cos, sin = table[0, distance], table[1, distance]  # [w, d_h]
    q = queries.float()
    x = q * cos + _rotate_half(q) * sin  # [B, H, w, d_h]: each query carried to the next positions
    mu = x.mean(dim=2)  # [B, H, d_h]
    centred = x - mu[:, :, None]
    sigma = centred.transpose(-1, -2) @ centred / w  # [B, H, d_h, d_h]
    k = keys.float()
    logits = (k @ mu[..., None])[..., 0] / math.sqrt(d) + ((k @ sigma) * k).sum(-1) / (2 * d)  # [B, H, n]
    pos = torch.arange(n, device=keys.device)
    start = torch.zeros(batch, dtype=torch.int64, device=keys.device) if valid_start is None else valid_start
    hidden = pos[None, :] < (start + sink_tokens)[:, None]  # padding and sinks: no share of the softmax
    logits = logits.masked_fill(hidden[:, None], -torch.inf)
    return torch.softmax(logits, dim=-1).nan_to_num(0.0)


@dataclass(frozen=True)
class ExpectedAttentionKnobs(Knobs):
    sink_tokens: int = SINK_TOKENS.field()
    future_positions: int = Knob(512, "expected-attention: the next positions the window's queries are carried to "
                                 "through RoPE (their rotation averaged over them), as kvpress's n_future_positions",
                                 rules=(Positive(), AtMost(MAX_TOKENS))).field()


class ExpectedAttention(BaseMethod):
    name = "expected-attention"
    cpp_enum = "kExpectedAttention"
    description = ("question-agnostic: the expected attention of the next queries (the window's queries' mean and "
                   "covariance carried through RoPE) × ‖v‖₂, sink_tokens first tokens kept")
    Knobs = ExpectedAttentionKnobs
    score_name = "expected"
    score_names = ("expected",)
    score_knobs = ("sink_tokens", "future_positions")
    pools = False
    needs_rotation = True
    native = False
    kernels = False
    cpp_refusal = ("reads RoPE's rotation averaged over the next future_positions positions, an input the "
                   "CriticalKVSelect plugin does not take; select it on the PyTorch path or ONNX Runtime")
    kernels_refusal = ("reads RoPE's rotation averaged over the next future_positions positions, an input the kernels "
                       "do not take; select it on the PyTorch path or ONNX Runtime")

    def sinks(self, policy) -> int:
        return policy.sink_tokens

    def rotation_table(self, policy, inv_freq, head_dim):
        return rotation_tables(default_inv_freq(head_dim) if inv_freq is None else inv_freq, policy.window,
                               policy.future_positions)

    # ------------------------------------------------------------------ PyTorch
    def attention_rows(self, policy, queries, keys, valid_start, rotation, m):
        probs = expected_attention(queries, keys, rotation, valid_start, policy.sink_tokens)[..., :m]  # [B, G, m]
        return probs[:, :, None], probs

    def group_scores(self, policy, inputs):
        values = inputs.values.float()  # [B, m, d_h]
        norms = (values * values).sum(-1).sqrt()
        return {"expected": inputs.raw.mean(dim=1) * norms}

    # ------------------------------------------------------------------ ONNX function body
    def onnx_attention_rows(self, body, g, q, keys, ctx, w, m):
        """q [B, H_kv, G, w, d_h] (post-RoPE window queries), keys [B, H_kv, n, d_h] -> (probs, raw) as the window
        attention's: [B, H_kv, G, 1, m] and [B, H_kv, G, m]."""
        p = body.policy
        d = body.head_dim
        table = body.rotation  # [2, window, d_h]
        distance = g.Sub(g.Range(g.squeeze(w, 0), g.scalar(0), g.scalar(-1)), g.scalar(1))  # [w]: row w - 1 - j of query j
        cos = g.Gather(g.squeeze(g.slice_axis(table, 0, 1, axis=0), 0), distance, axis=0)  # [w, d_h]
        sin = g.Gather(g.squeeze(g.slice_axis(table, 1, 2, axis=0), 0), distance, axis=0)
        half = d // 2
        rotated = g.concat(g.Neg(g.slice_axis(q, half, d, axis=4)), g.slice_axis(q, 0, half, axis=4), axis=-1)
        x = g.Add(g.Mul(q, cos), g.Mul(rotated, sin))  # [B, H_kv, G, w, d_h]
        mu = g.ReduceMean(x, g.i64(3), keepdims=1)  # [B, H_kv, G, 1, d_h]
        centred = g.Sub(x, mu)
        w_float = g.Cast(w, to=g.FLOAT)
        sigma = g.Div(g.MatMul(g.Transpose(centred, perm=[0, 1, 2, 4, 3]), centred), w_float)  # [B, H_kv, G, d, d]
        k = g.unsqueeze(keys, 2)  # [B, H_kv, 1, n, d_h]
        linear = g.Div(g.MatMul(k, g.Transpose(mu, perm=[0, 1, 2, 4, 3])), g.const(math.sqrt(d), np.float32))
        linear = g.squeeze(linear, 4)  # [B, H_kv, G, n]
        quadratic = g.Div(g.ReduceSum(g.Mul(g.MatMul(k, sigma), k), g.i64(4), keepdims=0), g.const(2.0 * d, np.float32))
        logits = g.Add(linear, quadratic)
        hidden = g.Less(g.unsqueeze(ctx["pos"], 0), g.unsqueeze(g.Add(ctx["valid_start"], g.scalar(p.sink_tokens)), 1))
        logits = g.Where(g.reshape(hidden, [0, 1, 1, -1]), g.const(-np.inf, np.float32), logits)
        probs = g.Softmax(logits, axis=-1)  # a row with no visible key cannot occur: n > budget >= window + sinks
        raw = g.slice_axis(probs, 0, m, axis=3)
        return g.unsqueeze(raw, 3), raw

    def onnx_group_scores(self, body, g, probs, raw, pooled, values_m):
        norms = g.Sqrt(g.ReduceSum(g.Mul(values_m, values_m), g.i64(3), keepdims=0))  # [B, H_kv, m]
        return {"expected": g.Mul(g.ReduceMean(raw, g.i64(2), keepdims=0), norms)}


METHOD = ExpectedAttention()
