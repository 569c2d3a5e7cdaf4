"""``adakv``: SnapKV scores, the layer's budget shared across its KV heads (each keeps a floor of its own)."""

from __future__ import annotations

from dataclasses import dataclass

from criticalkv.methods.base import Allocation, BaseMethod
from criticalkv.methods.knobs import Knob, Knobs
from criticalkv.methods.snapkv import POOL_KERNEL
from criticalkv.spec.rules import Between, Decimals
from criticalkv.methods.budget import head_floor
from criticalkv.methods.lazy import torch
from criticalkv.methods.topk import topk_mask


def shared_allocation_mask(scores, r, floor, eligible):
    """AdaKV-style allocation of a layer's ``H_kv * r`` slots across its KV heads.

    Every head first keeps its own top ``floor`` entries; the remaining ``H_kv * (r - floor)`` go to the
    highest ``scores`` over all heads of the layer (ties: lower head, then lower position).
    ``scores``, ``eligible``: [B, H_kv, m]; ``r``, ``floor``: [B]. Returns the chosen [B, H_kv, m] mask.
    """
    batch, heads, m = scores.shape
    safe = topk_mask(scores, floor[:, None], eligible)
    rest = topk_mask(scores.reshape(batch, heads * m), heads * (r - floor), (eligible & ~safe).reshape(batch, -1))
    return safe | rest.reshape(batch, heads, m)


def onnx_shared_allocation_mask(body, g, scores: str, r: str, floor: str, eligible: str) -> str:
    """The body's ``shared_allocation_mask``: each head its own top ``floor``, the other H_kv (r - floor) slots layer-wide."""
    safe = body.topk_mask(g, scores, g.Expand(g.unsqueeze(floor, 1), g.shape_of(scores, 0, 2)), eligible)
    flat_scores = g.reshape(scores, [0, -1])
    flat_eligible = g.reshape(g.And(eligible, g.Not(safe)), [0, -1])
    rest = body.topk_mask(g, flat_scores, g.Mul(g.Sub(r, floor), g.scalar(body.kv_heads)), flat_eligible, rank=2)
    return g.Or(safe, g.Reshape(rest, g.Shape(scores)))


def head_floors(policy, r):
    """[B] int64: the per-head floor (``head_floor``) of every sequence's ``r`` [B]."""
    return torch.tensor([head_floor(policy.ada_floor, int(x)) for x in r.tolist()], dtype=torch.int64, device=r.device)

ADA_FLOOR = Knob(0.2, "adakv/laprox: fraction of the per-head share every head keeps by its own scores",
                 rules=(Between(0.0, 1.0), Decimals(6)))


@dataclass(frozen=True)
class AdaKVKnobs(Knobs):
    pool_kernel: int = POOL_KERNEL.field()
    ada_floor: float = ADA_FLOOR.field()


class AdaKV(BaseMethod):
    name = "adakv"
    cpp_enum = "kAdaKV"
    description = "snapkv scores, per-layer budget shared across heads (per-head floor ada_floor)"
    Knobs = AdaKVKnobs
    shared_allocation = True

    def max_older_per_head(self, policy, r, m, num_kv_heads):
        rm = min(r, m)
        return min(num_kv_heads * rm - (num_kv_heads - 1) * head_floor(policy.ada_floor, rm), m)

    def allocate(self, policy, scores, eligible, r):
        return Allocation(mask=shared_allocation_mask(scores[self.score_name], r, head_floors(policy, r), eligible))

    def onnx_allocate(self, body, g, scores, eligible, r):
        floor = body.head_floor(g, r)
        return Allocation(mask=onnx_shared_allocation_mask(body, g, scores[self.score_name], r, floor, eligible))


METHOD = AdaKV()
