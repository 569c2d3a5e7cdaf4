"""``pyramidkv``: SnapKV with per-layer budgets decreasing linearly from the first to the last layer."""

from criticalkv.methods.budget import pyramid_layer_budgets
from criticalkv.methods.snapkv import SnapKV


class PyramidKV(SnapKV):
    name = "pyramidkv"
    cpp_enum = "kPyramidKV"
    description = "snapkv with per-layer budgets decreasing linearly (ratio pyramid_beta), same average"
    knobs = ("pool_kernel", "pyramid_beta")

    def layer_budget(self, policy, r, layer_idx, num_layers):
        return pyramid_layer_budgets(r, num_layers, policy.pyramid_beta)[layer_idx]


METHOD = PyramidKV()
