"""The batched top-k primitive and the selection flows built on it (plugins/kernels/topk_device.cuh,
criticalkv/topk.h) run on the CPU under the thread emulation (plugins/testing/cuda_emulation.h: one fiber per
CUDA thread, the CTAs of a launch one after another): the same kernels and the same sequence of launches as kernels/topk.cu, compiled with g++ from the headers.

Every row must keep what ``topk_mask`` (criticalkv/methods/topk.py) keeps among its candidates (flags == 0, outside
the left padding of every period), and what the host driver's radix select keeps; the mass count (defensivekv's
stage 1) must equal the host driver's. Rows cover NaN, +-inf, +-0, heavy ties at the threshold, k = 0, 1, len - 1,
len and more, lengths 1 .. 40,000 (one CTA per row up to 4,096 entries, then 2,048 entries per CTA), several rows
with different k, flags set before, and left padding of several segments (the layer-wide row of the shared
allocation).

The selection flows (plugins/kernels/select_flows.cuh: plan kernels computing every row's k on the device between
batched top-k launches) run the same way on small layers and must mark the host driver's flags (and shares) for every
KV head: per head (snapkv, pyramidkv, the two CriticalKV stages), shared allocation (adakv, laprox, ada-criticalkv)
and defensivekv (stage 1 by mass, then the shared allocation on its ranking)."""

import shutil
import subprocess

import numpy as np
import pytest
import torch

from ckv_native import ROOT
from criticalkv.methods.topk import topk_mask

PLUGINS = ROOT / "plugins"
SINGLE_CTA_MAX = 4096  # criticalkv/topk.h: kTopKSingleCtaMax
CHUNK = 2048  # kTopKChunk


