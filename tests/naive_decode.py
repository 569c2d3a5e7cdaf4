"""A float64 NumPy oracle of one decode step over per-head kept KV entries, written from the Llama-family definition
(RMSNorm, RoPE with rotate_half, grouped-query attention, SwiGLU MLP) and the exported weights, not from the graph
builder: the reference the fused and the portable decode graphs are both measured against (the flash-attention way:
the fused graph's error may be at most twice the portable graph's).
"""

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x * cos + rotate_half(x) * sin over the last axis (d_h); cos, sin broadcast."""
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


def decode_step(arrays: dict, spec, tokens, positions, keys, values, lengths) -> np.ndarray:
    """Logits [B, vocab] float64 of one new token per sequence.

    arrays : the export's weights (``collect_weights(model, spec).arrays``: float32, taken as exact values);
    spec : ``ModelSpec``; tokens, positions : [B] int (absolute positions); keys, values : per layer
    [B, H_kv, >= max length, d_h] (post-RoPE keys, as the engine's buffers hold them); lengths : per layer [B, H_kv]
    (head g of row b attends its first lengths[b, g] entries and the new token's own).
    """
    def w(name, default=None):  # float64 when used (a whole float64 copy of a 135M model would be 1 GB)
        return default if default is not None and name not in arrays else np.asarray(arrays[name], np.float64)

    H, Hkv, d, eps = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rms_norm_eps
    G = H // Hkv
    tokens, positions = np.asarray(tokens), np.asarray(positions, dtype=np.float64)
    batch = len(tokens)
    angles = positions[:, None] * w("inv_freq")[None, :]  # [B, d_h/2]
    cos = np.concatenate([np.cos(angles)] * 2, axis=-1) * spec.rope_attention_scaling  # [B, d_h]
    sin = np.concatenate([np.sin(angles)] * 2, axis=-1) * spec.rope_attention_scaling
    x = np.asarray(arrays["embed_tokens"][tokens], np.float64)  # [B, d]
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        h = rms_norm(x, w(p + "input_layernorm"), eps)
        qkv = h @ w(p + "qkv_proj") + w(p + "qkv_bias", 0.0)
        heads = qkv.reshape(batch, H + 2 * Hkv, d)
        q, k, v = heads[:, :H], heads[:, H:H + Hkv], heads[:, H + Hkv:]
        if spec.qk_norm:  # Qwen3: RMSNorm over d_h per head (weights [H + H_kv, 1, d_h])
            norm = w(p + "qk_norm")[:, 0, :]
            q, k = rms_norm(q, norm[:H], eps), rms_norm(k, norm[H:], eps)
        q, k = rotate(q, cos[:, None], sin[:, None]), rotate(k, cos[:, None], sin[:, None])
        attn = np.zeros((batch, H, d))
        for b in range(batch):
            for head in range(H):
                g = head // G
                n = int(lengths[i][b, g])
                ks = np.concatenate([np.asarray(keys[i][b, g, :n], np.float64), k[b, g][None]])
                vs = np.concatenate([np.asarray(values[i][b, g, :n], np.float64), v[b, g][None]])
                scores = ks @ q[b, head] / np.sqrt(d)
                probs = np.exp(scores - scores.max())
                attn[b, head] = probs @ vs / probs.sum()
        x = x + attn.reshape(batch, H * d) @ w(p + "o_proj").T + w(p + "o_bias", 0.0)
        h = rms_norm(x, w(p + "post_attention_layernorm"), eps)
        gate, up = np.split(h @ w(p + "gate_up_proj"), 2, axis=-1)
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w(p + "down_proj")
    head = w("lm_head") if "lm_head" in arrays else w("embed_tokens")
    return rms_norm(x, w("norm"), eps) @ head.T
