"""Budget arithmetic: how many older tokens each layer and KV head may keep, exactly in integers.

Every rule is integer arithmetic, so every language computes the same numbers (the C++ plugin:
``plugins/include/criticalkv/budget.h``; the ONNX body looks the numbers up in tables made here):

* ``r = budget - window`` older tokens per KV head on average;
* fractions are exact decimals with at most 6 decimals (a ``KVPolicy`` rule): ``A = alpha * 10^6`` is an integer;
* stage 1 keeps ``ceil(alpha * r) = (A * r + 10^6 - 1) // 10^6`` tokens (never silently 0 when alpha > 0);
* adakv / laprox floor: each head keeps at least ``max(1, F * r // 10^6)`` with ``F = ada_floor * 10^6`` (0 if
  ada_floor is 0), the rest of the layer's ``H_kv * r`` slots go to the highest scores across its heads;
* layer-defensivekv cap: a head keeps at most ``H * budget // 10^6`` entries (window included) with
  ``H = head_cap_ratio * 10^6`` (no cap when 0);
* pyramid: per-layer ``r_l`` linear from ``r_max`` (layer 0) down to ``r_min = max(r / beta, 1)`` (last layer),
  ``r_max = 2 r - r_min``, as exact rationals over the denominator ``beta_micros * (L - 1)``; floors, then the
  ``L * r - sum`` missing units go to the largest remainders (ties toward the lower layer), so the layers sum to
  exactly ``L * r``. Computed at export only (node attribute ``layer_budgets``).

These equal the earlier float definitions (``ceil``/``floor`` of ``round(x, 9)``) for every case tested
(``tests/selection/test_integer_rules.py``).

The rules that take a policy read its knobs and its method (``policy.method.base``); they sit here, beside the
methods, because the methods need them and ``KVPolicy`` stands a floor above (it imports the methods' registry).
"""

from __future__ import annotations

import functools

from criticalkv.methods.base import Policy
from criticalkv.spec.rules import DECIMAL_SCALE, micros


def stage1_count(alpha: float, r: int) -> int:
    """Tokens stage 1 keeps by attention alone out of a head's ``r``: ceil(alpha * r), exactly."""
    if r <= 0:
        return 0
    return min(r, (micros(alpha) * r + DECIMAL_SCALE - 1) // DECIMAL_SCALE)


def head_floor(ada_floor: float, r: int) -> int:
    """Tokens every head keeps by its own scores under shared (adakv / laprox) allocation: max(1, floor(f * r))."""
    f = micros(ada_floor)
    if f <= 0 or r <= 0:
        return 0
    return min(r, max(1, f * r // DECIMAL_SCALE))


def head_cap(head_cap_ratio: float, budget: int) -> int:
    """Most entries one KV head keeps under a model-level budget (``layer-defensivekv``), window included:
    floor(head_cap_ratio * budget), exactly; 0 when the cap is off (``head_cap_ratio`` 0)."""
    return micros(head_cap_ratio) * budget // DECIMAL_SCALE


def pyramid_layer_budgets(r: int, num_layers: int, beta: float) -> list[int]:
    """Selectable budget of every layer for PyramidKV; the list sums to ``num_layers * r``."""
    return list(_pyramid_layer_budgets(r, num_layers, micros(beta)))


@functools.lru_cache(maxsize=4096)
def _pyramid_layer_budgets(r: int, num_layers: int, beta_micros: int) -> tuple[int, ...]:
    if num_layers <= 0:
        raise ValueError(f"num_layers: must be positive, got {num_layers}")
    if num_layers == 1 or r <= 0:
        return (r,) * num_layers
    q, steps = beta_micros, num_layers - 1
    a = max(r * DECIMAL_SCALE, q)  # r_min = a / q = max(r / beta, 1)
    denominator = q * steps
    # exact_l = r_max - (r_max - r_min) * l / (L - 1) = numerator_l / denominator
    numerators = [(2 * r * q - a) * steps - (2 * r * q - 2 * a) * layer for layer in range(num_layers)]
    floors = [x // denominator for x in numerators]
    remainders = [x % denominator for x in numerators]
    missing = num_layers * r - sum(floors)
    by_remainder = sorted(range(num_layers), key=lambda i: (-remainders[i], i))
    for i in by_remainder[:missing]:
        floors[i] += 1
    return tuple(floors)


def layer_selectable_budget(policy: Policy, layer_idx: int, num_layers: int) -> int:
    """Older tokens per KV head (average over the layer's heads) that ``layer_idx`` may keep."""
    if not 0 <= layer_idx < num_layers:
        raise ValueError(f"layer_idx: {layer_idx} is outside [0, {num_layers})")
    return policy.method.base.layer_budget(policy, policy.selectable_budget, layer_idx, num_layers)


def layer_budget_table(policy: Policy, layer_idx: int, num_layers: int) -> list[int]:
    """r_l of layer ``layer_idx`` for every per-request budget b = window .. budget: ``table[b - window]``.

    This is the node attribute ``layer_budgets`` (the ONNX body and the plugin look r_l up in it, so no
    backend recomputes the pyramid). Empty for a policy that does not evict.
    """
    if not 0 <= layer_idx < num_layers:
        raise ValueError(f"layer_idx: {layer_idx} is outside [0, {num_layers})")
    base = policy.method.base
    if not base.evicts:
        return []
    return [base.layer_budget(policy, r, layer_idx, num_layers) for r in range(policy.selectable_budget + 1)]


def max_kept_per_head(policy: Policy, n: int, num_kv_heads: int, layer_idx: int = 0, num_layers: int = 1) -> int:
    """Upper bound of the entries any KV head of ``layer_idx`` keeps from an n-token prompt.

    This is the fixed capacity a compressed-cache buffer (or an ONNX/TensorRT output) needs.
    """
    base = policy.method.base
    if not base.evicts or n <= policy.budget:
        return n
    if not base.scored:
        return policy.budget
    w = min(policy.window, n)
    m = n - w
    return w + base.max_older_per_head(policy, layer_selectable_budget(policy, layer_idx, num_layers), m, num_kv_heads)


def adaptive_budget(scores, threshold: float, window: int, cap: int) -> int:
    """An input-adaptive budget (KVzap's and DMS's thresholding): the budget, in entries per KV head on average
    (window included), that keeps every older entry whose score reaches ``threshold``: the window plus their count
    over every layer and KV head divided by the number of KV heads, rounded up; at most ``cap`` (the request's
    budget), at least the window. ``scores``: per layer [B, H_kv, n] arrays (numpy or torch) of a method's own score
    of the prompt, e.g. KVzip's (re-read or surrogate: an attention probability, so one threshold means the same in
    every document). The policy then selects at that budget: under a model-wide ranking (``layer-kvzip``) exactly the
    entries above the threshold, up to the per-head floor and cap."""
    if not threshold > 0:
        raise ValueError(f"threshold: must be > 0, got {threshold}")
    n = int(scores[0].shape[-1])
    w = min(window, n)
    heads = sum(int(s.shape[0]) * int(s.shape[1]) for s in scores)
    above = sum(int((s[..., : n - w] >= threshold).sum()) for s in scores)
    return int(min(cap, max(w, w + -(-above // heads))))
