"""defensivekv's device code run on the CPU under a thread emulation (one std::thread per CUDA thread, __syncthreads()
a barrier, shared-memory atomics std::atomic_ref): the row kernels (kernels/window_scores.cu, "defensive rows") agree
with the host driver's whole-row form, and the block executor of the stage-1 count (kernels/selection.cu, "block mass
row") gives every thread of a 512-thread block the host's count. No GPU is needed: this checks the kernels' tiling, halo
chunks, reductions, barriers and indexing where nothing CUDA can run. The pruned stage-2 block executor
(kernels/selection.cu, "pruned row", not yet launched by the pipeline) runs prunedStage2 (pruned_stage2.h) to the host
driver's flags, count of exact scores and the unpruned kept set."""

import shutil
import subprocess

import pytest

from ckv_native import ROOT

PLUGINS = ROOT / "plugins"


def build_emulator(folder, source: str, section: str, include: str, harness: str, extra=()):
    """Copy the marked section of a kernel source next to the harness and compile both with g++ (with `extra`
    sources of plugins/, e.g. the host driver)."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ not found")
    text = (PLUGINS / "kernels" / source).read_text()
    begin, end = text.index(f"// BEGIN {section}"), text.index(f"// END {section}")
    (folder / include).write_text(text[begin:end])
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


def test_block_mass_count_equals_the_host_count_in_every_thread(tmp_path):
    binary = build_emulator(tmp_path, "selection.cu", "block mass row", "block_mass_row_section.inc",
                            "block_mass_count_emulation.cpp")
    result = subprocess.run([str(binary), "4", "48"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("seed", [0, 1])
def test_pruned_row_block_executor_equals_the_host_driver(tmp_path, seed):
    binary = build_emulator(tmp_path, "selection.cu", "pruned row", "pruned_row_section.inc",
                            "pruned_row_emulation.cpp", extra=("host/select_host.cpp",))
    result = subprocess.run([str(binary), str(seed), "60"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 of 60 trials differ" in result.stdout, result.stdout
