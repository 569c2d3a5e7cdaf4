"""``laprox``: layer-global importance sum_h ||A_h[:, i]||_2 ||V_i W_O^h||_2, shared like AdaKV.

LaProx-style: the window attention column of every query head (l2 over the window) times the l2 norm of
the value projected through that head's slice of W_O, summed over the group; the layer's budget is
shared across its heads with AdaKV's floor.
"""

from __future__ import annotations

from criticalkv.methods.adakv import AdaKV, AdaKVKnobs


class LaProx(AdaKV):
    name = "laprox"
    cpp_enum = "kLaProx"
    description = "layer-global ‖A col‖₂·‖V W_O^h‖₂ importance, per-head floor ada_floor"
    Knobs = AdaKVKnobs
    own_l2_norms = True
    score_name = "laprox"
    score_names = ("laprox",)

    def group_scores(self, policy, inputs):
        return {"laprox": (inputs.probs.norm(dim=2) * inputs.norms("l2")).sum(dim=1)}

    def onnx_group_scores(self, body, g, probs, raw, pooled, values_m):
        norms = body.value_norms(g, values_m, "l2")  # [B, H_kv, G, m]
        return {"laprox": g.ReduceSum(g.Mul(g.ReduceL2(probs, g.i64(3), keepdims=0), norms), g.i64(2), keepdims=0)}


METHOD = LaProx()
