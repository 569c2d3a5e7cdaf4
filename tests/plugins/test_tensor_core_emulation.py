"""The tensor-core kernels and CriticalKV's GPU pruned stage 2 on the CPU, no GPU needed.

The tile bodies (plugins/kernels/mma_tiles.cuh) and the pruned flow (plugins/kernels/pruned_flow.cuh: runPrunedStage2,
its top-k calls through the batched top-k's kernels) are compiled with g++ from the very headers the kernels include,
with the warp instructions of plugins/testing/mma_emulation.h and cuda_emulation.h: ldmatrix
and mma.sync place every element by the PTX ISA's fragment tables (criticalkv/mma_layout.h, itself checked against the
ISA's per-element formulas), cp.async copies land only at the wait that retires them, one fiber per CUDA thread.
Checked against plain fp64 loops: the value norms (l1 / l2, bf16 / fp16, d_h 64 and 128, GQA, ragged tails, gathered
rows), the l2 norms through the Gram pieces, the soundness of the tensor-core L1 bounds, and the whole pruned flow on
small layers (kept set = the unpruned selection on the same computed values; = the fp32 host driver's up to near-ties).
Also: the compiled kernels hold mma.sync / ldmatrix / cp.async (PTX; HMMA in the SASS when cuobjdump is installed)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ckv_native import ROOT

PLUGINS = ROOT / "plugins"


def compile_harness(folder: Path, harness: str, extra=()) -> Path:
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ not found")
    binary = folder / harness.removesuffix(".cpp")
    result = subprocess.run([compiler, "-std=c++20", "-O1", "-ffp-contract=off", "-Wall", "-Wextra", "-Werror",
                             "-Wno-unknown-pragmas", f"-I{PLUGINS / 'include'}", f"-I{PLUGINS / 'host'}",
                             f"-I{PLUGINS / 'kernels'}", f"-I{PLUGINS / 'testing'}", str(PLUGINS / "testing" / harness),
                             *(str(PLUGINS / x) for x in extra), "-o", str(binary), "-lpthread"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    return binary


@pytest.fixture(scope="module")
def tiles(tmp_path_factory):
    return compile_harness(tmp_path_factory.mktemp("tiles"), "value_norms_mma_emulation.cpp")


def run(binary, *args, timeout=600):
    result = subprocess.run([str(binary), *map(str, args)], capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_fragment_layouts_match_the_ptx_tables(tiles):
    assert "layouts: 0 failures" in run(tiles, "layouts")


def test_tile_reads_of_shared_memory_are_free_of_bank_conflicts(tiles):
    """Index analysis of the tile bodies' shared-memory reads with the header's own offset functions, d_h 16 .. 128:
    every ldmatrix.x4 phase, gramQuadBlock's epilogue reads and its bound epilogue's per-row loop (boundRowWord) hit 32
    banks; the bound loop in the plain order (before the swizzle) shows 4-way conflicts, so the analysis finds them."""
    out = run(tiles, "banks")
    assert "banks: 0 failures" in out, out
    for config in ("GramTiles64", "GramTiles128", "NormTiles", "NormTilesSmall"):
        assert f"{config}: ldmatrix phases 1-way, quad epilogue 1-way, bound rows 1-way (plain order: 4-way)" in out, out


@pytest.mark.parametrize(
    "dtype, kind, batch, heads, kv_heads, n, head_dim, hidden, gather, seed",
    [
        ("bf16", "l1", 1, 4, 2, 300, 64, 128, 0, 1),  # GQA, a ragged second tile (300 = 256 + 44)
        ("fp16", "l1", 2, 2, 1, 90, 128, 200, 1, 2),  # gathered ragged lists (one empty), hidden past a column tile
        ("bf16", "l2", 1, 3, 3, 70, 64, 72, 1, 3),  # MHA, direct l2, gathered
        ("fp16", "l2", 1, 2, 1, 40, 16, 48, 0, 4),  # d_h 16: one k step
        ("bf16", "l1", 1, 8, 2, 300, 128, 1024, 1, 5),  # group 4 over 1, 2 and 4 CTAs, the 3-deep ring at d_h 128
    ],
)
def test_value_norm_tiles_equal_the_fp64_norms(tiles, dtype, kind, batch, heads, kv_heads, n, head_dim, hidden, gather,
                                               seed):
    """Within 2e-5 of fp64; with a KV head's query heads spread over several CTAs (chooseHeadSplit), bit for bit the
    one-CTA launch's norms."""
    out = run(tiles, "norms", dtype, kind, batch, heads, kv_heads, n, head_dim, hidden, gather, seed)
    assert ", 0 failures" in out, out
    rows = int(re.search(r"norms: (\d+) rows", out).group(1))
    assert rows > 0, out
    if heads // kv_heads > 1:
        assert int(re.search(r"(\d+) rows split over CTAs", out).group(1)) > 0, out


