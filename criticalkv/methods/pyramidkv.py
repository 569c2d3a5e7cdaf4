"""``pyramidkv``: SnapKV with per-layer budgets decreasing linearly from the first to the last layer."""

from __future__ import annotations

from dataclasses import dataclass

from criticalkv.methods.budget import pyramid_layer_budgets
from criticalkv.methods.knobs import Knob, Knobs
from criticalkv.methods.snapkv import POOL_KERNEL, SnapKV
from criticalkv.spec.rules import AtLeast, Decimals


@dataclass(frozen=True)
class PyramidKVKnobs(Knobs):
    pool_kernel: int = POOL_KERNEL.field()
    pyramid_beta: float = Knob(20.0, "pyramidkv: ratio between the first and the last layer's selectable budget",
                               rules=(AtLeast(1.0), Decimals(6))).field()



class PyramidKV(SnapKV):
    name = "pyramidkv"
    cpp_enum = "kPyramidKV"
    description = "snapkv with per-layer budgets decreasing linearly (ratio pyramid_beta), same average"
    Knobs = PyramidKVKnobs

    def layer_budget(self, policy, r, layer_idx, num_layers):
        return pyramid_layer_budgets(r, num_layers, policy.pyramid_beta)[layer_idx]


METHOD = PyramidKV()
