"""The shared __host__ __device__ helpers (budget.h, radix.h) and the budget resolution against the Python rules."""

import dataclasses
import math
import random
import struct
from fractions import Fraction

import numpy as np
import pytest

from ckv_native import node_fields
from criticalkv import KVPolicy
from criticalkv.node import node_capacity
from criticalkv.selection import head_floor, layer_selectable_budget, max_kept_per_head, stage1_count
from policies import POLICY_CASES, make_policy

# Values where float arithmetic would matter: 0.3 * 10 = 3.0000000000000004 must stay 3. Every alpha has at most
# 6 decimals (KVPolicy's rule), so the C++ side computes with integer millionths.
ALPHAS = [0.0, 0.000001, 0.05, 0.1, 0.2, 0.25, 0.3, 0.333333, 0.35, 0.5, 0.6, 0.7, 0.666667, 0.75, 0.9, 0.95, 0.999,
          0.999999, 1.0]


def exact_stage1(alpha: float, r: int) -> int:
    return min(r, math.ceil(Fraction(repr(alpha)) * r)) if r > 0 else 0


def exact_floor(ada_floor: float, r: int) -> int:
    if ada_floor <= 0 or r <= 0:
        return 0
    return min(r, max(1, math.floor(Fraction(repr(ada_floor)) * r)))


def test_stage1_count_and_head_floor_match_python_on_a_grid(host_lib):
    for alpha in ALPHAS:
        assert host_lib.decimal_micros(alpha) == round(Fraction(repr(alpha)) * 10**6)
        for r in list(range(0, 4100)) + [8191, 8192, 100_000, 131_072, 4_000_000, 1 << 22]:
            want = stage1_count(alpha, r)
            assert host_lib.stage1_count(alpha, r) == want == exact_stage1(alpha, r), (alpha, r)
            want = head_floor(alpha, r)
            assert host_lib.head_floor(alpha, r) == want == exact_floor(alpha, r), (alpha, r)


