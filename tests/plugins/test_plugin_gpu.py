"""GPU tests of the CUDA kernels and the TensorRT plugin: `pytest -m gpu tests/plugins` on a machine with a GPU.

Skipped cleanly without one (tests/conftest.py). What they check:
* value norms, window scores (defensivekv's rows included) and the radix top-k against fp64 / PyTorch references,
  across shapes and dtypes, with flash-attention's tolerance rule (low precision at most 2x PyTorch's own error in that
  precision);
* the whole operator against select_layer on the same GPU tensors, for every policy, fp32 / fp16 / bf16, padded
  batches and long prompts (n up to 128k, budgets up to 8k);
* CriticalKV's pruned stage 2 in the pipeline: the fp64 reference's kept indices by the flash-attention rule (uniform
  window attention), and the value norms over gathered rows equal to the whole-prompt launch's;
* the policies ranked by window attention (snapkv, laprox, adakv, defensivekv): the fp64 reference's kept indices by
  the same rule (16-bit inputs: tensor-core window scores);
* compute-sanitizer memcheck / racecheck / synccheck / initcheck on plugins/testing/sanitizer_driver.cu, shape by shape
  (small; d128: d_h 128, hidden 4096; longrow: rows over 4,096 entries; model: the model-level selection);
* kernel time against the floor of reading V and W_O once, printed as a ratio;
* an engine built from an ONNX graph holding only the CriticalKVSelect node (needs tensorrt and onnx).
"""

import dataclasses
import importlib.util
import json
import math
import shutil
import statistics
import subprocess
from pathlib import Path

import pytest
import torch

from ckv_native import BUILD_DIR, PRUNED_ROW_KINDS, HostLibrary, pruned_row
from criticalkv import KVPolicy, gather_kv, select_layer
from criticalkv.node import node_attributes, node_capacity
from criticalkv.selection import topk_mask
from helpers import random_layer
from policies import POLICY_CASES, make_policy

pytestmark = pytest.mark.gpu
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = [c[0] for c in POLICY_CASES]


@pytest.fixture(autouse=True)
def _exact_fp32_matmul():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 references must be fp32
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


def cuda_layer(dtype=torch.float32, **kwargs):
    return tuple(t.to("cuda", dtype) for t in random_layer(**kwargs))


