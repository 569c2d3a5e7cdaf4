"""The shared __host__ __device__ helpers (budget.h, budget_host.h, radix.h) against the Python rules, via ctypes."""

import math
import random
import struct

import numpy as np
import pytest

from ckv_native import node_fields
from criticalkv import KVPolicy
from criticalkv.node import node_capacity
from criticalkv.selection import head_floor, layer_selectable_budget, max_kept_per_head, pyramid_layer_budgets, stage1_count
from policies import POLICY_CASES, make_policy

# Values where float noise matters: 0.3 * 10 = 3.0000000000000004 must stay 3.
ALPHAS = [0.0, 0.05, 0.1, 0.2, 0.25, 0.3, 1 / 3, 0.35, 0.5, 0.6, 0.7, 2 / 3, 0.75, 0.9, 0.95, 0.999, 1.0]


def test_stage1_count_and_head_floor_match_python_on_a_grid(host_lib):
    for alpha in ALPHAS:
        for r in list(range(0, 200)) + [255, 256, 1000, 1023, 4096, 8191, 8192, 100_000, 131_072, 4_000_000]:
            assert host_lib.stage1_count(alpha, r) == stage1_count(alpha, r), (alpha, r)
            assert host_lib.head_floor(alpha, r) == head_floor(alpha, r), (alpha, r)


def test_stage1_count_and_head_floor_match_python_on_random_and_adversarial_values(host_lib):
    rng = random.Random(0)
    for _ in range(20_000):
        alpha = rng.random() if rng.random() < 0.5 else round(rng.random(), rng.randint(1, 5))
        r = rng.randint(0, 1 << 21)
        assert host_lib.stage1_count(alpha, r) == stage1_count(alpha, r), (alpha, r)
        assert host_lib.head_floor(alpha, r) == head_floor(alpha, r), (alpha, r)
    # alpha * r landing a few ulps around k + 5e-10 and k + 0.9999999995 (the round(x, 9) boundaries)
    for k in (0, 1, 7, 1000, 65_537, 1 << 20):
        for frac in (5e-10, 0.9999999995, 1e-9, 0.999999999, 0.5):
            for r in (k + 1, 2 * k + 3, 1 << 21):
                target = k + frac
                alpha = target / r
                for a in (alpha, math.nextafter(alpha, 0), math.nextafter(alpha, 1)):
                    if 0 <= a <= 1:
                        assert host_lib.stage1_count(a, r) == stage1_count(a, r), (a, r)
                        assert host_lib.head_floor(a, r) == head_floor(a, r), (a, r)


@pytest.mark.parametrize("beta", [1.0, 1.5, 4.0, 7.3, 20.0, 100.0])
def test_pyramid_layer_budgets_match_python(host_lib, beta):
    for r in list(range(0, 70)) + [96, 100, 224, 480, 1000, 1024, 4064, 8160]:
        for layers in (1, 2, 3, 7, 12, 16, 24, 28, 30, 32, 40, 80):
            assert host_lib.pyramid_layer_budgets(r, layers, beta) == pyramid_layer_budgets(r, layers, beta), (r, layers)


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
    assert host_lib.ordered_key(float("nan")) < host_lib.ordered_key(float("-inf"))


def test_float32_fields_widen_to_their_shortest_decimal(host_lib):
    # ONNX FLOAT attributes are float32: 0.3 arrives as 0.30000001192092896 and must mean 0.3 again.
    for value in (0.3, 0.25, 1e-4, 0.2, 20.0, 0.1, 0.7, 1 / 3, 0.123456789, 5e-10, 1.0):
        f32 = struct.unpack("<f", struct.pack("<f", value))[0]
        assert host_lib.widen_float32(f32) == float(str(np.float32(f32)))
    assert host_lib.widen_float32(struct.unpack("<f", struct.pack("<f", 0.3))[0]) == 0.3
    # ... so that a float32 alpha = 0.3 gives ceil(0.3 * 10) = 3 like the Python policy, not 4
    assert stage1_count(0.3, 10) == 3 and stage1_count(np.float32(0.3).item(), 10) == 4


def test_policy_parser_defaults_are_kvpolicy_defaults(host_lib):
    from ckv_native import encode_fields

    described = host_lib.describe(encode_fields({"capacity": 100}))
    default = KVPolicy().to_dict()
    assert set(described) == set(default) | {"layer_idx", "num_layers", "capacity"}
    for name, value in default.items():
        if isinstance(value, float):
            assert float(described[name]) == value, name
        else:
            assert described[name] == str(value), name
