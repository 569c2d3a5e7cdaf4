"""PyTorch reference of the KV selection operator (the oracle every backend is tested against)."""

from criticalkv.selection.budget import (
    head_floor,
    layer_selectable_budget,
    max_kept_per_head,
    pyramid_layer_budgets,
    stage1_count,
)
from criticalkv.selection.layer import (
    LayerSelection,
    gather_kv,
    select_layer,
    select_model,
    shared_allocation_mask,
    two_stage_mask,
)
from criticalkv.selection.scores import (
    LayerScores,
    ScoreMemo,
    layer_scores,
    max_pool_positions,
    value_projection_norms,
    window_attention,
)
from criticalkv.selection.topk import mask_to_indices, topk_mask

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
