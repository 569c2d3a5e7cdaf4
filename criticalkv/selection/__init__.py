"""PyTorch reference of the KV selection operator (the oracle every backend is tested against).

``select_layer`` / ``select_model`` (``layer``) drive the policy's method (``criticalkv.methods``) over the scores of
``scores``. The integer budget rules, the top-k and the pruned stage 2 belong to the methods, one floor down
(``criticalkv.methods.budget``, ``.topk``, ``.pruned``); the helpers below are imported from there.
"""

from criticalkv.methods.adakv import shared_allocation_mask
from criticalkv.methods.budget import (
    head_floor,
    layer_selectable_budget,
    max_kept_per_head,
    pyramid_layer_budgets,
    stage1_count,
)
from criticalkv.methods.topk import mask_to_indices, topk_mask
from criticalkv.methods.two_stage import two_stage_mask
from criticalkv.selection.layer import LayerSelection, gather_kv, select_layer, select_model
from criticalkv.selection.scores import (
    LayerScores,
    ScoreMemo,
    layer_scores,
    max_pool_positions,
    value_projection_norms,
    window_attention,
)

__all__ = [
    "LayerScores",
    "LayerSelection",
    "ScoreMemo",
    "gather_kv",
    "head_floor",
    "layer_scores",
    "layer_selectable_budget",
    "mask_to_indices",
    "max_kept_per_head",
    "max_pool_positions",
    "pyramid_layer_budgets",
    "select_layer",
    "select_model",
    "shared_allocation_mask",
    "stage1_count",
    "topk_mask",
    "two_stage_mask",
    "value_projection_norms",
    "window_attention",
]
