"""The torch backend's decoder (``criticalkv.hf.decoder``) against the forms it replaced: the prompt's keys and values
projected straight into the selection's [B, H_kv, n, d_h] layout (no transposed copy) give the strided projections'
numbers; an extend's causal attention aligned to the lower right (flash attention on a GPU, one call per head when the
heads hold different counts) gives what the dense mask over grouped query rows gave."""

import pytest
import torch
import torch.nn.functional as F

from criticalkv.hf.decoder import CompactDecoder, head_major
from hf.conftest import tiny_model


def strided_kv(layer, x, shape):
    """The former projection: k, v as strided views [B, H_kv, T, d_h] of [B, T, H_kv * d_h]."""
    attn = layer.self_attn
    b, t, _ = x.shape
    return tuple(proj(x).view(b, t, shape.num_kv_heads, shape.head_dim).transpose(1, 2)
                 for proj in (attn.k_proj, attn.v_proj))


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])  # qwen2: k/v biases; qwen3: k_norm on the heads
def test_the_prompt_keys_and_values_come_contiguous_with_the_strided_projections_numbers(model_type):
    torch.manual_seed(0)
    model = tiny_model(model_type, seed=3)
    decoder = CompactDecoder(model, 256)
    shape = decoder.shape
    x = torch.randn(2, 37, shape.hidden_size)
    layer = decoder.layers[1]
    for proj, old in zip((layer.self_attn.k_proj, layer.self_attn.v_proj), strided_kv(layer, x, shape)):
        new = head_major(proj, x, shape.num_kv_heads, shape.head_dim)
        assert new.is_contiguous() and not old.is_contiguous() and new.shape == old.shape
        torch.testing.assert_close(new, old, rtol=1e-5, atol=1e-6)
    # the whole prefill: what after_attention receives is contiguous, and the model's own forward agrees
    ids = torch.randint(1, 128, (1, 45), generator=torch.Generator().manual_seed(1))
    seen = []

    def after_attention(i, q, k, v):
        assert k.is_contiguous() and v.is_contiguous(), f"layer {i}: the selection would copy K/V"
        seen.append((k.clone(), v.clone()))

    with torch.no_grad():
        logits = decoder.prefill_layers(ids, torch.arange(45)[None], None, after_attention)
        out = model(ids, use_cache=True)
    torch.testing.assert_close(logits, out.logits[:, -1].float(), rtol=1e-4, atol=1e-5)
    for i, (k, v) in enumerate(seen):
        torch.testing.assert_close(k, out.past_key_values.layers[i].keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, out.past_key_values.layers[i].values, rtol=1e-5, atol=1e-5)


def dense_extend(decoder, token_ids, positions, keys, values, lengths, used, equal_heads):
    """The former extend: a dense mask over the G query heads of each KV head as G blocks of N rows, SDPA with a mask.
    Returns the last token's logits (keys, values and lengths written in place as ``extend`` does)."""
    n_new = token_ids.shape[1]
    h = decoder.embed(token_ids)
    cos, sin = decoder.cos[positions], decoder.sin[positions]
    s = decoder.shape
    new = torch.arange(n_new)
    for i, layer in enumerate(decoder.layers):
        q, k, v = decoder._qkv(layer, layer.input_layernorm(h), cos, sin)
        span = used[i] + n_new
        count = lengths[i]
        at = count[..., None] + new
        grid = torch.arange(s.num_kv_heads)[None, :, None].expand_as(at)
        keys[i][torch.zeros_like(at), grid, at] = k
        values[i][torch.zeros_like(at), grid, at] = v
        slot = torch.arange(span)
        if equal_heads:
            mask = (slot[None, :] <= used[i] + new[:, None])[None, None]
        else:
            mask = slot[None, None, None, :] <= (count[..., None] + new)[..., None]
        mask = mask.repeat(1, 1, s.group, 1)
        out = F.scaled_dot_product_attention(decoder.grouped(q), keys[i][:, :, :span], values[i][:, :, :span],
                                             attn_mask=mask, scale=decoder.scaling[i])
        h = decoder._finish_layer(layer, h, decoder.ungrouped(out, n_new))
        count += n_new
    return decoder.logits(h[:, -1])


@pytest.mark.parametrize("held, n_new", [((0, 0), 20), ((40, 40), 17), ((40, 40), 1), ((29, 41), 9), ((41, 3), 12)])
def test_an_extend_on_lower_right_causal_attention_is_the_dense_masks(held, n_new):
    """Equal heads (a prefill buffer: the first chunk, a later one, one token) and heads that hold different counts
    (a row compressed by a per-head policy, the slots past a short head's length holding another sequence's
    entries): the same logits, buffers and window queries as the dense mask."""
    torch.manual_seed(0)
    model = tiny_model("llama", seed=5)
    decoder = CompactDecoder(model, 256)
    s = decoder.shape
    cap = max(held) + n_new + 5
    generator = torch.Generator().manual_seed(sum(held) + n_new)
    base_keys = [torch.randn(1, s.num_kv_heads, cap, s.head_dim, generator=generator) for _ in range(s.num_layers)]
    base_values = [torch.randn(1, s.num_kv_heads, cap, s.head_dim, generator=generator) for _ in range(s.num_layers)]
    equal = held[0] == held[1]
    ids = torch.randint(1, 128, (1, n_new), generator=generator)
    positions = torch.arange(max(held), max(held) + n_new)[None] + 7  # positions after an eviction: not the counts

    def state():
        return ([k.clone() for k in base_keys], [v.clone() for v in base_values],
                [torch.tensor([list(held)]) for _ in range(s.num_layers)])

    with torch.no_grad():
        keys, values, lengths = state()
        logits, queries = decoder.extend(ids, positions, keys, values, lengths, [max(held)] * s.num_layers, 4, equal)
        ref_keys, ref_values, ref_lengths = state()
        want = dense_extend(decoder, ids, positions, ref_keys, ref_values, ref_lengths, [max(held)] * s.num_layers,
                            equal)
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    for got, ref in zip(keys + values, ref_keys + ref_values):  # a later layer's input rounds differently by ~1e-7
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(got, ref) for got, ref in zip(lengths, ref_lengths))
    assert all(q.shape == (1, s.num_heads, min(n_new, 4), s.head_dim) for q in queries)
