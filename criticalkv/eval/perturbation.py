"""The paper's perturbation analysis (Section 5, Figures 2, 3 and 5; Assumption 1 of Section 3.5).

All quantities are taken at the first decoding token (the greedy token after the prompt, fed at
position n; the same token for every policy because the prompt's logits do not depend on the cache
that is kept).

Head-wise perturbation (no cascade, Figure 2). For layer l and query head h, with the full-cache hidden
state of that token entering layer l (so every layer sees the same input whatever the policy):
q = its post-RoPE query, K, V = the layer's full prompt keys/values plus the token's own key/value,
W_O^h = head h's slice of ``o_proj``. The head's contribution to the attention output is
o_h = softmax(q K^T / sqrt(d_h)) V W_O^h with every entry (full) or only the kept prompt entries of KV
head g(h) plus the token itself (policy). The perturbation is the L1 distance ||o_h,full - o_h,kept||_1
(the paper's Definition 1, L = ||(A - A') V W_O||_1). A CriticalKV variant "wins" a head when its
perturbation is lower than its base method's at the same budget; the fraction of heads it wins is
the paper's 74-92%.

Layer-wise perturbation (cascade, Figures 3 and 5). The compressed model runs the token through
every layer with its own cache: the L1 distance between each decoder layer's output (the residual
stream) under the policy and under the full cache, and after the final norm (the last hidden state).

Assumption 1. For the CriticalKV policies, sigma_h = the first decoding token's attention mass (full
cache) on the entries kept no matter what stage 2 does: the stage-1 picks (top ceil(alpha r_g) by the
pooled window score), the observation window and the token itself. Theorem 3's bound needs
sigma > 0.5. ``kept_mass_h`` is the same mass over all kept entries, for every policy.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch

from criticalkv.hf.compress import window_queries
from criticalkv.policy import KVPolicy
from criticalkv.methods.two_stage import stage1_counts
from criticalkv.selection import LayerSelection, topk_mask


class FirstStepRecorder:
    """Records, during one decoding forward, each decoder layer's output and the final norm's output
    at the new token, and (``attention_inputs``) what enters each attention module."""

    def __init__(self, model, attention_inputs: bool = False):
        self.model = model
        self.attention_inputs = attention_inputs
        self.layer_outputs: list[torch.Tensor | None] = [None] * len(model.model.layers)
        self.final: torch.Tensor | None = None
        self.attn_in: list[tuple[torch.Tensor, tuple] | None] = [None] * len(model.model.layers)

    @contextlib.contextmanager
    def __call__(self):
        handles = []
        for i, layer in enumerate(self.model.model.layers):
            def out_hook(module, args, output, i=i):
                hidden = output[0] if isinstance(output, tuple) else output
                self.layer_outputs[i] = hidden[:, -1].detach().float().clone()

            handles.append(layer.register_forward_hook(out_hook))
            if self.attention_inputs:
                def in_hook(module, args, kwargs, i=i):
                    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                    self.attn_in[i] = (hidden.detach(), kwargs["position_embeddings"])

                handles.append(layer.self_attn.register_forward_pre_hook(in_hook, with_kwargs=True))

        def norm_hook(module, args, output):
            self.final = output[:, -1].detach().float().clone()

        handles.append(self.model.model.norm.register_forward_hook(norm_hook))
        try:
            yield self
        finally:
            for h in handles:
                h.remove()


@dataclass
class FullReference:
    """The first decoding token under the full cache, per layer: its post-RoPE query q [1, H, 1, d_h],
    the layer's keys/values with the token's own entry appended [1, H_kv, n + 1, d_h], the per-head
    projected attention outputs o_h [H, d] and the attention probabilities [H, n + 1]."""

    queries: list[torch.Tensor]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    o_proj: list[torch.Tensor]
    outputs: list[torch.Tensor] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)
    layer_outputs: list[torch.Tensor] = field(default_factory=list)
    final: torch.Tensor | None = None


@torch.no_grad()
def head_outputs(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, o_proj_weight: torch.Tensor,
                 keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head projected attention outputs of one query token, in fp32.

    q [1, H, 1, d_h]; keys, values [1, H_kv, N, d_h]; o_proj_weight [d, H * d_h]; keep [1, H_kv, N] bool
    (None = every entry). Returns ``(o [H, d], probs [H, N])`` with o_h = softmax(q_h K^T / sqrt(d_h))
    V W_O^h over the kept entries of KV head g(h).
    """
    num_heads, head_dim = q.shape[1], q.shape[-1]
    group = num_heads // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)[0]  # [H, N, d_h]
    v = values.float().repeat_interleave(group, dim=1)[0]
    logits = (q.float()[0] @ k.transpose(-1, -2))[:, 0] / head_dim**0.5  # [H, N]
    if keep is not None:
        logits = logits.masked_fill(~keep[0].repeat_interleave(group, dim=0), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    per_head = (probs[:, None, :] @ v)[:, 0]  # [H, d_h]
    w_o = o_proj_weight.float().reshape(o_proj_weight.shape[0], num_heads, head_dim).permute(1, 2, 0)  # [H, d_h, d]
    return (per_head[:, None, :] @ w_o)[:, 0], probs


@torch.no_grad()
def full_reference(prefill, recorder: FirstStepRecorder, cache) -> FullReference:
    """Build the per-layer reference from a full-cache first decoding step recorded with
    ``attention_inputs`` (``cache`` is the ``CompressedKVCache`` of the full policy after that step:
    its decode tail holds the token's own post-RoPE key and value)."""
    ref = FullReference(queries=[], keys=[], values=[], o_proj=list(prefill.o_proj))
    for layer, module in enumerate(recorder.model.model.layers):
        hidden, position_embeddings = recorder.attn_in[layer]
        q = window_queries(module.self_attn, hidden, position_embeddings, 1)
        tail = cache.layers[layer]
        k = torch.cat([prefill.keys[layer], tail.tail_keys[:, :, :1]], dim=2)
        v = torch.cat([prefill.values[layer], tail.tail_values[:, :, :1]], dim=2)
        o, probs = head_outputs(q, k, v, prefill.o_proj[layer])
        ref.queries.append(q)
        ref.keys.append(k)
        ref.values.append(v)
        ref.outputs.append(o)
        ref.probs.append(probs)
    ref.layer_outputs = list(recorder.layer_outputs)
    ref.final = recorder.final
    return ref


def keep_with_token(selection: LayerSelection, n: int) -> torch.Tensor:
    """[1, H_kv, n + 1] bool: the kept prompt entries plus the new token (always attended)."""
    mask = selection.mask(n)
    return torch.cat([mask, torch.ones_like(mask[..., :1])], dim=-1)


@torch.no_grad()
def head_perturbation(ref: FullReference, selections: list[LayerSelection], n: int) -> np.ndarray:
    """[L, H] L1 distance of each head's projected attention output, kept entries vs full (no cascade)."""
    rows = []
    for layer, sel in enumerate(selections):
        o, _ = head_outputs(ref.queries[layer], ref.keys[layer], ref.values[layer], ref.o_proj[layer],
                            keep_with_token(sel, n))
        rows.append((o - ref.outputs[layer]).abs().sum(-1))
    return torch.stack(rows).cpu().numpy()


@torch.no_grad()
def attention_mass(ref: FullReference, masks: list[torch.Tensor]) -> np.ndarray:
    """[L, H] full-cache attention mass of the first decoding token on the entries of ``masks``
    (per layer [1, H_kv, n + 1] bool)."""
    rows = []
    for layer, mask in enumerate(masks):
        group = ref.probs[layer].shape[0] // mask.shape[1]
        m = mask[0].repeat_interleave(group, dim=0).float()
        rows.append((ref.probs[layer] * m).sum(-1))
    return torch.stack(rows).cpu().numpy()


@torch.no_grad()
def stage1_masks(policy: KVPolicy, bank, selections: list[LayerSelection]) -> list[torch.Tensor]:
    """Per layer [1, H_kv, n + 1]: CriticalKV's stage-1 picks + window + the new token.

    Stage 1 keeps the top ceil(alpha * r_g) older tokens by the pooled score S, with r_g the older
    tokens KV head g keeps (its kept count minus the window), exactly as ``two_stage_mask`` does.
    """
    n = bank.prefill.n
    w = min(policy.window, n)
    masks = []
    for layer, sel in enumerate(selections):
        if not policy.method.base.evicts or n <= policy.budget:
            masks.append(keep_with_token(sel, n))
            continue
        scores = bank.scores(policy, layer)
        r = (sel.lengths - w).clamp_min(0)
        first = stage1_counts(policy.alpha, r)
        eligible = torch.ones_like(scores.attention, dtype=torch.bool)
        stage1 = topk_mask(scores.attention, first, eligible)  # [1, H_kv, m]
        ones = torch.ones(*stage1.shape[:2], w + 1, dtype=torch.bool)
        masks.append(torch.cat([stage1, ones], dim=-1))
    return masks


@torch.no_grad()
def layer_perturbation(ref: FullReference, recorder: FirstStepRecorder) -> dict:
    """Cascade: L1 distance of each decoder layer's output and of the final hidden state vs full."""
    l1 = [float((a - b).abs().sum()) for a, b in zip(recorder.layer_outputs, ref.layer_outputs)]
    scale = [float(b.abs().sum()) for b in ref.layer_outputs]
    final = float((recorder.final - ref.final).abs().sum())
    return {
        "layer_l1": l1,
        "layer_rel": [a / s if s else 0.0 for a, s in zip(l1, scale)],
        "final_l1": final,
        "final_rel": final / float(ref.final.abs().sum()),
    }
