"""The pruned stage 2 in the CriticalKVSelect function body (ONNX Runtime) against the PyTorch reference."""

import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from criticalkv import KVPolicy, select_layer
from criticalkv.export.select_function import selection_model
from criticalkv.runtime.profiling import stage2_branches
from criticalkv.methods import pruned
from helpers import random_layer
from policies import POLICY_CASES, make_policy

REFINED = [c for c in POLICY_CASES if KVPolicy(**c[1], budget=40, window=8).method.refine is not None]


pruning = pruned.pruning


def run_profiled(policy, q, k, v, o, lengths, layer_idx=0, num_layers=1):
    """(kept_indices, kept_lengths, branch counts) of the node on ONNX Runtime, body exported with pruning on."""
    with pruning(True):
        model = selection_model(policy, o.numpy(), q.shape[1], k.shape[1], layer_idx=layer_idx, num_layers=num_layers,
                                max_prompt_len=k.shape[2])
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "ort_profile")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {"queries": q.numpy(), "keys": k.numpy(), "values": v.numpy(), "prompt_lengths": lengths.numpy().astype(np.int32)}
    _, _, kept_lengths, kept_indices = session.run(None, feeds)
    trace = Path(session.end_profiling())
    branches = stage2_branches(trace)
    shutil.rmtree(trace.parent)
    return kept_indices, kept_lengths, branches


def assert_same(policy, q, k, v, o, lengths, layer_idx=0, num_layers=1):
    indices, kept_lengths, branches = run_profiled(policy, q, k, v, o, lengths, layer_idx, num_layers)
    for on in (True, False):  # the reference, pruned and not: all three agree
        with pruning(on):
            ref = select_layer(policy, q, k, v, o, layer_idx, num_layers, lengths.to(torch.int64))
        width = ref.indices.shape[-1]
        assert np.array_equal(kept_lengths, ref.lengths.numpy())
        assert np.array_equal(indices[..., :width], ref.indices.numpy()), f"kept indices differ (reference pruned={on})"
    return branches


@pytest.mark.parametrize("case", REFINED, ids=[c[0] for c in REFINED])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4)], ids=["gqa9x3", "mha4"])
def test_pruned_body_equals_the_reference(case, heads, kv_heads):
    q, k, v, o = random_layer(batch=2, heads=heads, kv_heads=kv_heads, n=400, head_dim=16, hidden=96, window=8, seed=21)
    lengths = torch.tensor([400, 233], dtype=torch.int32)
    for budget, layer_idx in ((40, 0), (120, 2)):
        policy = make_policy(case[1], budget=budget, window=8)
        branches = assert_same(policy, q, k, v, o, lengths, layer_idx, 3)
        pruned_case = policy.value_norm == "l1"
        assert sum(branches.values()) == (1 if pruned_case else 0), branches


@pytest.mark.parametrize("adversary, branch", [("random", "2k"), ("equal-values", "4k"), ("all-ties", "all")])
def test_each_branch_runs_and_keeps_the_reference_entries(adversary, branch):
    q, k, v, o = random_layer(batch=1, n=600, window=8, seed=2)
    if adversary != "random":  # equal values: every bound ties, only the attention orders the exact scores
        v = torch.ones_like(v)
    if adversary == "all-ties":  # and uniform attention: every score ties, no bound can separate them
        k = torch.zeros_like(k)
    branches = assert_same(KVPolicy("criticalkv", budget=64, window=8), q, k, v, o, torch.tensor([600], dtype=torch.int32))
    assert branches == {b: int(b == branch) for b in ("2k", "4k", "all")}


@pytest.mark.parametrize("seed", range(4))
def test_random_shapes_and_budgets(seed):
    g = torch.Generator().manual_seed(seed)
    kv_heads, group = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
    n = int(torch.randint(80, 500, (1,), generator=g))
    q, k, v, o = random_layer(batch=2, heads=kv_heads * group, kv_heads=kv_heads, n=n, head_dim=8,
                              hidden=int(torch.randint(16, 160, (1,), generator=g)), window=16, seed=seed + 30)
    lengths = torch.tensor([n, int(torch.randint(1, n, (1,), generator=g))], dtype=torch.int32)
    for name, extra in (("criticalkv", dict(gqa_reduce="kvpress")), ("ada-criticalkv", dict(stage2_scores="raw"))):
        policy = KVPolicy(name, budget=int(torch.randint(17, n, (1,), generator=g)), window=16, **extra)
        assert_same(policy, q, k, v, o, lengths, 1, 2)