@pytest.mark.parametrize(
    "dtype, batch, heads, kv_heads, n, head_dim, hidden, gather, seed, values",
    [
        ("bf16", 1, 4, 2, 280, 64, 128, 0, 3, "random"),
        ("fp16", 1, 2, 1, 60, 128, 128, 1, 4, "random"),  # fp16 pieces with a power-of-two scale, gathered
        ("bf16", 1, 2, 1, 70, 64, 128, 0, 5, "cancel"),  # v W_O cancelling: the bound's absolute terms
        ("fp16", 1, 2, 1, 70, 64, 128, 1, 6, "tiny"),  # values near fp16's subnormals
        ("bf16", 1, 2, 1, 70, 32, 64, 0, 7, "sparse"),
    ],
)
def test_gram_quadratic_forms_and_l1_bounds(tiles, dtype, batch, heads, kv_heads, n, head_dim, hidden, gather, seed,
                                            values):
    """l2 norms through 3 Gram pieces within 4e-6 of fp64; the 2-piece L1 bound >= the fp64 L1 norm and >= the
    emulated tensor-core L1 norm / (1 + gamma_d) for every row."""
    out = run(tiles, "quad", dtype, batch, heads, kv_heads, n, head_dim, hidden, gather, seed, values)
    assert ", 0 failures" in out, out
    tightest = float(re.search(r"tightest bound / L1 ([0-9.]+)", out).group(1))
    assert 1.0 <= tightest < 2.0, out  # sound, and not vacuous


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return compile_harness(tmp_path_factory.mktemp("pruned_flow"), "pruned_pipeline_emulation.cpp",
                           extra=("host/select_host.cpp",))


@pytest.mark.parametrize(
    "base, batch, heads, kv_heads, n, head_dim, hidden, window, budget, kv_budget, kind, seed",
    [
        ("snapkv", 2, 6, 2, 300, 16, 48, 8, 72, 0, "random", 0),  # GQA, a padded sequence
        ("pyramidkv", 2, 4, 1, 280, 16, 48, 8, 64, 48, "random", 3),  # r_l from the table at a runtime budget, raw P
        ("adakv", 3, 4, 2, 200, 16, 48, 8, 100, 96, "random", 7),  # shares; the third sequence kept whole
        ("snapkv", 2, 4, 2, 260, 16, 48, 8, 64, 0, "ties", 0),  # exact-score ties: the lower index wins
        ("snapkv", 2, 4, 2, 300, 16, 48, 8, 40, 0, "mixed", 0),  # the best bounds are the wrong tokens: rounds
        ("snapkv", 1, 2, 1, 4800, 16, 48, 32, 512, 0, "mixed", 0),  # rows of 4,768 tokens: multi-CTA top-k calls
        ("adakv", 2, 4, 2, 4800, 16, 48, 32, 300, 0, "random", 5),  # shares on multi-CTA rows
        # Llama-3-8B's d_h and hidden: the 3-deep ring of W_O tiles, gramQuad at d_h 128, G_h on the tensor cores
        ("snapkv", 1, 4, 2, 300, 128, 4096, 32, 96, 0, "flat", 1),  # the tight bound settles the first round
        ("snapkv", 1, 4, 2, 300, 128, 4096, 32, 96, 0, "mixed", 0),  # doubling rounds
    ],
)
def test_pruned_flow_keeps_the_unpruned_selection(pipeline, base, batch, heads, kv_heads, n, head_dim, hidden, window,
                                                  budget, kv_budget, kind, seed):
    out = run(pipeline, base, batch, heads, kv_heads, n, head_dim, hidden, window, budget, kv_budget, kind, seed, 0)
    assert out.startswith("0 of"), out
    assert "host driver: 0 heads, 0 entries apart" in out, out
    computed, eligible = map(int, re.search(r"exact scores: (\d+) of (\d+) eligible", out).groups())
    assert 0 < computed <= eligible, out
    if kind in ("random", "mixed"):
        assert int(re.search(r"pruned rows: (\d+)", out).group(1)) > 0, out  # some heads stopped early
    if kind in ("random", "mixed", "flat") and head_dim == 128:
        assert int(re.search(r"pruned rows: (\d+)", out).group(1)) > 0, out
    if kind == "mixed":
        assert int(re.search(r"rows past the first round: (\d+)", out).group(1)) > 0, out  # doubling rounds ran
        assert int(re.search(r"rounds with candidates: (\d+)", out).group(1)) > 1, out
    if heads // kv_heads > 1:
        assert int(re.search(r"group split over CTAs: (\d+)", out).group(1)) > 0, out
    # three top-k calls (stage 1, every round's candidates as 4 levels of one call, the k kept): one launch each on
    # rows of at most 4,096 tokens, else a memset, 4 radix passes and the marks (7 calls before the levels: 42 there)
    operations, topk_operations, calls = map(int, re.search(
        r"stream operations: (\d+), of which (\d+) in (\d+) top-k calls", out).groups())
    assert calls == 3 and topk_operations == 3 * (1 if n - window <= 4096 else 6), out
    assert operations == topk_operations + 27, out  # the memset of the flags, 5 lists, 5 norms + scores, 4 counts,
    # 4 decisions, the plan and 2 relabellings