def norms_reference(values, o_proj, heads, kind, dtype=torch.float64):
    """||V W_O^h|| computed in `dtype` (fp64: the truth; the input dtype: PyTorch's own low-precision result)."""
    batch, kv_heads, n, d = values.shape
    group = heads // kv_heads
    out = torch.empty(batch, heads, n, dtype=dtype, device=values.device)
    for h in range(heads):
        w = o_proj[:, h * d : (h + 1) * d].to(dtype).t()
        proj = values[:, h // group].to(dtype) @ w
        out[:, h] = proj.abs().sum(-1) if kind == "l1" else proj.pow(2).sum(-1).sqrt()
    return out


def assert_within_flash_attention_tolerance(ours, low, truth, what):
    """max |ours - truth| <= 2 * max |PyTorch in the same precision - truth| (+ a hair for exact fp32 cases)."""
    ours_error = (ours.double() - truth).abs().max().item()
    torch_error = (low.double() - truth).abs().max().item()
    slack = 1e-6 * truth.abs().max().item()
    assert ours_error <= 2 * torch_error + slack, f"{what}: error {ours_error:.3e} vs PyTorch {torch_error:.3e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["l1", "l2"])
@pytest.mark.parametrize(
    "batch, heads, kv_heads, n, head_dim, hidden",
    [(2, 8, 2, 1000, 64, 512), (1, 32, 8, 4097, 128, 4096), (1, 4, 4, 333, 80, 320), (3, 9, 3, 70, 16, 48)],
    ids=["gqa-d64", "llama-d128", "mha-d80", "tiny"],
)
def test_value_norms(cuda_lib, dtype, kind, batch, heads, kv_heads, n, head_dim, hidden):
    _, _, v, o = cuda_layer(dtype, batch=batch, heads=heads, kv_heads=kv_heads, n=n, head_dim=head_dim,
                            hidden=hidden, window=1, seed=1)
    truth = norms_reference(v, o, heads, kind)
    low = norms_reference(v, o, heads, kind, dtype)
    ours = cuda_lib.value_norms(v, o, heads, kind=kind)
    assert_within_flash_attention_tolerance(ours, low, truth, f"{kind} {dtype}")
    partial = cuda_lib.value_norms(v, o, heads, num_tokens=n // 2, kind=kind)  # the pipeline scores [0, m) only
    assert torch.equal(partial, ours[..., : n // 2])


def gram_norms_reference(values, o_proj, heads, dtype):
    """The reference's l2 form sqrt(v^T (W W^T) v) computed in `dtype` (criticalkv/selection/scores.py)."""
    batch, kv_heads, n, d = values.shape
    group = heads // kv_heads
    out = torch.empty(batch, heads, n, dtype=dtype, device=values.device)
    for h in range(heads):
        w = o_proj[:, h * d : (h + 1) * d].to(dtype).t()
        v = values[:, h // group].to(dtype)
        out[:, h] = ((v @ (w @ w.t())) * v).sum(-1).clamp_min(0).sqrt()
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "batch, heads, kv_heads, n, head_dim, hidden",
    [(2, 8, 2, 1000, 64, 512), (1, 32, 8, 4097, 128, 4096), (1, 4, 4, 333, 80, 320), (1, 4, 2, 300, 256, 1024)],
    ids=["gqa-d64", "llama-d128", "mha-d80", "d256"],
)
def test_value_norms_through_the_gram_matrices(cuda_lib, dtype, batch, heads, kv_heads, n, head_dim, hidden):
    """The pipeline's l2 path (value_norm=l2, laprox): error at most 2x the reference's own Gram form in fp32."""
    _, _, v, o = cuda_layer(dtype, batch=batch, heads=heads, kv_heads=kv_heads, n=n, head_dim=head_dim,
                            hidden=hidden, window=1, seed=1)
    truth = norms_reference(v, o, heads, "l2")
    low = gram_norms_reference(v, o, heads, torch.float32)  # what select_layer computes from these inputs
    ours = cuda_lib.value_norms(v, o, heads, kind="l2", gram=True)
    assert_within_flash_attention_tolerance(ours, low, truth, f"gram l2 {dtype}")
    partial = cuda_lib.value_norms(v, o, heads, num_tokens=n // 2, kind="l2", gram=True)
    assert torch.equal(partial, ours[..., : n // 2])


def window_probabilities(q, k, lengths, window, precision):
    """softmax(Q K^T / sqrt(d)) of the window queries over the m older keys [B, H, w, m], computed entirely in
    `precision` (fp64: the truth; the input dtype: PyTorch's own result in that precision); 0 on left padding."""
    heads, head_dim = q.shape[1], q.shape[-1]
    n = k.shape[2]
    keys = k.repeat_interleave(heads // k.shape[1], dim=1)
    pos = torch.arange(n, device=q.device)
    valid_start = n - lengths
    blocked = (pos[None, :] > torch.arange(n - window, n, device=q.device)[:, None])[None] | (
        pos[None, None, :] < valid_start[:, None, None])
    logits = (q.to(precision) @ keys.to(precision).transpose(-1, -2)) / (head_dim**0.5)
    return torch.softmax(logits.masked_fill(blocked[:, None], float("-inf")), dim=-1)[..., : n - window]


def defensive_rows_reference(probs, valid_start, pool):
    """defensivekv's rows as criticalkv.methods.defensivekv.avg_pool_rows computes them, in the precision of `probs`
    [B, H, w, m]: worst [B, H, m] = max over the window queries of the rescaled pooled rows, and the rows' mass and
    pooled total [B, H, w]. valid_start [B]: the first valid older token."""
    m = probs.shape[-1]
    valid = torch.arange(m, device=probs.device)[None, :] >= valid_start[:, None]  # [B, m]
    mass = probs.sum(-1)
    pooled = torch.nn.functional.avg_pool1d(probs.reshape(-1, 1, m), pool, stride=1, padding=pool // 2,
                                            count_include_pad=True).reshape(probs.shape)
    pooled = pooled * valid[:, None, None, :].to(pooled.dtype)
    total = pooled.sum(-1)
    tiny = torch.finfo(torch.float32).tiny
    rescaled = torch.where(total[..., None] > 0, pooled / total.clamp_min(tiny)[..., None] * mass[..., None], pooled)
    return rescaled.amax(2), mass, total


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n, window", [(1000, 32), (4097, 64), (95, 8)])
def test_window_scores(cuda_lib, dtype, n, window):
    """Ā and sum A^2 by the flash-attention rule against fp64 (at most 2x PyTorch's own error in the input precision);
    16-bit inputs run on the tensor cores (never bit-equal to the host driver: the rule is the contract)."""
    q, k, v, o = cuda_layer(dtype, batch=2, heads=8, kv_heads=2, n=n, head_dim=64, hidden=128, window=window, seed=3)
    policy = KVPolicy("laprox", budget=window, window=window)
    lengths = torch.tensor([n, n - n // 3], device="cuda")
    raw, squares = cuda_lib.window_scores(policy, q, k, o, lengths)
    truth = window_probabilities(q, k, lengths, window, torch.float64)
    low = window_probabilities(q, k, lengths, window, dtype)  # PyTorch's own result in the input precision
    assert_within_flash_attention_tolerance(raw, low.mean(2), truth.mean(2), f"raw {dtype}")
    assert_within_flash_attention_tolerance(squares, low.pow(2).sum(2), truth.pow(2).sum(2), f"squares {dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "heads, kv_heads, n, head_dim, window, pool",
    [(8, 2, 1000, 64, 32, 7), (32, 8, 4097, 128, 32, 7), (8, 1, 700, 128, 64, 5), (4, 4, 300, 64, 24, 49),
     (4, 2, 500, 64, 16, 151)],
    ids=["gqa-d64", "llama-d128", "g8-w64", "mha-pool49", "pool151-simt"],
)
def test_defensive_rows(cuda_lib, dtype, heads, kv_heads, n, head_dim, window, pool):
    """defensivekv's rows from launchWindowScores (out of the same two passes as Ā on the tensor cores; the SIMT row
    passes for fp32 and pools wider than 49): worst and the rows' (mass, pooled total), Ā and sum A^2 by the
    flash-attention rule against fp64; left padding exactly 0; an uncompressed sequence left untouched."""
    q, k, v, o = cuda_layer(dtype, batch=3, heads=heads, kv_heads=kv_heads, n=n, head_dim=head_dim, hidden=128,
                            window=window, seed=4)
    policy = KVPolicy("defensivekv", budget=window + 8, window=window, pool_kernel=pool)
    lengths = torch.tensor([n, n - n // 3, window + 5], device="cuda")  # whole, left-padded, not compressed
    got = cuda_lib.window_scores(policy, q, k, o, lengths, rows=True)
    assert got["tensor_cores"] == (dtype != torch.float32 and pool // 2 <= 24), got["tensor_cores"]
    for name in ("raw", "squares", "worst", "row_mass"):
        assert got[name][2].isnan().all(), name  # the third sequence is not compressed: skipped
    q, k, lengths = q[:2], k[:2], lengths[:2]
    valid_start = n - lengths
    truth = window_probabilities(q, k, lengths, window, torch.float64)
    low = window_probabilities(q, k, lengths, window, dtype)
    want = defensive_rows_reference(truth, valid_start, pool)
    own = defensive_rows_reference(low, valid_start, pool)
    ours = (got["worst"][:2], got["row_mass"][:2, ..., 0], got["row_mass"][:2, ..., 1])
    for name, mine, theirs, exact in zip(("worst", "mass", "total"), ours, own, want):
        assert_within_flash_attention_tolerance(mine, theirs, exact, f"{name} {dtype}")
    assert_within_flash_attention_tolerance(got["raw"][:2], low.mean(2), truth.mean(2), f"raw {dtype}")
    assert_within_flash_attention_tolerance(got["squares"][:2], low.pow(2).sum(2), truth.pow(2).sum(2),
                                            f"squares {dtype}")
    padding = torch.arange(n - window, device="cuda")[None, None, :] < valid_start[:, None, None]
    assert (got["worst"][:2][padding.expand(-1, heads, -1)] == 0).all(), "left padding has no attention"


@pytest.fixture
def fp64_window_attention(monkeypatch):
    """Turns select_layer's window attention (criticalkv.selection.scores.window_attention) into the fp64 reference:
    the same softmax computed in float64 from the same inputs, rounded once to fp32."""
    from criticalkv.selection import scores

    def window_attention_fp64(queries, keys, valid_start=None):
        w, n = queries.shape[2], keys.shape[2]
        logits = (queries.double() @ keys.double().transpose(-1, -2)) / math.sqrt(queries.shape[-1])
        pos = torch.arange(n, device=keys.device)
        blocked = pos[None, :] > torch.arange(n - w, n, device=keys.device)[:, None]
        if valid_start is not None:
            blocked = (blocked[None] | (pos[None, None, :] < valid_start[:, None, None]))[:, None]
        return torch.softmax(logits.masked_fill(blocked, torch.finfo(torch.float32).min), dim=-1).float()

    monkeypatch.setattr(scores, "window_attention", window_attention_fp64)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["snapkv", "laprox", "adakv", "defensivekv"])
def test_window_scored_pipeline_keeps_the_reference_indices(cuda_lib, fp64_norms, fp64_window_attention, monkeypatch,
                                                            dtype, name):
    """The whole CUDA pipeline of the policies ranked by window attention (tensor-core window scores and defensivekv's
    rows for 16-bit inputs) against the fp64 reference (window attention and L1 norms in float64) by the
    flash-attention rule: its kept set misses at most 2x what PyTorch's own fp32-from-`dtype` result misses, plus one
    entry per head (near-ties only)."""
    n = 1000
    q, k, v, o = cuda_layer(dtype, batch=3, heads=8, kv_heads=2, n=n, head_dim=64, hidden=256, window=32, seed=6)
    lengths = torch.tensor([n, 700, 100], device="cuda")
    policy = KVPolicy(name, budget=160, window=32)
    truth = select_layer(policy, q, k, v, o, 1, 4, prompt_lengths=lengths)
    monkeypatch.undo()  # PyTorch's own result: fp32 from the same inputs
    own = select_layer(policy, q, k, v, o, 1, 4, prompt_lengths=lengths)
    got = cuda_lib.select_layer(policy, q, k, v, o, 1, 4, prompt_lengths=lengths)
    if not policy.method.base.shared_allocation:
        assert torch.equal(got[1].cpu(), truth.lengths.cpu()), (name, dtype)
    assert_kept_within_flash_attention_rule(got[0], own.indices, truth.indices, n, (name, dtype))


@pytest.mark.parametrize("n", [1000, 32768, 131072])
@pytest.mark.parametrize("levels", [3, 1000, None], ids=["ties", "some-ties", "continuous"])
def test_radix_top_k(cuda_lib, n, levels):
    g = torch.Generator(device="cuda").manual_seed(n)
    rows = 4
    scores = torch.rand(rows, n, device="cuda", generator=g)
    if levels:
        scores = (scores * levels).floor() / levels
    scores[1] = -scores[1]  # negative scores
    scores[2, ::7] = 0.0
    scores[2, 1::7] = -0.0  # signed zeros are equal, the lower index wins
    for k in (1, 777, min(8192, n - 1), n):
        ks = torch.full((rows,), k, dtype=torch.int64)
        got = cuda_lib.top_k_rows(scores, ks)
        want = topk_mask(scores, k)
        assert torch.equal(got, want), (n, levels, k)


@pytest.mark.parametrize("kind", PRUNED_ROW_KINDS)
@pytest.mark.parametrize("m, seed", [(700, 0), (700, 1), (5000, 2), (5000, 3), (40000, 4)])
def test_pruned_row_kernel_equals_the_host_driver(cuda_lib, kind, m, seed):
    """launchPrunedRow (the block executor of prunedStage2, kernels/pruned_row.cuh) gives the host driver's flags
    and count of exact scores."""
    from criticalkv.methods import pruned

    margin = pruned.stop_margin(576, 3)
    bound, exact, flags, valid_start, k = pruned_row(kind, m, seed, margin)
    want, want_done = HostLibrary().pruned_row(bound, exact, flags, valid_start, k, margin)
    got, done = cuda_lib.pruned_row(bound.cuda(), exact.cuda(), flags.cuda(), valid_start, k, margin)
    assert torch.equal(got.cpu(), want), (kind, m, seed, k)
    assert done == want_done


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch, heads, kv_heads, n, head_dim, hidden", [(2, 8, 2, 300, 64, 256), (1, 4, 4, 130, 128, 1024),
                                                                       (1, 3, 1, 77, 24, 40)])
def test_l1_bounds_equal_the_host_driver(cuda_lib, dtype, batch, heads, kv_heads, n, head_dim, hidden):
    """launchL1Bounds (Gram terms and bounds of the pruned stage 2) gives the host driver's bounds bit for bit (the
    inputs widened to fp32 exactly): same functions, same order, no fused multiply-add."""
    q, k, v, o = random_layer(batch=batch, heads=heads, kv_heads=kv_heads, n=n, head_dim=head_dim, hidden=hidden,
                              window=8, seed=4, dtype=dtype)
    want = HostLibrary().l1_bounds(v.float(), o.float(), heads)
    got = cuda_lib.l1_bounds(v.cuda(), o.cuda(), heads)
    assert torch.equal(got.cpu(), want), (got.cpu() - want).abs().max().item()


@pytest.fixture
def fp64_norms(monkeypatch):
    """Turns select_layer into the fp64 reference of the L1 norms: every exact norm the PyTorch reference computes
    (criticalkv.methods.pruned.l1_norms_rows, pruned or not) in float64 from the same inputs, rounded once to fp32."""
    from criticalkv.methods import pruned
    from criticalkv.selection import scores

    def l1_norms_rows_fp64(rows, w_cat, heads):
        projected = rows.double() @ w_cat.double()  # [R, heads * d]
        return projected.abs().view(rows.shape[0], heads, -1).sum(-1).float()

    monkeypatch.setattr(pruned, "l1_norms_rows", l1_norms_rows_fp64)
    monkeypatch.setattr(scores, "l1_norms_rows", l1_norms_rows_fp64)


def kept_mask(indices, n):
    """bool [B, H_kv, n] of kept positions from indices [B, H_kv, cap] (-1 padded)."""
    indices = indices.long().cpu()
    mask = torch.zeros(*indices.shape[:2], n + 1, dtype=torch.bool)
    mask.scatter_(-1, indices.masked_fill(indices < 0, n), True)
    return mask[..., :n]


def assert_kept_within_flash_attention_rule(ours, torch_own, truth, n, what):
    """The GPU's kept set may miss entries of the fp64 reference's only where PyTorch's own result in the input
    precision does (near-ties): missed(ours) <= 2 missed(PyTorch) + one entry per head."""
    truth_mask = kept_mask(truth, n)
    missed_ours = (truth_mask & ~kept_mask(ours, n)).sum().item()
    missed_torch = (truth_mask & ~kept_mask(torch_own, n)).sum().item()
    heads = truth_mask.shape[0] * truth_mask.shape[1]
    assert missed_ours <= 2 * missed_torch + heads, f"{what}: missed {missed_ours} vs PyTorch {missed_torch}"
    return missed_ours, missed_torch


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("values", ["random", "ties"])
@pytest.mark.parametrize(
    "name, heads, kv_heads, n, budget, kv_budget, layer",
    [
        ("criticalkv", 8, 2, 1000, 160, None, 0),  # GQA, a padded batch
        ("criticalkv", 4, 4, 1000, 160, 70, 0),  # MHA at a runtime budget
        ("pyramid-criticalkv", 8, 2, 1000, 256, 100, 3),  # r_l from the table at a runtime budget
        ("ada-criticalkv", 8, 2, 1000, 160, None, 1),  # each head's share of the shared allocation
        ("criticalkv", 8, 2, 32768, 2048, None, 0),  # many candidates, large rows
    ],
)
def test_pruned_pipeline_keeps_the_reference_indices(cuda_lib, fp64_norms, monkeypatch, dtype, values, name, heads,
                                                     kv_heads, n, budget, kv_budget, layer):
    """The CUDA pipeline's pruned stage 2 (launchPrunedBounds, launchPrunedStage2: tensor-core bounds and exact norms
    of the candidates in rounds) against the fp64 reference by the flash-attention rule (its kept set misses at most
    2x what PyTorch's own fp32-from-`dtype` result misses, plus one entry per head: near-ties only). Keys are 0 so that
    the window attention is uniform everywhere: stage 2 is decided by the value norms. `ties`: 3 distinct value rows
    per head, the lower index wins (identical rows get identical norms from the kernel, so ties are exact here too)."""
    q, k, v, o = random_layer(batch=3, heads=heads, kv_heads=kv_heads, n=n, head_dim=64, hidden=256, window=32,
                              seed=11, dtype=dtype)
    k = torch.zeros_like(k)
    if values == "ties":
        v = v[:, :, torch.randint(0, 3, (n,), generator=torch.Generator().manual_seed(2))]
    lengths = torch.tensor([n, n * 7 // 10, n // 10])
    policy = KVPolicy(name, budget=budget, window=32)
    q, k, v, o = (t.cuda() for t in (q, k, v, o))
    budgeted = dataclasses.replace(policy, budget=kv_budget) if kv_budget is not None else policy
    truth = select_layer(budgeted, q, k, v, o, layer, 4, prompt_lengths=lengths.cuda())
    monkeypatch.undo()  # PyTorch's own result: fp32 from the same inputs
    own = select_layer(budgeted, q, k, v, o, layer, 4, prompt_lengths=lengths.cuda())
    got = cuda_lib.select_layer(policy, q, k, v, o, layer, 4, prompt_lengths=lengths.cuda(), kv_budget=kv_budget)
    assert torch.equal(got[1].cpu(), truth.lengths.cpu()) or policy.method.base.shared_allocation
    assert_kept_within_flash_attention_rule(got[0], own.indices, truth.indices, n, (name, values, dtype))
    if values == "ties":  # exact ties: both pick the lower index, whatever the rounding
        assert torch.equal(kept_mask(got[0], n), kept_mask(truth.indices, n)), (name, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["criticalkv", "ada-criticalkv"])
@pytest.mark.parametrize("head_dim, hidden", [(64, 256), (128, 4096)])
def test_pruned_pipeline_on_precomputed_terms_keeps_the_same_entries(cuda_lib, dtype, name, head_dim, hidden):
    """The pruned stage 2's weights-only terms computed once by launchPrunedTerms and passed in
    (SelectTensors::prunedTerms) give the call that computes them itself, bit for bit: indices, lengths, gathered
    rows (fp32: the host driver's terms; fp16 / bf16: G_h on the tensor cores)."""
    q, k, v, o = cuda_layer(dtype, batch=2, heads=8, kv_heads=2, n=3000, head_dim=head_dim, hidden=hidden, window=32,
                            seed=13)
    policy = KVPolicy(name, budget=256, window=32)
    lengths = torch.tensor([3000, 2100]).cuda()
    itself = cuda_lib.select_layer(policy, q, k, v, o, prompt_lengths=lengths)
    given = cuda_lib.select_layer(policy, q, k, v, o, prompt_lengths=lengths, pruned_terms=True)
    for a, b in zip(itself, given):
        assert torch.equal(a, b), (name, dtype, head_dim)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_value_norms_over_gathered_rows(cuda_lib, dtype, head_dim):
    """launchValueNorms over gathered rows (the pruned stage 2's candidate lists): the listed tokens get the norm the
    whole-prompt launch gives them, bit for bit (a row's result never depends on the other rows of its tile), and
    nothing else is written; ragged lists, an empty one and a full one, GQA."""
    batch, heads, kv_heads, n = 2, 8, 2, 1500
    _, _, v, o = cuda_layer(dtype, batch=batch, heads=heads, kv_heads=kv_heads, n=n, head_dim=head_dim,
                            hidden=512, window=1, seed=12)
    every = cuda_lib.value_norms(v, o, heads)
    g = torch.Generator().manual_seed(4)
    rows = torch.stack([torch.stack([torch.randperm(n, generator=g) for _ in range(kv_heads)]) for _ in range(batch)])
    counts = torch.tensor([[n, 0], [777, 1]], dtype=torch.int32)
    out = torch.full_like(every, float("nan"))
    cuda_lib.value_norms(v, o, heads, rows=rows.cuda(), counts=counts.cuda(), out=out)
    group = heads // kv_heads
    for b in range(batch):
        for h in range(heads):
            listed = rows[b, h // group, : counts[b, h // group]].cuda()
            assert torch.equal(out[b, h, listed], every[b, h, listed]), (b, h)
            unlisted = torch.ones(n, dtype=torch.bool, device="cuda")
            unlisted[listed] = False
            assert out[b, h, unlisted].isnan().all(), (b, h)


def test_radix_top_k_with_nan_infinities_and_k_zero(cuda_lib):
    """NaN ranks above +inf (torch's descending sort), +-inf and signed zeros by value, k = 0 keeps nothing."""
    g = torch.Generator(device="cuda").manual_seed(3)
    rows, n = 6, 5000
    scores = torch.randn(rows, n, device="cuda", generator=g)
    specials = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0], device="cuda")
    for row, fraction in enumerate((0.001, 0.01, 0.1, 0.5, 0.9, 1.0)):
        where = torch.rand(n, device="cuda", generator=g) < fraction
        picks = torch.randint(0, len(specials), (int(where.sum()),), device="cuda", generator=g)
        scores[row, where] = specials[picks]
    for k in (0, 1, 5, 777, n - 1, n):
        ks = torch.full((rows,), k, dtype=torch.int64)
        assert torch.equal(cuda_lib.top_k_rows(scores, ks), topk_mask(scores, k)), k


def topk_rows_reference(scores, flags, k, first_valid, period, mark):
    """topk_mask over each row's candidates (flags == 0, position % period >= first_valid), on the CPU."""
    scores, flags = scores.cpu(), flags.cpu()
    out = flags.clone()
    positions = torch.arange(scores.shape[1])
    for r in range(scores.shape[0]):
        index = ((flags[r] == 0) & (positions % period >= int(first_valid[r]))).nonzero().flatten()
        kk = max(0, min(int(k[r]), index.numel()))
        if index.numel():
            out[r, index[topk_mask(scores[r, index], kk)]] = mark
    return out


@pytest.mark.parametrize("length", [3000, 32736])
def test_batched_top_k_levels_mark_the_first_level(cuda_lib, length):
    """One launchTopK with 4 levels of nested k (the pruned stage 2's candidate rounds): every candidate gets mark + the
    first level whose k best (topk_mask over the candidates) hold it; ties, flags set before, left padding, k 0."""
    g = torch.Generator(device="cuda").manual_seed(length)
    rows = 6
    scores = (torch.rand(rows, length, device="cuda", generator=g) * 64).floor()
    flags = (torch.rand(rows, length, device="cuda", generator=g) < 0.1).to(torch.uint8)
    first_valid = torch.tensor([0, 5, length // 3, 0, 0, length - 1], dtype=torch.int32)
    base = torch.tensor([length // 40, 1, length // 8, 0, 7, 2])
    k = torch.stack([torch.clamp(base << level, max=length + 3) for level in range(4)])
    got, _ = cuda_lib.top_k(scores, flags, k, first_valid, mark=249)
    want = flags.cpu().clone()
    for level in reversed(range(4)):
        marked = topk_rows_reference(scores, flags, k[level], first_valid, length, 249 + level)
        want = torch.where(marked != flags.cpu(), marked, want)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("length", [1000, 4096, 4097, 32736, 131072, 262144])
@pytest.mark.parametrize("kind", ["continuous", "ties", "specials"])
def test_batched_top_k_equals_topk_mask(cuda_lib, length, kind):
    """launchTopK (one CTA per row up to 4,096 entries, then 2,048 per CTA and a launch per pass): a different k per
    row, flags set before, left padding of several segments, ties, NaN / +-inf / +-0."""
    g = torch.Generator(device="cuda").manual_seed(length)
    rows = 6
    scores = torch.rand(rows, length, device="cuda", generator=g)
    if kind == "ties":
        scores = (scores * 3).floor() / 3
    if kind == "specials":
        specials = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0], device="cuda")
        where = torch.rand(rows, length, device="cuda", generator=g) < 0.3
        scores[where] = specials[torch.randint(0, 6, (int(where.sum()),), device="cuda", generator=g)]
    flags = (torch.rand(rows, length, device="cuda", generator=g) < 0.1).to(torch.uint8) * 3
    period = length // 4 if length >= 4 else length
    first_valid = torch.tensor([0, 1, period // 3, 0, period - 1, 0], dtype=torch.int32)
    k = torch.tensor([0, 1, length // 16, 2048, length // 2, length], dtype=torch.int64)
    got, _ = cuda_lib.top_k(scores, flags, k, first_valid, period=period, mark=1)
    want = topk_rows_reference(scores, flags, k, first_valid, period, 1)
    for r in range(rows):
        assert torch.equal(got[r].cpu(), want[r]), (length, kind, r, int(k[r]))


@pytest.mark.parametrize("length", [700, 5000, 40000])
def test_batched_mass_count_equals_the_host_driver(cuda_lib, length):
    host = HostLibrary()
    g = torch.Generator(device="cuda").manual_seed(length)
    rows = 5
    scores = torch.rand(rows, length, device="cuda", generator=g) ** 4
    scores[1] = (scores[1] * 4).floor()  # ties
    scores = scores / scores.sum(-1, keepdim=True)
    flags = (torch.rand(rows, length, device="cuda", generator=g) < 0.1).to(torch.uint8)
    first_valid = torch.tensor([0, 0, length // 3, 5, 0], dtype=torch.int32)
    limit = torch.tensor([0.5, 0.9, 0.3, 1e-4, -0.1])
    got = cuda_lib.mass_count(scores, flags, limit, first_valid).cpu()
    for r in range(rows):
        want = host.mass_count(scores[r].cpu(), float(limit[r]), flags[r].cpu(), int(first_valid[r]))
        assert int(got[r]) == want, (r, int(got[r]), want)


@pytest.mark.parametrize("rows, length", [(8, 32736), (1, 8 * 32736), (64, 32736), (8, 131040)])
def test_batched_top_k_time_per_row_batch(cuda_lib, rows, length):
    """Prints microseconds per call (k = 2048, every row at once) beside a device copy of the scores (the floor)
    and the per-row figure; the selection of a 32k Llama layer calls it on 8 rows of m = 32,736 (per head) and 1 row of
    8 m (shared allocation). Only the result is asserted."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    scores = torch.rand(rows, length, device="cuda", generator=g)
    flags = torch.zeros(rows, length, dtype=torch.uint8, device="cuda")
    k = torch.full((rows,), 2048, dtype=torch.int64)
    got, microseconds = cuda_lib.top_k(scores, flags, k, iterations=50)
    assert torch.equal(got.sum(-1, dtype=torch.int64).cpu(), k)
    copy = torch.empty_like(scores)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        copy.copy_(scores)
    stop.record()
    stop.synchronize()
    copy_us = start.elapsed_time(stop) * 1e3 / 50
    print(f"\n{torch.cuda.get_device_name()}: top-k of {rows} rows x {length} (k=2048): {microseconds:.1f} us per "
          f"call, {microseconds / rows:.2f} us per row; device copy of the scores {copy_us:.1f} us")
    assert microseconds > 0


def check_selection(got, ref, policy, n, context, min_overlap=0.99):
    """Kept sets agree up to near-ties (fp32 reductions run in a different order than PyTorch's)."""
    indices, lengths, kk, vv = got[:4]
    batch, heads = lengths.shape
    mask_ref = ref.mask(n)
    mask_got = torch.zeros(batch, heads, n + 1, dtype=torch.bool, device=indices.device)
    mask_got.scatter_(-1, indices.masked_fill(indices < 0, n), True)
    mask_got = mask_got[..., :n]
    if policy.method.base.shared_allocation:  # adakv, laprox, defensivekv: per-head lengths follow the scores
        assert torch.equal(lengths.sum(-1), ref.lengths.sum(-1)), context
    else:
        assert torch.equal(lengths, ref.lengths), context
    overlap = (mask_got & mask_ref).sum().item() / ref.lengths.sum().item()
    assert overlap >= min_overlap, (context, overlap)
    valid = indices >= 0
    assert torch.equal(valid.sum(-1), lengths), context
    assert (indices[..., 1:][valid[..., 1:]] > indices[..., :-1][valid[..., 1:]]).all(), "ascending"
    return mask_got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", POLICY_CASES, ids=IDS)
def test_select_layer_matches_the_reference(cuda_lib, case, dtype):
    n = 1000
    q, k, v, o = cuda_layer(dtype, batch=3, heads=8, kv_heads=2, n=n, head_dim=64, hidden=256, window=32, seed=5)
    lengths = torch.tensor([n, 700, 100], device="cuda")
    for layer, num_layers in ((0, 1), (3, 4)):
        policy = make_policy(case[1], budget=160, window=32)
        ref = select_layer(policy, q, k, v, o, layer, num_layers, prompt_lengths=lengths)
        got = cuda_lib.select_layer(policy, q, k, v, o, layer, num_layers, prompt_lengths=lengths)
        check_selection(got, ref, policy, n, (case[0], dtype, layer))
        indices, _, kk, vv = got
        idx = indices.clamp_min(0)[..., None].expand(-1, -1, -1, 64)
        pad = (indices < 0)[..., None]
        assert torch.equal(kk, torch.gather(k, 2, idx).masked_fill(pad, 0)), "kept_keys are the indexed rows"
        assert torch.equal(vv, torch.gather(v, 2, idx).masked_fill(pad, 0)), "kept_values are the indexed rows"
        if dtype == torch.float32:  # the host C++ twin of the kernels
            host = HostLibrary().select_layer(policy, q.cpu(), k.cpu(), v.cpu(), o.cpu(), layer, num_layers,
                                              prompt_lengths=lengths.cpu())
            check_selection(tuple(t.cuda() for t in host), ref, policy, n, (case[0], "host", layer))


@pytest.mark.parametrize("name", ["criticalkv", "ada-criticalkv", "laprox", "pyramidkv", "defensivekv"])
@pytest.mark.parametrize("n, budget", [(32768, 2048), (131072, 8192)])
def test_long_prompts(cuda_lib, name, n, budget):
    q, k, v, o = cuda_layer(torch.float16, batch=1, heads=8, kv_heads=2, n=n, head_dim=128, hidden=1024,
                            window=32, seed=9)
    policy = KVPolicy(name, budget=budget, window=32)
    capacity = node_capacity(policy, n, 2, 1, 4)
    ref = select_layer(policy, q, k, v, o, 1, 4)
    got = cuda_lib.select_layer(policy, q, k, v, o, 1, 4, capacity=capacity)
    mask = check_selection(got, ref, policy, n, (name, n))
    assert mask[..., -32:].all(), "the window is always kept"


def test_capacity_is_respected(cuda_lib):
    q, k, v, o = cuda_layer(batch=2, n=600, window=16, seed=2)
    policy = KVPolicy("adakv", budget=64, window=16)
    capacity = node_capacity(policy, 600, 3, 0, 1)
    indices, lengths, kk, vv = cuda_lib.select_layer(policy, q, k, v, o, capacity=capacity)
    assert indices.shape[-1] == capacity and kk.shape[2] == capacity and lengths.max() <= capacity


@pytest.mark.parametrize("case", POLICY_CASES, ids=IDS)
def test_runtime_budgets_on_one_node(cuda_lib, case):
    """The kv_budget input (device int32 [1]) selects like a node built with that budget, at the built capacity."""
    n = 1000
    q, k, v, o = cuda_layer(torch.float32, batch=3, heads=8, kv_heads=2, n=n, head_dim=64, hidden=256, window=32,
                            seed=6)
    lengths = torch.tensor([n, 700, 100], device="cuda")
    built = make_policy(case[1], budget=256, window=32)
    for layer, num_layers in ((0, 4), (3, 4)):
        capacity = node_capacity(built, n, 2, layer, num_layers)
        for budget in (32, 33, 100, 255, 256):
            policy = dataclasses.replace(built, budget=budget)
            ref = select_layer(policy, q, k, v, o, layer, num_layers, prompt_lengths=lengths)
            got = cuda_lib.select_layer(built, q, k, v, o, layer, num_layers, capacity=capacity,
                                        prompt_lengths=lengths, kv_budget=budget)
            assert got[0].shape[-1] == capacity
            check_selection(got, ref, policy, n, (case[0], budget, layer))


def test_runtime_budget_changes_between_graph_replays(cuda_lib):
    """kv_budget is read on the device: one captured launch serves several budgets (PyramidKV: the table lookup)."""
    n, budget = 1500, 256
    q, k, v, o = cuda_layer(torch.float16, batch=2, heads=8, kv_heads=2, n=n, head_dim=64, hidden=256, window=32,
                            seed=3)
    lengths = torch.tensor([n, 1200], dtype=torch.int32, device="cuda")
    built = KVPolicy("pyramid-criticalkv", budget=budget, window=32)
    capacity = node_capacity(built, n, 2, 1, 4)
    outputs = (torch.empty(2, 2, capacity, dtype=torch.int32, device="cuda"),
               torch.empty(2, 2, dtype=torch.int32, device="cuda"),
               torch.empty(2, 2, capacity, 64, dtype=torch.float16, device="cuda"),
               torch.empty(2, 2, capacity, 64, dtype=torch.float16, device="cuda"))
    workspace = torch.empty(cuda_lib.workspace_bytes(built, q, k, o, capacity, layer_idx=1, num_layers=4),
                            dtype=torch.uint8, device="cuda")  # the workspace of the node it launches
    requested = torch.tensor([budget], dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    launch = dict(layer_idx=1, num_layers=4, capacity=capacity, kv_budget=requested)
    with torch.cuda.stream(stream):  # warm-up outside the capture
        assert cuda_lib.select_layer_async(built, q, k, v, o, lengths, outputs, workspace, stream, **launch) == 0
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        assert cuda_lib.select_layer_async(built, q, k, v, o, lengths, outputs, workspace, stream, **launch) == 0
    for b in (256, 40, 130):
        requested.fill_(b)
        graph.replay()
        torch.cuda.synchronize()
        policy = dataclasses.replace(built, budget=b)
        ref = select_layer(policy, q, k, v, o, 1, 4, prompt_lengths=lengths.long())
        got = (outputs[0].long(), outputs[1].long(), outputs[2], outputs[3])
        check_selection(got, ref, policy, n, ("graph replay", b))


def test_launch_is_cuda_graph_capturable(cuda_lib):
    """launchCriticalKVSelect records into a CUDA graph (no allocation, no synchronisation) and replays exactly."""
    n, budget = 2000, 256
    q, k, v, o = cuda_layer(torch.float16, batch=2, heads=8, kv_heads=2, n=n, head_dim=64, hidden=256, window=32, seed=8)
    lengths = torch.tensor([n, 1500], dtype=torch.int32, device="cuda")
    policy = KVPolicy("ada-criticalkv", budget=budget, window=32)
    capacity = node_capacity(policy, n, 2, 0, 1)
    outputs = (torch.empty(2, 2, capacity, dtype=torch.int32, device="cuda"),
               torch.empty(2, 2, dtype=torch.int32, device="cuda"),
               torch.empty(2, 2, capacity, 64, dtype=torch.float16, device="cuda"),
               torch.empty(2, 2, capacity, 64, dtype=torch.float16, device="cuda"))
    workspace = torch.empty(cuda_lib.workspace_bytes(policy, q, k, o, capacity), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        assert cuda_lib.select_layer_async(policy, q, k, v, o, lengths, outputs, workspace, stream, capacity=capacity) == 0
    stream.synchronize()
    eager = [t.clone() for t in outputs]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        status = cuda_lib.select_layer_async(policy, q, k, v, o, lengths, outputs, workspace, stream, capacity=capacity)
    assert status == 0
    for t in outputs:
        t.fill_(0)
    graph.replay()
    torch.cuda.synchronize()
    for replayed, want in zip(outputs, eager):
        assert torch.equal(replayed, want)
    # new inputs in the same buffers: the replay recomputes
    k.copy_(torch.randn_like(k))
    graph.replay()
    torch.cuda.synchronize()
    ref = select_layer(policy, q, k, v, o, prompt_lengths=lengths.long())
    check_selection((outputs[0].long(), outputs[1].long(), outputs[2], outputs[3]), ref, policy, n, "graph replay")


def sanitizer_path():
    found = shutil.which("compute-sanitizer")
    default = Path("/usr/local/cuda/bin/compute-sanitizer")
    return found or (str(default) if default.exists() else None)


SANITIZER_SHAPES = ("small", "d128", "longrow", "model")  # plugins/testing/sanitizer_driver.cu: ckv_sanitizer_driver --list


@pytest.mark.parametrize("shape", SANITIZER_SHAPES)
@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck", "initcheck"])
def test_compute_sanitizer(native_build, needs_nvcc, tool, shape):
    """One sanitizer on one of the driver's shapes: small (every policy, three dtypes), d128 (d_h 128, hidden 4096: the
    172 KiB cp.async ring, gramQuad at d_h 128, WindowTiles<8>), longrow (4,668 older tokens: the multi-CTA top-k),
    model (the model-level selection: the head cap's sort and levels, the refinement, kvzip's scores)."""
    sanitizer = sanitizer_path()
    if sanitizer is None:
        pytest.skip("compute-sanitizer not found")
    driver = native_build / "ckv_sanitizer_driver"
    result = subprocess.run([sanitizer, "--tool", tool, "--error-exitcode", "3", str(driver), shape],
                            capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, (result.stdout + result.stderr)[-8000:]
    assert "ERROR SUMMARY: 0 errors" in result.stdout + result.stderr


def measured_copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy (read + write), the practical memory floor."""
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")  # 256 MiB
    y = torch.empty_like(x)
    y.copy_(x)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(10):
            y.copy_(x)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 10 / 1e3)
    return 2 * x.numel() / statistics.median(times)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_kernel_time_against_the_memory_floor(cuda_lib, dtype):
    batch, heads, kv_heads, n, head_dim, hidden = 1, 32, 8, 32768, 128, 4096
    q, k, v, o = cuda_layer(dtype, batch=batch, heads=heads, kv_heads=kv_heads, n=n, head_dim=head_dim,
                            hidden=hidden, window=32, seed=0)
    bandwidth = measured_copy_bandwidth()
    norm_ms = statistics.median(cuda_lib.value_norms(v, o, heads, iterations=20)[1] for _ in range(5))
    floor_ms = (v.numel() + o.numel()) * v.element_size() / bandwidth * 1e3
    flops = 2.0 * batch * heads * n * head_dim * hidden
    policy = KVPolicy("criticalkv", budget=2048, window=32)
    select_ms = statistics.median(cuda_lib.select_layer(policy, q, k, v, o, iterations=10)[4] for _ in range(5))
    select_floor_ms = sum(t.numel() for t in (q, k, v, o)) * v.element_size() / bandwidth * 1e3
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dtype": str(dtype),
        "shape": dict(batch=batch, heads=heads, kv_heads=kv_heads, n=n, head_dim=head_dim, hidden=hidden),
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "value_norms_ms": norm_ms,
        "value_norms_floor_ms": floor_ms,
        "value_norms_ratio_to_floor": norm_ms / floor_ms,
        "value_norms_TFLOPs": flops / norm_ms / 1e9,
        "select_layer_ms": select_ms,
        "select_layer_floor_ms": select_floor_ms,
        "select_layer_ratio_to_floor": select_ms / select_floor_ms,
    }
    print("\n" + json.dumps(report, indent=2))
    (BUILD_DIR / f"gpu_timing_{str(dtype).split('.')[-1]}.json").write_text(json.dumps(report, indent=2))
    assert norm_ms > 0 and select_ms > 0


# ------------------------------------------------------------------------------------------ TensorRT engine

def onnx_select_model(policy, heads, kv_heads, head_dim, hidden, window, o_proj, capacity, with_function_body):
    """An ONNX model holding one CriticalKVSelect node (the plugin's node contract), dynamic B and n."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from criticalkv.node import DOMAIN, INPUTS, OP_TYPE, OUTPUTS

    node_inputs = list(INPUTS) + ([] if "kv_budget" in INPUTS else ["kv_budget"])  # the request's budget, input 5
    node = helper.make_node(OP_TYPE, node_inputs, list(OUTPUTS), domain=DOMAIN, name="select0")
    # not make_node(**attributes): the policy knob `name` collides with make_node's own `name` argument
    node.attribute.extend(helper.make_attribute(k, v) for k, v in node_attributes(policy, 0, 1, capacity).items())
    f = TensorProto.FLOAT
    inputs = [
        helper.make_tensor_value_info("queries", f, ["batch", heads, window, head_dim]),
        helper.make_tensor_value_info("keys", f, ["batch", kv_heads, "n", head_dim]),
        helper.make_tensor_value_info("values", f, ["batch", kv_heads, "n", head_dim]),
        helper.make_tensor_value_info("prompt_lengths", TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info("kv_budget", TensorProto.INT32, [1]),
    ]
    outputs = [
        helper.make_tensor_value_info("kept_keys", f, ["batch", kv_heads, "cap", head_dim]),
        helper.make_tensor_value_info("kept_values", f, ["batch", kv_heads, "cap", head_dim]),
        helper.make_tensor_value_info("kept_lengths", TensorProto.INT32, ["batch", kv_heads]),
        helper.make_tensor_value_info("kept_indices", TensorProto.INT32, ["batch", kv_heads, "cap"]),
    ]
    weight = numpy_helper.from_array(o_proj.cpu().numpy(), "o_proj_weight")
    graph = helper.make_graph([node], "criticalkv_select", inputs, outputs, [weight])
    functions = []
    if with_function_body:  # a deliberately different body: if TensorRT inlines it, the indices are wrong
        body = [
            helper.make_node("Identity", ["keys"], ["kept_keys"]),
            helper.make_node("Identity", ["values"], ["kept_values"]),
            helper.make_node("Shape", ["keys"], ["shape"], start=0, end=2),
            helper.make_node("ConstantOfShape", ["shape"], ["kept_lengths"],
                             value=helper.make_tensor("zero", TensorProto.INT32, [1], [0])),
            helper.make_node("Shape", ["keys"], ["shape3"], start=0, end=3),
            helper.make_node("ConstantOfShape", ["shape3"], ["kept_indices"],
                             value=helper.make_tensor("minus", TensorProto.INT32, [1], [-5])),
        ]
        functions.append(helper.make_function(DOMAIN, OP_TYPE, node_inputs, list(OUTPUTS), body,
                                              [helper.make_opsetid("", 17)], attributes=list(node_attributes(policy, 0, 1, capacity))))
    model = helper.make_model(graph, functions=functions,
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    return onnx._serialize(model) if hasattr(onnx, "_serialize") else model.SerializeToString()


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is None, reason="tensorrt is not installed")
@pytest.mark.skipif(importlib.util.find_spec("onnx") is None, reason="onnx is not installed")
@pytest.mark.parametrize("with_function_body", [False, True], ids=["function-free", "with-function-body"])
def test_engine_with_the_plugin_matches_the_reference(native_build, trt_plugin, tmp_path, with_function_body):
    import tensorrt as trt

    from criticalkv.tensorrt import load_plugin_library
    from criticalkv.tensorrt.tensorrt_build import count_plugin_layers

    logger = trt.Logger(trt.Logger.WARNING)
    load_plugin_library(native_build / "libcriticalkv_trt_plugin.so", trt.get_plugin_registry())
    heads, kv_heads, head_dim, hidden, window, n = 8, 2, 64, 256, 32, 900
    q, k, v, o = cuda_layer(batch=2, heads=heads, kv_heads=kv_heads, n=n, head_dim=head_dim, hidden=hidden,
                            window=window, seed=4)
    policy = KVPolicy("ada-criticalkv", budget=128, window=window)
    capacity = node_capacity(policy, 2048, kv_heads, 0, 1)
    blob = onnx_select_model(policy, heads, kv_heads, head_dim, hidden, window, o, capacity, with_function_body)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if hasattr(trt.OnnxParserFlag, "ENABLE_PLUGIN_OVERRIDE"):
        parser.set_flag(trt.OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE)
    assert parser.parse(blob), [str(parser.get_error(i)) for i in range(parser.num_errors)]
    plugin_layers = count_plugin_layers(network, trt)
    major, minor = (int(x) for x in trt.__version__.split(".")[:2])
    if with_function_body and (major, minor) < (10, 7):
        assert plugin_layers == 0, "TensorRT < 10.7 inlines model-local functions (plugins/README.md)"
        return
    assert plugin_layers == 1, "the CriticalKVSelect node must become the plugin, not its function body"
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    profile.set_shape("queries", (1, heads, window, head_dim), (2, heads, window, head_dim), (4, heads, window, head_dim))
    for name in ("keys", "values"):
        profile.set_shape(name, (1, kv_heads, 1, head_dim), (2, kv_heads, 1024, head_dim), (4, kv_heads, 2048, head_dim))
    profile.set_shape("prompt_lengths", (1,), (2,), (4,))
    profile.set_shape("kv_budget", (1,), (1,), (1,))
    config.add_optimization_profile(profile)
    engine_blob = builder.build_serialized_network(network, config)
    assert engine_blob is not None
    engine = trt.Runtime(logger).deserialize_cuda_engine(engine_blob)
    context = engine.create_execution_context()
    lengths = torch.tensor([n, 600], dtype=torch.int32, device="cuda")
    requested = torch.tensor([96], dtype=torch.int32, device="cuda")  # below the built budget of 128
    feeds = {"queries": q, "keys": k, "values": v, "prompt_lengths": lengths, "kv_budget": requested}
    for name, tensor in feeds.items():
        context.set_input_shape(name, tuple(tensor.shape))
        context.set_tensor_address(name, tensor.data_ptr())
    dtypes = {"kept_keys": torch.float32, "kept_values": torch.float32, "kept_lengths": torch.int32,
              "kept_indices": torch.int32}
    outputs = {}
    for name, dtype in dtypes.items():
        outputs[name] = torch.empty(tuple(context.get_tensor_shape(name)), dtype=dtype, device="cuda")
        context.set_tensor_address(name, outputs[name].data_ptr())
    stream = torch.cuda.current_stream()
    assert context.execute_async_v3(stream.cuda_stream)
    stream.synchronize()
    policy = dataclasses.replace(policy, budget=96)
    ref = select_layer(policy, q, k, v, o, prompt_lengths=lengths.long())
    got = (outputs["kept_indices"].long(), outputs["kept_lengths"].long(), outputs["kept_keys"], outputs["kept_values"])
    assert got[0].shape[-1] == min(n, capacity)
    check_selection(got, ref, policy, n, "engine at kv_budget 96")
    want_k, _ = gather_kv(ref, k, v)
    assert want_k.shape[2] <= got[2].shape[2]


def build_and_run_engine(blob, profile_shapes, feeds, out_dtypes, expected_plugins):
    """Parse an ONNX model with the plugin library's nodes, build an fp32 engine over ``profile_shapes`` ({input:
    (min, opt, max)}), run it once on the CUDA tensors ``feeds``; {output: tensor} of ``out_dtypes``."""
    import tensorrt as trt

    from criticalkv.tensorrt import load_plugin_library
    from criticalkv.tensorrt.tensorrt_build import count_plugin_layers

    logger = trt.Logger(trt.Logger.WARNING)
    load_plugin_library(BUILD_DIR / "libcriticalkv_trt_plugin.so", trt.get_plugin_registry())
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if hasattr(trt.OnnxParserFlag, "ENABLE_PLUGIN_OVERRIDE"):
        parser.set_flag(trt.OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE)
    assert parser.parse(blob), [str(parser.get_error(i)) for i in range(parser.num_errors)]
    assert count_plugin_layers(network, trt) == expected_plugins
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for name, (low, opt, high) in profile_shapes.items():
        profile.set_shape(name, low, opt, high)
    config.add_optimization_profile(profile)
    engine_blob = builder.build_serialized_network(network, config)
    assert engine_blob is not None
    engine = trt.Runtime(logger).deserialize_cuda_engine(engine_blob)
    context = engine.create_execution_context()
    for name, tensor in feeds.items():
        context.set_input_shape(name, tuple(tensor.shape))
        context.set_tensor_address(name, tensor.data_ptr())
    outputs = {}
    for name, dtype in out_dtypes.items():
        outputs[name] = torch.empty(tuple(context.get_tensor_shape(name)), dtype=dtype, device="cuda")
        context.set_tensor_address(name, outputs[name].data_ptr())
    stream = torch.cuda.current_stream()
    assert context.execute_async_v3(stream.cuda_stream)
    stream.synchronize()
    return outputs


def layer_value_infos(suffix, heads, kv_heads, head_dim, window):
    from onnx import TensorProto, helper

    f = TensorProto.FLOAT
    return [helper.make_tensor_value_info(f"queries{suffix}", f, ["batch", heads, window, head_dim]),
            helper.make_tensor_value_info(f"keys{suffix}", f, ["batch", kv_heads, "n", head_dim]),
            helper.make_tensor_value_info(f"values{suffix}", f, ["batch", kv_heads, "n", head_dim]),
            helper.make_tensor_value_info(f"scores{suffix}", f, ["batch", kv_heads, "n"])]


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is None, reason="tensorrt is not installed")
@pytest.mark.skipif(importlib.util.find_spec("onnx") is None, reason="onnx is not installed")
def test_engine_with_the_scores_input_matches_the_reference(native_build, trt_plugin):
    """kvzip-criticalkv through the CriticalKVSelect plugin with its seventh input, the scores the graph passes in."""
    from onnx import TensorProto, helper, numpy_helper

    from criticalkv.node import DOMAIN, INPUTS, OP_TYPE, OUTPUTS, SCORES_INPUT

    heads, kv_heads, head_dim, hidden, window, n = 8, 2, 64, 256, 32, 900
    q, k, v, o = cuda_layer(batch=2, heads=heads, kv_heads=kv_heads, n=n, head_dim=head_dim, hidden=hidden,
                            window=window, seed=6)
    scores = torch.rand(2, kv_heads, n, generator=torch.Generator().manual_seed(6)).cuda()
    policy = KVPolicy("kvzip-criticalkv", budget=128, window=window, sink_tokens=4)
    capacity = node_capacity(policy, 2048, kv_heads, 0, 1)
    node = helper.make_node(OP_TYPE, list(INPUTS) + [SCORES_INPUT], list(OUTPUTS), domain=DOMAIN, name="select0")
    node.attribute.extend(helper.make_attribute(key, value) for key, value in node_attributes(policy, 0, 1, capacity).items())
    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    inputs = layer_value_infos("", heads, kv_heads, head_dim, window)
    inputs = inputs[:3] + [helper.make_tensor_value_info("prompt_lengths", i32, ["batch"]),
                           helper.make_tensor_value_info("kv_budget", i32, [1]), inputs[3]]
    outputs = [helper.make_tensor_value_info("kept_keys", f, ["batch", kv_heads, "cap", head_dim]),
               helper.make_tensor_value_info("kept_values", f, ["batch", kv_heads, "cap", head_dim]),
               helper.make_tensor_value_info("kept_lengths", i32, ["batch", kv_heads]),
               helper.make_tensor_value_info("kept_indices", i32, ["batch", kv_heads, "cap"])]
    graph = helper.make_graph([node], "criticalkv_select_scores", inputs, outputs,
                              [numpy_helper.from_array(o.cpu().numpy(), "o_proj_weight")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    lengths = torch.tensor([n, 600], dtype=torch.int32, device="cuda")
    feeds = {"queries": q, "keys": k, "values": v, "prompt_lengths": lengths,
             "kv_budget": torch.tensor([128], dtype=torch.int32, device="cuda"), "scores": scores}
    shapes = {"queries": ((1, heads, window, head_dim), (2, heads, window, head_dim), (4, heads, window, head_dim)),
              "scores": ((1, kv_heads, 1), (2, kv_heads, 1024), (4, kv_heads, 2048)),
              "prompt_lengths": ((1,), (2,), (4,)), "kv_budget": ((1,), (1,), (1,))}
    for name in ("keys", "values"):
        shapes[name] = ((1, kv_heads, 1, head_dim), (2, kv_heads, 1024, head_dim), (4, kv_heads, 2048, head_dim))
    out = build_and_run_engine(model.SerializeToString(), shapes, feeds,
                               {"kept_keys": torch.float32, "kept_values": torch.float32, "kept_lengths": torch.int32,
                                "kept_indices": torch.int32}, 1)
    ref = select_layer(policy, q, k, v, o, prompt_lengths=lengths.long(), scores=scores)
    got = (out["kept_indices"].long(), out["kept_lengths"].long(), out["kept_keys"], out["kept_values"])
    check_selection(got, ref, policy, n, "engine with scores")


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is None, reason="tensorrt is not installed")
@pytest.mark.skipif(importlib.util.find_spec("onnx") is None, reason="onnx is not installed")
@pytest.mark.parametrize("name", ["layer-defensivekv", "layer-kvzip-criticalkv"])
def test_engine_of_the_model_level_nodes_matches_select_model(native_build, trt_plugin, name):
    """CriticalKVScore per layer, CriticalKVSelectModel after the last one: the model's kept entries equal
    select_model's (the total per sequence exactly, the kept sets up to near-ties)."""
    from onnx import TensorProto, helper, numpy_helper

    from criticalkv.export.model_select import model_inputs, model_node, model_outputs, score_node, score_outputs
    from criticalkv.node import DOMAIN
    from criticalkv.selection.layer import select_model

    layers, heads, kv_heads, head_dim, hidden, window, n = 3, 8, 2, 64, 256, 16, 700
    policy = KVPolicy(name, budget=96, window=window, head_cap_ratio=2.0)
    scored = policy.method.base.external_scores
    tensors = [cuda_layer(batch=2, heads=heads, kv_heads=kv_heads, n=n, head_dim=head_dim, hidden=hidden,
                          window=window, seed=10 + i) for i in range(layers)]
    scores = [torch.rand(2, kv_heads, n, generator=torch.Generator().manual_seed(20 + i)).cuda() for i in range(layers)]
    capacities = [node_capacity(policy, 2048, kv_heads, i, layers) for i in range(layers)]
    nodes, infos, weights, feeds = [], [], [], {}
    lengths = torch.tensor([n, 500], dtype=torch.int32, device="cuda")
    for i, (q, k, v, o) in enumerate(tensors):
        names = [f"queries.{i}", f"keys.{i}", f"values.{i}", f"o_proj.{i}", "prompt_lengths", "kv_budget"]
        names += [f"scores.{i}"] if scored else []
        outs = [f"{out}.{i}" for out in score_outputs(policy)]
        nodes.append(score_node(policy, i, layers, capacities[i], names, outs))
        infos += [info for info in layer_value_infos(f".{i}", heads, kv_heads, head_dim, window)
                  if scored or not info.name.startswith("scores")]
        weights.append(numpy_helper.from_array(o.cpu().numpy(), f"o_proj.{i}"))
        feeds.update({f"queries.{i}": q, f"keys.{i}": k, f"values.{i}": v, **({f"scores.{i}": scores[i]} if scored else {})})
    refined = len(score_outputs(policy)) == 2
    nodes.append(model_node(policy, capacities, model_inputs(layers, refined), model_outputs(layers)))
    # the score nodes' outputs (ranking.l, critical.l) are the model node's inputs by name
    i32, f = TensorProto.INT32, TensorProto.FLOAT
    infos += [helper.make_tensor_value_info("prompt_lengths", i32, ["batch"]), helper.make_tensor_value_info("kv_budget", i32, [1])]
    outputs = []
    for i in range(layers):
        cap = ["batch", kv_heads, f"cap_{i}"]
        outputs += [helper.make_tensor_value_info(f"kept_keys.{i}", f, cap + [head_dim]),
                    helper.make_tensor_value_info(f"kept_values.{i}", f, cap + [head_dim]),
                    helper.make_tensor_value_info(f"kept_lengths.{i}", i32, cap[:2]),
                    helper.make_tensor_value_info(f"kept_indices.{i}", i32, cap)]
    assert [o.name for o in outputs] == model_outputs(layers)
    graph = helper.make_graph(nodes, "criticalkv_model_level", infos, outputs, weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    feeds.update({"prompt_lengths": lengths, "kv_budget": torch.tensor([96], dtype=torch.int32, device="cuda")})
    shapes = {"prompt_lengths": ((1,), (2,), (4,)), "kv_budget": ((1,), (1,), (1,))}
    for i in range(layers):
        shapes[f"queries.{i}"] = ((1, heads, window, head_dim), (2, heads, window, head_dim), (4, heads, window, head_dim))
        for kind in ("keys", "values"):
            shapes[f"{kind}.{i}"] = ((1, kv_heads, 1, head_dim), (2, kv_heads, 1024, head_dim), (4, kv_heads, 2048, head_dim))
        if scored:
            shapes[f"scores.{i}"] = ((1, kv_heads, 1), (2, kv_heads, 1024), (4, kv_heads, 2048))
    dtypes = {x: torch.float32 if x.startswith(("kept_keys", "kept_values")) else torch.int32 for x in model_outputs(layers)}
    out = build_and_run_engine(model.SerializeToString(), shapes, feeds, dtypes, layers + 1)
    refs = select_model(policy, tensors, lengths.long(), scores=scores if scored else None)
    kept, agree, total = torch.zeros(2, device="cuda"), 0, 0
    for i, ref in enumerate(refs):
        indices, got_lengths = out[f"kept_indices.{i}"].long(), out[f"kept_lengths.{i}"].long()
        mask = torch.zeros(2, kv_heads, n + 1, dtype=torch.bool, device="cuda")
        mask.scatter_(-1, indices.masked_fill(indices < 0, n), True)
        agree += (mask[..., :n] & ref.mask(n)).sum().item()
        total += ref.lengths.sum().item()
        kept += got_lengths.sum(-1) - ref.lengths.sum(-1).to(kept.device)
        assert indices.shape[-1] == min(n, capacities[i])
    assert torch.equal(kept, torch.zeros_like(kept)), "the model keeps L H_kv b entries per compressed sequence"
    assert agree / total >= 0.99, agree / total
