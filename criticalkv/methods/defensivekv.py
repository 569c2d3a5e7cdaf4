"""``defensivekv`` and ``layer-defensivekv``: defensive aggregation of the window attention (arXiv 2510.13334).

DefensiveKV (Feng, Guo et al., ICLR 2026; reference code FFY0/DefensiveKV,
``kvpress/presses/efficient_defensivekv_press.py`` and ``efficient_layer_defensivekv_press.py``) replaces
the mean over window queries by a worst-case aggregation. For one KV head g with query heads h in g, window
queries j and older tokens i (m = n - w of them):

1. Pool: each window query's attention row over the older tokens, A[h, j, :], is **average**-pooled over
   positions (kernel ``pool_kernel``, zero padding at the borders) and rescaled so the row keeps its own mass
   over the older tokens (sum_i pooled = sum_i A). This is the reference's pool (``avg_pool1d`` then
   ``/ sum * scores_base``), not SnapKV's max-pool of the window mean: the maximum below is taken per row, and an
   average pool keeps each row a distribution, so no row wins the maximum by pooling alone. (The reference's
   kernel is 5; here it is the shared ``pool_kernel`` knob, 7 by default: ``defensivekv:pool_kernel=5`` is the
   reference's.)
2. Defensive aggregation: D[g, i] = max over h in g and j of pooled[h, j, i] (the maximum, not the mean),
   clamped from below at its mean over the older tokens (the reference's "adaptive prior correction").
3. Output awareness: D times the projected-value norm ||V_i W_O^h|| (``value_norm``, l1 as the reference),
   averaged over the group's query heads and normalised to sum 1 over the older tokens.
4. Stage 1 (CriticalKV's, by attention mass): per head, the older tokens with the most unpooled attention
   (mean over the group's heads and the window, normalised over the older tokens) are kept while the
   cumulative mass of those before and including each stays below ``stage1_mass - window mass`` (the
   reference's ``0.9 - window_bias``), at most the head's average share r of the layer. The window mass is the
   attention the window queries give the window itself, averaged over every query head of the layer and every
   window query, per sequence. (The reference slices the window off before summing, so its number is the mass
   on the ``window`` older tokens just before the window, and it averages over the batch too; here it is the
   mass the reference's comment and the paper name, per sequence, so a sequence's selection does not depend on
   its batch.) As in the reference the crossing token itself is not in stage 1. The cumulative mass is summed exactly
   in fixed point (``stage1_count``), so every backend counts the same stage-1 tokens. The limit is computed in one
   order by every backend (``window_masses``, ``stage1_limit``: the host C++'s, plugins/include/criticalkv/methods/
   defensivekv.h): each row's mass over the older tokens summed in double and rounded to fp32, a group's rows summed
   in double, rounded, divided by the row count and subtracted from 1 in fp32, then the groups' window masses added
   one after the other in fp32 and divided by H_kv. (Summed in fp32 in each library's own order, the limit came
   out 1 ulp apart between this module and its ONNX body on identical inputs.)
5. Allocation: stage-1 tokens rank above every other (the reference gives them the layer's maximum score; here
   score + 2, above any score, which is at most 1), then AdaKV's shared allocation of the layer's H_kv * r slots
   with the per-head floor ``ada_floor`` (the reference's AdaKV press); the window is always kept.

``layer-defensivekv`` shares the budget across **all layers and heads** of the model (the reference's
``EfficientAdaGlobalScorerPress``: top entries over every layer's flattened scores after the last layer's
prefill); floors and window stay per head. ``head_cap_ratio`` (0 = off, the reference) caps what one head keeps at
that multiple of the budget (window included), with an allocation nested in the budget (``nested_capped_mask``: a
larger budget keeps a superset of a smaller one's set on the same scores). The cap bounds the
per-layer decode buffers of an exported engine (an uncapped head may keep its whole prompt). It is a model-level method: ``criticalkv.selection.select_model``
selects it; ``select_layer`` alone only for a one-layer model.

C++ (CUDA kernels, TensorRT plugin, host version): ``defensivekv``'s flow is
``plugins/include/criticalkv/methods/defensivekv.h`` (``row_scores`` tells the pipeline its score reads every window
query's row); ``layer-defensivekv`` is refused by the per-layer plugin (``cpp_refusal``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from criticalkv.methods.adakv import ADA_FLOOR, AdaKV, head_floors, onnx_shared_allocation_mask, shared_allocation_mask
from criticalkv.methods.base import MODEL_LEVEL_REFUSAL, Allocation
from criticalkv.methods.budget import head_cap, head_floor
from criticalkv.methods.knobs import Knob, Knobs
from criticalkv.methods.lazy import torch
from criticalkv.methods.snapkv import POOL_KERNEL
from criticalkv.methods.topk import canonical_scores, topk_mask
from criticalkv.methods.two_stage import VALUE_NORM
from criticalkv.spec.rules import Between, Decimals, ZeroOrAtLeast

#: Most entries one KV head keeps in a model-level allocation (``layer-defensivekv``, ``layer-kvzip``).
HEAD_CAP_RATIO = Knob(0.0, "layer-defensivekv, layer-kvzip (the context cache's default context policy): "
                      "most entries one KV head keeps, as a multiple of the budget "
                      "(window included; 0 = no cap, a head may keep its whole prompt); an engine's per-layer "
                      "KV buffers hold min(max_input_len, head_cap_ratio × budget) entries per head",
                      rules=(ZeroOrAtLeast(1.0), Decimals(6)))


@dataclass(frozen=True)
class DefensiveKVKnobs(Knobs):
    pool_kernel: int = POOL_KERNEL.field()
    ada_floor: float = ADA_FLOOR.field()
    value_norm: str = VALUE_NORM.field()
    stage1_mass: float = Knob(0.9, "defensivekv: stage 1 keeps each head's most-attended older tokens while their "
                              "attention mass stays below stage1_mass minus the window's own mass (capped at the head's "
                              "share)", rules=(Between(0.0, 1.0),)).field()


@dataclass(frozen=True)
class LayerDefensiveKVKnobs(DefensiveKVKnobs):
    head_cap_ratio: float = HEAD_CAP_RATIO.field()

#: Offset that ranks stage-1 tokens above every other (defensive scores lie in [0, 1]).
STAGE1_OFFSET = 2.0


def avg_pool_rows(probs, kernel: int, valid):
    """Average-pool [..., m] rows over positions (zero padding), zero outside ``valid`` [B, m], each row rescaled
    to keep its mass over the valid older tokens. ``probs``: [B, G, w, m] fp32."""
    mass = probs.sum(-1, keepdim=True)
    if kernel > 1:
        shape = probs.shape
        pooled = torch.nn.functional.avg_pool1d(probs.reshape(-1, 1, shape[-1]), kernel, stride=1, padding=kernel // 2,
                              count_include_pad=True).reshape(shape)
    else:
        pooled = probs
    pooled = pooled * valid[:, None, None, :]
    total = pooled.sum(-1, keepdim=True)
    return torch.where(total > 0, pooled / total.clamp_min(torch.finfo(torch.float32).tiny) * mass, pooled)


#: Stage 1's cumulative mass is summed in units of 2^-MASS_FIXED_BITS (exact int64 sums): a float sum depends on its
#: order and precision (torch's CPU cumsum accumulates in double, its CUDA cumsum and ONNX Runtime's CumSum in float32,
#: the plugin in per-digit bins), and near the limit that decided the count differently per backend. Masses are at
#: most 1, so the sums stay far below 2^63; a token's mass is truncated by less than 2^-48.
MASS_FIXED_BITS = 48
MASS_SCALE = float(2**MASS_FIXED_BITS)


def fixed_mass(mass):
    """floor(mass * 2^48) as int64 (exact: a power-of-two scaling and a floor). ``mass``: fp32 tensor >= 0."""
    return torch.floor(mass * MASS_SCALE).to(torch.int64)


def fixed_limit(limit):
    """ceil(limit * 2^48) as int64: for an integer sum C, C < limit * 2^48 exactly when C < fixed_limit(limit)."""
    return torch.ceil(limit * MASS_SCALE).to(torch.int64)


def stage1_count(mass, limit, r, eligible):
    """[B, H_kv] int64: how many of the most massive eligible tokens keep their cumulative fixed-point mass below
    ``limit`` [B] (fp32), at most r [B]. ``mass`` [B, H_kv, m] fp32 >= 0."""
    masked = torch.where(eligible, mass, torch.zeros_like(mass))
    ordered = fixed_mass(torch.sort(masked, dim=-1, descending=True).values)  # floor is monotone: still sorted
    cumulative = torch.cumsum(ordered, dim=-1)  # exact: integers
    return torch.minimum((cumulative < fixed_limit(limit)[:, None, None]).sum(-1), r[:, None])


def window_masses(probs):
    """[B] fp32: one group's window mass, 1 - the mean over its rows of their mass over the older tokens, in the one
    order of every backend: row sums in double rounded to fp32, their sum in double rounded to fp32, then fp32.
    ``probs``: [B, G, w, m] fp32 (the group's window rows over the older tokens)."""
    rows = probs.to(torch.float64).sum(-1).to(torch.float32)  # [B, G, w]
    total = rows.to(torch.float64).sum(dim=(1, 2)).to(torch.float32)  # [B]
    count = torch.tensor(float(probs.shape[1] * probs.shape[2]), dtype=torch.float32, device=probs.device)
    return torch.tensor(1.0, dtype=torch.float32, device=probs.device) - total / count


def stage1_limit(threshold: float, window_mass):
    """[B] fp32: ``threshold`` - the layer's window mass, the mean of its groups' [B, H_kv] window masses added one
    after the other in fp32 (the order of every backend)."""
    total = window_mass[:, 0]
    for g in range(1, window_mass.shape[1]):
        total = total + window_mass[:, g]
    heads = torch.tensor(float(window_mass.shape[1]), dtype=torch.float32, device=window_mass.device)
    return torch.tensor(threshold, dtype=torch.float32, device=window_mass.device) - total / heads


def priority(scores, threshold: float, r, eligible):
    """[B, H_kv, m] ranking score of shared allocation: the defensive score, stage-1 tokens first."""
    limit = stage1_limit(threshold, scores["window_mass"][..., 0])  # [B]
    first = topk_mask(scores["stage1_mass"], stage1_count(scores["stage1_mass"], limit, r, eligible), eligible)
    return scores["defensive"] + first.to(scores["defensive"].dtype) * STAGE1_OFFSET


def onnx_window_masses(g, probs: str) -> str:
    """``window_masses`` of every group at once, in its order: [B, H_kv] fp32 of ``probs`` [B, H_kv, G, w, m]."""
    rows = g.Cast(g.ReduceSum(g.Cast(probs, to=g.DOUBLE), g.i64(4), keepdims=0), to=g.FLOAT)  # [B, H_kv, G, w]
    total = g.Cast(g.ReduceSum(g.Cast(rows, to=g.DOUBLE), g.i64(2, 3), keepdims=0), to=g.FLOAT)  # [B, H_kv]
    count = g.Cast(g.Mul(g.shape_of(probs, 2, 3), g.shape_of(probs, 3, 4)), to=g.FLOAT)  # G * w, exact in fp32
    return g.Sub(g.const(1.0, np.float32), g.Div(total, count))


def onnx_stage1_limit(g, threshold: float, window_mass: str, kv_heads: int) -> str:
    """``stage1_limit`` in its order: [B] fp32 of the groups' window masses [B, H_kv] (H_kv = ``kv_heads``)."""
    total = g.squeeze(g.slice_axis(window_mass, 0, 1, axis=1), 1)
    for k in range(1, kv_heads):
        total = g.Add(total, g.squeeze(g.slice_axis(window_mass, k, k + 1, axis=1), 1))
    return g.Sub(g.const(threshold, np.float32), g.Div(total, g.const(float(kv_heads), np.float32)))


class DefensiveKV(AdaKV):
    name = "defensivekv"
    cpp_enum = "kDefensiveKV"
    description = "max over window queries and group heads (clamped at the mean) × ‖V W_O‖, stage 1 by attention mass, adakv sharing"
    Knobs = DefensiveKVKnobs
    score_name = "defensive"
    score_names = ("defensive", "stage1_mass", "window_mass")
    score_knobs = ("pool_kernel", "value_norm")
    #: the defensive score reads every window query's attention row (per-row pool, maximum over the rows)
    row_scores = True
    #: whether the budget is shared across the layers of the model (selected by ``select_model``)
    model_level = False

    def group_scores(self, policy, inputs):
        valid = inputs.valid.to(torch.float32)  # [B, m]
        count = valid.sum(-1, keepdim=True).clamp_min(1.0)
        pooled = avg_pool_rows(inputs.probs, policy.pool_kernel, inputs.valid)  # [B, G, w, m]
        worst = pooled.amax(dim=(1, 2))  # [B, m]
        prior = (worst * valid).sum(-1, keepdim=True) / count
        defended = torch.maximum(worst, prior)
        norms = inputs.norms(policy.value_norm).mean(dim=1) * valid  # [B, m]
        norms = norms / norms.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        mean_attention = inputs.raw.mean(dim=1) * valid  # unpooled, mean over heads and window
        stage1_mass = mean_attention / mean_attention.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        window_mass = window_masses(inputs.probs)  # [B]
        return {
            "defensive": defended * norms,
            "stage1_mass": stage1_mass,
            "window_mass": window_mass[:, None].expand_as(stage1_mass),
        }

    def priority(self, policy, scores, eligible, r):
        return priority(scores, policy.stage1_mass, r, eligible)

    def allocate(self, policy, scores, eligible, r):
        ranking = self.priority(policy, scores, eligible, r)
        return Allocation(mask=shared_allocation_mask(ranking, r, head_floors(policy, r), eligible))

    # ------------------------------------------------------------------ ONNX function body
    def onnx_group_scores(self, body, g, probs, raw, pooled, values_m):
        p = body.policy
        valid = g.Cast(body.eligible, to=g.FLOAT)  # [B, H_kv, m]
        valid5 = g.unsqueeze(g.unsqueeze(valid, 2), 2)  # [B, H_kv, 1, 1, m]
        tiny = g.const(float(np.finfo(np.float32).tiny), np.float32)
        zero = g.const(0.0, np.float32)
        mass = g.ReduceSum(probs, g.i64(4), keepdims=1)  # [B, H_kv, G, w, 1]
        box = probs
        if p.pool_kernel > 1:
            half = p.pool_kernel // 2
            flat = g.Reshape(probs, g.concat(g.i64(-1, 1), g.shape_of(probs, 4, 5)))
            padded = g.Pad(flat, g.i64(0, 0, half, 0, 0, half), zero, mode="constant")
            box = g.Reshape(g.AveragePool(padded, kernel_shape=[p.pool_kernel], strides=[1]), g.Shape(probs))
        box = g.Mul(box, valid5)
        total = g.ReduceSum(box, g.i64(4), keepdims=1)
        # the reference's where(total > 0, box / total * mass, box) without the Where: a row whose total is 0 is all
        # zeros (box >= 0), and 0 / tiny * mass is 0, so the same numbers; a broadcast Where over this 5-D tensor
        # cost ONNX Runtime as much as the rest of the defensive scoring (results/benchmarks/selection_defensivekv)
        pooled_rows = g.Mul(g.Div(box, g.Max(total, tiny)), mass)
        worst = g.ReduceMax(pooled_rows, g.i64(2, 3), keepdims=0)  # [B, H_kv, m]
        count = g.Max(g.ReduceSum(valid, g.i64(2), keepdims=1), g.const(1.0, np.float32))
        prior = g.Div(g.ReduceSum(g.Mul(worst, valid), g.i64(2), keepdims=1), count)
        defended = g.Max(worst, prior)
        norms = g.Mul(g.ReduceMean(body.value_norms(g, values_m, p.value_norm), g.i64(2), keepdims=0), valid)
        norms = g.Div(norms, g.Max(g.ReduceSum(norms, g.i64(2), keepdims=1), tiny))
        mean_attention = g.Mul(g.ReduceMean(raw, g.i64(2), keepdims=0), valid)
        stage1 = g.Div(mean_attention, g.Max(g.ReduceSum(mean_attention, g.i64(2), keepdims=1), tiny))
        window_mass = onnx_window_masses(g, probs)  # [B, H_kv]
        return {
            "defensive": g.Mul(defended, norms),
            "stage1_mass": stage1,
            "window_mass": g.Expand(g.unsqueeze(window_mass, 2), g.Shape(stage1)),
        }

    def onnx_priority(self, body, g, scores, eligible, r):
        """The body's ``priority``: [B, H_kv, m] float."""
        p = body.policy
        per_group = g.squeeze(g.slice_axis(scores["window_mass"], 0, 1, axis=2), 2)  # [B, H_kv]
        mass = scores["stage1_mass"]
        masked = g.Where(eligible, mass, g.const(0.0, np.float32))
        m = g.shape_of(mass, 2, 3)
        ordered = g.op("TopK", masked, m, outputs=2, axis=2, largest=1, sorted=1)[0]
        scale = g.const(MASS_SCALE, np.float32)
        # stage1_count's exact fixed-point sums (a float CumSum accumulates in float32 here, in double in torch's CPU
        # cumsum: near the limit the counts differed)
        cumulative = g.CumSum(g.Cast(g.Floor(g.Mul(ordered, scale)), to=g.INT64), g.scalar(2))
        limit = onnx_stage1_limit(g, p.stage1_mass, per_group, body.kv_heads)
        limit = g.reshape(g.Cast(g.Ceil(g.Mul(limit, scale)), to=g.INT64), [-1, 1, 1])
        count = g.ReduceSum(g.Cast(g.Less(cumulative, limit), to=g.INT64), g.i64(2), keepdims=0)  # [B, H_kv]
        count = g.Min(count, g.unsqueeze(r, 1))
        first = body.topk_mask(g, mass, count, eligible)
        return g.Add(scores["defensive"], g.Mul(g.Cast(first, to=g.FLOAT), g.const(STAGE1_OFFSET, np.float32)))

    def onnx_allocate(self, body, g, scores, eligible, r):
        floor = body.head_floor(g, r)
        ranking = self.onnx_priority(body, g, scores, eligible, r)
        return Allocation(mask=onnx_shared_allocation_mask(body, g, ranking, r, floor, eligible))


class LayerDefensiveKV(DefensiveKV):
    name = "layer-defensivekv"
    cpp_enum = "kLayerDefensiveKV"
    description = "defensivekv scores, the budget shared across all layers and heads (per-head floor ada_floor)"
    model_level = True
    Knobs = LayerDefensiveKVKnobs
    #: the CriticalKVSelect plugin is one node per layer: a budget shared by every layer needs every layer's ranking
    #: in one node, the CriticalKVScore / CriticalKVSelectModel plugins' (plugins/README.md)
    native = False
    cpp_refusal = MODEL_LEVEL_REFUSAL

    def max_older_per_head(self, policy, r, m, num_kv_heads):
        # any head of any layer may take up to L * H_kv * r entries: bounded by its m older tokens, and by the
        # cap (head_cap_ratio × budget, window included) when one is set
        return m if policy.head_cap_ratio == 0 else min(m, older_cap(policy))  # compressing: n > budget, so w = window

    def model_allocate(self, policy, ranking, eligible, r):
        """Each head its own top floor, the other L * H_kv * (r - floor) slots over the flattened ranking (ties: lower
        layer, head, position); with ``head_cap_ratio``, the nested capped allocation (``nested_capped_mask``)."""
        if older_cap(policy) is not None:
            return nested_capped_mask(policy, ranking, eligible, r)
        return shared_allocation_mask(ranking, r, head_floors(policy, r), eligible)

    def onnx_model_allocate(self, body, g, ranking, eligible, r, budget):
        if body.policy.head_cap_ratio:
            return onnx_nested_capped_mask(body, g, ranking, eligible, r)
        return onnx_shared_allocation_mask(body, g, ranking, r, body.head_floor(g, r), eligible)


def level_caps(policy, levels: int) -> list[int]:
    """``older_cap`` at every average share t = 1 .. ``levels`` (budget t + window): what a head may hold once the
    nested allocation has reached level t."""
    return [head_cap(policy.head_cap_ratio, t + policy.window) - policy.window for t in range(1, levels + 1)]


def nested_capped_mask(policy, ranking, eligible, r):
    """The model-level allocation under ``head_cap_ratio``, nested in the budget: [B, N, m] bool.

    The greedy walk down the ranking that skips a head once it holds ``older_cap`` entries is not monotone in the
    budget: raising the budget raises the cap, the strongest heads take the entries the cap had left to the others,
    and a larger budget can keep a set that misses entries a smaller one kept (needles kept at 256 entries
    and lost at 512). Here the allocation grows one level at a time instead: at level t = 1 .. r (the budget
    t + window), every head first keeps its own top ``head_floor(ada_floor, t)``, then the set grows to N * t entries
    by the highest-ranked entries not kept yet among each head's top ``older_cap`` at budget t + window. So the set at
    r contains the set at every smaller share (nested by construction), each head holds at most the cap of its
    budget, and with no head at its cap on the way it is exactly the greedy walk (the ranking's top N * r with the
    floors: ``shared_allocation_mask``).

    Within a head the kept entries are always its top-ranked ones, so the state of the walk is one count per head:
    level t takes the best N * t - sum(counts) of a window of the N next entries of every head (each head's sorted
    ranking, ties to the lower position; across heads to the lower head, the flattened ranking's rule).
    ``ranking``, ``eligible``: [B, N, m] (N = L * H_kv heads, layer-major); r [B] int64. Cost: r steps on [B, N, N].
    """
    batch, heads, m = ranking.shape
    levels = int(r.max()) if r.numel() else 0
    if levels <= 0:
        return torch.zeros_like(eligible)
    masked = canonical_scores(ranking).masked_fill(~eligible, float("-inf"))
    ordered = torch.sort(masked, dim=-1, descending=True, stable=True).values  # [B, N, m], each head's ranking
    available = eligible.sum(-1)  # [B, N]
    counts = torch.zeros(batch, heads, dtype=torch.int64, device=ranking.device)
    window = torch.arange(heads, device=ranking.device)  # a level adds at most N entries (floors included)
    caps = level_caps(policy, levels)
    for t in range(1, levels + 1):
        active = (t <= r)[:, None]  # [B, 1]: a sequence stops at its own r
        limit = torch.minimum(available, torch.tensor(caps[t - 1], device=ranking.device))
        floor = torch.minimum(available, torch.tensor(head_floor(policy.ada_floor, t), device=ranking.device))
        counts = torch.where(active, torch.maximum(counts, floor), counts)
        need = torch.clamp(heads * t - counts.sum(-1), min=0) * active[:, 0]  # [B]
        at = counts[..., None] + window  # [B, N, N]: every head's next entries
        room = window < (limit - counts)[..., None]
        values = ordered.gather(-1, at.clamp(max=m - 1)).masked_fill(~room, float("-inf"))
        take = topk_mask(values.reshape(batch, -1), need, room.reshape(batch, -1)).reshape(batch, heads, heads)
        counts = counts + take.sum(-1)
    return topk_mask(ranking, counts, eligible)


def onnx_nested_capped_mask(body, g, ranking: str, eligible: str, r: str) -> str:
    """``nested_capped_mask`` in the body: a ``Loop`` over the levels t = 1 .. max(r) carrying each head's count [B, N],
    the caps and floors of every level from export-time tables (``level_caps``, the floor table), the window of each
    head's next N entries gathered from its sorted ranking; then every head keeps its top count."""
    p = body.policy
    heads = body.kv_heads  # the model's L * H_kv heads (model_select's _Body)
    r_max = max(p.budget - p.window, 0)
    caps = g.const(np.array([0] + level_caps(p, r_max), dtype=np.int64), hint="level_cap_table")
    masked = g.Where(eligible, ranking, g.const(-np.inf, np.float32))
    m = g.shape_of(ranking, 2, 3)
    ordered = g.op("TopK", masked, m, outputs=2, axis=2, largest=1, sorted=1)[0]  # [B, N, m]: each head's ranking
    available = g.ReduceSum(g.Cast(eligible, to=g.INT64), g.i64(2), keepdims=0)  # [B, N]
    window = g.Range(g.scalar(0), g.scalar(heads), g.scalar(1))  # [N]
    last = g.Sub(m, g.i64(1))
    levels = g.ReduceMax(r, keepdims=0)
    counts0 = g.Mul(available, g.scalar(0))

    b = g.child()
    step, cond_in, counts = b.fresh("level"), b.fresh("cond_in"), b.fresh("counts")
    t = b.Add(step, b.scalar(1))
    active = b.unsqueeze(b.LessOrEqual(t, r), 1)  # [B, 1]: a sequence stops at its own r
    limit = b.Min(available, b.Gather(caps, t))
    floor = b.Min(available, body.head_floor(b, t))
    counts1 = b.Where(active, b.Max(counts, floor), counts)
    need = b.Max(b.Sub(b.Mul(t, b.scalar(heads)), b.ReduceSum(counts1, b.i64(1), keepdims=0)), b.scalar(0))
    need = b.Mul(need, b.Cast(b.squeeze(active, 1), to=b.INT64))  # [B]
    at = b.Min(b.Add(b.unsqueeze(counts1, 2), window), last)  # [B, N, N]: every head's next entries
    room = b.Less(window, b.unsqueeze(b.Sub(limit, counts1), 2))
    values = b.Where(room, b.GatherElements(ordered, at, axis=2), b.const(-np.inf, np.float32))
    flat = b.concat(b.shape_of(values, 0, 1), b.i64(-1))
    take = body.topk_mask(b, b.Reshape(values, flat), need, b.Reshape(room, flat), rank=2)
    taken = b.ReduceSum(b.Cast(b.Reshape(take, b.Shape(values)), to=b.INT64), b.i64(2), keepdims=0)
    counts2 = b.Add(counts1, taken)
    cond_out = b.Identity(b.const(True, np.bool_, hint="cond_out"))
    loop_body = b.graph("nested_allocation_level",
                        [g.value_info(step, g.INT64, []), g.value_info(cond_in, g.BOOL, []),
                         g.value_info(counts, g.INT64, None)],
                        [g.value_info(cond_out, g.BOOL, []), g.value_info(counts2, g.INT64, None)])
    final = g.op("Loop", levels, "", counts0, body=loop_body, hint="nested_counts")
    return body.topk_mask(g, ranking, final, eligible)


def older_cap(policy) -> int | None:
    """Most older tokens one head keeps under ``head_cap_ratio``: its cap minus the window (a compressed prompt has
    n > budget >= window, so its whole window); None when the cap is off. At least r = budget - window."""
    cap = head_cap(policy.head_cap_ratio, policy.budget)
    return None if cap == 0 else cap - policy.window


METHOD = DefensiveKV()
LAYER_METHOD = LayerDefensiveKV()
