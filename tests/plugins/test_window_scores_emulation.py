"""The window-score kernels on the CPU, no GPU needed.

plugins/testing/window_scores_emulation.cpp compiles the very headers the kernels are built from
(plugins/kernels/window_tiles.cuh: the tensor-core passes; window_simt.cuh: the SIMT passes and defensivekv's SIMT row
passes) with g++, the warp instructions of plugins/testing/mma_emulation.h (ldmatrix / mma.sync by the PTX ISA's
fragment tables, cp.async landing only at the wait that retires it, one fiber per CUDA thread) and shared memory
filled with garbage before every block. Checked against fp64 loops of the operator's definitions and against the host
driver (select_host.cpp) on the same inputs: Ā, sum A^2, and defensivekv's worst and row (mass, total), over GQA and
MHA, d_h 16 to 128, ragged key tails, n below one tile, w below 32 and up to 128, query heads split over row chunks,
multi-step cp.async rings, left padding (exact zeros) and a sequence too short to be compressed (left untouched).
Also: the compiled tensor-core kernels hold mma.sync / ldmatrix / cp.async (PTX)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ckv_native import ROOT

PLUGINS = ROOT / "plugins"


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ not found")
    binary = tmp_path_factory.mktemp("window") / "window_scores_emulation"
    result = subprocess.run([compiler, "-std=c++20", "-O1", "-ffp-contract=off", "-Wall", "-Wextra", "-Werror",
                             "-Wno-unknown-pragmas", f"-I{PLUGINS / 'include'}", f"-I{PLUGINS / 'host'}",
                             f"-I{PLUGINS / 'kernels'}", f"-I{PLUGINS / 'testing'}",
                             str(PLUGINS / "testing" / "window_scores_emulation.cpp"),
                             str(PLUGINS / "host" / "select_host.cpp"), "-o", str(binary), "-lpthread"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    return binary


def run(binary, *args):
    result = subprocess.run([str(binary), *map(str, args)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.parametrize(
    "dtype, batch, heads, kv_heads, n, head_dim, window, pool, rows, tiles_per_block",
    [
        ("bf16", 3, 4, 2, 230, 64, 32, 7, 1, 2),  # GQA, a ragged tail, 2-step rings, padded + uncompressed sequences
        ("fp16", 1, 8, 1, 200, 128, 32, 7, 1, 3),  # d_h 128, G = 8: two row chunks of 4 heads
        ("bf16", 1, 3, 3, 50, 64, 24, 5, 1, 0),  # MHA, n below one tile, w = 24
        ("fp16", 3, 4, 1, 150, 16, 8, 1, 0, 1),  # w = 8, d_h 16 (one k step), laprox's squares without rows
        ("bf16", 1, 4, 1, 160, 32, 48, 49, 1, 1),  # the widest pool on the tensor cores (halo 24), w = 48
        ("fp16", 1, 2, 1, 200, 32, 128, 7, 1, 0),  # w = 128: one head per row chunk
        ("fp32", 3, 2, 1, 150, 16, 24, 7, 1, 0),  # the SIMT path (fp32) with defensivekv's SIMT rows
    ],
)
def test_window_kernels_equal_the_fp64_scores(emulator, dtype, batch, heads, kv_heads, n, head_dim, window, pool,
                                              rows, tiles_per_block):
    """Every quantity within 2e-5 of fp64 (relative, per value), and at most 2x as far from it as the host driver's
    fp32 (+1e-6): the flash-attention rule with the host driver as the fp32 computation."""
    out = run(emulator, "window", dtype, batch, heads, kv_heads, n, head_dim, window, pool, rows, tiles_per_block, 1)
    assert "\n0 failures" in out, out
    errors = re.findall(r"(\w+): largest relative error vs fp64: kernel ([0-9.e+-]+), host driver ([0-9.e+-]+)", out)
    assert [name for name, _, _ in errors] == ["raw", "squares"] + (["worst", "mass", "total"] if rows else []), out
    for name, kernel, host in errors:
        assert float(kernel) <= 2 * float(host) + 1e-6, (name, out)


@pytest.mark.parametrize(
    "pool, batch, heads, kv_heads, n, head_dim, window, seed",
    [
        (7, 2, 4, 2, 300, 16, 24, 0),  # default pool, GQA, a padded sequence, query chunks 16 + 8
        (5, 1, 3, 3, 200, 8, 8, 1),  # the reference's pool, MHA
        (1, 2, 2, 1, 150, 16, 32, 2),  # no pool
        (151, 1, 2, 1, 260, 16, 17, 3),  # a span over three key chunks
    ],
)
def test_simt_row_passes_equal_the_host_form(emulator, pool, batch, heads, kv_heads, n, head_dim, window, seed):
    """defensivekv's SIMT row passes, fed the softmax statistics of the rows they are compared with: worst and the
    rows' (mass, total) equal the host driver's whole-row form up to fp32 rounding (2e-6)."""
    out = run(emulator, "rows", pool, batch, heads, kv_heads, n, head_dim, window, seed)
    assert f"pool {pool}: worst bitwise equal" in out, out


WINDOW_MMA_KERNELS = ("windowStatsMmaKernel", "windowColumnsMmaKernel")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_window_kernels_compile_to_mma(tmp_path, arch):
    """The two tensor-core passes' PTX issues mma.sync m16n8k16 (bf16 and f16), ldmatrix and cp.async."""
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(nvcc).exists():
        pytest.skip("nvcc not found")
    ptx = tmp_path / "window_scores.ptx"
    result = subprocess.run([nvcc, "-std=c++17", f"-arch={arch}", "-O3", f"-I{PLUGINS / 'include'}",
                             f"-I{PLUGINS / 'kernels'}", "-ptx", str(PLUGINS / "kernels" / "window_scores.cu"), "-o",
                             str(ptx)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    seen = {}
    for entry in re.split(r"(?=\.visible \.entry |\.weak \.entry |\.entry )", ptx.read_text()):
        name = re.match(r"\.(?:visible |weak )?\.?entry\s+(\S+)\(", entry)
        kernel = next((k for k in WINDOW_MMA_KERNELS if name and k in name.group(1)), None)
        if kernel is None:
            continue
        seen[kernel] = seen.get(kernel, 0) + 1
        assert "mma.sync.aligned.m16n8k16.row.col.f32" in entry, name.group(1)
        assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in entry, name.group(1)
        assert "cp.async.cg.shared.global" in entry and "cp.async.wait_group" in entry, name.group(1)
    assert seen == {k: 4 for k in WINDOW_MMA_KERNELS}, seen  # bf16 / fp16 x d_h <= 64 / <= 128
    for dtype in ("bf16", "f16"):
        assert f"mma.sync.aligned.m16n8k16.row.col.f32.{dtype}.{dtype}.f32" in ptx.read_text(), dtype
