"""CriticalKV's two-stage selection (arXiv 2502.03805), applied on top of any scored base method.

Inside each KV head's share of the budget (the base's allocation, r_g older tokens), stage 1 keeps the
top ``ceil(alpha * r_g)`` by the base's own score (the pooled window attention S for SnapKV, PyramidKV and AdaKV;
the expected attention x ||v|| for Expected Attention), so alpha = 1 is the base method, and stage 2 the top
``r_g - ceil(alpha * r_g)`` of the rest by the critical score C = (attention + epsilon) x ||V_i W_O^h||
(``value_norm``), reduced over the heads of each GQA group (``gqa_reduce``), with the base's attention (the window's,
pooled or raw: ``stage2_scores``; or the expected attention).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from criticalkv.methods import pruned
from criticalkv.methods.base import GroupScoreInputs
from criticalkv.methods.budget import stage1_count
from criticalkv.methods.knobs import Knob, Knobs, knob_names
from criticalkv.methods.lazy import torch
from criticalkv.methods.pruned import BoundTerms, DeferredCritical, combine_critical, combine_group_bound
from criticalkv.methods.topk import topk_mask
from criticalkv.spec.rules import AtLeast, Between, Decimals

VALUE_NORMS = ("l1", "l2")
GQA_REDUCES = ("mean", "kvpress")
STAGE2_SCORES = ("pooled", "raw")

VALUE_NORM = Knob("l1", "norm of the projected value ‖V_i W_O^h‖", choices=VALUE_NORMS)


@dataclass(frozen=True)
class TwoStageKnobs(Knobs):
    alpha: float = Knob(0.25, "CriticalKV stage-1 fraction of the selectable budget chosen by attention alone",
                        rules=(Between(0.0, 1.0), Decimals(6))).field()
    epsilon: float = Knob(1e-4, "CriticalKV stage-2 score is (attention + epsilon) × ‖V W_O‖", rules=(AtLeast(0.0),)).field()
    value_norm: str = VALUE_NORM.field()
    gqa_reduce: str = Knob("mean", "stage-2 GQA reduction: mean of per-head products, or kvpress: mean(P) * mean(N)",
                           choices=GQA_REDUCES).field()
    stage2_scores: str = Knob("pooled", "attention used in stage 2: max-pooled window mean (kvpress) or raw (paper Alg. 2)",
                              choices=STAGE2_SCORES).field()


def stage1_counts(alpha: float, r):
    """ceil(alpha * r) for every entry of the int64 tensor ``r`` (``criticalkv.methods.budget.stage1_count``)."""
    first = torch.tensor([stage1_count(alpha, int(x)) for x in r.flatten().tolist()], dtype=torch.int64)
    return first.reshape(r.shape).to(r.device)


def two_stage_mask(attention, critical, r, alpha: float, eligible):
    """CriticalKV's selection inside each head's allocation.

    Stage 1 keeps the top ``ceil(alpha * r)`` by ``attention``; stage 2 the top ``r - ceil(alpha * r)``
    of the rest by ``critical``. ``attention``, ``critical``, ``eligible``: [B, H_kv, m]; ``r``: [B, H_kv].
    """
    first = stage1_counts(alpha, r)
    stage1 = topk_mask(attention, first, eligible)
    stage2 = topk_mask(critical, r - first, eligible & ~stage1)
    return stage1 | stage2


def torch_cat_heads(w_heads):
    """[d_h, G * d]: the heads' W_O^h side by side (as ``value_projection_norms`` concatenates them)."""
    return torch.cat(list(w_heads), dim=1)


