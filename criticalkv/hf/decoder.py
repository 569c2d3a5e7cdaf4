"""A compact Llama-family decoder over a transformers model's own modules, for the torch backend.

The weights and the per-layer modules (embeddings, RMSNorms, q/k/v/o projections with Qwen2's biases, Qwen3's q/k
norms, the SiLU-gated MLP, lm_head, tied or not) are the model's; what this file owns is the data flow around
attention, so that

* the prompt runs layer by layer (``prefill_layers``) and each layer's post-RoPE keys, values and window queries are
  handed to a callback right after its attention (the selection), and then dropped: at most one layer's full K/V
  exists at a time;
* one decode step (``decode_step``) runs over per-head KV rows ``[B, H_kv, cap, d_h]`` with per-head lengths: RoPE at
  the absolute positions given (n + t after eviction, not the cache length), the new K/V written at each head's
  length, attention over each head's valid entries (a length mask), with static shapes only, so it can be captured in
  a CUDA graph per batch size;
* N new tokens (``extend``) attend to a row's (or a prefill buffer's) entries and causally to each other, their K/V
  appended at each head's length: chunked prefill and a question after a cached context. The new tokens sit at the
  end of what each head holds, so their mask is causal aligned to the lower right (query j sees the first
  held + j + 1 entries): ``causal_lower_right``, which SDPA runs as flash attention on a GPU (fp16 / bf16), with no
  mask tensor; heads that hold different counts run one such call each.

Query head h reads KV head h // G (G = H / H_kv), as transformers' ``repeat_kv``; attention runs with grouped K/V
(``enable_gqa``, or in a decode step the G query heads of a group as G query rows: transformers' own ``pack_gqa``), so
K/V are never repeated. The prompt's keys and values are projected straight into the [B, H_kv, n, d_h] layout the
selection kernels read (``head_major``): no transposed copy of a layer's K/V before the selection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers.models.llama.modeling_llama import rotate_half

#: ``scaled_dot_product_attention(enable_gqa=...)`` exists from torch 2.5
_SDPA_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


@dataclass(frozen=True)
class DecoderShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


def decoder_shape(model) -> DecoderShape:
    config = model.config
    heads = config.num_attention_heads
    return DecoderShape(
        num_layers=config.num_hidden_layers, num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        hidden_size=config.hidden_size, vocab_size=config.vocab_size)


def head_major(linear: torch.nn.Linear, x: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """``linear(x)`` split into heads as [B, heads, T, head_dim], contiguous: x [B, T, d]. One batched product per
    sequence writes each head's [T, head_dim] block where it belongs (``linear(x).view(B, T, heads, head_dim)
    .transpose(1, 2)`` is a strided view, which a kernel reading [B, heads, T, head_dim] rows must copy first)."""
    b, t, d = x.shape
    weight = linear.weight.view(heads, head_dim, d).transpose(1, 2)  # [heads, d, head_dim], no copy
    bias = None if linear.bias is None else linear.bias.view(heads, 1, head_dim)

    def project(row, out=None):
        rows = x[row].expand(heads, t, d)  # every head reads the same rows (stride 0: no copy)
        if bias is None:
            return torch.bmm(rows, weight, out=out)
        return torch.baddbmm(bias, rows, weight, out=out)

    if b == 1:
        return project(0).unsqueeze(0)
    if torch.is_grad_enabled():  # out= takes no part in autograd: the rows stacked (a copy) where gradients flow
        return torch.stack([project(row) for row in range(b)])
    out = torch.empty(b, heads, t, head_dim, dtype=x.dtype, device=x.device)
    for row in range(b):
        project(row, out[row])
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb`` for one tensor: x [..., d_h], cos/sin broadcastable to it."""
    return x * cos + rotate_half(x) * sin


