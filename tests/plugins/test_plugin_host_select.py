"""The host C++ version of the operator (plugins/host: a sequential driver of the kernels' shared functions) equals the
PyTorch reference."""

import dataclasses

import pytest
import torch

from ckv_native import encode_fields, node_fields
from criticalkv import KVPolicy, gather_kv, select_layer
from criticalkv.methods.defensivekv import stage1_count
from criticalkv.node import node_capacity
from criticalkv.selection import topk_mask
from helpers import random_layer
from policies import POLICY_CASES, make_policy

IDS = [c[0] for c in POLICY_CASES]


def assert_same_selection(got, ref, context):
    indices, lengths = got[0], got[1]
    assert torch.equal(lengths, ref.lengths), (context, lengths.tolist(), ref.lengths.tolist())
    batch, heads = lengths.shape
    for b in range(batch):
        for g in range(heads):
            count = int(ref.lengths[b, g])
            assert torch.equal(indices[b, g, :count], ref.indices[b, g, :count]), (context, b, g)
            assert (indices[b, g, count:] == -1).all(), (context, b, g)


@pytest.mark.parametrize("case", POLICY_CASES, ids=IDS)
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4), (8, 2)], ids=["gqa9x3", "mha4", "gqa8x2"])
@pytest.mark.parametrize("seed", range(3))
def test_equals_the_reference_on_random_padded_batches(host_lib, case, heads, kv_heads, seed):
    n = (150, 211, 96)[seed]
    q, k, v, o = random_layer(batch=3, heads=heads, kv_heads=kv_heads, n=n, head_dim=16, hidden=40, window=8, seed=seed)
    lengths = torch.tensor([n, n - 37, 30])  # compressed, compressed with padding, kept whole
    for budget in (24, 40):
        policy = make_policy(case[1], budget=budget, window=8)
        for layer, num_layers in ((0, 1), (0, 4), (3, 4)):
            ref = select_layer(policy, q, k, v, o, layer, num_layers, prompt_lengths=lengths)
            got = host_lib.select_layer(policy, q, k, v, o, layer, num_layers, prompt_lengths=lengths)
            assert_same_selection(got, ref, (case[0], budget, layer, num_layers))


@pytest.mark.parametrize("case", POLICY_CASES, ids=IDS)
def test_runtime_budgets_on_one_node_equal_the_reference_built_with_each_budget(host_lib, case):
    """One node (built budget 64, its capacity) serves requests of several budgets through its kv_budget input."""
    q, k, v, o = random_layer(batch=3, heads=8, kv_heads=2, n=170, head_dim=16, hidden=40, window=8, seed=5)
    lengths = torch.tensor([170, 121, 30])
    built = make_policy(case[1], budget=64, window=8)
    for layer, num_layers in ((0, 1), (1, 4), (3, 4)):
        capacity = node_capacity(built, 170, 2, layer, num_layers)
        for budget in (8, 9, 20, 37, 63, 64):
            want = select_layer(dataclasses.replace(built, budget=budget), q, k, v, o, layer, num_layers,
                                prompt_lengths=lengths)
            got = host_lib.select_layer(built, q, k, v, o, layer, num_layers, capacity=capacity,
                                        prompt_lengths=lengths, kv_budget=budget)
            assert got[0].shape[-1] == capacity, "the output width is the built capacity, whatever the budget"
            assert_same_selection(got, want, (case[0], budget, layer))
        # out-of-range requests are clamped to [window, budget]
        for requested, budget in ((0, 8), (-3, 8), (65, 64), (1 << 20, 64)):
            want = select_layer(dataclasses.replace(built, budget=budget), q, k, v, o, layer, num_layers,
                                prompt_lengths=lengths)
            got = host_lib.select_layer(built, q, k, v, o, layer, num_layers, capacity=capacity,
                                        prompt_lengths=lengths, kv_budget=requested)
            assert_same_selection(got, want, (case[0], requested, layer))


@pytest.mark.parametrize("case", POLICY_CASES, ids=IDS)
def test_equals_the_reference_with_realistic_head_dims(host_lib, case):
    q, k, v, o = random_layer(batch=1, heads=8, kv_heads=2, n=700, head_dim=64, hidden=256, window=32, seed=11)
    policy = make_policy(case[1], budget=160, window=32)
    for layer in (0, 5):
        ref = select_layer(policy, q, k, v, o, layer, 6)
        got = host_lib.select_layer(policy, q, k, v, o, layer, 6)
        assert_same_selection(got, ref, (case[0], layer))


