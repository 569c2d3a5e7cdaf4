"""An independent, loop-by-loop float64 NumPy oracle of the operator (one unpadded sequence).

Written from the operator's definition (ARCHITECTURE.md, "The operator") rather than from the
vectorised reference, so that a slip in the reference's masking, pooling or ranking shows up.
"""

import math

import numpy as np

from criticalkv.selection import head_floor, layer_selectable_budget, stage1_count


def top(scores, k, candidates):
    """The k best candidates by score, ties toward the lower index (candidates are (key, index) pairs)."""
    return set(sorted(candidates, key=lambda c: (-scores[c], c))[:k])


def naive_scores(p, q, k, v, o):
    """S, C, LaProx importance: [H_kv, m] float64 arrays for one sequence."""
    heads, _, d = q.shape
    kv_heads, n, _ = k.shape
    group = heads // kv_heads
    w = min(p.window, n)
    m = n - w
    S, Pm, Nm, C, L = (np.zeros((kv_heads, m)) for _ in range(5))
    for h in range(heads):
        g = h // group
        A = np.zeros((w, n))
        for j in range(w):
            visible = n - w + j + 1
            logits = q[h, -w + j] @ k[g, :visible].T / math.sqrt(d)
            e = np.exp(logits - logits.max())
            A[j, :visible] = e / e.sum()
        mean = A.mean(0)[:m]
        half = p.pool_kernel // 2
        pooled = np.array([mean[max(0, i - half) : i + half + 1].max() for i in range(m)])
        proj = v[g, :m] @ o[:, h * d : (h + 1) * d].T  # [m, hidden]
        norm = np.abs(proj).sum(1) if p.value_norm == "l1" else np.sqrt((proj**2).sum(1))
        P = pooled if p.stage2_scores == "pooled" else mean
        S[g] += pooled / group
        C[g] += (P + p.epsilon) * norm / group
        Pm[g] += P / group
        Nm[g] += norm / group
        L[g] += np.sqrt((A[:, :m] ** 2).sum(0)) * np.sqrt((proj**2).sum(1))
    if p.gqa_reduce == "kvpress":
        C = (Pm + p.epsilon) * Nm
    return S, C, L


def naive_select(p, q, k, v, o, layer_idx=0, num_layers=1):
    """Kept positions of every KV head: a list of sorted lists. q [H, w, d_h], k/v [H_kv, n, d_h], o [d, H*d_h]."""
    q, k, v, o = (np.asarray(x, dtype=np.float64) for x in (q, k, v, o))
    kv_heads, n, _ = k.shape
    if p.name == "full" or n <= p.budget:
        return [list(range(n))] * kv_heads
    if p.name == "streamingllm":
        keep = set(range(p.sink_tokens)) | set(range(n - (p.budget - p.sink_tokens), n))
        return [sorted(keep)] * kv_heads
    w = min(p.window, n)
    m = n - w
    S, C, L = naive_scores(p, q, k, v, o)
    r = min(layer_selectable_budget(p, layer_idx, num_layers), m)
    older = [range(m)] * kv_heads

    def two_stage(g, count):
        first = stage1_count(p.alpha, count)
        s1 = top({i: S[g, i] for i in older[g]}, first, list(older[g]))
        rest = [i for i in older[g] if i not in s1]
        return s1 | top({i: C[g, i] for i in rest}, count - first, rest)

    if p.base in ("snapkv", "pyramidkv"):
        chosen = [two_stage(g, r) if p.two_stage else top(dict(enumerate(S[g])), r, list(older[g])) for g in range(kv_heads)]
    else:
        scores = L if p.base == "laprox" else S
        floor = head_floor(p.ada_floor, r)
        safe = [top(dict(enumerate(scores[g])), floor, list(older[g])) for g in range(kv_heads)]
        pool = {(g, i): scores[g, i] for g in range(kv_heads) for i in older[g] if i not in safe[g]}
        shared = top(pool, kv_heads * (r - floor), list(pool))
        chosen = [safe[g] | {i for (gg, i) in shared if gg == g} for g in range(kv_heads)]
        if p.two_stage:
            chosen = [two_stage(g, len(chosen[g])) for g in range(kv_heads)]
    return [sorted(c | set(range(m, n))) for c in chosen]