def compile_emulator(folder, harness: str):
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ not found")
    binary = folder / harness.removesuffix(".cpp")
    result = subprocess.run([compiler, "-std=c++20", "-O1", "-ffp-contract=off", "-Wall", "-Wextra", "-Werror",
                             "-Wno-unknown-pragmas", f"-I{PLUGINS / 'include'}", f"-I{PLUGINS / 'host'}", f"-I{PLUGINS / 'kernels'}",
                             f"-I{PLUGINS / 'testing'}", str(PLUGINS / "testing" / harness),
                             str(PLUGINS / "host" / "select_host.cpp"), "-o", str(binary), "-lpthread"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    return binary


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return compile_emulator(tmp_path_factory.mktemp("topk"), "topk_emulation.cpp")


def run_rows(emulator, tmp_path, scores, flags, k, first_valid=None, period=None, mark=1, limit=None):
    """(emulated flags, host flags, emulated counts, host counts, CTAs per row) of rows [rows, len]."""
    rows, length = scores.shape
    period = period or length
    first_valid = np.zeros(rows, np.int32) if first_valid is None else np.asarray(first_valid, np.int32)
    limit = np.full(rows, 0.5, np.float32) if limit is None else np.asarray(limit, np.float32)
    source, target = tmp_path / "in.bin", tmp_path / "out.bin"
    k = np.asarray(k, np.int64)
    levels = k.shape[0] if k.ndim == 2 else 1
    with open(source, "wb") as f:
        f.write(np.array([rows, length, period, mark, levels], np.int32).tobytes())
        f.write(scores.numpy().astype(np.float32).tobytes())
        f.write(flags.numpy().astype(np.uint8).tobytes())
        f.write(np.asarray(k, np.int64).tobytes())
        f.write(first_valid.tobytes())
        f.write(limit.tobytes())
    result = subprocess.run([str(emulator), str(source), str(target)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    out = np.fromfile(target, np.uint8)
    n = rows * length
    device, host = out[:n].reshape(rows, length), out[n:2 * n].reshape(rows, length)
    counts = out[2 * n:2 * n + 16 * rows].view(np.int64)
    ctas = int(out[2 * n + 16 * rows:].view(np.int32)[0])
    return torch.from_numpy(device.copy()), torch.from_numpy(host.copy()), counts[:rows], counts[rows:], ctas


def expected_flags(scores, flags, k, first_valid, period, mark):
    """topk_mask over each row's candidates (compacted, so that ineligible entries never take a rank)."""
    rows, length = scores.shape
    out = flags.clone()
    positions = torch.arange(length)
    for r in range(rows):
        eligible = (flags[r] == 0) & (positions % period >= int(first_valid[r]))
        index = eligible.nonzero().flatten()
        kk = max(0, min(int(k[r]), index.numel()))
        if index.numel():
            out[r, index[topk_mask(scores[r, index], kk)]] = mark
    return out


def expected_levels(scores, flags, levels_k, first_valid, period, mark):
    """Nested levels: an entry gets mark + l for the first level l whose topk_mask keeps it."""
    out = flags.clone()
    for level in reversed(range(len(levels_k))):
        marked = expected_flags(scores, flags, levels_k[level], first_valid, period, mark + level)
        out = torch.where(marked != flags, marked, out)
    return out


def check(emulator, tmp_path, scores, flags, k, first_valid=None, period=None, mark=1):
    rows, length = scores.shape
    first_valid = [0] * rows if first_valid is None else first_valid
    device, host, counts, host_counts, ctas = run_rows(emulator, tmp_path, scores, flags, k, first_valid, period,
                                                       mark)
    if np.asarray(k).ndim == 2:
        want = expected_levels(scores, flags, [list(x) for x in np.asarray(k)], first_valid, period or length, mark)
        k = np.asarray(k)[-1]
    else:
        want = expected_flags(scores, flags, k, first_valid, period or length, mark)
    assert ctas == (1 if length <= SINGLE_CTA_MAX else -(-length // CHUNK))
    for r in range(rows):
        assert torch.equal(host[r], want[r]), ("host driver", r, int(k[r]))
        assert torch.equal(device[r], want[r]), ("kernels", r, int(k[r]), (device[r] != want[r]).nonzero()[:8])
    assert np.array_equal(counts, host_counts), (counts, host_counts)
    return device


def special_scores(rows, length, fractions, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, length, generator=g)
    specials = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0])
    for row in range(rows):
        where = torch.rand(length, generator=g) < fractions[row % len(fractions)]
        scores[row, where] = specials[torch.randint(0, len(specials), (int(where.sum()),), generator=g)]
    return scores


@pytest.mark.parametrize("length", [1000, 5000])
def test_nan_infinities_and_signed_zeros(emulator, tmp_path, length):
    """The GPU test's rows (NaN of both signs above +inf, -0 == +0), every k of it, one CTA and several per row."""
    fractions = (0.001, 0.01, 0.1, 0.5, 0.9, 1.0)
    ks = (0, 1, 5, 777, length - 1, length)
    scores = special_scores(12, length, fractions, seed=3)
    k = [ks[(r + r // 6) % len(ks)] for r in range(12)]  # every fraction with two k, every k twice
    check(emulator, tmp_path, scores, torch.zeros(12, length, dtype=torch.uint8), k)


@pytest.mark.parametrize("length, levels", [(3000, 3), (9000, 3), (12000, 1)])
def test_ties_at_the_threshold_go_to_the_lower_index(emulator, tmp_path, length, levels):
    """Few distinct values: the threshold's ties span several chunks; the first of them in index order are kept."""
    g = torch.Generator().manual_seed(length + levels)
    scores = (torch.rand(4, length, generator=g) * levels).floor() / levels
    scores[1] = -scores[1]
    scores[2, ::7] = 0.0
    scores[2, 1::7] = -0.0
    k = [1, length // 3, length // 2 + 17, length - 1]
    check(emulator, tmp_path, scores, torch.zeros(4, length, dtype=torch.uint8), k)


@pytest.mark.parametrize("length", [1, 2, 31, 257, SINGLE_CTA_MAX, SINGLE_CTA_MAX + 1, 40000])
def test_lengths(emulator, tmp_path, length):
    g = torch.Generator().manual_seed(length)
    scores = torch.randn(3, length, generator=g)
    k = [min(length, 1), length // 2, length + 5]  # k beyond the candidates keeps them all
    check(emulator, tmp_path, scores, torch.zeros(3, length, dtype=torch.uint8), k)


@pytest.mark.parametrize("length", [1500, 7000])
def test_flags_set_before_and_left_padding(emulator, tmp_path, length):
    """Entries already chosen are neither candidates nor changed; each row skips its own left padding; the mark is
    the caller's."""
    g = torch.Generator().manual_seed(length)
    scores = (torch.rand(5, length, generator=g) * 50).floor()
    flags = (torch.rand(5, length, generator=g) < 0.2).to(torch.uint8) * 1
    first_valid = [0, 3, length // 2, length - 1, length]
    k = [length // 4, length // 4, length, 1, 3]
    check(emulator, tmp_path, scores, flags, k, first_valid=first_valid, mark=2)


def test_layer_rows_of_several_heads(emulator, tmp_path):
    """The shared allocation's row: H_kv heads of m tokens each, the left padding at the start of every head."""
    heads, m = 4, 2100
    g = torch.Generator().manual_seed(7)
    scores = torch.rand(2, heads * m, generator=g)
    scores[:, ::5] = 0.25  # ties across heads
    flags = (torch.rand(2, heads * m, generator=g) < 0.1).to(torch.uint8)
    check(emulator, tmp_path, scores, flags, [1000, 3000], first_valid=[0, 700], period=m)


@pytest.mark.parametrize("length", [3000, 9000])
def test_levels_mark_each_entry_with_its_first_level(emulator, tmp_path, length):
    """One call with 4 levels of non-decreasing k (the pruned stage 2's candidate rounds: 2k, 4k, 8k, 16k): every
    candidate gets mark + the first level whose k best hold it, i.e. what 4 calls with the differences as k would mark;
    ties at every level's threshold across chunks, flags set before, left padding, a level with k 0, k past the
    candidates. One CTA per row (3,000) and several (9,000)."""
    g = torch.Generator().manual_seed(length + 4)
    rows = 5
    scores = (torch.rand(rows, length, generator=g) * 40).floor() / 40  # heavy ties
    scores[1] = torch.randn(length, generator=g)
    scores[2, ::3] = float("nan")
    flags = (torch.rand(rows, length, generator=g) < 0.15).to(torch.uint8)
    first_valid = [0, 7, length // 3, 0, length - 2]
    base = [length // 40, 1, length // 5, 0, 3]
    k = np.array([[min(b << level, length + 9) for b in base] for level in range(4)], np.int64)
    k[1, 0] = k[0, 0]  # a level adding nothing
    device = check(emulator, tmp_path, scores, flags, k, first_valid=first_valid, mark=249)
    assert {249, 250, 251, 252} <= set(device.unique().tolist()), device.unique()


@pytest.fixture(scope="module")
def flows_emulator(tmp_path_factory):
    return compile_emulator(tmp_path_factory.mktemp("flows"), "select_flows_emulation.cpp")


@pytest.mark.parametrize(
    "base, two_stage, batch, kv_heads, n, window, budget, kv_budget, kind, seed",
    [
        ("snapkv", 0, 3, 2, 300, 16, 80, 0, "random", 0),  # left padding, a sequence kept whole
        ("snapkv", 1, 3, 2, 300, 16, 80, 0, "ties", 1),  # criticalkv's two stages, ties at both thresholds
        ("pyramidkv", 1, 2, 2, 260, 8, 72, 40, "random", 2),  # a runtime budget below the built one
        ("adakv", 0, 3, 3, 400, 16, 100, 60, "random", 3),  # floor, then the layer-wide rest; the heads' shares
        ("laprox", 0, 2, 4, 300, 16, 64, 0, "ties", 4),
        ("adakv", 1, 3, 2, 300, 16, 80, 0, "random", 5),  # ada-criticalkv: both stages inside each head's share
        ("defensivekv", 0, 3, 2, 300, 16, 80, 0, "random", 6),  # stage 1 by mass, then the shared allocation
        ("defensivekv", 0, 2, 3, 300, 16, 80, 0, "ties", 7),
        ("adakv", 0, 2, 3, 1500, 16, 400, 0, "random", 8),  # layer rows of 4,452 entries: the multi-CTA launches
        ("defensivekv", 0, 1, 2, 4200, 32, 600, 0, "random", 9),  # multi-CTA head rows and mass counts
    ],
)
def test_selection_flows_mark_the_host_driver_flags(flows_emulator, base, two_stage, batch, kv_heads, n, window,
                                                    budget, kv_budget, kind, seed):
    args = (base, two_stage, batch, kv_heads, n, window, budget, kv_budget, kind, seed)
    result = subprocess.run([str(flows_emulator), *map(str, args)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("0 of ") and "shares 0" in result.stdout, result.stdout
