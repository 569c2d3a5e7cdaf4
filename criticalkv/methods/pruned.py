"""Exact pruning of CriticalKV's stage 2: the same kept entries, the L1 value norms of a few candidates only.

Stage 2 keeps the top k = r_g - b1 of the non-stage-1 older tokens by C_i = mean_h (P_{h,i} + eps) N_{h,i} with
N_{h,i} = ||v_i W_O^h||_1 (``gqa_reduce=kvpress``: (mean_h P + eps) mean_h N). Computing every N costs one
``o_proj``-sized product over the prompt. Since ||x||_1 <= sqrt(d) ||x||_2 and ||v W||_2^2 = v (W W^T) v^T through
the d_h x d_h Gram matrix (d / d_h times cheaper), every C_i has an upper bound U_i; the tokens are ranked by U, the
exact C computed for the best ``m`` candidates only, and the search stops when the best bound left out, inflated by
the float32 margin ``stop_margin``, is strictly below the k-th exact score: no token left out can then reach the
top k (ties included), so the kept set is the unpruned one. Otherwise ``m`` doubles. docs/operator.md, step 6a,
derives the bound and the margin.

Bit stability: the exact L1 norms go through ``l1_norms_rows``, fixed-shape GEMMs of 64-row blocks, so a token's norm is the
same float whether it is computed among the candidates or with the whole prompt (``value_projection_norms`` uses
the same function): pruned and unpruned selections then agree even on exact and near ties.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

from criticalkv.methods.budget import stage1_count
from criticalkv.methods.lazy import torch
from criticalkv.methods.topk import topk_mask

#: Whether the pruned stage 2 runs (how the operator runs; ``unpruned()`` turns it off for the code run inside it, to
#: compare with the unpruned path): a context variable, so a comparison in one thread or task changes nothing elsewhere.
_PRUNED: contextvars.ContextVar[bool] = contextvars.ContextVar("criticalkv_pruned_stage2", default=True)


def enabled() -> bool:
    """Whether the pruned stage 2 runs here (the PyTorch reference and the ONNX body the exporter writes)."""
    return _PRUNED.get()


@contextlib.contextmanager
def pruning(on: bool):
    """Run the code inside with the pruned stage 2 on or off (``with pruning(False): ...``: the unpruned path, the
    same kept entries by construction; the benchmarks and tests that compare the two use it)."""
    token = _PRUNED.set(bool(on))
    try:
        yield
    finally:
        _PRUNED.reset(token)
#: Rows per GEMM block of the exact L1 norms, and blocks per batched product (every call has this shape).
NORM_BLOCK = 64
NORM_CALL_BLOCKS = 4
#: First candidate count = CANDIDATE_FACTOR * k; it doubles until the stop rule holds.
CANDIDATE_FACTOR = 2
#: The per-head bound is computed for the best PREFILTER_FACTOR * k tokens by the group bound only (the others keep
#: the group bound, looser but still an upper bound of C).
PREFILTER_FACTOR = 6
#: float32 unit roundoff (round to nearest)
UNIT_ROUNDOFF = 2.0 ** -24
#: Absolute slack for flushed subnormals (a product below the smallest normal float may read as 0).
TINY = 2.0 ** -126


def gamma(k: int) -> float:
    """gamma_k = k u / (1 - k u): the relative error bound of a k-term float32 sum or dot product (any order)."""
    return k * UNIT_ROUNDOFF / (1 - k * UNIT_ROUNDOFF)


def stop_margin(hidden: int, group: int) -> float:
    """Relative margin rho of the stop rule: ``fl(C_i) <= fl(U_i) * (1 + rho)`` for every token.

    The bound U_i is already an upper bound of the computed N (rounding of the direct product included, see
    ``BoundTerms``) up to the relative error of the final sum of |x_j| (gamma_d), and C_i and U_i are the same
    float operations on P + eps (G-term sum, one product and one division each, nonnegative terms): a factor
    (1 + gamma_d)(1 + gamma_{G+2}) / (1 - gamma_{G+10})^2 covers them; rho is twice that excess (second-order
    terms and the rounding of the stop test's own product). SmolLM2 (d 576, G 3): 7.3e-5; Llama-3-8B (4096, 4): 4.9e-4.
    """
    return 2.0 * (gamma(hidden) + gamma(group + 2) + 2 * gamma(group + 10))


@dataclass
class BoundTerms:
    """Weights-only terms of the upper bound of ||v W_O^h||_1 for the heads of one KV group (fp32).

    gram : [k, d_h, d_h] W_O^h W_O^h^T;  row_l1 : [k, d_h] s_h = sum_j |W_O^h[:, j]|;  col_l1 : [k] c_h = max_j
    sum_r |W_O^h[r, j]|;  hidden : d.

    With x = v W (exact), the computed direct norm satisfies fl(||x||_1) <= (1 + gamma_d) (||x||_1 + gamma_{d_h} a)
    with a = |v| . s_h, and the computed Gram form q = fl(v G v^T) satisfies ||x||_2^2 <= q + gamma_{d + 2 d_h + 2} b
    with b = a * max_r |v_r| * c_h (>= |v|^T |W||W|^T |v|). So ``upper`` = sqrt(d) sqrt(max(q, 0) + gamma b)
    + gamma_{d_h} a (+ a subnormal slack) bounds the computed L1 norm up to (1 + gamma_d) and its own few roundings.
    """

    gram: torch.Tensor
    row_l1: torch.Tensor
    col_l1: torch.Tensor
    hidden: int

    @staticmethod
    def of(w_heads: torch.Tensor) -> "BoundTerms":
        """``w_heads`` [k, d_h, d] fp32: W_O^h of each head."""
        return BoundTerms(w_heads @ w_heads.transpose(1, 2), w_heads.abs().sum(-1), w_heads.abs().sum(1).amax(-1),
                          w_heads.shape[-1])

    def squared_l2(self, v: torch.Tensor) -> torch.Tensor:
        """[..., k, c]: fl(v G_h v^T) for ``v`` [..., c, d_h] (the Gram path: also the exact ``value_norm=l2``)."""
        v = v.unsqueeze(-3)  # [..., 1, c, d_h]
        return ((v @ self.gram) * v).sum(-1)

    def upper(self, v: torch.Tensor) -> torch.Tensor:
        """[..., k, c] upper bound of the computed ||v W_O^h||_1 (up to ``stop_margin``), ``v`` [..., c, d_h] fp32."""
        absv = v.abs()
        a = (absv @ self.row_l1.t()).transpose(-1, -2)  # [..., k, c]
        b = a * absv.amax(-1).unsqueeze(-2) * self.col_l1[:, None]
        return self.l1_from(self.squared_l2(v), a, b, v.shape[-1], 0)

    def l1_from(self, q: torch.Tensor, a: torch.Tensor, b: torch.Tensor, d_h: int, extra_ops: int) -> torch.Tensor:
        """sqrt(d) sqrt(max(q, 0) + gamma_{d + 2 d_h + 2 + extra_ops} b) + gamma_{d_h} a + the subnormal slack: the
        bound from a computed Gram form q and its rounding terms a and b."""
        d = self.hidden
        l2 = (q.clamp_min(0) + gamma(d + 2 * d_h + 2 + extra_ops) * b).sqrt()
        return (d ** 0.5) * l2 + gamma(d_h) * a + TINY * d * (d_h + 2)

    def group_upper(self, v: torch.Tensor) -> torch.Tensor:
        """[..., c] upper bound of the mean over the k heads of the computed ||v W_O^h||_1 (up to ``stop_margin``),
        from one quadratic form with the mean Gram matrix: k times cheaper than ``upper``.

        mean_h ||x_h||_1 <= sqrt(d) mean_h ||x_h||_2 <= sqrt(d) sqrt(mean_h ||x_h||_2^2) (the square root is concave)
        and mean_h ||x_h||_2^2 = v (mean_h G_h) v^T; the rounding terms are the heads' means (a-bar = |v| . mean_h s_h,
        b-bar = max|v| |v| . mean_h c_h s_h), the Gram path's gamma counting the mean's k + 1 extra operations.
        """
        q = ((v @ self.gram.mean(0)) * v).sum(-1)
        absv = v.abs()
        a = absv @ self.row_l1.mean(0)
        b = (absv @ (self.col_l1[:, None] * self.row_l1).mean(0)) * absv.amax(-1)
        return self.l1_from(q, a, b, v.shape[-1], self.gram.shape[0] + 1)


def l1_norms_rows(rows: torch.Tensor, w_cat: torch.Tensor, heads: int) -> torch.Tensor:
    """||row W_O^h||_1 for every row and head, in fixed-shape GEMMs: [R, heads] fp32.

    ``rows`` [R, d_h] (any float dtype, computed in fp32); ``w_cat`` [d_h, heads * d]: the heads' W_O^h side by
    side. Rows go in calls of ``NORM_CALL_BLOCKS`` blocks of ``NORM_BLOCK`` rows (zero padded), each call the same
    [blocks, 64, d_h] x [d_h, heads * d] batched product, so a row's norm does not depend on which other rows are
    computed with it (a single-row product takes another BLAS path and other roundings; a fixed shape also keeps
    a GPU library on one algorithm).
    """
    count, d_h = rows.shape
    if count == 0:
        return torch.empty(0, heads, dtype=torch.float32, device=rows.device)
    per_call = NORM_BLOCK * NORM_CALL_BLOCKS
    padded = torch.nn.functional.pad(rows.float(), (0, 0, 0, (-count) % per_call))
    weights = w_cat.expand(NORM_CALL_BLOCKS, *w_cat.shape)
    out = []
    for start in range(0, padded.shape[0], per_call):
        blocks = padded[start : start + per_call].view(NORM_CALL_BLOCKS, NORM_BLOCK, d_h)
        projected = torch.bmm(blocks, weights)  # [blocks, 64, heads * d]
        out.append(projected.abs().view(per_call, heads, -1).sum(-1))
    return torch.cat(out)[:count]


def combine_critical(p: torch.Tensor, norms: torch.Tensor, epsilon: float, gqa_reduce: str) -> torch.Tensor:
    """C [..., c] from the heads' attention P and norms N [..., G, c] (the same float ops for every subset)."""
    if gqa_reduce == "mean":
        return ((p + epsilon) * norms).mean(dim=-2)
    return (p.mean(dim=-2) + epsilon) * norms.mean(dim=-2)  # kvpress: product of the means


