"""The ``CriticalKVSelect`` node and its model-local ONNX function body (standard operators only).

Stock ONNX Runtime runs the node by inlining the body; TensorRT maps the node to the plugin (the
TensorRT flavour of the prefill graph carries the node without a body). The body computes exactly
``criticalkv.selection.select_layer`` (see docs/operator.md):

* window attention of the last w queries over all n keys (causal inside the window, left padding
  masked with the float32 minimum, as the reference), mean over the window, max-pool over the
  m = n - w older positions only (padded with -inf: a border position pools over the positions
  that exist);
* value norms with one ``MatMul`` per layer covering every KV group and all its query heads
  (l1: ``V [B, H_kv, m, d_h] @ W [H_kv, d_h, G*d]`` then ``ReduceL1``; l2: the d_h x d_h Gram matrices);
* top-k with the tie rule "equal scores go to the lower index" made exact without relying on
  ``TopK``'s tie order: ``TopK`` only supplies the k-th largest *value* t (values are the same
  whatever order a runtime breaks ties in); every score > t is kept, and of the scores == t the
  first ``k - #(> t)`` by position (an exclusive ``CumSum`` over the equal ones);
* kept positions ascending (``TopK`` smallest of ``where(keep, position, n)``: the keys are unique),
  -1 padded, and the K/V rows gathered with ``GatherND(batch_dims=2)``, zero padded.

Integer rules that depend only on the policy (pyramid per-layer r_l, ``ceil(alpha * r)``, the per-head
floor) are tabulated at export from ``criticalkv.methods.budget`` over every count that can occur and
looked up in the graph, so they are the reference's numbers exactly. The body is generated for the
model's policy; the per-layer values ``layer_idx`` and ``capacity`` are read from the node's attributes
(``ref_attr_name``). A prompt whose padded length n is at most the budget skips the scoring (an ``If``).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper, numpy_helper

from criticalkv.export.graph import BOOL, FLOAT, INT32, INT64, IR_VERSION, OPSET, GraphBuilder, live_nodes, value_info
from criticalkv.methods.budget import head_floor, layer_selectable_budget, stage1_count
from criticalkv.methods.pruned import TINY, UNIT_ROUNDOFF, gamma
from criticalkv.node import (
    BRANCH_NODES,
    DOMAIN,
    INPUTS,
    LAYER_ATTRIBUTES,
    OP_TYPE,
    OPSET_VERSION,
    OUTPUTS,
    ROTATION_INPUT,
    SCORES_INPUT,
    node_attributes,
    node_capacity,
    node_inputs,
)
from criticalkv.policy import KVPolicy

FLOAT32_MIN = float(np.finfo(np.float32).min)


def selection_tables(policy: KVPolicy, num_layers: int, num_kv_heads: int) -> dict[str, np.ndarray]:
    """The integer lookup tables the body uses (int64).

    ``stage1[r]`` = ceil(alpha * r) for every r a head can be given (up to H_kv * max r_l under shared
    allocation, at any per-request budget); ``floor[r]``: the per-head floor. Each layer's r_l for every
    budget comes from the node's ``layer_budgets`` attribute.
    """
    r_layer = [max(layer_selectable_budget(policy, i, num_layers), 0) for i in range(num_layers)]
    r_max = max(r_layer)
    return {
        "stage1": np.array([stage1_count(policy.alpha, r) for r in range(num_kv_heads * r_max + 1)], dtype=np.int64),
        "floor": np.array([head_floor(policy.ada_floor, r) for r in range(r_max + 1)], dtype=np.int64),
    }


class _Body:
    """Writes the function body into a GraphBuilder (one method per step of docs/operator.md)."""

    #: whether step 4 computes every older entry's critical score (CriticalKV's stage 2) instead of the pruned path's
    #: bound: a model-level score node, whose heads' counts are known only after the last layer
    exact_critical = False

    def __init__(self, g: GraphBuilder, policy: KVPolicy, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int):
        self.g = g
        self.policy = policy
        self.num_layers = num_layers
        self.heads = num_heads
        self.kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.tables = selection_tables(policy, num_layers, num_kv_heads)
        self.rotation = ROTATION_INPUT if policy.method.base.needs_rotation else None

    @staticmethod
    def where_bool(g: GraphBuilder, cond: str, a: str, b: str) -> str:
        """``Where`` for bool tensors (ONNX Runtime's CPU ``Where`` has no bool kernel)."""
        return g.Or(g.And(cond, a), g.And(g.Not(cond), b))

    # ------------------------------------------------------------------ top-k with the tie rule
    def topk_mask(self, g: GraphBuilder, scores: str, k: str, eligible: str, rank: int = 3) -> str:
        """[..., M] bool: the k (int64 [...]) highest eligible scores, equal scores to the lower index.

        ``rank`` of ``scores``: axes are given as non-negative numbers (onnx.reference 1.23's
        GatherElements mishandles axis -1)."""
        last = rank - 1
        s = g.Where(eligible, scores, g.const(-np.inf, np.float32))
        kmax = g.Max(g.reshape(g.ReduceMax(k, keepdims=0), [1]), g.i64(1))
        values = g.op("TopK", s, kmax, outputs=2, axis=last, largest=1, sorted=1)[0]
        k1 = g.unsqueeze(k, -1)
        kth = g.GatherElements(values, g.Max(g.Sub(k1, g.scalar(1)), g.scalar(0)), axis=last)
        greater = g.Greater(s, kth)
        equal = g.Equal(s, kth)
        need = g.Sub(k1, g.ReduceSum(g.Cast(greater, to=INT64), g.i64(-1), keepdims=1))
        tie_rank = g.CumSum(g.Cast(equal, to=INT64), g.scalar(last), exclusive=1)
        take = g.Or(greater, g.And(equal, g.Less(tie_rank, need)))
        return g.And(g.And(take, eligible), g.Greater(k1, g.scalar(0)))

    def stage1_count(self, g: GraphBuilder, r: str) -> str:
        """ceil(alpha * r) for the int64 tensor ``r`` (looked up in the export-time table)."""
        return g.Gather(g.const(self.tables["stage1"], hint="stage1_table"), r)

    def head_floor(self, g: GraphBuilder, r: str) -> str:
        """The per-head floor of shared allocation for the int64 tensor ``r`` (export-time table)."""
        return g.Gather(g.const(self.tables["floor"], hint="floor_table"), r)

    # ------------------------------------------------------------------ scores
    def value_norms(self, g: GraphBuilder, values_m: str, kind: str) -> str:
        """[B, H_kv, G, m] float: ||V_{g,i} W_O^h|| for every query head h = g * G + j."""
        o_proj = self.o_proj
        d = self.head_dim
        if kind == "l1":
            # W [D, H*d_h] -> [H_kv, d_h, G*D]: one MatMul per layer covers every group and its heads
            w = g.Transpose(g.reshape(o_proj, [-1, self.kv_heads, self.group, d]), perm=[1, 3, 2, 0])
            w = g.reshape(w, [self.kv_heads, d, -1])
            projected = g.reshape(g.MatMul(values_m, w), [0, 0, 0, self.group, -1])  # [B, H_kv, m, G, D]
            norms = g.ReduceL1(projected, g.i64(-1), keepdims=0)  # [B, H_kv, m, G]
            return g.Transpose(norms, perm=[0, 1, 3, 2])
        return g.Sqrt(g.Max(self.gram_quadratic(g, values_m), g.const(0.0, np.float32)))

    def head_weights(self, g: GraphBuilder) -> str:
        """[H, d_h, D]: W_O^h of every query head."""
        return g.Transpose(g.reshape(self.o_proj, [-1, self.heads, self.head_dim]), perm=[1, 2, 0])

    def bound_terms(self, g: GraphBuilder) -> tuple[str, str, str]:
        """Weights-only terms of the bounds (``pruned.BoundTerms``), per KV group and head: G_h = W_O^h W_O^h^T
        [H_kv, G, d_h, d_h], s_h = row L1 sums [H_kv, G, d_h], c_h = the largest column L1 sum [H_kv, G, 1]."""
        d_h = self.head_dim
        w = self.head_weights(g)  # [H, d_h, D]
        gram = g.reshape(g.MatMul(w, g.Transpose(w, perm=[0, 2, 1])), [self.kv_heads, self.group, d_h, d_h])
        row_l1 = g.reshape(g.ReduceL1(w, g.i64(2), keepdims=0), [self.kv_heads, self.group, d_h])
        col_l1 = g.reshape(g.ReduceMax(g.ReduceL1(w, g.i64(1), keepdims=0), g.i64(1), keepdims=0),
                           [self.kv_heads, self.group, 1])
        return gram, row_l1, col_l1

    def gram_quadratic(self, g: GraphBuilder, values_m: str) -> str:
        """[B, H_kv, G, m] fl(v G_h v^T) through the Gram matrices G_h = W_O^h W_O^h^T [d_h, d_h] (weights only)."""
        v = g.unsqueeze(values_m, 2)  # [B, H_kv, 1, m, d_h]
        return g.ReduceSum(g.Mul(g.MatMul(v, self.bound_terms(g)[0]), v), g.i64(-1), keepdims=0)

    # ------------------------------------------------------------------ pruned stage 2 (criticalkv/methods/pruned.py)
    def hidden_float(self, g: GraphBuilder) -> str:
        """d (rows of ``o_proj``) as a float32 [1]."""
        return g.Cast(g.shape_of(self.o_proj, 0, 1), to=FLOAT)

    def gamma(self, g: GraphBuilder, k: str) -> str:
        """gamma_k = k u / (1 - k u) for the float32 tensor ``k``."""
        ku = g.Mul(k, g.const(UNIT_ROUNDOFF, np.float32))
        return g.Div(ku, g.Sub(g.const(1.0, np.float32), ku))

    def l1_bound_from(self, g: GraphBuilder, q: str, a: str, b: str, extra_ops: int) -> str:
        """sqrt(d) sqrt(max(q, 0) + gamma_{d + 2 d_h + 2 + extra_ops} b) + gamma_{d_h} a + the subnormal slack: the
        bound of ``BoundTerms`` from a computed Gram form q and its rounding terms a and b (any common shape)."""
        d = self.hidden_float(g)
        d_h = float(self.head_dim)
        q = g.Max(q, g.const(0.0, np.float32))
        gamma2 = self.gamma(g, g.Add(d, g.const(2 * d_h + 2 + extra_ops, np.float32)))
        l2 = g.Sqrt(g.Add(q, g.Mul(gamma2, b)))
        tiny = g.Mul(d, g.const(TINY * (d_h + 2), np.float32))
        return g.Add(g.Add(g.Mul(g.Sqrt(d), l2), g.Mul(g.const(gamma(self.head_dim), np.float32), a)), tiny)

    def l1_upper_bounds(self, g: GraphBuilder, values_m: str) -> str:
        """[B, H_kv, G, m] ``BoundTerms.upper``: an upper bound of every computed ||v W_O^h||_1 (up to the margin)."""
        _, row_l1, col_l1 = self.bound_terms(g)
        absv = g.Abs(values_m)  # [B, H_kv, m, d_h]
        a = g.Transpose(g.MatMul(absv, g.Transpose(row_l1, perm=[0, 2, 1])), perm=[0, 1, 3, 2])  # [B, H_kv, G, m]
        b = g.Mul(g.Mul(a, g.unsqueeze(g.ReduceMax(absv, g.i64(-1), keepdims=0), 2)), g.unsqueeze(col_l1, 0))
        return self.l1_bound_from(g, self.gram_quadratic(g, values_m), a, b, 0)

    def group_upper_bounds(self, g: GraphBuilder, values_m: str) -> str:
        """[B, H_kv, m] ``BoundTerms.group_upper``: an upper bound of the mean over each group's heads of the computed
        ||v W_O^h||_1, through one quadratic form with the group's mean Gram matrix (G times cheaper than
        ``l1_upper_bounds``)."""
        gram, row_l1, col_l1 = self.bound_terms(g)
        mean_gram = g.ReduceMean(gram, g.i64(1), keepdims=0)  # [H_kv, d_h, d_h]
        q = g.ReduceSum(g.Mul(g.MatMul(values_m, mean_gram), values_m), g.i64(-1), keepdims=0)  # [B, H_kv, m]
        absv = g.Abs(values_m)
        sums = g.concat(g.ReduceMean(row_l1, g.i64(1), keepdims=1), g.ReduceMean(g.Mul(row_l1, col_l1), g.i64(1), keepdims=1),
                        axis=1)  # [H_kv, 2, d_h]: mean_h s_h, mean_h c_h s_h
        at = g.MatMul(absv, g.Transpose(sums, perm=[0, 2, 1]))  # [B, H_kv, m, 2]
        a = g.squeeze(g.slice_axis(at, 0, 1, axis=3), 3)
        b = g.Mul(g.squeeze(g.slice_axis(at, 1, 2, axis=3), 3), g.ReduceMax(absv, g.i64(-1), keepdims=0))
        return self.l1_bound_from(g, q, a, b, self.group + 1)

    def stop_margin(self, g: GraphBuilder) -> str:
        """[1] float32 ``pruned.stop_margin(d, G)`` (d read from ``o_proj``)."""
        rho = g.Add(self.gamma(g, self.hidden_float(g)),
                    g.const(gamma(self.group + 2) + 2 * gamma(self.group + 10), np.float32))
        return g.Mul(rho, g.const(2.0, np.float32))

    def pruned_topk(self, g: GraphBuilder, bound: str, k: str, eligible: str, exact, full) -> str:
        """[B, H_kv, m] bool: ``topk_mask`` of the exact stage-2 scores computed for as few tokens as the bound allows.

        ``bound`` [B, H_kv, m] upper bounds, ``k`` [B, H_kv] int64, ``eligible`` [B, H_kv, m]; ``exact(gb, index)``
        writes the exact scores [B, H_kv, c] of the positions ``index`` [B, H_kv, c]; ``full(gb)`` those of every
        older token. Try the best 2 k_max by the bound, then 4 k_max (an ``If``), then every token (its else branch);
        a try stands when every head passes the stop rule.
        """
        keyed = g.Where(eligible, bound, g.const(-np.inf, np.float32))
        kmax = g.Max(g.reshape(g.ReduceMax(k, keepdims=0), [1]), g.i64(1))
        margin = self.stop_margin(g)
        ninf = g.const(-np.inf, np.float32)
        m = g.shape_of(keyed, 2, 3)
        first, second = (g.Min(g.Mul(kmax, g.i64(factor)), m) for factor in (2, 4))
        # one ranking for both tries (so the second extends the first): the best 4 k_max + 1 bounds
        top, index = g.op("TopK", keyed, g.Min(g.Add(second, g.i64(1)), m), outputs=2, axis=2, largest=1, sorted=1)
        padded = g.concat(top, g.Expand(ninf, g.concat(g.shape_of(top, 0, 2), g.i64(1))), axis=2)

        def attempt(gb: GraphBuilder, c: str, done: str | None, earlier: str | None) -> tuple[str, str, str]:
            """Candidates index[:c]; the exact scores of index[:done] are ``earlier``. Returns (mask, ok, scores)."""
            fresh = gb.slice_axis(index, done if done is not None else 0, c, axis=2)
            # GatherND rather than GatherElements: onnx.reference 1.23 gathers elements with np.choose (<= 64 values)
            fresh_scores = gb.Where(gb.GatherND(eligible, gb.unsqueeze(fresh, -1), batch_dims=2), exact(gb, fresh), ninf)
            scores = fresh_scores if earlier is None else gb.concat(earlier, fresh_scores, axis=2)  # [B, H_kv, c]
            candidates = gb.slice_axis(index, 0, c, axis=2)
            following = gb.squeeze(gb.slice_axis(padded, c, gb.Add(c, gb.i64(1)), axis=2), 2)  # the best bound left out
            spread = gb.ScatterElements(gb.Expand(ninf, gb.Shape(keyed)), candidates, scores, axis=2)
            mask = self.topk_mask(gb, spread, k, gb.Greater(spread, ninf))
            kth_values = gb.op("TopK", scores, gb.Min(kmax, c), outputs=2, axis=2, largest=1, sorted=1)[0]
            kth = gb.GatherND(kth_values, gb.unsqueeze(gb.Max(gb.Sub(k, gb.scalar(1)), gb.scalar(0)), 2), batch_dims=2)
            ok = gb.Or(gb.Or(gb.LessOrEqual(k, gb.scalar(0)), gb.Equal(following, ninf)),
                       gb.Less(gb.Mul(following, gb.Add(margin, gb.const(1.0, np.float32))), kth))
            all_ok = gb.Cast(gb.ReduceMin(gb.Cast(ok, to=INT64), keepdims=0), to=BOOL)
            return mask, all_ok, scores

        mask2k, ok2k, scores2k = attempt(g, first, None, None)
        retry = g.child()
        mask4k, ok4k, _ = attempt(retry, second, first, scores2k)  # only the candidates 2 k_max .. 4 k_max are new
        fallback = retry.child()
        # the accepting Identity nodes are named so that a profile tells which branch ran (BRANCH_NODES)
        # (an And with the eligible mask there, a no-op that ONNX Runtime's optimizer cannot remove as it does an Identity)
        all_mask = fallback.op("And", self.topk_mask(fallback, full(fallback), k, eligible), eligible, name=g.fresh(BRANCH_NODES[2]))
        accept4k = retry.child()
        accepted4k = accept4k.op("Identity", mask4k, name=g.fresh(BRANCH_NODES[1]))
        inner = retry.op("If", ok4k,
                         then_branch=accept4k.graph("stage2_4k", [], [value_info(accepted4k, BOOL, None)]),
                         else_branch=fallback.graph("stage2_all", [], [value_info(all_mask, BOOL, None)]),
                         hint="stage2_retry", name=g.fresh("stage2_if_4k"))
        accept2k = g.child()
        accepted2k = accept2k.op("Identity", mask2k, name=g.fresh(BRANCH_NODES[0]))
        return g.op("If", ok2k,
                    then_branch=accept2k.graph("stage2_2k", [], [value_info(accepted2k, BOOL, None)]),
                    else_branch=retry.graph("stage2_retry", [], [value_info(inner, BOOL, None)]),
                    hint="stage2", name=g.fresh("stage2_if_2k"))

    def compressed_keep(self, g: GraphBuilder, ctx: dict[str, str]) -> str:
        """[B, H_kv, n] bool keep mask when n > budget (sequences of at most budget tokens kept whole)."""
        p = self.policy
        method = p.method
        lens, valid_h, batch = ctx["lens"], ctx["valid_h"], ctx["batch"]
        compress = g.reshape(g.Greater(lens, ctx["budget"]), [-1, 1, 1])
        if not method.base.scored:
            return self.where_bool(g, compress, method.base.onnx_unscored_keep(self, g, ctx), valid_h)
        scores, eligible, r, w = self.window_scores(g, ctx)
        # 5-6. budget sharing, then the refinement inside each head's share (or the base's own choice)
        allocation = method.base.onnx_allocate(self, g, scores, eligible, r)
        if method.refine is not None:
            counts = allocation.counts
            if counts is None:
                counts = g.ReduceSum(g.Cast(allocation.mask, to=INT64), g.i64(-1), keepdims=0)
            older = method.refine.onnx_choose(self, g, scores, counts, eligible)
        elif allocation.mask is not None:
            older = allocation.mask
        else:
            older = self.topk_mask(g, scores[method.base.score_name], allocation.counts, eligible)
        if self.sink is not None:
            older = g.Or(older, self.sink)
        window = g.Expand(g.const(True, np.bool_), g.concat(batch, g.i64(self.kv_heads), w))
        chosen = g.concat(older, window, axis=-1)
        return self.where_bool(g, compress, chosen, valid_h)

    def window_attention(self, g: GraphBuilder, q: str, ctx: dict[str, str], w: str, m: str) -> tuple[str, str]:
        """Step 1, the window's own attention, query head h = g * G + j, rows (j, t): q [B, H, w, d_h] (the window
        queries) -> (probs [B, H_kv, G, w, m], raw [B, H_kv, G, m] = every older column's mean over the window)."""
        n, pos, valid = ctx["n"], ctx["pos"], ctx["valid"]
        w_s, m_s = g.squeeze(w, 0), g.squeeze(m, 0)
        q = g.reshape(q, [0, self.kv_heads, -1, self.head_dim])
        logits = g.Div(g.MatMul(q, g.Transpose(ctx["keys"], perm=[0, 1, 3, 2])), g.const(math.sqrt(self.head_dim), np.float32))
        logits = g.Reshape(logits, g.concat(g.i64(0, self.kv_heads, self.group, -1), n))
        query_pos = g.Add(g.Range(g.scalar(0), w_s, g.scalar(1)), m_s)
        causal = g.Greater(g.unsqueeze(pos, 0), g.unsqueeze(query_pos, 1))  # [w, n]
        padding = g.reshape(g.Not(valid), [0, 1, 1, 1, -1])  # [B, 1, 1, 1, n]
        # an additive mask [B, 1, 1, w, n]: FLOAT32_MIN + a finite logit rounds to FLOAT32_MIN, so this equals
        # Where(mask, FLOAT32_MIN, logits) (the reference) at a third of its time on ONNX Runtime's CPU
        bias = g.Where(g.Or(causal, padding), g.const(FLOAT32_MIN, np.float32), g.const(0.0, np.float32))
        logits = g.Add(logits, bias)
        softmax = g.Softmax(logits, axis=-1)
        probs = g.slice_axis(softmax, 0, m, axis=4)  # [B, H_kv, G, w, m] (ONNX Runtime drops it when no method reads it)
        # Ā [B, H_kv, G, m]: the mean over the window of every column, then the older columns (not a slice of probs:
        # a copy of [B, H_kv, G, w, m] saved; each column's mean is the same sum)
        raw = g.slice_axis(g.ReduceMean(softmax, g.i64(3), keepdims=0), 0, m, axis=3)
        return probs, raw

    def window_scores(self, g: GraphBuilder, ctx: dict[str, str]) -> tuple[dict[str, str], str, str, str]:
        """Steps 1-4 for a prompt longer than the budget: (scores {name: [B, H_kv, m] float}, eligible [B, H_kv, m]
        bool, r [B] int64 (older tokens per head at this budget, clamped to the valid ones), w [1] int64)."""
        p = self.policy
        method = p.method
        n, lens, valid_h = ctx["n"], ctx["lens"], ctx["valid_h"]
        w = g.Min(g.i64(p.window), n)  # [1]
        m = g.Sub(n, w)
        # 1. the window's attention [B, H_kv, G, w, m] (or the method's own: expected-attention)
        q = g.Slice(ctx["queries"], g.Neg(w), g.i64(np.iinfo(np.int64).max), g.i64(2))  # [B, H, w, d_h]
        own = method.base.onnx_attention_rows(self, g, g.reshape(q, [0, self.kv_heads, self.group, -1, self.head_dim]),
                                              ctx["keys"], ctx, w, m)
        probs, raw = own if own is not None else self.window_attention(g, q, ctx, w, m)
        # 2. pool over the older positions only
        pooled = raw
        if p.pool_kernel > 1 and method.base.pools:
            # explicit -inf padding rather than MaxPool's pads (onnx.reference 1.23 mis-sizes padded 1-D pools)
            half = p.pool_kernel // 2
            padded = g.Pad(g.Reshape(raw, g.concat(g.i64(-1, 1), m)), g.i64(0, 0, half, 0, 0, half),
                           g.const(-np.inf, np.float32), mode="constant")
            pooled = g.MaxPool(padded, kernel_shape=[p.pool_kernel], strides=[1])
            pooled = g.Reshape(pooled, g.Shape(raw))
        scores = {"attention": g.ReduceMean(pooled, g.i64(2), keepdims=0)}  # S [B, H_kv, m]
        eligible = g.slice_axis(valid_h, 0, m, axis=2)
        self.eligible = eligible  # [B, H_kv, m] bool, read by methods whose scores exclude the padding
        r_layer = g.Gather(ctx["layer_budgets"], g.Sub(ctx["budget"], g.scalar(p.window)))  # r_l at this budget
        sinks = method.base.sinks(p)
        self.sink = None
        if sinks:  # the first valid tokens, kept inside the budget: not eligible, and r shrinks by as many
            positions = g.slice_axis(ctx["pos"], 0, m, axis=0)  # [m]
            first = g.Less(g.unsqueeze(positions, 0), g.unsqueeze(g.Add(ctx["valid_start"], g.scalar(sinks)), 1))
            self.sink = g.And(eligible, g.unsqueeze(first, 1))  # [B, H_kv, m]
            eligible = g.And(eligible, g.Not(self.sink))
            r_layer = g.Max(g.Sub(r_layer, g.scalar(sinks)), g.scalar(0))
            r = g.Min(g.Max(g.Sub(g.Sub(lens, w), g.scalar(sinks)), g.scalar(0)), r_layer)
        else:
            r = g.Min(g.Max(g.Sub(lens, w), g.scalar(0)), r_layer)  # [B]: never more than the valid older tokens
        values_m = g.slice_axis(ctx["values"], 0, m, axis=2)  # (dropped when no method reads it: see live_nodes)
        self.values, self.older = ctx["values"], m  # every value [B, H_kv, n, d_h] and m [1]: a row-wise score of
        # all n rows, then the first m, saves the copy of the older values
        # 3-4. the method's own scores and its refinement's
        for part in (method.base, method.refine):
            if part is not None:
                scores.update(part.onnx_group_scores(self, g, probs, raw, pooled, values_m))
        return scores, eligible, r, w

    # ------------------------------------------------------------------ whole body
    def context(self) -> dict[str, str]:
        """The values every step reads (prompt length, valid positions, the request's budget), from the node inputs."""
        g = self.g
        p = self.policy
        queries, keys, values, o_proj, prompt_lengths, kv_budget = INPUTS
        batch = g.shape_of(keys, 0, 1)
        n = g.shape_of(keys, 2, 3)
        n_s = g.squeeze(n, 0)
        lens = g.Cast(prompt_lengths, to=INT64)
        valid_start = g.Sub(n, lens)  # [B]
        pos = g.Range(g.scalar(0), n_s, g.scalar(1))  # [n]
        valid = g.GreaterOrEqual(g.unsqueeze(pos, 0), g.unsqueeze(valid_start, 1))  # [B, n]
        valid_h = g.Expand(g.unsqueeze(valid, 1), g.concat(batch, g.i64(self.kv_heads), n))  # [B, H_kv, n]
        self.batch, self.o_proj = batch, o_proj
        ctx = dict(n=n, lens=lens, pos=pos, valid=valid, valid_h=valid_h, batch=batch, valid_start=valid_start,
                   queries=queries, keys=keys, values=values, o_proj_weight=o_proj, budget=None,
                   layer_idx=g.attribute_const("layer_idx", "int"))
        if p.method.base.external_scores:  # [1 or B, H_kv, n or 0] -> [B, H_kv, n or 0]
            ctx["scores"] = g.Expand(SCORES_INPUT, g.concat(batch, g.i64(self.kv_heads, 1)))
        if p.method.base.evicts:
            # the request's budget, clamped to [min_budget, budget] (the build fixes only the capacity)
            requested = g.Cast(g.reshape(kv_budget, [-1]), to=INT64)
            budget = g.Min(g.Max(requested, g.i64(p.min_budget)), g.i64(p.budget))
            ctx["budget"] = g.squeeze(g.slice_axis(budget, 0, 1, axis=0), 0)
            ctx["layer_budgets"] = g.attribute_const("layer_budgets", "ints")
        return ctx

    def build(self) -> None:
        g = self.g
        p = self.policy
        ctx = self.context()
        n_s, valid_h = g.squeeze(ctx["n"], 0), ctx["valid_h"]
        if not p.method.base.evicts:
            keep = valid_h
        else:
            then = g.child()
            then_keep = self.compressed_keep(then, ctx)
            otherwise = g.child()
            else_keep = otherwise.Identity(valid_h)
            keep = g.op(
                "If", g.Greater(n_s, ctx["budget"]),
                then_branch=then.graph("compress", [], [value_info(then_keep, BOOL, None)]),
                else_branch=otherwise.graph("keep_all", [], [value_info(else_keep, BOOL, None)]),
                hint="keep",
            )
        # 7. ascending kept positions, lengths, gathered K/V
        emit_kept(g, keep, ctx["keys"], ctx["values"], g.attribute_const("capacity", "int"), list(OUTPUTS))


def emit_kept(g: GraphBuilder, keep: str, keys: str, values: str, capacity: str, outputs: list[str]) -> None:
    """Step 7: from the keep mask [B, H_kv, n] bool, write ``outputs`` = (kept keys, kept values [B, H_kv, cap, d_h]
    zero padded, kept lengths [B, H_kv] int32, kept indices [B, H_kv, cap] int32 ascending, -1 padded), with
    cap = min(n, ``capacity``) (an int64 scalar)."""
    n = g.shape_of(keys, 2, 3)
    n_s = g.squeeze(n, 0)
    pos = g.Range(g.scalar(0), n_s, g.scalar(1))
    cap = g.Min(n, g.unsqueeze(capacity, 0))
    keyed = g.Where(keep, pos, n_s)  # unique keys: the positions, n for dropped entries
    ordered = g.op("TopK", keyed, cap, outputs=2, axis=2, largest=0, sorted=1)[0]  # [B, H_kv, cap]
    padded = g.Equal(ordered, n_s)
    g.Cast(g.ReduceSum(g.Cast(keep, to=INT64), g.i64(-1), keepdims=0), to=INT32, outputs=[outputs[2]])
    g.Cast(g.Where(padded, g.scalar(-1), ordered), to=INT32, outputs=[outputs[3]])
    rows = g.unsqueeze(g.Where(padded, g.scalar(0), ordered), -1)
    zero_rows = g.unsqueeze(padded, -1)
    for src, dst in ((keys, outputs[0]), (values, outputs[1])):
        g.Where(zero_rows, g.const(0.0, np.float32), g.GatherND(src, rows, batch_dims=2), outputs=[dst])


def check_exportable(policy: KVPolicy, num_layers: int = 2) -> None:
    """Refuse a policy the per-layer node cannot express: a model-level method (``layer-defensivekv``) ranks every
    layer's entries together after the last layer, so no layer's node can decide alone what it keeps. The prefill
    graph selects it with per-layer ``CriticalKVScore`` nodes and one ``CriticalKVSelectModel`` node after the last
    layer (``criticalkv.export.model_select``); a per-layer approximation would be a different policy."""
    if policy.method.base.model_level and num_layers > 1:
        raise ValueError(
            f"{policy.name} shares the budget across all layers, which the per-layer CriticalKVSelect node cannot "
            "express: the prefill graph selects it after the last layer (criticalkv.export.model_select: "
            "CriticalKVScore per layer, then CriticalKVSelectModel)"
        )


def selection_function(policy: KVPolicy, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int) -> onnx.FunctionProto:
    """The model-local function ``ai.criticalkv::CriticalKVSelect`` for ``policy`` and this attention shape."""
    check_exportable(policy, num_layers)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    g = GraphBuilder("ckv/")
    _Body(g, policy, num_layers, num_heads, num_kv_heads, head_dim).build()
    return helper.make_function(
        DOMAIN, OP_TYPE, list(node_inputs(policy)), list(OUTPUTS), live_nodes(g.nodes, OUTPUTS),
        opset_imports=[helper.make_opsetid("", OPSET)],
        attributes=list(KVPolicy.knob_names()) + list(LAYER_ATTRIBUTES),
        doc_string=f"CriticalKVSelect body generated for policy {policy.to_json()} (H={num_heads}, "
        f"H_kv={num_kv_heads}, d_h={head_dim}, layers={num_layers}); layer_idx and capacity come from the node.",
    )


def selection_node(
    policy: KVPolicy, layer_idx: int, num_layers: int, capacity: int, inputs: list[str], outputs: list[str], name: str
) -> onnx.NodeProto:
    """One layer's ``CriticalKVSelect`` node with every KVPolicy knob + layer_idx, num_layers, capacity."""
    node = helper.make_node(OP_TYPE, inputs, outputs, name=name, domain=DOMAIN)
    attributes = node_attributes(policy, layer_idx, num_layers, capacity)
    node.attribute.extend(
        helper.make_attribute(k, v, attr_type=onnx.AttributeProto.INTS if isinstance(v, list) else None)
        for k, v in attributes.items()
    )
    return node


def selection_opset() -> onnx.OperatorSetIdProto:
    return helper.make_opsetid(DOMAIN, OPSET_VERSION)


def selection_model(
    policy: KVPolicy,
    o_proj_weight: np.ndarray,
    num_heads: int,
    num_kv_heads: int,
    layer_idx: int = 0,
    num_layers: int = 1,
    capacity: int | None = None,
    max_prompt_len: int = 4096,
    with_body: bool = True,
    runtime_budget: bool = False,
    scores_input: bool = False,
) -> onnx.ModelProto:
    """A model holding one ``CriticalKVSelect`` node (tests, polygraphy comparisons, plugin checks).

    Inputs ``queries`` [batch, H, window, d_h], ``keys``/``values`` [batch, H_kv, n, d_h], ``prompt_lengths``
    [batch] int32; ``o_proj_weight`` [d, H*d_h] is an initializer. ``capacity`` defaults to
    ``node_capacity(policy, max_prompt_len, ...)``. ``with_body=False`` leaves the function out (TensorRT flavour).
    ``runtime_budget=True`` makes ``kv_budget`` [1] int32 a graph input; otherwise it is a constant = the budget.
    A method that ranks by external scores (kvzip) gets ``scores`` [batch, H_kv, n or 0] as a graph input with
    ``scores_input``, otherwise none (a constant [1, H_kv, 0]: its fallback).
    """
    o_proj_weight = np.asarray(o_proj_weight, dtype=np.float32)
    head_dim = o_proj_weight.shape[1] // num_heads
    if capacity is None:
        capacity = node_capacity(policy, max_prompt_len, num_kv_heads, layer_idx, num_layers)
    node = selection_node(policy, layer_idx, num_layers, capacity, list(node_inputs(policy)), list(OUTPUTS),
                          "criticalkv_select")
    inputs = [
        value_info(INPUTS[0], FLOAT, ["batch", num_heads, "window", head_dim]),
        value_info(INPUTS[1], FLOAT, ["batch", num_kv_heads, "sequence", head_dim]),
        value_info(INPUTS[2], FLOAT, ["batch", num_kv_heads, "sequence", head_dim]),
        value_info(INPUTS[4], INT32, ["batch"]),
    ]
    initializers = [numpy_helper.from_array(o_proj_weight, INPUTS[3])]
    if policy.method.base.needs_rotation:  # RoPE's default tables, as select_layer assumes when given none
        table = policy.method.base.rotation_table(policy, None, head_dim)
        initializers.append(numpy_helper.from_array(table, ROTATION_INPUT))
    if policy.method.base.external_scores:
        if scores_input:
            inputs.append(value_info(SCORES_INPUT, FLOAT, ["batch", num_kv_heads, "scored"]))
        else:
            initializers.append(numpy_helper.from_array(np.zeros((1, num_kv_heads, 0), np.float32), SCORES_INPUT))
    if runtime_budget:
        inputs.append(value_info(INPUTS[5], INT32, [1]))
    else:
        initializers.append(numpy_helper.from_array(np.array([policy.budget], np.int32), INPUTS[5]))
    outputs = [
        value_info(OUTPUTS[0], FLOAT, ["batch", num_kv_heads, "kept", head_dim]),
        value_info(OUTPUTS[1], FLOAT, ["batch", num_kv_heads, "kept", head_dim]),
        value_info(OUTPUTS[2], INT32, ["batch", num_kv_heads]),
        value_info(OUTPUTS[3], INT32, ["batch", num_kv_heads, "kept"]),
    ]
    graph = helper.make_graph([node], "criticalkv_select", inputs, outputs,
                              initializer=initializers)
    functions = [selection_function(policy, num_layers, num_heads, num_kv_heads, head_dim)] if with_body else []
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), selection_opset()],
                             functions=functions, ir_version=IR_VERSION, producer_name="criticalkv")
