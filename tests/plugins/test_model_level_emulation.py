"""The model-level selection's kernels (plugins/kernels/model_level.cuh) run on the CPU under the thread emulation
(plugins/testing/cuda_emulation.h: one fiber per CUDA thread), beside the host driver (plugins/host/model_host.cpp), on
the same rankings: both must keep what the PyTorch reference keeps (criticalkv.selection.layer: model_level_mask, with
wt-quality's allocation nested in the budget under head_cap_ratio, and model_level_refine for layer-kvzip-criticalkv).

Cases: no cap (the shared allocation over N = L H_kv heads: the model-wide row is one multi-CTA top-k when it exceeds
4,096 entries), caps that bind at every level and only at some, floors 0 / 0.2 / 1, ties (scores from a few values), a
runtime budget, left padding, a sequence kept whole; the kernels built with 2 cached keys per head (CKV_LEVEL_CACHE),
so that the level kernel's search in global memory runs too. The external scores' raw copy and layer-kvzip's sink ranking of one layer are
checked against LayerKVzip.priority on the same scores."""

import shutil
import subprocess

import numpy as np
import pytest
import torch

from criticalkv import KVPolicy
from criticalkv.selection.layer import model_level_mask, model_level_refine
from criticalkv.selection.scores import LayerScores
from test_plugin_topk_emulation import PLUGINS


