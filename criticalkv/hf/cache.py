"""A compressed KV cache for transformers decoding: only the kept entries are stored.

Layout per layer (like FFY0/AdaKV's flattened cache): the kept prompt entries of every
(sequence, KV head) segment lie back to back in one ``[T, d_h]`` tensor (T = the sum of the kept
lengths, no padding even when heads keep different counts), plus a dense decode tail
``[B, H_kv, capacity, d_h]`` that every head grows by one entry per generated token.

Decoding attends over (segment prefix, tail) with ``packed_attention``, registered in
transformers' ``AttentionInterface`` as ``criticalkv_packed`` and switched on for the decode loop
only (``packed_decoding``). When every segment keeps the same count (snapkv, pyramidkv,
criticalkv, ...) the prefix is viewed as ``[B, H_kv, L, d_h]`` without a copy and attention is one
batched matmul; otherwise it loops over the segments.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from criticalkv.selection import LayerSelection

ATTENTION_NAME = "criticalkv_packed"


def cache_kwargs(model, cache) -> dict:
    """The keyword that hands ``cache`` to ``model``'s forward: transformers 5.24 renamed ``past_key_values`` to
    ``cache`` (the old name still works there, with a deprecation notice); earlier 5.x only know the old one."""
    forward = getattr(model, "forward", model)
    return {"cache": cache} if "cache" in inspect.signature(forward).parameters else {"past_key_values": cache}


def hook_cache(kwargs: dict):
    """The cache an attention module's forward received (``cache`` from transformers 5.24, ``past_key_values`` before)."""
    return kwargs["cache"] if kwargs.get("cache") is not None else kwargs["past_key_values"]


