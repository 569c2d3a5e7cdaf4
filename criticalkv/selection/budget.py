"""Budget arithmetic: how many older tokens each layer and KV head may keep.

Integer rules (shared with the CUDA/C++ implementation, ``plugins/include/criticalkv/budget.h``):

* ``r = budget - window`` older tokens per KV head on average;
* stage 1 keeps ``ceil(alpha * r_head)`` tokens (never silently 0 when alpha > 0);
* pyramid: per-layer ``r_l`` linear from ``r_max`` (layer 0) down to ``r_min = max(r / beta, 1)``
  (last layer), ``r_max = 2 r - r_min``, rounded by largest remainder so that the layers sum to
  exactly ``num_layers * r`` (ties toward the lower layer);
* adakv / laprox floor: each head keeps at least ``max(1, floor(ada_floor * r))`` (0 if ada_floor
  is 0), the rest of the layer's ``H_kv * r`` slots go to the highest scores across its heads.
"""

from __future__ import annotations

import math

from criticalkv.policy import KVPolicy


def stage1_count(alpha: float, r: int) -> int:
    """Tokens stage 1 keeps by attention alone out of a head's ``r``: ceil(alpha * r)."""
    # round() first so that e.g. 0.3 * 10 = 3.0000000000000004 does not become 4
    return min(r, math.ceil(round(alpha * r, 9)))


def head_floor(ada_floor: float, r: int) -> int:
    """Tokens every head keeps by its own scores under shared (adakv / laprox) allocation."""
    if ada_floor <= 0 or r <= 0:
        return 0
    return min(r, max(1, math.floor(round(ada_floor * r, 9))))


def pyramid_layer_budgets(r: int, num_layers: int, beta: float) -> list[int]:
    """Selectable budget of every layer for PyramidKV; the list sums to ``num_layers * r``."""
    if num_layers <= 0:
        raise ValueError(f"num_layers: must be positive, got {num_layers}")
    if num_layers == 1 or r <= 0:
        return [r] * num_layers
    r_min = max(r / beta, 1.0)
    r_max = 2 * r - r_min
    exact = [r_max - (r_max - r_min) * layer / (num_layers - 1) for layer in range(num_layers)]
    floors = [math.floor(round(x, 9)) for x in exact]
    missing = num_layers * r - sum(floors)
    by_remainder = sorted(range(num_layers), key=lambda i: (-(exact[i] - floors[i]), i))
    for i in by_remainder[:missing]:
        floors[i] += 1
    return floors


def layer_selectable_budget(policy: KVPolicy, layer_idx: int, num_layers: int) -> int:
    """Older tokens per KV head (average over the layer's heads) that ``layer_idx`` may keep."""
    if not 0 <= layer_idx < num_layers:
        raise ValueError(f"layer_idx: {layer_idx} is outside [0, {num_layers})")
    r = policy.selectable_budget
    if policy.base == "pyramidkv":
        return pyramid_layer_budgets(r, num_layers, policy.pyramid_beta)[layer_idx]
    return r


def max_kept_per_head(policy: KVPolicy, n: int, num_kv_heads: int, layer_idx: int = 0, num_layers: int = 1) -> int:
    """Upper bound of the entries any KV head of ``layer_idx`` keeps from an n-token prompt.

    This is the fixed capacity a compressed-cache buffer (or an ONNX/TensorRT output) needs.
    """
    if policy.name == "full" or n <= policy.budget:
        return n
    if policy.base == "streamingllm":
        return policy.budget
    w = min(policy.window, n)
    m = n - w
    r = layer_selectable_budget(policy, layer_idx, num_layers)
    if policy.base in ("adakv", "laprox"):
        floor = head_floor(policy.ada_floor, min(r, m))
        r = num_kv_heads * min(r, m) - (num_kv_heads - 1) * floor
    return w + min(r, m)