def combine_group_bound(p: torch.Tensor, mean_bound: torch.Tensor, epsilon: float, gqa_reduce: str) -> torch.Tensor:
    """[..., c] upper bound of C from the heads' attention P [..., G, c] and ``group_upper`` [..., c]:
    mean_h (P_h + eps) N_h <= max_h (P_h + eps) mean_h N_h (``gqa_reduce=mean``); kvpress' C is already a product
    with mean_h N_h."""
    if gqa_reduce == "mean":
        return (p + epsilon).amax(dim=-2) * mean_bound
    return (p.mean(dim=-2) + epsilon) * mean_bound


@dataclass
class DeferredCritical:
    """CriticalKV's stage-2 score of one KV group, computed on demand (for some tokens or all).

    p : [B, G, m] the heads' attention (pooled or raw); values : [B, m, d_h]; w_cat : [d_h, G * d];
    full_norms : () -> [B, G, m], the (memoised) L1 norms of every older token, through ``l1_norms_rows``.
    """

    p: torch.Tensor
    values: torch.Tensor
    w_cat: torch.Tensor
    epsilon: float
    gqa_reduce: str
    full_norms: object
    terms: BoundTerms | None = None

    def rows(self, b: int, index: torch.Tensor) -> torch.Tensor:
        """C of sequence ``b`` at the older positions ``index`` [c] (int64): [c] fp32."""
        group = self.p.shape[1]
        norms = l1_norms_rows(self.values[b, index], self.w_cat, group).t()  # [G, c]
        return combine_critical(self.p[b][:, index], norms, self.epsilon, self.gqa_reduce)

    def head_bounds(self, b: int, index: torch.Tensor) -> torch.Tensor:
        """U of sequence ``b`` at ``index`` [c] from the per-head bounds (``BoundTerms.upper``): [c] fp32."""
        return combine_critical(self.p[b][:, index], self.terms.upper(self.values[b, index]), self.epsilon,
                                self.gqa_reduce)

    def full(self) -> torch.Tensor:
        """C of every older token: [B, m]."""
        return combine_critical(self.p, self.full_norms(), self.epsilon, self.gqa_reduce)


