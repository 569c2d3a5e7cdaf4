"""``snapkv``: every KV head keeps the window + its top r older tokens by pooled window attention.

The pooled window attention ("attention", S) is computed by the driver for every scored method
(``criticalkv.selection.scores``); SnapKV's budget sharing is the default of ``BaseMethod``: r per head.
"""

from __future__ import annotations

from dataclasses import dataclass

from criticalkv.methods.base import BaseMethod
from criticalkv.methods.knobs import Knob, Knobs
from criticalkv.spec.rules import MAX_TOKENS, AtMost, PositiveOdd

POOL_KERNEL = Knob(7, "odd max-pool kernel over token positions applied to window attention",
                   rules=(PositiveOdd(), AtMost(MAX_TOKENS)))


@dataclass(frozen=True)
class SnapKVKnobs(Knobs):
    pool_kernel: int = POOL_KERNEL.field()



class SnapKV(BaseMethod):
    name = "snapkv"
    cpp_enum = "kSnapKV"
    description = "every KV head keeps the window + top (budget - window) by pooled window attention"
    Knobs = SnapKVKnobs


METHOD = SnapKV()