class CompactDecoder:
    """The model's layers driven for prefill, decode and extend (module docstring). ``max_positions``: positions
    the RoPE tables cover (absolute positions are < max_positions)."""

    def __init__(self, model, max_positions: int):
        self.model = model
        self.shape = decoder_shape(model)
        self.layers = list(model.model.layers)
        self.embed = model.model.embed_tokens
        self.norm = model.model.norm
        self.lm_head = model.lm_head
        self.dtype = self.embed.weight.dtype
        self.device = self.embed.weight.device
        # RoPE of every position once, from the model's own rotary embedding (its scaling type and attention factor):
        # a decode step gathers its rows by position (static shapes, no host work per step)
        positions = torch.arange(max_positions, device=self.device)[None]
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        cos, sin = model.model.rotary_emb(probe, positions)
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()  # [P, d_h]
        self.max_positions = max_positions
        self.scaling = [layer.self_attn.scaling for layer in self.layers]

    # ------------------------------------------------------------------ pieces
    def _qkv(self, layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, contiguous_kv: bool = False):
        """Post-RoPE q [..., H, T, d_h], k, v [..., H_kv, T, d_h] of x [..., T, d] (the layer's input, normalised).
        ``contiguous_kv`` (x [B, T, d]): k and v laid out as [B, H_kv, T, d_h] in memory (``head_major``), as the
        selection reads them; else strided views of the projections (a decode step's or an extend's, copied into the
        KV rows anyway)."""
        attn = layer.self_attn
        s = self.shape
        lead = x.shape[:-1]
        q = attn.q_proj(x).view(*lead, s.num_heads, s.head_dim).transpose(-2, -3)
        if contiguous_kv:
            k = head_major(attn.k_proj, x, s.num_kv_heads, s.head_dim)
            v = head_major(attn.v_proj, x, s.num_kv_heads, s.head_dim)
        else:
            k = attn.k_proj(x).view(*lead, s.num_kv_heads, s.head_dim).transpose(-2, -3)
            v = attn.v_proj(x).view(*lead, s.num_kv_heads, s.head_dim).transpose(-2, -3)
        q_norm = getattr(attn, "q_norm", None)
        if q_norm is not None:  # Qwen3: RMSNorm over d_h of every head before RoPE (layout kept)
            q, k = q_norm(q), attn.k_norm(k)
        cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)  # [..., 1, T, d_h]: every head
        return rope(q, cos, sin), rope(k, cos, sin), v

    def _finish_layer(self, layer, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """h + o_proj(attention) and the MLP block; attended [..., T, H * d_h]."""
        h = h + layer.self_attn.o_proj(attended)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits of hidden states h [..., d]."""
        return self.lm_head(self.norm(h)).float()

    def grouped(self, q: torch.Tensor) -> torch.Tensor:
        """q [B, H, T, d_h] -> [B, H_kv, G * T, d_h]: the G query heads of KV head g as G blocks of T query rows."""
        b, _, t, d = q.shape
        return q.reshape(b, self.shape.num_kv_heads, self.shape.group * t, d)

    def ungrouped(self, out: torch.Tensor, t: int) -> torch.Tensor:
        """Attention output [B, H_kv, G * T, d_h] -> [B, T, H * d_h] (o_proj's input)."""
        b = out.shape[0]
        return out.reshape(b, self.shape.num_heads, t, self.shape.head_dim).transpose(1, 2).reshape(b, t, -1)

    # ------------------------------------------------------------------ prefill
    def prefill_layers(self, input_ids: torch.Tensor, position_ids: torch.Tensor, lengths: torch.Tensor | None,
                       after_attention: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]) -> torch.Tensor:
        """The prompt input_ids [B, n] (left-padded; ``lengths`` [B] of the valid tokens, None when none is padded) at
        position_ids [B, n], layer by layer; ``after_attention(i, q, k, v)`` receives layer i's post-RoPE queries
        [B, H, n, d_h], keys and values [B, H_kv, n, d_h] right after its attention, before o_proj and the MLP (they
        are dropped when it returns, so the MLP's activations never sit beside a layer's full-length Q/K/V). Returns
        the last prompt token's logits [B, vocab] float32.

        Attention is causal SDPA with grouped K/V (``enable_gqa``) and no mask tensor, so a GPU runs flash attention;
        a left-padded batch runs it per sequence over its own valid tokens (varlen, no [B, 1, n, n] mask), and the
        padding positions' outputs are zeros (never read)."""
        b, n = input_ids.shape
        h = self.embed(input_ids)
        cos, sin = self.cos[position_ids], self.sin[position_ids]  # [B, n, d_h]
        starts = None if lengths is None else (n - lengths.to(torch.int64)).tolist()  # one host read per prompt
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, layer.input_layernorm(h), cos, sin, contiguous_kv=True)
            if starts is None:
                attended = self._causal(q, k, v, self.scaling[i])
            else:
                attended = self._causal_rows(q, k, v, starts, self.scaling[i])
            attended = attended.transpose(1, 2).reshape(b, n, -1)
            after_attention(i, q, k, v)
            del q, k, v
            h = self._finish_layer(layer, h, attended)
            del attended
        return self.logits(h[:, -1])

    def _causal(self, q, k, v, scale):
        if _SDPA_GQA:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        g = self.shape.group
        return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True,
                                              scale=scale)

    def _causal_after(self, q, k, v, scale):
        """q [B, H, N, d_h] after the first S - N of k, v [B, H_kv, S, d_h]: query j sees keys 0 .. S - N + j (causal
        aligned to the lower right; a mask-free flash attention call on a GPU in fp16 / bf16, the mask materialised
        elsewhere). Returns [B, H, N, d_h]."""
        n, total = q.shape[2], k.shape[2]
        if n == total:
            return self._causal(q, k, v, scale)
        bias = causal_lower_right(n, total)
        if _SDPA_GQA:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=True)
        g = self.shape.group
        return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=bias,
                                              scale=scale)

    def _causal_rows(self, q, k, v, starts: list[int], scale):
        """Causal attention of a left-padded batch, one sequence at a time over its valid tokens (row b's start at
        ``starts[b]``): q [B, H, n, d_h], k, v [B, H_kv, n, d_h] -> [B, H, n, d_h], zeros at the padding."""
        out = q.new_zeros(q.shape)
        for row, start in enumerate(starts):
            if start >= q.shape[2]:
                continue
            out[row:row + 1, :, start:] = self._causal(q[row:row + 1, :, start:], k[row:row + 1, :, start:],
                                                       v[row:row + 1, :, start:], scale)
        return out

    # ------------------------------------------------------------------ decode
    def decode_step(self, token_ids: torch.Tensor, positions: torch.Tensor, keys: list[torch.Tensor],
                    values: list[torch.Tensor], lengths: torch.Tensor, rows: torch.Tensor, heads: torch.Tensor,
                    slots: list[torch.Tensor], spans: list[int] | None = None,
                    last_slots: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row, static shapes, no host synchronisation (capturable in a CUDA graph).

        token_ids, positions : [B] int64 (absolute positions)
        keys, values : per layer [B, H_kv, cap_l, d_h] (the first B rows of the buffers), written in place
        lengths : [L, B, H_kv] int64 valid entries per head, incremented in place (a row whose head is full writes
            its new entry into the last slot: only free rows a padded batch runs over may be)
        rows, heads : [B, H_kv] int64 index grids; slots : per layer [cap_l] int64 (arange)
        spans : per layer the entries per head attention reads (every held entry and the new one of the real rows must
            lie below it; None: the whole capacity)
        last_slots : [L, 1, 1] int64, each layer's capacity - 1 (the clamp of the write slot; None: from the buffers)
        Returns logits [B, vocab] float32.
        """
        b = token_ids.shape[0]
        h = self.embed(token_ids)[:, None]  # [B, 1, d]
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [B, 1, d_h]
        # where each head's new entry goes: its length, clamped into the buffer (a real row has room, checked on the
        # host; a free row a padded batch runs over may not), for every layer at once
        if last_slots is None:
            last_slots = torch.tensor([k.shape[2] - 1 for k in keys], device=lengths.device)[:, None, None]
        at = torch.minimum(lengths, last_slots)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, layer.input_layernorm(h), cos, sin)  # [B, H, 1, d_h], [B, H_kv, 1, d_h]
            count = lengths[i]
            keys[i][rows, heads, at[i]] = k[:, :, 0]
            values[i][rows, heads, at[i]] = v[:, :, 0]
            span = keys[i].shape[2] if spans is None else spans[i]
            valid = slots[i][:span] <= count[..., None]  # [B, H_kv, span]: the held entries and the new one
            out = F.scaled_dot_product_attention(self.grouped(q), keys[i][:, :, :span], values[i][:, :, :span],
                                                 attn_mask=valid[:, :, None, :], scale=self.scaling[i])  # [B, H_kv, G, d_h]
            h = self._finish_layer(layer, h, self.ungrouped(out, 1))
        lengths += 1
        return self.logits(h[:, 0])

    # ------------------------------------------------------------------ extend
    def extend(self, token_ids: torch.Tensor, positions: torch.Tensor, keys: list[torch.Tensor],
               values: list[torch.Tensor], lengths: list[torch.Tensor], used: list[int], window: int,
               equal_heads: bool, layer_input: Callable[[int, torch.Tensor], None] | None = None,
               after_attention: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """N new tokens of one sequence over its entries, appended at each head's length.

        token_ids, positions : [1, N] int64 (absolute positions)
        keys, values : per layer [1, H_kv, cap_l, d_h] (a buffer row or a prefill buffer), written in place
        lengths : per layer [1, H_kv] int64 valid entries per head (+= N in place)
        used : per layer the longest head's length (known on the host; used[l] + N <= cap_l)
        equal_heads : every head holds ``used[l]`` entries (a prefill buffer, a policy that keeps equal lengths):
            one mask for all heads
        layer_input : ``layer_input(i, h)`` gets layer i's attention input h [1, N, d] (after input_layernorm): a
            method's streams (``criticalkv.methods.phases.Stream``)
        after_attention : ``after_attention(i, q, k)`` gets layer i's post-RoPE queries [1, H, N, d_h] and the keys
            they attended [1, H_kv, used + N, d_h] (the past's, then the new ones): a re-read pass's scores
        Returns the last token's logits [1, vocab] float32 and per layer the post-RoPE queries of the last
        min(N, window) tokens [1, H, w', d_h].
        """
        n_new = token_ids.shape[1]
        h = self.embed(token_ids)
        cos, sin = self.cos[positions], self.sin[positions]  # [1, N, d_h]
        s = self.shape
        new = torch.arange(n_new, device=h.device)
        # what each head holds before the new tokens, known on the host (one read per call): a head's keys are its
        # first held + N slots, the new ones last
        held = None if equal_heads else torch.stack([c.reshape(-1) for c in lengths]).tolist()
        queries = []
        for i, layer in enumerate(self.layers):
            normed = layer.input_layernorm(h)
            if layer_input is not None:
                layer_input(i, normed)
            q, k, v = self._qkv(layer, normed, cos, sin)  # [1, H, N, d_h], [1, H_kv, N, d_h]
            span = used[i] + n_new
            count = lengths[i]  # [1, H_kv]
            at = count[..., None] + new  # [1, H_kv, N]: each head's next slots
            grid = torch.arange(s.num_kv_heads, device=h.device)[None, :, None].expand_as(at)
            keys[i][torch.zeros_like(at), grid, at] = k
            values[i][torch.zeros_like(at), grid, at] = v
            if equal_heads:  # query j (at slot used + j) sees slots <= used + j: causal, aligned to the lower right
                out = self._causal_after(q, keys[i][:, :, :span], values[i][:, :, :span], self.scaling[i])
            else:  # head g's query j (at slot held_g + j) sees its held entries and the new ones up to j
                g = s.group
                heads = [self._causal_after(q[:, kv * g:(kv + 1) * g], keys[i][:, kv:kv + 1, :held[i][kv] + n_new],
                                            values[i][:, kv:kv + 1, :held[i][kv] + n_new], self.scaling[i])
                         for kv in range(s.num_kv_heads)]
                out = torch.cat(heads, dim=1)
            if after_attention is not None:
                after_attention(i, q, keys[i][:, :, :span])
            h = self._finish_layer(layer, h, out.transpose(1, 2).reshape(1, n_new, -1))
            count += n_new
            queries.append(q[:, :, -min(n_new, window):])
        return self.logits(h[:, -1]), queries