@dataclass
class PruningStats:
    """What the pruned stage 2 computed: per call (layer), summed over its heads and sequences, ``computed`` exact
    scores, ``eligible`` stage-2 candidates, ``older`` older tokens (what the unpruned path computes), ``rounds``
    the most candidate rounds a head needed (1: the first 2k candidates sufficed)."""

    calls: list = field(default_factory=list)

    def reset(self) -> None:
        self.calls.clear()

    def fraction(self) -> float:
        """Exact norms computed over the older tokens' norms the unpruned stage 2 computes."""
        older = sum(c["older"] for c in self.calls)
        return sum(c["computed"] for c in self.calls) / older if older else 0.0


#: Filled by every pruned stage 2 (``computed``: exact norms computed; ``eligible``: stage-2 candidates there were;
#: ``rounds``: candidate doublings per head). Read by tests and scripts; reset it before a run.
STATS = PruningStats()


def pruned_topk_row(bound: torch.Tensor, exact, k: int, eligible: torch.Tensor, margin: float,
                    refine=None) -> tuple[torch.Tensor, int, int]:
    """The ``topk_mask`` of the exact scores of one head, computing ``exact`` for as few tokens as the bound allows.

    bound : [m] upper bounds (fp32); exact : index [c] -> [c] exact scores; k : count; eligible : [m] bool;
    margin : ``stop_margin``; refine : index [c] -> [c] tighter upper bounds, computed for the best
    ``PREFILTER_FACTOR * k`` tokens by ``bound`` (each token keeps the smaller of its two bounds).
    Returns (mask [m] bool, exact scores computed, rounds).
    """
    m = bound.shape[0]
    mask = torch.zeros(m, dtype=torch.bool, device=bound.device)
    count = int(eligible.sum())
    if k <= 0:
        return mask, 0, 0
    if k >= count:  # every eligible token is kept, whatever its score
        return eligible.clone(), 0, 0
    keyed = bound.masked_fill(~eligible, float("-inf"))
    if refine is not None:  # both are upper bounds of C: their minimum is one too
        top = torch.topk(keyed, min(PREFILTER_FACTOR * k, count)).indices
        keyed[top] = torch.minimum(keyed[top], refine(top))
    order = torch.sort(keyed, descending=True, stable=True).indices[:count]  # eligible tokens, best bound first
    c = min(CANDIDATE_FACTOR * k, count)
    full = torch.full((m,), float("-inf"), dtype=torch.float32, device=bound.device)
    chosen = torch.zeros(m, dtype=torch.bool, device=bound.device)
    done = rounds = 0
    while True:  # each round computes only the new candidates (a token's exact score never depends on the others)
        rounds += 1
        fresh = order[done:c]
        full[fresh] = exact(fresh)
        chosen[fresh] = True
        done = c
        if c >= count:
            break
        kth = torch.topk(full[order[:c]], k).values[-1]
        if float(keyed[order[c]]) * (1 + margin) < float(kth):  # no token left out can reach the k-th exact score
            break
        c = min(2 * c, count)
    return topk_mask(full, k, chosen), c, rounds