#: defensivekv's knobs beyond the shared table: the reference's pool (5), no pool, a wide pool, l2 norms, the floors'
#: extremes, stage 1 off (mass 0) and unbounded (mass 1, capped at each head's share)
DEFENSIVE_VARIANTS = [
    dict(pool_kernel=5), dict(pool_kernel=1), dict(pool_kernel=31, value_norm="l2"), dict(ada_floor=0.0),
    dict(ada_floor=1.0), dict(stage1_mass=0.0), dict(stage1_mass=1.0, ada_floor=0.5),
]


@pytest.mark.parametrize("knobs", DEFENSIVE_VARIANTS, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4)], ids=["gqa9x3", "mha4"])
def test_defensivekv_knobs_equal_the_reference(host_lib, knobs, heads, kv_heads):
    n = 190
    q, k, v, o = random_layer(batch=3, heads=heads, kv_heads=kv_heads, n=n, head_dim=16, hidden=40, window=8, seed=3)
    lengths = torch.tensor([n, n - 51, 20])
    for budget in (16, 40, 100):
        policy = KVPolicy("defensivekv", budget=budget, window=8, **knobs)
        ref = select_layer(policy, q, k, v, o, prompt_lengths=lengths)
        got = host_lib.select_layer(policy, q, k, v, o, prompt_lengths=lengths)
        assert_same_selection(got, ref, (knobs, budget))