def test_stage1_count_and_head_floor_match_python_on_random_and_exact_products(host_lib):
    rng = random.Random(0)
    for _ in range(20_000):
        alpha = rng.randint(0, 10**6) / 10**6 if rng.random() < 0.5 else round(rng.random(), rng.randint(1, 6))
        r = rng.randint(0, 1 << 22)
        assert host_lib.stage1_count(alpha, r) == stage1_count(alpha, r) == exact_stage1(alpha, r), (alpha, r)
        assert host_lib.head_floor(alpha, r) == head_floor(alpha, r) == exact_floor(alpha, r), (alpha, r)
    # alpha * r an integer exactly (where a float product can land one ulp above and ceil one too high)
    for micros in (1, 3, 7, 125_000, 300_000, 333_333, 700_000, 999_999):
        alpha = micros / 10**6
        step = 10**6 // math.gcd(micros, 10**6)
        for r in (step, 3 * step, 10 * step, (1 << 22) // step * step):
            assert host_lib.stage1_count(alpha, r) == stage1_count(alpha, r) == exact_stage1(alpha, r), (alpha, r)
            assert host_lib.head_floor(alpha, r) == head_floor(alpha, r) == exact_floor(alpha, r), (alpha, r)


@pytest.mark.parametrize("case", POLICY_CASES, ids=[c[0] for c in POLICY_CASES])
def test_layer_budget_and_capacity_match_python(host_lib, case):
    for budget, window in ((24, 8), (64, 16), (256, 32), (1000, 64)):
        policy = make_policy(case[1], budget=budget, window=window)
        for layer, layers in ((0, 1), (0, 30), (17, 30), (29, 30)):
            values = node_fields(policy, layer, layers, 4096)
            if policy.name != "full":
                assert host_lib.layer_budget(values) == layer_selectable_budget(policy, layer, layers)
            for n in (1, window, budget, budget + 1, 3 * budget + 5, 10_000):
                for kv_heads in (1, 3, 8):
                    want = max_kept_per_head(policy, n, kv_heads, layer, layers)
                    assert host_lib.max_kept_per_head(values, n, kv_heads) == want, (n, kv_heads, layer)
                    assert node_capacity(policy, n, kv_heads, layer, layers) >= want


@pytest.mark.parametrize("case", POLICY_CASES, ids=[c[0] for c in POLICY_CASES])
def test_runtime_budget_resolves_like_a_policy_built_with_that_budget(host_lib, case):
    """kv_budget = b on a node built with budget B acts as the policy with budget b (clamped to [min_budget, B]: the
    window, with the sinks beside it for the kvzip pair and streamingllm's sinks)."""
    for budget, window in ((64, 16), (256, 32), (1000, 64)):
        policy = make_policy(case[1], budget=budget, window=window)
        floor_budget = max(window, policy.sink_tokens) if policy.base == "streamingllm" else window
        floor_budget = max(floor_budget, window + policy.method.base.sinks(policy))  # the kvzip pair keeps its sinks
        for layer, layers in ((0, 1), (0, 30), (17, 30), (29, 30)):
            values = node_fields(policy, layer, layers, 4096)
            for requested in (-5, 0, window - 1, window, window + 1, (window + budget) // 2, budget - 1, budget,
                              budget + 1, 1 << 30):
                b = min(max(requested, floor_budget), budget)
                smaller = dataclasses.replace(policy, budget=b)
                got_budget, got_layer_budget = host_lib.budget_choice(values, requested)
                assert got_budget == b, (requested, b)
                if policy.name != "full":
                    assert got_layer_budget == layer_selectable_budget(smaller, layer, layers), (requested, layer)
                for n in (b, b + 1, 3 * budget + 5):
                    want = max_kept_per_head(smaller, n, 3, layer, layers)
                    assert host_lib.max_kept_per_head(values, n, 3, requested) == want, (requested, n, layer)
                    assert want <= node_capacity(policy, n, 3, layer, layers), "the built capacity holds every b"


def test_ordered_key_preserves_order_and_merges_signed_zeros(host_lib):
    rng = np.random.default_rng(0)
    values = np.concatenate([
        rng.standard_normal(2000).astype(np.float32) * 10.0 ** rng.integers(-40, 38, 2000),
        np.array([0.0, -0.0, 1e-45, -1e-45, 1.17e-38, -1.17e-38, np.inf, -np.inf, 3.4e38, -3.4e38], dtype=np.float32),
    ]).astype(np.float32)
    keys = np.array([host_lib.ordered_key(float(v)) for v in values], dtype=np.uint64)
    for i in range(0, len(values), 7):
        for j in range(0, len(values), 11):
            a, b = values[i], values[j]
            assert (a < b) == (keys[i] < keys[j]) and (a == b) == (keys[i] == keys[j]), (a, b)
    assert host_lib.ordered_key(0.0) == host_lib.ordered_key(-0.0)
    # NaN ranks like torch's descending sort ranks it (criticalkv/methods/topk.py): above +inf, one key for all
    assert host_lib.ordered_key(float("nan")) > host_lib.ordered_key(float("inf"))
    assert host_lib.ordered_key(-float("nan")) == host_lib.ordered_key(float("nan"))


def test_float32_fields_widen_to_their_shortest_decimal(host_lib):
    # ONNX FLOAT attributes are float32: 0.3 arrives as 0.30000001192092896 and must mean 0.3 again.
    for value in (0.3, 0.25, 1e-4, 0.2, 20.0, 0.1, 0.7, 1 / 3, 0.123456789, 5e-10, 1.0):
        f32 = struct.unpack("<f", struct.pack("<f", value))[0]
        assert host_lib.widen_float32(f32) == float(str(np.float32(f32)))
    assert host_lib.widen_float32(struct.unpack("<f", struct.pack("<f", 0.3))[0]) == 0.3
    # ... and a float32 alpha = 0.3 gives ceil(0.3 * 10) = 3 like the Python policy, not ceil(3.0000001) = 4
    assert stage1_count(0.3, 10) == 3 and host_lib.stage1_count(np.float32(0.3).item(), 10) == 3


def test_policy_parser_defaults_are_kvpolicy_defaults(host_lib):
    from ckv_native import encode_fields

    described = host_lib.describe(encode_fields({"capacity": 100}))
    default = KVPolicy().attributes()
    assert set(described) == set(default) | {"layer_idx", "num_layers", "capacity", "layer_budgets"}
    # without a layer_budgets field a non-pyramid node's r_l is b - window (described as count:FNV-1a of the values)
    table = list(range(KVPolicy().budget - KVPolicy().window + 1))
    digest = 0xcbf29ce484222325
    for byte in struct.pack(f"<{len(table)}i", *table):
        digest = ((digest ^ byte) * 0x100000001b3) % (1 << 64)
    assert described.pop("layer_budgets") == f"{len(table)}:{digest:016x}"
    for name, value in default.items():
        if isinstance(value, float):
            assert float(described[name]) == value, name
        else:
            assert described[name] == str(value), name
