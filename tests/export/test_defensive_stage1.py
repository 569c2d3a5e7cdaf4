"""defensivekv's stage-1 count is exact in every backend (issue 22).

The count is the number of most-attended tokens whose cumulative mass stays below ``stage1_mass - window mass``. It was
a float sum: torch's CPU cumsum accumulates in double, ONNX Runtime's CumSum in float32 (and torch's CUDA cumsum too),
the plugin in double per radix bin; near the limit the backends kept a different number of stage-1 tokens, one token
more or less in a head. The masses are now summed as int64 in units of 2^-48 (``fixed_mass``), so the count depends only
on the masses themselves. The host C++ count is checked against the same cases in tests/plugins.
"""

from fractions import Fraction

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import helper

from criticalkv import KVPolicy
from criticalkv.export.graph import BOOL, FLOAT, INT64, IR_VERSION, OPSET, GraphBuilder, value_info
from criticalkv.export.select_function import _Body
from criticalkv.methods.defensivekv import MASS_FIXED_BITS, METHOD, STAGE1_OFFSET, priority
from helpers import straddling_masses

NAMES = ("defensive", "stage1_mass", "window_mass")


def onnx_priority(policy: KVPolicy, kv_heads: int) -> ort.InferenceSession:
    """The body's ranking piece (``DefensiveKV.onnx_priority``) alone, on scores given as inputs."""
    g = GraphBuilder("p/")
    body = _Body(g, policy, 1, kv_heads, kv_heads, 8)
    ranking = METHOD.onnx_priority(body, g, {n: n for n in NAMES}, "eligible", "r")
    g.Identity(ranking, outputs=["ranking"])
    inputs = [value_info(n, FLOAT, None) for n in NAMES] + [value_info("eligible", BOOL, None), value_info("r", INT64, None)]
    graph = helper.make_graph(g.nodes, "priority", inputs, [value_info("ranking", FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def exact_count(mass: torch.Tensor, eligible: torch.Tensor, limit: float, r: int) -> int:
    """The rule in Python integers: #{k : sum of floor(2^48 m) over the k most massive eligible tokens
    < 2^48 limit}, at most r (an oracle independent of any tensor library's sums)."""
    unit = 2**MASS_FIXED_BITS
    values = sorted((int(Fraction(float(x)) * unit) for x, e in zip(mass.tolist(), eligible.tolist()) if e), reverse=True)
    total, count = 0, 0
    for v in values:
        total += v
        if not Fraction(total) < Fraction(limit) * unit:
            break
        count += 1
    return min(count, r)


def run_both(policy, mass, window_mass, eligible, r, defensive=None):
    """(reference ranking, ONNX ranking) [B, H_kv, m] for scores of shape [B, H_kv, m]."""
    defensive = torch.rand(mass.shape, generator=torch.Generator().manual_seed(1)) * 1e-3 if defensive is None else defensive
    scores = {"defensive": defensive, "stage1_mass": mass, "window_mass": window_mass[:, None, None].expand_as(mass).contiguous()}
    ref = priority(scores, policy.stage1_mass, r, eligible)
    feeds = {n: scores[n].numpy() for n in NAMES}
    got = onnx_priority(policy, mass.shape[1]).run(None, {**feeds, "eligible": eligible.numpy(), "r": r.numpy()})[0]
    return ref, torch.from_numpy(got)


@pytest.mark.parametrize("m, seed", [(3000, 0), (3000, 1), (1200, 2), (8000, 3)])
def test_a_limit_between_float32_and_double_sums_counts_the_same(m, seed):
    """The masses of one head and a limit that a float32 running sum and a double one put on different sides: the
    reference and the ONNX body keep the same stage-1 tokens, the count of exact fixed-point sums."""
    mass, limit, _ = straddling_masses(m, seed)
    threshold = 0.9
    window_mass = torch.tensor([np.float32(threshold) - np.float32(limit)], dtype=torch.float32)
    assert float(torch.tensor(threshold, dtype=torch.float32) - window_mass) == limit  # the limit the rule meets
    eligible = torch.ones(1, 1, m, dtype=torch.bool)
    policy = KVPolicy("defensivekv", budget=m + 64, window=32, stage1_mass=threshold)
    r = torch.tensor([m])
    ref, got = run_both(policy, mass[None, None], window_mass, eligible, r)
    assert torch.equal(ref, got)
    assert int((ref >= STAGE1_OFFSET).sum()) == exact_count(mass, eligible[0, 0], limit, m)


def test_random_heads_with_ties_zeros_and_padding():
    g = torch.Generator().manual_seed(5)
    for trial in range(40):
        batch, heads, m = 2, 3, int(torch.randint(5, 400, (1,), generator=g))
        levels = [None, 3, 1][trial % 3]
        raw = torch.rand(batch, heads, m, generator=g) if levels is None else \
            torch.randint(0, levels + 1, (batch, heads, m), generator=g).float()
        raw[torch.rand(batch, heads, m, generator=g) < 0.1] = 0.0
        first_valid = torch.tensor([0, int(torch.randint(0, m // 2 + 1, (1,), generator=g))])
        eligible = (torch.arange(m)[None, :] >= first_valid[:, None])[:, None].expand(batch, heads, m)
        mass = torch.where(eligible, raw, 0.0)
        mass = mass / mass.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        window_mass = torch.rand(batch, generator=g) * 0.3
        r = torch.minimum(eligible[:, 0].sum(-1), torch.tensor(int(torch.randint(1, m + 1, (1,), generator=g))))
        for threshold in (0.0, 0.2, 0.9, 1.0):
            policy = KVPolicy("defensivekv", budget=m + 64, window=32, stage1_mass=threshold)
            ref, got = run_both(policy, mass, window_mass, eligible, r)
            assert torch.equal(ref, got), (trial, threshold)
            limit = float(torch.tensor(threshold, dtype=torch.float32) - window_mass[1])
            want = exact_count(mass[1, 2], eligible[1, 2], limit, int(r[1]))
            assert int((ref[1, 2] >= STAGE1_OFFSET).sum()) == want, (trial, threshold)