def test_stage1_mass_count_is_the_reference_cumulative_count(host_lib):
    """defensivekv's stage-1 count (a radix flow over per-digit sums) equals the reference's sorted cumulative sum
    (exact int64 sums of the masses in units of 2^-48, below the fixed-point limit), with ties, zeros, padding and any
    limit."""
    g = torch.Generator().manual_seed(2)
    for trial in range(300):
        m = int(torch.randint(1, 300, (1,), generator=g))
        levels = [1, 3, 20, None][trial % 4]
        raw = torch.rand(m, generator=g) if levels is None else torch.randint(0, levels + 1, (m,), generator=g).float()
        raw[torch.rand(m, generator=g) < 0.1] = 0.0
        first_valid = int(torch.randint(0, max(1, m // 4), (1,), generator=g)) if trial % 3 == 0 else 0
        eligible = torch.arange(m) >= first_valid
        mass = torch.where(eligible, raw, torch.zeros(m))
        mass = mass / mass.sum().clamp_min(torch.finfo(torch.float32).tiny)
        for limit in (-0.1, 0.0, 1e-6, float(torch.rand(1, generator=g)), 0.5, 0.9, 1.0, 1.5):
            r = torch.tensor([int(eligible.sum())])  # the reference's cap: never more than the eligible tokens
            want = int(stage1_count(mass[None, None], torch.tensor([limit]), r, eligible[None, None]))
            got = host_lib.mass_count(mass, limit, first_valid=first_valid)
            assert got == want, (trial, limit, got, want)


@pytest.mark.parametrize("m, seed", [(3000, 0), (1200, 2), (8000, 3)])
def test_stage1_count_where_float32_and_double_sums_straddle_the_limit(host_lib, m, seed):
    """A limit between a float32 and a double running sum of the sorted masses (issue 22: the plugin summed per radix
    bin in double): the host count is the reference's exact fixed-point count."""
    from helpers import straddling_masses

    mass, limit, _ = straddling_masses(m, seed)
    eligible = torch.ones(1, 1, m, dtype=torch.bool)
    want = int(stage1_count(mass[None, None], torch.tensor([limit]), torch.tensor([m]), eligible))
    assert host_lib.mass_count(mass, limit) == want


def test_stage1_mass_needs_no_decimals_rule(host_lib):
    """stage1_mass only meets fp32 cumulative masses: float32(x) survives the ONNX float32 attribute and its widening,
    so any value in [0, 1] selects the same in both languages (no 6-decimals rule as for alpha / ada_floor)."""
    q, k, v, o = random_layer(n=200, window=8, seed=6)
    for mass in (0.3, 0.123456789, 0.7071067811865476):
        policy = KVPolicy("defensivekv", budget=60, window=8, stage1_mass=mass)
        ref = select_layer(policy, q, k, v, o)
        for kind in ("float32", "float64"):
            assert_same_selection(host_lib.select_layer(policy, q, k, v, o, float_kind=kind), ref, (mass, kind))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["criticalkv", "ada-criticalkv", "laprox", "pyramidkv", "defensivekv"])
def test_low_precision_inputs(host_lib, dtype, name):
    q, k, v, o = random_layer(batch=2, n=180, window=8, seed=2, dtype=dtype)
    policy = KVPolicy(name, budget=40, window=8)
    ref = select_layer(policy, q, k, v, o, 1, 3, prompt_lengths=torch.tensor([180, 120]))
    got = host_lib.select_layer(policy, q, k, v, o, 1, 3, prompt_lengths=torch.tensor([180, 120]))
    assert_same_selection(got, ref, name)


def test_ties_go_to_the_lower_index(host_lib):
    q, k, v, o = random_layer(n=64, window=8, seed=0)
    k, v = torch.zeros_like(k), torch.zeros_like(v)
    for policy in (KVPolicy("snapkv", budget=24, window=8), KVPolicy("criticalkv", budget=24, window=8),
                   KVPolicy("pyramidkv", budget=24, window=8), KVPolicy("adakv", budget=24, window=8, ada_floor=0.25),
                   KVPolicy("ada-criticalkv", budget=24, window=8, ada_floor=0.25), KVPolicy("laprox", budget=24, window=8),
                   KVPolicy("defensivekv", budget=24, window=8), KVPolicy("defensivekv", budget=24, window=8, stage1_mass=0.3)):
        ref = select_layer(policy, q, k, v, o)
        assert_same_selection(host_lib.select_layer(policy, q, k, v, o), ref, policy.name)


def test_gathered_keys_and_values_and_capacity(host_lib):
    q, k, v, o = random_layer(batch=2, n=120, window=8, seed=4)
    lengths = torch.tensor([120, 70])
    policy = KVPolicy("adakv", budget=24, window=8)
    ref = select_layer(policy, q, k, v, o, prompt_lengths=lengths)
    want_k, want_v = gather_kv(ref, k, v)
    indices, kept, kk, vv = host_lib.select_layer(policy, q, k, v, o, prompt_lengths=lengths)
    width = want_k.shape[2]
    assert torch.equal(kk[:, :, :width], want_k) and torch.equal(vv[:, :, :width], want_v)
    assert (kk[:, :, width:] == 0).all() and indices.shape[-1] == 120
    # a capacity below n shrinks the output; node_capacity-sized outputs hold every kept entry
    indices, kept, kk, vv = host_lib.select_layer(policy, q, k, v, o, capacity=int(ref.lengths.max()), prompt_lengths=lengths)
    assert indices.shape[-1] == int(ref.lengths.max())
    assert_same_selection((indices, kept), ref, "capacity")


def test_float32_fields_select_like_the_python_policy(host_lib):
    # ONNX attributes carry alpha as float32; 0.3 must still give ceil(0.3 * r) as Python computes it.
    q, k, v, o = random_layer(n=200, window=8, seed=6)
    policy = KVPolicy("criticalkv", budget=18, window=8, alpha=0.3, epsilon=1e-3)  # r = 10: stage 1 keeps 3, not 4
    ref = select_layer(policy, q, k, v, o)
    got = host_lib.select_layer(policy, q, k, v, o, float_kind="float32")
    assert_same_selection(got, ref, "float32 fields")


def test_radix_top_k_matches_topk_mask_with_heavy_ties(host_lib):
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        m = int(torch.randint(1, 400, (1,), generator=g))
        levels = [1, 2, 5, 50, 10_000][trial % 5]
        scores = torch.randint(0, levels, (m,), generator=g).float() * 0.125 - 1.0
        if trial % 3 == 0:
            scores[torch.rand(m, generator=g) < 0.2] = -0.0
        eligible = torch.rand(m, generator=g) < 0.8
        first_valid = int(torch.randint(0, max(1, m // 3), (1,), generator=g))
        eligible[:first_valid] = False
        count = int(eligible.sum())
        for k in {0, 1, count // 3, count - 1, count, count + 5}:
            if k < 0:
                continue
            flags = (~eligible).to(torch.uint8) * 9  # already taken / ineligible
            flags[:first_valid] = 0  # handled by first_valid instead
            got = host_lib.select_top_k(scores, k, flags, first_valid=first_valid) == 1
            want = topk_mask(scores, min(k, count), eligible)
            assert torch.equal(got, want), (trial, k)


def test_radix_top_k_ranks_nan_and_infinities_like_topk_mask(host_lib):
    """NaN / +-inf scores: the radix select keeps what the PyTorch reference's stable descending sort keeps."""
    g = torch.Generator().manual_seed(1)
    specials = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0])
    for trial in range(40):
        m = int(torch.randint(2, 300, (1,), generator=g))
        scores = torch.randn(m, generator=g)
        where = torch.rand(m, generator=g) < (0.05, 0.3, 0.9)[trial % 3]
        scores[where] = specials[torch.randint(0, len(specials), (int(where.sum()),), generator=g)]
        for k in {0, 1, m // 4, m // 2, m - 1, m}:
            got = host_lib.select_top_k(scores, k) == 1
            assert torch.equal(got, topk_mask(scores, k)), (trial, k, scores[got ^ topk_mask(scores, k)])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(name="h2o"), "name"),
        (dict(budget=0), "budget"),
        (dict(budget=16, window=32), "budget"),
        (dict(window=0), "window"),
        (dict(alpha=-0.1), "alpha"),
        (dict(alpha=1.5), "alpha"),
        (dict(pool_kernel=4), "pool_kernel"),
        (dict(epsilon=-1.0), "epsilon"),
        (dict(value_norm="l3"), "value_norm"),
        (dict(gqa_reduce="max"), "gqa_reduce"),
        (dict(stage2_scores="cooked"), "stage2_scores"),
        (dict(ada_floor=2.0), "ada_floor"),
        (dict(pyramid_beta=0.5), "pyramid_beta"),
        (dict(sink_tokens=-1), "sink_tokens"),
        (dict(name="streamingllm", sink_tokens=300), "sink_tokens"),
        (dict(layer_idx=4, num_layers=4), "layer_idx"),
        (dict(num_layers=0), "num_layers"),
        (dict(capacity=0), "capacity"),
    ],
)
def test_policy_errors_name_the_field_like_kvpolicy(host_lib, kwargs, field):
    values = {**node_fields(KVPolicy(), 0, 1, 512), **kwargs}
    policy_kwargs = {k: v for k, v in kwargs.items() if k not in ("layer_idx", "num_layers", "capacity")}
    if policy_kwargs:
        with pytest.raises(ValueError, match=rf"^{field}:"):
            KVPolicy(**policy_kwargs)
    assert host_lib.parse(encode_fields(values)).startswith(f"{field}:")


def test_new_field_rules_name_the_field(host_lib):
    good = node_fields(KVPolicy("pyramidkv", budget=40, window=8), 1, 4, 512)
    assert host_lib.parse(encode_fields(good)) == ""
    for change, field in (
        ({"alpha": 0.1234567}, "alpha"),  # more than 6 decimals
        ({"ada_floor": 1e-7}, "ada_floor"),
        ({"layer_budgets": good["layer_budgets"][:-1]}, "layer_budgets"),  # one value short
        ({"layer_budgets": [0] * 32 + [65]}, "layer_budgets"),  # above 2 (b - window)
        ({"layer_budgets": [-1] * 33}, "layer_budgets"),
    ):
        assert host_lib.parse(encode_fields({**good, **change})).startswith(f"{field}:"), change
    # PyramidKV's per-layer budgets come from Python only: a pyramid node without them is refused
    del good["layer_budgets"]
    assert host_lib.parse(encode_fields(good)).startswith("layer_budgets:")


@pytest.mark.parametrize("scale_95, kept, evicted", [(1.0, 95, 149), (1 - 8e-6, 149, 95)])
def test_the_defensive_near_tie_of_issue_29_is_resolved_as_the_reference_does(host_lib, scale_95, kept, evicted):
    """tests/export/test_defensive_stage1.py's near tie (two candidates 2e-6 apart in attention mass for one slot of KV
    head 1): the host C++ keeps the same entries as select_layer, the heavier of the two (its window mass and stage-1
    limit are computed in the same order)."""
    from export.test_defensive_stage1 import near_tie_layer

    policy = KVPolicy("defensivekv", budget=64, window=32)
    q, k, v, o = near_tie_layer(scale_95)
    ref = select_layer(policy, q, k, v, o)
    got = host_lib.select_layer(policy, q, k, v, o, 0, 1)
    assert_same_selection(got, ref, ("near tie", scale_95))
    chosen = set(ref.indices[0, 1, : int(ref.lengths[0, 1])].tolist())
    assert kept in chosen and evicted not in chosen