class TwoStage:
    """The refinement: stage 1 by attention, stage 2 by attention x projected-value norm."""

    name = "two-stage"
    Knobs = TwoStageKnobs

    @property
    def knobs(self) -> tuple[str, ...]:
        """The names of the knobs it reads (``Knobs``'s fields)."""
        return knob_names(self.Knobs)
    score_names = ("critical",)
    score_knobs = ("epsilon", "value_norm", "gqa_reduce", "stage2_scores")

    def group_scores(self, policy, inputs: GroupScoreInputs):
        p = inputs.pooled if policy.stage2_scores == "pooled" else inputs.raw
        if pruned.enabled() and policy.value_norm == "l1" and inputs.values is not None:
            # the group bound for every token now; the per-head bound and the exact score only for the candidates
            w = inputs.w_heads
            values = inputs.values.float()
            terms = BoundTerms.of(w)
            bound = combine_group_bound(p, terms.group_upper(values), policy.epsilon, policy.gqa_reduce)
            deferred = DeferredCritical(p, values, torch_cat_heads(w), policy.epsilon, policy.gqa_reduce,
                                        lambda: inputs.norms("l1"), terms)
            return {"critical_bound": bound, "critical": deferred}
        return {"critical": combine_critical(p, inputs.norms(policy.value_norm), policy.epsilon, policy.gqa_reduce)}

    def choose(self, policy, scores, counts, eligible):
        """[B, H_kv, m] kept older tokens given each head's ``counts`` [B, H_kv]."""
        deferred = getattr(scores, "deferred", {}).get("critical")
        if deferred is None or not pruned.enabled():
            return two_stage_mask(scores[policy.method.base.score_name], scores["critical"], counts, policy.alpha, eligible)
        first = stage1_counts(policy.alpha, counts)
        stage1 = topk_mask(scores[policy.method.base.score_name], first, eligible)
        w_cat = deferred[0].w_cat
        margin = pruned.stop_margin(w_cat.shape[1] // deferred[0].p.shape[1], deferred[0].p.shape[1])
        stage2 = pruned.pruned_stage2(scores["critical_bound"], deferred, counts - first, eligible & ~stage1, margin)
        return stage1 | stage2

    # ------------------------------------------------------------------ ONNX function body
    def onnx_group_scores(self, body, g, probs, raw, pooled, values_m):
        p = body.policy
        attn = pooled if p.stage2_scores == "pooled" else raw
        if pruned.enabled() and p.value_norm == "l1" and not body.exact_critical:
            # the group bound now; the rest inside the stage-2 choice (``_Body.exact_critical``: every entry's)
            body.stage2_inputs = (attn, body.values)  # rows are gathered at older positions < m
            mean_bound = g.slice_axis(body.group_upper_bounds(g, body.values), 0, body.older, axis=2)
            return {"critical_bound": self.onnx_combine_group_bound(body, g, attn, mean_bound)}
        return {"critical": self.onnx_combine(body, g, attn, body.value_norms(g, values_m, p.value_norm))}

    @staticmethod
    def onnx_combine(body, g, attn, norms):
        """[B, H_kv, c] stage-2 scores from the heads' attention and norms [B, H_kv, G, c] (``combine_critical``)."""
        p = body.policy
        eps = g.const(p.epsilon, np.float32)
        if p.gqa_reduce == "mean":
            return g.ReduceMean(g.Mul(g.Add(attn, eps), norms), g.i64(2), keepdims=0)
        return g.Mul(g.Add(g.ReduceMean(attn, g.i64(2), keepdims=0), eps), g.ReduceMean(norms, g.i64(2), keepdims=0))

    @staticmethod
    def onnx_combine_group_bound(body, g, attn, mean_bound):
        """[B, H_kv, c] ``combine_group_bound``: attention [B, H_kv, G, c] and the group bound [B, H_kv, c]."""
        p = body.policy
        eps = g.const(p.epsilon, np.float32)
        if p.gqa_reduce == "mean":
            return g.Mul(g.ReduceMax(g.Add(attn, eps), g.i64(2), keepdims=0), mean_bound)
        return g.Mul(g.Add(g.ReduceMean(attn, g.i64(2), keepdims=0), eps), mean_bound)

    def onnx_choose(self, body, g, scores, counts, eligible):
        first = body.stage1_count(g, counts)
        stage1 = body.topk_mask(g, scores[body.policy.method.base.score_name], first, eligible)
        rest = g.And(eligible, g.Not(stage1))
        if "critical_bound" not in scores:
            return g.Or(stage1, body.topk_mask(g, scores["critical"], g.Sub(counts, first), rest))
        attn, values = body.stage2_inputs
        group = body.group

        def gather(gb, index):  # index [B, H_kv, c] -> (values [B, H_kv, c, d_h], attention [B, H_kv, G, c])
            rows = gb.GatherND(values, gb.unsqueeze(index, -1), batch_dims=2)
            shape = gb.concat(gb.shape_of(index, 0, 2), gb.i64(group), gb.shape_of(index, 2, 3))
            return rows, gb.GatherND(attn, gb.unsqueeze(gb.Expand(gb.unsqueeze(index, 2), shape), -1), batch_dims=3)

        def exact(gb, index):  # index [B, H_kv, c] -> the exact scores [B, H_kv, c]
            rows, p = gather(gb, index)
            return self.onnx_combine(body, gb, p, body.value_norms(gb, rows, "l1"))

        def full(gb):
            return self.onnx_combine(body, gb, attn, body.value_norms(gb, gb.slice_axis(values, 0, body.older, axis=2), "l1"))

        # the per-head bound for the best PREFILTER_FACTOR k_max tokens by the group bound; each keeps the smaller
        k2 = g.Sub(counts, first)
        kmax = g.Max(g.reshape(g.ReduceMax(k2, keepdims=0), [1]), g.i64(1))
        bound = scores["critical_bound"]
        keyed = g.Where(rest, bound, g.const(-np.inf, np.float32))
        width = g.Min(g.Mul(kmax, g.i64(pruned.PREFILTER_FACTOR)), g.shape_of(bound, 2, 3))
        top, index = g.op("TopK", keyed, width, outputs=2, axis=2, largest=1, sorted=1)
        rows, p = gather(g, index)
        tight = g.Min(self.onnx_combine(body, g, p, body.l1_upper_bounds(g, rows)), top)
        bound = g.ScatterElements(bound, index, tight, axis=2)
        stage2 = body.pruned_topk(g, bound, k2, rest, exact, full)
        return g.Or(stage1, stage2)


TWO_STAGE = TwoStage()