def _compile(folder, cache: int):
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ not found")
    binary = folder / f"model_level_emulation_{cache}"
    result = subprocess.run([compiler, "-std=c++20", "-O1", "-ffp-contract=off", "-Wall", "-Wextra", "-Werror",
                             "-Wno-unknown-pragmas", f"-DCKV_LEVEL_CACHE={cache}", f"-I{PLUGINS / 'include'}",
                             f"-I{PLUGINS / 'host'}", f"-I{PLUGINS / 'kernels'}", f"-I{PLUGINS / 'testing'}",
                             str(PLUGINS / "testing" / "model_level_emulation.cpp"),
                             str(PLUGINS / "host" / "select_host.cpp"), str(PLUGINS / "host" / "model_host.cpp"),
                             "-o", str(binary), "-lpthread"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    return binary


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    """One build with 2 cached keys per head (the kernels' 8 is a constant of the same code): a level then searches
    both the cache and global memory, so both paths run on every capped case."""
    return _compile(tmp_path_factory.mktemp("model_level"), 2)


def micros(x: float) -> int:
    return round(x * 10**6)


def run(binary, tmp_path, policy: KVPolicy, layers: int, kv_heads: int, group: int, n: int, lengths, ranking,
        attention, critical, scores, kv_budget: int | None):
    base = 0 if policy.name == "layer-defensivekv" else 1
    header = np.array([len(lengths), layers, kv_heads, n, policy.window, policy.budget, kv_budget or 0,
                       int(policy.method.refine is not None), base, policy.sink_tokens, group], np.int32)
    wide = np.array([micros(policy.head_cap_ratio), micros(policy.ada_floor), micros(policy.alpha)], np.int64)
    source, target = tmp_path / "in.bin", tmp_path / "out.bin"
    with open(source, "wb") as f:
        for part in (header, wide, np.asarray(lengths, np.int32)):
            f.write(part.tobytes())
        for t in (ranking, attention, critical, scores):
            f.write(t.numpy().astype(np.float32).tobytes())
    result = subprocess.run([str(binary), str(source), str(target)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    out = np.fromfile(target, np.uint8)
    batch, heads, m = ranking.shape
    cells = batch * heads * m
    raw_size = batch * kv_heads * group * m * 4
    sink_size = batch * kv_heads * m * 4
    device = torch.from_numpy(out[:cells].reshape(batch, heads, m).copy())
    host = torch.from_numpy(out[cells:2 * cells].reshape(batch, heads, m).copy())
    raw = torch.from_numpy(out[2 * cells:2 * cells + raw_size].view(np.float32).reshape(batch, kv_heads * group, m).copy())
    sink = torch.from_numpy(out[2 * cells + raw_size:2 * cells + raw_size + sink_size].view(np.float32)
                            .reshape(batch, kv_heads, m).copy())
    launches = out[2 * cells + raw_size + sink_size:].view(np.int64)
    return device, host, raw, sink, launches


def reference(policy: KVPolicy, layers: int, kv_heads: int, n: int, lengths, ranking, attention, critical):
    """[B, N, m] kept older tokens of the PyTorch reference (model_level_mask, then model_level_refine), and which
    sequences are compressed."""
    batch, heads, m = ranking.shape
    valid_start = n - torch.as_tensor(lengths, dtype=torch.int64)
    eligible = (torch.arange(m)[None, :] >= valid_start[:, None])[:, None, :].expand(batch, heads, m)
    r = torch.clamp(eligible[:, 0].sum(-1), max=policy.selectable_budget)
    kept = model_level_mask(policy, ranking, eligible, r)
    if policy.method.refine is not None:
        per_layer = [LayerScores({"attention": attention[:, l * kv_heads:(l + 1) * kv_heads],
                                  "critical": critical[:, l * kv_heads:(l + 1) * kv_heads]}) for l in range(layers)]
        kept = model_level_refine(policy, per_layer, kept, eligible)
    return kept, torch.as_tensor(lengths) > policy.budget


def scores_of(kind: str, shape, generator):
    if kind == "ties":
        return torch.randint(0, 4, shape, generator=generator).float() / 4
    return torch.rand(shape, generator=generator)


CASES = [
    # name, layers, kv_heads, n, budget, window, cap, floor, kind, kv_budget
    ("layer-defensivekv", 3, 2, 90, 24, 4, 0.0, 0.2, "random", None),
    ("layer-defensivekv", 3, 2, 90, 24, 4, 1.5, 0.2, "random", None),
    ("layer-defensivekv", 4, 3, 80, 30, 6, 1.0, 0.0, "ties", None),
    ("layer-defensivekv", 2, 2, 120, 40, 8, 3.0, 1.0, "skewed", 20),
    ("layer-kvzip", 3, 2, 100, 32, 8, 2.0, 0.0, "skewed", None),
    ("layer-kvzip", 5, 2, 70, 20, 4, 1.25, 0.2, "ties", 12),
    ("layer-kvzip-criticalkv", 3, 2, 90, 28, 6, 2.0, 0.0, "skewed", None),
    ("layer-kvzip-criticalkv", 2, 3, 80, 24, 4, 0.0, 0.2, "random", None),
    ("layer-kvzip-criticalkv", 4, 1, 60, 20, 4, 1.5, 0.0, "ties", 10),
    ("layer-defensivekv", 2, 2, 2200, 64, 8, 0.0, 0.2, "random", None),  # the model-wide row over 4,096 entries
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-cap{c[6]}-floor{c[7]}-{c[8]}-n{c[3]}")
def test_model_level_kernels_keep_the_reference_entries(emulator, tmp_path, case):
    name, layers, kv_heads, n, budget, window, cap, floor, kind, kv_budget = case
    policy = KVPolicy(name, budget=budget, window=window, head_cap_ratio=cap, ada_floor=floor, sink_tokens=3)
    g = torch.Generator().manual_seed(sum(map(ord, repr(case))))
    batch, m, heads, group = 3, n - window, layers * kv_heads, 2
    lengths = [n, n - 17, budget - 2]  # full, left-padded, kept whole
    shape = (batch, heads, m)
    ranking = scores_of("random" if kind == "skewed" else kind, shape, g)
    if kind == "skewed":  # a few heads far above the others: the cap binds level after level
        ranking = ranking * torch.where(torch.arange(heads) % 3 == 0, 10.0, 1.0)[None, :, None]
    attention, critical = scores_of(kind, shape, g), scores_of(kind, shape, g)
    scores = torch.rand(batch, kv_heads, n, generator=g)
    device, host, raw, sink, launches = run(emulator, tmp_path, policy, layers, kv_heads, group, n, lengths,
                                            ranking, attention, critical, scores, kv_budget)
    chosen = policy if kv_budget is None else policy.with_budget(kv_budget)
    want, compressed = reference(chosen, layers, kv_heads, n, lengths, ranking, attention, critical)
    for b in range(batch):
        if not compressed[b]:  # kept whole: its flags are never read
            continue
        assert torch.equal(host[b] != 0, want[b]), ("host", b, (host[b] != 0) ^ want[b])
        assert torch.equal(device[b] != 0, want[b]), ("kernels", b, ((device[b] != 0) ^ want[b]).nonzero()[:8])
    # the refinement flags its allocated sinks apart
    if policy.method.refine is not None:
        assert bool((device == 3).any()) and torch.equal(device == 3, host == 3)
    # one layer's external scores: every query head's raw row is its group's scores, the sink ranking LayerKVzip's
    valid_start = n - torch.as_tensor(lengths)
    for b in range(batch):
        if lengths[b] <= chosen.budget:
            continue
        assert torch.equal(raw[b], scores[b, :, :m].repeat_interleave(group, dim=0))
    if name.startswith("layer-kvzip"):
        eligible = (torch.arange(m)[None, :] >= valid_start[:, None])[:, None, :].expand(batch, kv_heads, m)
        attention_1 = scores[:, :, None, :m].expand(batch, kv_heads, group, m).mean(dim=2)
        want_rank = chosen.method.base.priority(chosen, {"attention": attention_1}, eligible, None)
        for b in range(batch):
            if lengths[b] > chosen.budget:
                assert torch.equal(sink[b], want_rank[b])


def test_the_capped_flow_is_a_fixed_sequence_of_launches(emulator, tmp_path):
    """Head cap: a plan, one top-k (its candidates), the sort, the levels, the marks; the refinement adds a plan and
    the two stages' top-k calls. Two kernels of the external scores follow in the harness."""
    policy = KVPolicy("layer-kvzip-criticalkv", budget=20, window=4, head_cap_ratio=2.0)
    g = torch.Generator().manual_seed(5)
    n, layers, kv_heads = 40, 2, 2
    shape = (2, layers * kv_heads, n - 4)
    ranking, attention, critical = (torch.rand(shape, generator=g) for _ in range(3))
    *_, launches = run(emulator, tmp_path, policy, layers, kv_heads, 2, n, [n, n], ranking, attention, critical,
                       torch.rand(2, kv_heads, n, generator=g), None)
    kernels, memsets, topk_calls = launches.tolist()
    assert topk_calls == 3 and memsets == 1
    assert kernels == 4 + 1 + 3 + 2  # plan, sort, levels, marks; refine plan; 3 single-CTA top-k; 2 harness kernels


@pytest.mark.parametrize("cap, floor, kind, kv_budget", [(0.0, 0.0, "random", None), (1.0, 0.2, "ties", None),
                                                         (2.0, 0.0, "random", 14), (1.0, 0.0, "skewed", None)],
                         ids=["uncapped", "cap1-ties", "cap2-budget", "cap1-skewed"])
def test_the_refinement_by_the_ranking_keeps_the_reference_entries(emulator, tmp_path, cap, floor, kind, kv_budget):
    """The TensorRT CriticalKVSelectModel plugin refines layer-kvzip-criticalkv by the ranking its CriticalKVScore nodes
    output (the graph's score node has no separate attention output): the ranking is the base score plus the sink
    offset on the sinks, and every sink is allocated (head_cap_ratio is 0 or >= 1), so stage 1 ranks the rest by the
    same values. The kernels given the ranking as their attention keep the reference's entries (which refines by the
    attention itself)."""
    policy = KVPolicy("layer-kvzip-criticalkv", budget=24, window=4, head_cap_ratio=cap, ada_floor=floor, sink_tokens=3)
    layers, kv_heads, n, batch, group = 3, 2, 80, 3, 2
    g = torch.Generator().manual_seed(int(cap * 10) + int(floor * 100) + len(kind))
    m, heads = n - policy.window, layers * kv_heads
    lengths = [n, n - 17, policy.budget - 2]
    attention = scores_of("random" if kind == "skewed" else kind, (batch, heads, m), g)
    if kind == "skewed":
        attention = attention * torch.where(torch.arange(heads) % 3 == 0, 10.0, 1.0)[None, :, None]
    critical = scores_of(kind, (batch, heads, m), g)
    chosen = policy if kv_budget is None else policy.with_budget(kv_budget)
    valid_start = n - torch.as_tensor(lengths)
    eligible = (torch.arange(m)[None, :] >= valid_start[:, None])[:, None, :].expand(batch, heads, m)
    ranking = chosen.method.base.priority(chosen, {"attention": attention}, eligible, None)
    device, host, *_ = run(emulator, tmp_path, policy, layers, kv_heads, group, n, lengths, ranking, ranking, critical,
                           torch.rand(batch, kv_heads, n, generator=g), kv_budget)
    want, compressed = reference(chosen, layers, kv_heads, n, lengths, ranking, attention, critical)
    assert compressed.any()
    for b in range(batch):
        if compressed[b]:
            assert torch.equal(device[b] != 0, want[b]), (b, ((device[b] != 0) ^ want[b]).nonzero()[:8])
            assert torch.equal(host[b] != 0, want[b]), b
