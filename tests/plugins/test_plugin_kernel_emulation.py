"""defensivekv's device code run on the CPU under a thread emulation (one std::thread per CUDA thread, __syncthreads()
a barrier, shared-memory atomics std::atomic_ref): the row kernels (kernels/window_scores.cu, "defensive rows") agree
with the host driver's whole-row form (the stage-1 mass count and the batched top-k are tested from their headers in
test_plugin_topk_emulation.py). No GPU is needed: this checks the kernels' tiling, halo
chunks, reductions, barriers and indexing where nothing CUDA can run. The pruned stage-2 block executor
(kernels/selection.cu, "pruned row") runs prunedStage2 (pruned_stage2.h) to the host
driver's flags, count of exact scores and the unpruned kept set. The CUDA pipeline's pruned stage 2 (kernels/value_norms.cu
"l1 bounds": the bound-terms and bound kernels' per-thread bodies; kernels/selection.cu "pruned pipeline": a KV head's
two stages in three launches) keeps the host driver's indices on whole layers, and its kernels' PTX holds no fused
multiply-add (which would change the device's floats)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ckv_native import ROOT

PLUGINS = ROOT / "plugins"


def copy_section(folder, source: str, section: str, include: str):
    text = (PLUGINS / "kernels" / source).read_text()
    begin, end = text.index(f"// BEGIN {section}"), text.index(f"// END {section}")
    (folder / include).write_text(text[begin:end])


def build_emulator(folder, source: str, section: str, include: str, harness: str, extra=(), sections=()):
    """Copy the marked section of a kernel source (and the `sections`, (source, section, include) triples) next to
    the harness and compile both with g++ (with `extra` sources of plugins/, e.g. the host driver)."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ not found")
    for triple in ((source, section, include), *sections):
        copy_section(folder, *triple)
    binary = folder / harness.removesuffix(".cpp")
    result = subprocess.run([compiler, "-std=c++20", "-O1", "-ffp-contract=off", "-Wall", "-Wextra", "-Werror",
                             f"-I{PLUGINS / 'include'}", f"-I{PLUGINS / 'host'}", f"-I{folder}",
                             str(PLUGINS / "testing" / harness), *(str(PLUGINS / x) for x in extra), "-o",
                             str(binary), "-lpthread"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    return binary


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return build_emulator(tmp_path_factory.mktemp("rows"), "window_scores.cu", "defensive rows",
                          "defensive_rows_section.inc", "defensive_rows_emulation.cpp")


@pytest.mark.parametrize(
    "pool, batch, heads, kv_heads, n, head_dim, window, seed",
    [
        (7, 2, 4, 2, 300, 16, 24, 0),  # default pool, GQA, a padded sequence, query chunks 16 + 8
        (5, 1, 3, 3, 200, 8, 8, 1),  # the reference's pool, MHA
        (1, 2, 2, 1, 150, 16, 32, 2),  # no pool
        (151, 1, 2, 1, 260, 16, 17, 3),  # a span over three key chunks
    ],
)
def test_defensive_row_kernels_equal_the_host_form(emulator, pool, batch, heads, kv_heads, n, head_dim, window, seed):
    result = subprocess.run([str(emulator), *map(str, (pool, batch, heads, kv_heads, n, head_dim, window, seed))],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("seed", [0, 1])
def test_pruned_row_block_executor_equals_the_host_driver(tmp_path, seed):
    binary = build_emulator(tmp_path, "selection.cu", "pruned row", "pruned_row_section.inc",
                            "pruned_row_emulation.cpp", extra=("host/select_host.cpp",))
    result = subprocess.run([str(binary), str(seed), "60"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 of 60 trials differ" in result.stdout, result.stdout


@pytest.fixture(scope="module")
def pipeline_emulator(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pruned_pipeline")
    return build_emulator(folder, "selection.cu", "pruned pipeline", "pruned_pipeline_section.inc",
                          "pruned_pipeline_emulation.cpp", extra=("host/select_host.cpp",),
                          sections=(("selection.cu", "pruned row", "pruned_row_section.inc"),
                                    ("value_norms.cu", "l1 bounds", "l1_bounds_section.inc")))


@pytest.mark.parametrize(
    "base, batch, heads, kv_heads, n, head_dim, hidden, window, budget, kv_budget, kind, seed",
    [
        ("snapkv", 2, 6, 2, 300, 16, 48, 8, 72, 0, "random", 0),  # GQA, a padded sequence
        ("snapkv", 1, 3, 3, 260, 8, 40, 16, 40, 0, "random", 1),  # MHA, alpha 0.5
        ("snapkv", 2, 4, 2, 240, 16, 64, 8, 96, 40, "random", 2),  # a runtime budget below the built one, kvpress reduce
        ("pyramidkv", 2, 4, 1, 280, 16, 48, 8, 64, 48, "random", 3),  # r_l from the table at a runtime budget, raw P
        ("adakv", 2, 6, 2, 300, 16, 48, 8, 64, 0, "random", 4),  # each head's share of the shared allocation
        ("adakv", 3, 4, 2, 200, 16, 48, 8, 100, 96, "random", 7),  # the third sequence (94 tokens <= b = 96) kept whole
        ("snapkv", 2, 4, 2, 260, 16, 48, 8, 64, 0, "ties", 0),  # exact-score ties: the lower index wins
        ("adakv", 1, 4, 2, 260, 16, 48, 8, 48, 0, "ties", 1),
        ("snapkv", 2, 4, 2, 260, 16, 48, 8, 64, 0, "near", 0),  # exact scores within the stop margin
        ("snapkv", 2, 4, 2, 300, 16, 48, 8, 40, 0, "mixed", 0),  # the best bounds are the wrong tokens: doubling rounds
        ("snapkv", 2, 4, 2, 300, 16, 48, 8, 72, 0, "flat", 0),  # tight bounds: the first round (launch 2) settles it
        ("adakv", 2, 4, 2, 300, 16, 48, 8, 72, 0, "flat", 1),
    ],
)
def test_pruned_pipeline_keeps_the_host_driver_indices(pipeline_emulator, base, batch, heads, kv_heads, n, head_dim,
                                                       hidden, window, budget, kv_budget, kind, seed):
    args = (base, batch, heads, kv_heads, n, head_dim, hidden, window, budget, kv_budget, kind, seed)
    result = subprocess.run([str(pipeline_emulator), *map(str, args)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f" of {batch * kv_heads} heads differ" in result.stdout and result.stdout.startswith("0 of"), result.stdout
    computed, eligible = re.search(r"exact scores: (\d+) of (\d+) eligible", result.stdout).groups()
    assert 0 < int(computed) <= int(eligible), result.stdout
    pruned_rows = int(re.search(r"pruned rows: (\d+)", result.stdout).group(1))
    doubled_rows = int(re.search(r"rows past the first round: (\d+)", result.stdout).group(1))
    if kind in ("random", "mixed", "flat"):  # the pruning happened: some rows stopped before every exact score
        assert pruned_rows > 0, result.stdout
    if kind == "mixed":  # doubling rounds ran in the finishing block
        assert doubled_rows > 0, result.stdout
    if kind == "flat":  # the first candidates, scored by the grid-wide launch, sufficed
        assert doubled_rows == 0, result.stdout


PRUNED_KERNELS = {
    "value_norms.cu": ("boundTermsKernel", "columnL1Kernel", "l1BoundsKernel"),
    "selection.cu": ("groupScoresKernel", "prunedPrepareKernel", "prunedExactKernel", "prunedFinishKernel"),
}


@pytest.mark.parametrize("source", sorted(PRUNED_KERNELS))
def test_pruned_kernels_fuse_no_multiply_add(tmp_path, source):
    """The emulation runs the device code with g++ -ffp-contract=off; nvcc fuses a product into a following sum (FMA)
    unless it is rounded on its own (multiplyRounded), which would make the device's bounds and exact norms differ
    from the host driver's in the last bit. The PTX of the pruned stage 2's kernels holds no fma.rn.f32."""
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(nvcc).exists():
        pytest.skip("nvcc not found")
    ptx = tmp_path / "kernels.ptx"
    result = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-ptx", "-O3", f"-I{PLUGINS / 'include'}",
                             str(PLUGINS / "kernels" / source), "-o", str(ptx)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    entries = re.split(r"(?=\.visible \.entry |\.weak \.entry |\.entry )", ptx.read_text())
    seen = set()
    for entry in entries:
        name = re.match(r"\.(?:visible |weak )?\.?entry\s+(\S+)\(", entry)
        kernel = next((k for k in PRUNED_KERNELS[source] if name and k in name.group(1)), None)
        if kernel is None:
            continue
        seen.add(kernel)
        assert "fma.rn.f32" not in entry, f"{name.group(1)} fuses a multiply-add"
    assert seen == set(PRUNED_KERNELS[source]), seen