@pytest.mark.parametrize(
    "dtype, heads, head_dim, hidden, seed",
    [
        ("fp32", 2, 128, 300, 1),  # two row blocks, a ragged last chunk of hidden columns
        ("fp32", 2, 80, 130, 2),  # d_h not a multiple of 64 (padded rows), hidden not of 64
        ("bf16", 2, 128, 1024, 3),
        ("fp16", 3, 64, 200, 4),
        ("bf16", 2, 48, 64, 5),  # d_h 48: padded rows on the tensor path too
        ("fp16", 1, 256, 100, 6),  # d_h 256: the fp32 path only
    ],
)
def test_pruned_bound_terms(tiles, dtype, heads, head_dim, hidden, seed):
    """kernels/bound_terms.cuh: the fp32 path's G_h, s_h, c_h bit for bit the host driver's (gramEntry, rowL1Entry,
    columnL1: what makes launchL1Bounds bitwise the host driver's); the tensor path's G_h within (34 + hidden / 16 + 2) u
    of sum_c |W_kc W_lc| of fp64, s_h and c_h within gamma_hidden."""
    out = run(tiles, "terms", dtype, heads, head_dim, hidden, seed)
    assert ", 0 failures" in out and "fp32 path 0 entries apart" in out, out
    if dtype != "fp32" and head_dim % 16 == 0 and head_dim <= 128:
        assert float(re.search(r"tensor-path G error ([0-9.]+) u", out).group(1)) > 0.0, out  # it ran


MMA_KERNELS = ("valueNormsMmaKernel", "gramQuadKernel", "boundTermsTensorKernel")
CP_ASYNC_KERNELS = ("valueNormsMmaKernel", "gramQuadKernel")  # boundTermsTensorKernel prefetches into registers


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_tensor_core_kernels_compile_to_mma(tmp_path, arch):
    """The value-norm and Gram kernels' PTX issues mma.sync m16n8k16 (bf16 and f16), ldmatrix and cp.async; with
    cuobjdump at hand, the SASS holds HMMA, LDSM and LDGSTS."""
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(nvcc).exists():
        pytest.skip("nvcc not found")
    ptx = tmp_path / "value_norms.ptx"
    common = ["-std=c++17", f"-arch={arch}", "-O3", f"-I{PLUGINS / 'include'}", f"-I{PLUGINS / 'kernels'}"]
    result = subprocess.run([nvcc, *common, "-ptx", str(PLUGINS / "kernels" / "value_norms.cu"), "-o", str(ptx)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    seen = set()
    for entry in re.split(r"(?=\.visible \.entry |\.weak \.entry |\.entry )", ptx.read_text()):
        name = re.match(r"\.(?:visible |weak )?\.?entry\s+(\S+)\(", entry)
        kernel = next((k for k in MMA_KERNELS if name and k in name.group(1)), None)
        if kernel is None:
            continue
        seen.add(kernel)
        assert "mma.sync.aligned.m16n8k16.row.col.f32" in entry, name.group(1)
        assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in entry, name.group(1)
        if kernel in CP_ASYNC_KERNELS:
            assert "cp.async.cg.shared.global" in entry and "cp.async.wait_group" in entry, name.group(1)
    assert seen == set(MMA_KERNELS), seen
    for dtype in ("bf16", "f16"):
        assert f"mma.sync.aligned.m16n8k16.row.col.f32.{dtype}.{dtype}.f32" in ptx.read_text(), dtype
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump is not None:
        cubin = tmp_path / "value_norms.cubin"
        subprocess.run([nvcc, *common, "-cubin", str(PLUGINS / "kernels" / "value_norms.cu"), "-o", str(cubin)],
                       check=True, capture_output=True)
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
        assert "HMMA.16816.F32" in sass and "LDSM" in sass and "LDGSTS" in sass
