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


def naive_expected_scores(p, q, k, v, o):
    """Expected attention, loop by loop (arXiv 2510.00636, from its definition; RoPE's default angles, base 10000):
    every window query rotated by each of the next ``future_positions`` offsets and averaged, the Gaussian's
    closed-form logits, softmax over the non-sink keys. Returns (own score A ||v||_2, C with P = A_h) [H_kv, m]."""
    heads, w_all, d = q.shape
    kv_heads, n, _ = k.shape
    group = heads // kv_heads
    w = min(p.window, n)
    m = n - w
    theta = 1.0 / (10000.0 ** (np.arange(0, d, 2) / d))
    A, C = np.zeros((kv_heads, m)), np.zeros((kv_heads, m))
    for h in range(heads):
        g = h // group
        rows = []
        for j in range(w):
            x = q[h, w_all - w + j]
            e = w - j  # query j sits e positions before the next one
            carried = np.zeros(d)
            for t in range(e, e + p.future_positions):
                ang = np.concatenate([t * theta, t * theta])
                rotated = np.concatenate([-x[d // 2:], x[: d // 2]])
                carried += x * np.cos(ang) + rotated * np.sin(ang)
            rows.append(carried / p.future_positions)
        X = np.array(rows)
        mu = X.mean(0)
        sigma = (X - mu).T @ (X - mu) / w
        logits = np.array([k[g, i] @ mu / math.sqrt(d) + k[g, i] @ sigma @ k[g, i] / (2 * d) for i in range(n)])
        logits[: p.sink_tokens] = -np.inf
        e_ = np.exp(logits - logits[p.sink_tokens:].max())
        probs = (e_ / e_.sum())[:m]
        A[g] += probs / group
        proj = v[g, :m] @ o[:, h * d : (h + 1) * d].T
        norm = np.abs(proj).sum(1) if p.value_norm == "l1" else np.sqrt((proj**2).sum(1))
        C[g] += (probs + p.epsilon) * norm / group
    return A * np.sqrt((v[:, :m] ** 2).sum(-1)), C


def naive_kvzip_scores(p, q, k, v, o):
    """kvzip without a reconstruction (the window's queries score): S = the max over the group's heads and the window
    queries of the window attention (not pooled), C = (S + epsilon) x the group's mean projected-value norm.
    [H_kv, m] each."""
    heads, _, d = q.shape
    kv_heads, n, _ = k.shape
    group = heads // kv_heads
    w = min(p.window, n)
    m = n - w
    S, C = np.zeros((kv_heads, m)), np.zeros((kv_heads, m))
    norms = np.zeros((kv_heads, m))
    for h in range(heads):
        g = h // group
        for j in range(w):
            visible = n - w + j + 1
            logits = q[h, -w + j] @ k[g, :visible].T / math.sqrt(d)
            e = np.exp(logits - logits.max())
            row = np.zeros(n)
            row[:visible] = e / e.sum()
            S[g] = np.maximum(S[g], row[:m])
        proj = v[g, :m] @ o[:, h * d : (h + 1) * d].T
        norms[g] += (np.abs(proj).sum(1) if p.value_norm == "l1" else np.sqrt((proj**2).sum(1))) / group
    C = (S + p.epsilon) * norms
    return S, C


def naive_keydiff_scores(k):
    """KeyDiff (one unpadded sequence), key by key: 1 - the cosine between a key and the mean of every key's unit
    vector (the window included). [H_kv, n]."""
    kv_heads, n, _ = k.shape
    S = np.zeros((kv_heads, n))
    for g in range(kv_heads):
        anchor = sum(k[g, j] / np.linalg.norm(k[g, j]) for j in range(n)) / n
        for i in range(n):
            S[g, i] = 1.0 - k[g, i] @ anchor / (np.linalg.norm(k[g, i]) * np.linalg.norm(anchor))
    return S


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
    if p.base == "defensivekv":
        return naive_defensive_select(p, q, k, v, o, min(layer_selectable_budget(p, layer_idx, num_layers), m))
    r = min(layer_selectable_budget(p, layer_idx, num_layers), m)
    older = [range(m)] * kv_heads
    sinks = set()
    if p.base in ("expected-attention", "kvzip"):
        S, C = (naive_expected_scores if p.base == "expected-attention" else naive_kvzip_scores)(p, q, k, v, o)
        sinks = set(range(p.sink_tokens))  # kept first, inside the budget
        r = min(r - p.sink_tokens, m - p.sink_tokens)
        older = [range(p.sink_tokens, m)] * kv_heads
    elif p.base == "keydiff":
        S = naive_keydiff_scores(k)[:, :m]
    else:
        S, C, L = naive_scores(p, q, k, v, o)

    def two_stage(g, count):
        first = stage1_count(p.alpha, count)
        s1 = top({i: S[g, i] for i in older[g]}, first, list(older[g]))
        rest = [i for i in older[g] if i not in s1]
        return s1 | top({i: C[g, i] for i in rest}, count - first, rest)

    if p.base in ("snapkv", "pyramidkv", "expected-attention", "keydiff"):
        chosen = [two_stage(g, r) if p.two_stage else top(dict(enumerate(S[g])), r, list(older[g])) for g in range(kv_heads)]
        chosen = [c | sinks for c in chosen]
    else:
        scores = L if p.base == "laprox" else S
        floor = head_floor(p.ada_floor, r)
        safe = [top(dict(enumerate(scores[g])), floor, list(older[g])) for g in range(kv_heads)]
        pool = {(g, i): scores[g, i] for g in range(kv_heads) for i in older[g] if i not in safe[g]}
        shared = top(pool, kv_heads * (r - floor), list(pool))
        chosen = [safe[g] | {i for (gg, i) in shared if gg == g} for g in range(kv_heads)]
        if p.two_stage:
            chosen = [two_stage(g, len(chosen[g])) for g in range(kv_heads)]
        chosen = [c | sinks for c in chosen]
    return [sorted(c | set(range(m, n))) for c in chosen]


def naive_defensive_scores(p, q, k, v, o):
    """DefensiveKV, loop by loop: defensive score D, stage-1 mass M [H_kv, m] and the layer's window mass."""
    heads, _, d = q.shape
    kv_heads, n, _ = k.shape
    group = heads // kv_heads
    w = min(p.window, n)
    m = n - w
    half = p.pool_kernel // 2
    worst = np.zeros((kv_heads, m))
    mean_attention = np.zeros((kv_heads, m))
    norms = np.zeros((kv_heads, m))
    window_mass = 0.0
    for h in range(heads):
        g = h // group
        for j in range(w):
            visible = n - w + j + 1
            logits = q[h, -w + j] @ k[g, :visible].T / math.sqrt(d)
            e = np.exp(logits - logits.max())
            row = np.zeros(n)
            row[:visible] = e / e.sum()
            older = row[:m]
            window_mass += row[m:].sum() / (heads * w)
            mean_attention[g] += older / (group * w)
            box = np.array([older[max(0, i - half) : i + half + 1].sum() / p.pool_kernel for i in range(m)])
            pooled = box / box.sum() * older.sum()
            worst[g] = np.maximum(worst[g], pooled)
        proj = v[g, :m] @ o[:, h * d : (h + 1) * d].T
        norms[g] += (np.abs(proj).sum(1) if p.value_norm == "l1" else np.sqrt((proj**2).sum(1))) / group
    D = np.zeros((kv_heads, m))
    M = np.zeros((kv_heads, m))
    for g in range(kv_heads):
        D[g] = np.maximum(worst[g], worst[g].mean()) * norms[g] / norms[g].sum()
        M[g] = mean_attention[g] / mean_attention[g].sum()
    return D, M, window_mass


def naive_defensive_select(p, q, k, v, o, r):
    """defensivekv: stage 1 by cumulative mass (< stage1_mass - window mass, at most r), then AdaKV sharing."""
    kv_heads, n, _ = k.shape
    m = n - min(p.window, n)
    D, M, window_mass = naive_defensive_scores(p, q, k, v, o)
    first = []
    for g in range(kv_heads):
        order = sorted(range(m), key=lambda i: (-M[g, i], i))
        total, chosen = 0.0, set()
        for i in order:
            total += M[g, i]
            if total >= p.stage1_mass - window_mass or len(chosen) == r:
                break
            chosen.add(i)
        first.append(chosen)
    rank = {(g, i): D[g, i] + (2.0 if i in first[g] else 0.0) for g in range(kv_heads) for i in range(m)}
    floor = head_floor(p.ada_floor, r)
    safe = [top({i: rank[g, i] for i in range(m)}, floor, list(range(m))) for g in range(kv_heads)]
    pool = {key: value for key, value in rank.items() if key[1] not in safe[key[0]]}
    shared = top(pool, kv_heads * (r - floor), list(pool))
    return [sorted(safe[g] | {i for (gg, i) in shared if gg == g} | set(range(m, n))) for g in range(kv_heads)]
