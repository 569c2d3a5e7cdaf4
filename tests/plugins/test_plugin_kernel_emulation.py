"""defensivekv's row kernels (kernels/window_scores.cu, the "defensive rows" section) run on the CPU under a thread
emulation (plugins/testing/defensive_rows_emulation.cpp: one std::thread per CUDA thread, __syncthreads() a barrier)
and agree with the host driver's whole-row form of the same functions. No GPU is needed: this checks the kernels'
tiling, halo chunks, reductions and indexing where nothing CUDA can run."""

import shutil
import subprocess

import pytest

from ckv_native import ROOT

SOURCE = ROOT / "plugins" / "kernels" / "window_scores.cu"
HARNESS = ROOT / "plugins" / "testing" / "defensive_rows_emulation.cpp"


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ not found")
    text = SOURCE.read_text()
    begin, end = text.index("// BEGIN defensive rows"), text.index("// END defensive rows")
    folder = tmp_path_factory.mktemp("emulation")
    (folder / "defensive_rows_section.inc").write_text(text[begin:end])
    binary = folder / "defensive_rows_emulation"
    subprocess.run([compiler, "-std=c++20", "-O1", "-ffp-contract=off", "-Wall", "-Werror", f"-I{ROOT / 'plugins' / 'include'}",
                    f"-I{folder}", str(HARNESS), "-o", str(binary), "-lpthread"], check=True, capture_output=True, text=True)
    return binary


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