class CompressedLayer:
    """Kept prompt entries of one layer (flattened per segment) + the dense decode tail."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, tail_capacity: int = 0):
        """``keys``/``values`` [T, d_h] in segment order (sequence-major, then KV head, then position);
        ``lengths`` [B, H_kv] kept entries of every segment."""
        self.prefix_keys = keys
        self.prefix_values = values
        self.lengths = lengths.to("cpu", torch.int64)
        self.batch, self.num_kv_heads = self.lengths.shape
        flat = self.lengths.flatten().tolist()
        self.uniform = len(set(flat)) == 1
        self.segment_starts = [0]
        for length in flat:
            self.segment_starts.append(self.segment_starts[-1] + length)
        head_dim = keys.shape[-1]
        shape = (self.batch, self.num_kv_heads, max(tail_capacity, 1), head_dim)
        self.tail_keys = keys.new_zeros(shape)
        self.tail_values = values.new_zeros(shape)
        self.tail_len = 0

    @classmethod
    def from_selection(
        cls, keys: torch.Tensor, values: torch.Tensor, selection: LayerSelection, tail_capacity: int = 0
    ) -> "CompressedLayer":
        """Keep the selected entries of full ``keys``/``values`` [B, H_kv, n, d_h]."""
        mask = selection.mask(keys.shape[2])  # [B, H_kv, n]; boolean indexing walks it in segment order
        return cls(keys[mask].contiguous(), values[mask].contiguous(), selection.lengths, tail_capacity)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add the new tokens' keys/values [B, H_kv, q, d_h] to every segment's tail."""
        q = keys.shape[2]
        if self.tail_len + q > self.tail_keys.shape[2]:  # grow geometrically (rare: capacity is reserved)
            grow = max(self.tail_keys.shape[2], q)
            pad = self.tail_keys.new_zeros(*self.tail_keys.shape[:2], grow, self.tail_keys.shape[3])
            self.tail_keys = torch.cat([self.tail_keys, pad], dim=2)
            self.tail_values = torch.cat([self.tail_values, pad.clone()], dim=2)
        self.tail_keys[:, :, self.tail_len : self.tail_len + q] = keys
        self.tail_values[:, :, self.tail_len : self.tail_len + q] = values
        self.tail_len += q

    def segment(self, b: int, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Kept prompt keys/values [L_bg, d_h] of sequence b, KV head g (views, no copy)."""
        s = b * self.num_kv_heads + g
        lo, hi = self.segment_starts[s], self.segment_starts[s + 1]
        return self.prefix_keys[lo:hi], self.prefix_values[lo:hi]

    def prefix_nbytes(self) -> int:
        return self.prefix_keys.nbytes + self.prefix_values.nbytes

    def tail_nbytes(self) -> int:
        """Bytes of the decode tail actually used (the reserved capacity is ``tail_keys.nbytes * 2``)."""
        per_token = self.batch * self.num_kv_heads * self.tail_keys.shape[3] * self.tail_keys.element_size()
        return 2 * per_token * self.tail_len


@dataclass
class PackedKV:
    """What ``CompressedKVCache.update`` hands to the attention function: the layer itself."""

    layer: CompressedLayer


class CompressedKVCache:
    """Duck-typed transformers ``Cache`` holding one ``CompressedLayer`` per decoder layer.

    The decode loop passes explicit ``position_ids`` (after eviction the RoPE position of a new
    token is its absolute position, not the cache length) and a prepared 4-D attention mask, so
    the model never asks the cache for mask sizes.
    """

    is_compileable = False

    def __init__(self, layers: list[CompressedLayer], seen_tokens: int):
        self.layers = layers
        self.seen_tokens = seen_tokens  # longest absolute length so far (prompt + generated)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        layer.append(key_states, value_states)
        if layer_idx == len(self.layers) - 1:
            self.seen_tokens += key_states.shape[2]
        packed = PackedKV(layer)
        return packed, packed

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def __len__(self) -> int:
        return len(self.layers)

    def kv_nbytes(self) -> int:
        """Bytes of kept prompt entries over all layers (what the eviction saves is relative to this)."""
        return sum(layer.prefix_nbytes() for layer in self.layers)

    def tail_nbytes(self) -> int:
        return sum(layer.tail_nbytes() for layer in self.layers)


def _attend(q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]], scaling: float):
    """softmax(q K^T * scaling) V over the concatenation of ``parts`` without concatenating them.

    q [..., M, d]; each part is (K [..., L, d], V [..., L, d], additive mask broadcastable to [..., M, L] or None).
    Softmax in fp32, like transformers' eager attention; returns [..., M, d] in q's dtype.
    """
    logits = []
    for k, _, mask in parts:
        s = (q @ k.transpose(-1, -2)).float() * scaling
        logits.append(s if mask is None else s + mask)
    probs = torch.softmax(torch.cat(logits, dim=-1), dim=-1).to(q.dtype)
    out, start = None, 0
    for (k, v, _), s in zip(parts, logits):
        term = probs[..., start : start + s.shape[-1]] @ v
        out = term if out is None else out + term
        start += s.shape[-1]
    return out


def packed_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """Attention over a ``CompressedLayer``: query [B, H, q, d_h] -> ([B, q, H, d_h], None)."""
    if not isinstance(key, PackedKV):
        raise TypeError("criticalkv_packed attention runs only on a CompressedKVCache (use criticalkv.hf.generate)")
    if scaling is None:
        scaling = module.head_dim**-0.5
    layer = key.layer
    batch, num_heads, q_len, head_dim = query.shape
    g_size = num_heads // layer.num_kv_heads
    qg = query.reshape(batch, layer.num_kv_heads, g_size * q_len, head_dim)  # query head h = g * G + j
    t = layer.tail_len
    tail_k = layer.tail_keys[:, :, :t]
    tail_v = layer.tail_values[:, :, :t]
    tail_mask = None
    if q_len > 1:  # new token i (tail position t - q + i) sees tail positions <= t - q + i
        rows = torch.arange(t - q_len, t, device=query.device).repeat(g_size)
        blocked = torch.arange(t, device=query.device)[None, :] > rows[:, None]
        tail_mask = torch.zeros(blocked.shape, device=query.device).masked_fill(blocked, float("-inf"))
    if layer.uniform:
        length = layer.segment_starts[1]
        pk = layer.prefix_keys.view(batch, layer.num_kv_heads, length, head_dim)
        pv = layer.prefix_values.view(batch, layer.num_kv_heads, length, head_dim)
        out = _attend(qg, [(pk, pv, None), (tail_k, tail_v, tail_mask)], scaling)
    else:
        out = torch.empty_like(qg)
        for b in range(batch):
            for g in range(layer.num_kv_heads):
                pk, pv = layer.segment(b, g)
                out[b, g] = _attend(qg[b, g], [(pk, pv, None), (tail_k[b, g], tail_v[b, g], tail_mask)], scaling)
    out = out.reshape(batch, num_heads, q_len, head_dim).transpose(1, 2).contiguous()
    return out, None


def _register() -> None:
    AttentionInterface.register(ATTENTION_NAME, packed_attention)


_register()


@contextlib.contextmanager
def packed_decoding(model):
    """Route the model's attention to ``packed_attention`` inside the block (restored afterwards)."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = previous