def pruned_stage2(bound: torch.Tensor, deferred: list[DeferredCritical], k: torch.Tensor, eligible: torch.Tensor,
                  margin: float) -> torch.Tensor:
    """[B, H_kv, m] the top ``k`` [B, H_kv] eligible tokens by the exact stage-2 score, ties to the lower index.

    ``bound`` [B, H_kv, m]: upper bounds of the scores; ``deferred[g]`` computes group g's exact scores.
    """
    batch, heads, m = bound.shape
    out = torch.zeros(batch, heads, m, dtype=torch.bool, device=bound.device)
    computed = rounds = 0
    for b in range(batch):
        for g in range(heads):
            refine = None if deferred[g].terms is None else (lambda idx, b=b, g=g: deferred[g].head_bounds(b, idx))
            mask, c, r = pruned_topk_row(bound[b, g], lambda idx, b=b, g=g: deferred[g].rows(b, idx), int(k[b, g]),
                                         eligible[b, g], margin, refine)
            out[b, g] = mask
            computed += c
            rounds = max(rounds, r)
    STATS.calls.append({"computed": computed, "eligible": int(eligible.sum()), "older": batch * heads * m, "rounds": rounds})
    return out


def norm_flops(n: int, budget: int, window: int, alpha: float, heads: int, head_dim: int, hidden: int,
               candidate_factor: int = CANDIDATE_FACTOR, kv_heads: int | None = None,
               prefilter_factor: int = PREFILTER_FACTOR) -> dict[str, float]:
    """Multiply-add FLOPs (2 per multiply-add) of one layer's stage-2 value norms for an n-token prompt, unpruned
    and pruned (first candidate round accepted; ``candidate_factor`` k candidates per KV head, each read by the G
    heads of its group). The Gram matrices are weights only (computed at export), not counted.

    unpruned : 2 n H d_h d (the projection) + n H d (the |x| sums);  bound : the group bound over every token,
    n H_kv (2 d_h^2 + 6 d_h) (one quadratic form per KV head, plus its rounding terms), then the per-head bound over
    the best ``prefilter_factor`` k tokens, (2 d_h^2 + 6 d_h) per token and query head;  exact : the unpruned
    formula over c = factor * k candidates.
    """
    kv_heads = heads if kv_heads is None else kv_heads
    m = n - window
    r = budget - window
    k = r - stage1_count(alpha, r)
    c = min(candidate_factor * k, m)
    per_token = 2.0 * head_dim * head_dim + 6.0 * head_dim
    unpruned = 2.0 * m * heads * head_dim * hidden + m * heads * hidden
    bound = m * kv_heads * per_token + min(prefilter_factor * k, m) * heads * per_token
    exact = 2.0 * c * heads * head_dim * hidden + c * heads * hidden
    return {"unpruned": unpruned, "bound": bound, "exact": exact, "pruned": bound + exact,
            "ratio": unpruned / (bound + exact), "candidates": c, "stage2_count": k}
