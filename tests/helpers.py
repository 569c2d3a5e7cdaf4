"""Random inputs shared by the tests."""

import torch


def random_layer(batch=1, heads=9, kv_heads=3, n=96, head_dim=16, hidden=48, window=8, seed=0, dtype=torch.float32):
    """Random post-RoPE queries [B, H, w, d_h], keys/values [B, H_kv, n, d_h] and o_proj [d, H*d_h]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, window, head_dim, generator=g) * 2
    k = torch.randn(batch, kv_heads, n, head_dim, generator=g)
    v = torch.randn(batch, kv_heads, n, head_dim, generator=g) * torch.rand(batch, kv_heads, n, 1, generator=g) * 3
    o = torch.randn(hidden, heads * head_dim, generator=g) / (heads * head_dim) ** 0.5
    return q.to(dtype), k.to(dtype), v.to(dtype), o.to(dtype)
