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


def straddling_masses(m: int, seed: int):
    """Normalised masses [m] (fp32, descending order not assumed) and a float32 stage-1 limit that a float32 running sum
    of the sorted masses (ONNX Runtime's CumSum) and a double one (torch's CPU cumsum) put on different sides: the case
    where summation precision decided defensivekv's stage-1 count (issue 22). Returns (mass, limit, k): at k + 1 tokens
    the two sums straddle the limit."""
    import numpy as np

    rng = np.random.default_rng(seed)
    mass = rng.random(m).astype(np.float32)
    mass /= mass.sum(dtype=np.float32)
    ordered = np.sort(mass)[::-1]
    single = np.cumsum(ordered)  # float32, sequential
    double = np.cumsum(ordered.astype(np.float64)).astype(np.float32)
    apart = np.nonzero(single != double)[0]
    assert len(apart), "no straddle at this size"
    k = int(apart[len(apart) // 2])
    lo, hi = sorted((single[k], double[k]))
    limit = np.nextafter(lo, np.float32(2))  # lo < limit <= hi
    return torch.from_numpy(mass), float(limit), k
