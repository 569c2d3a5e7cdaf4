"""``snapkv``: every KV head keeps the window + its top r older tokens by pooled window attention.

The pooled window attention ("attention", S) is computed by the driver for every scored method
(``criticalkv.selection.scores``); SnapKV's budget sharing is the default of ``BaseMethod``: r per head.
"""

from criticalkv.methods.base import BaseMethod


class SnapKV(BaseMethod):
    name = "snapkv"
    cpp_enum = "kSnapKV"
    description = "every KV head keeps the window + top (budget - window) by pooled window attention"
    knobs = ("pool_kernel",)


METHOD = SnapKV()
