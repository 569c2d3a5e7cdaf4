"""Device code of the selection run on the CPU under a thread emulation (one fiber per CUDA thread, __syncthreads()
a barrier, shared-memory atomics std::atomic_ref). The stage-1 mass count and the batched top-k are tested from their
headers in test_plugin_topk_emulation.py, defensivekv's row kernels in test_window_scores_emulation.py. No GPU is
needed: this checks the kernels' tiling, halo chunks, reductions, barriers and indexing where nothing CUDA can run.
The pruned stage-2 block executor (kernels/pruned_row.cuh) runs prunedStage2 (pruned_stage2.h) to the host driver's
flags, count of exact scores and the unpruned kept set. The compaction kernel (kernels/compact.cuh) writes the host
driver's kept indices. The fp32 bounds' kernels (kernels/l1_bounds.cuh, bitwise the host driver's) and the
group-score kernel hold no fused multiply-add in their PTX. The tensor-core kernels and the GPU pruned flow are
emulated in test_tensor_core_emulation.py."""

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


def build_emulator(folder, source: str | None, section: str | None, include: str | None, harness: str, extra=(),
                   sections=()):
    """Copy the marked section of a kernel source (and the `sections`, (source, section, include) triples) next to
    the harness and compile both with g++ (with `extra` sources of plugins/, e.g. the host driver). Harnesses that
    include the kernels' headers (plugins/kernels/*.cuh) pass source None."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ not found")
    for triple in ((source, section, include), *sections):
        if triple[0] is not None:
            copy_section(folder, *triple)
    binary = folder / harness.removesuffix(".cpp")
    result = subprocess.run([compiler, "-std=c++20", "-O1", "-ffp-contract=off", "-Wall", "-Wextra", "-Werror",
                             "-Wno-unknown-pragmas", f"-I{PLUGINS / 'include'}", f"-I{PLUGINS / 'host'}",
                             f"-I{PLUGINS / 'kernels'}", f"-I{PLUGINS / 'testing'}", f"-I{folder}",
                             str(PLUGINS / "testing" / harness), *(str(PLUGINS / x) for x in extra), "-o",
                             str(binary), "-lpthread"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    return binary


@pytest.mark.parametrize("seed", [0, 1])
def test_pruned_row_block_executor_equals_the_host_driver(tmp_path, seed):
    binary = build_emulator(tmp_path, None, None, None, "pruned_row_emulation.cpp", extra=("host/select_host.cpp",))
    result = subprocess.run([str(binary), str(seed), "60"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 of 60 trials differ" in result.stdout, result.stdout
    assert "stop rule by count: 0 of 3000 cases differ" in result.stdout, result.stdout


@pytest.mark.parametrize("seed", [0, 1])
def test_compaction_kernel_equals_the_host_rule(tmp_path, seed):
    """kernels/compact.cuh (a CTA per 4,096 positions of a head: the kept positions before its tile counted from the
    flags, its own ranked by a block scan) writes the host driver's kept indices and lengths: scored, streamingllm and
    full heads, left padding with flags set inside it, runtime budgets, up to four tiles, truncation at the capacity,
    flag rows at every byte alignment."""
    binary = build_emulator(tmp_path, None, None, None, "compact_emulation.cpp")
    result = subprocess.run([str(binary), str(seed), "300"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "compaction: 0 of 300 trials differ" in result.stdout, result.stdout
    tiles = int(re.search(r"up to (\d+) tiles", result.stdout).group(1))
    truncated = int(re.search(r"(\d+) heads truncated", result.stdout).group(1))
    assert tiles >= 3 and truncated > 0, result.stdout


PRUNED_KERNELS = {
    "value_norms.cu": ("boundTermsSimtKernel", "l1BoundsKernel"),
    "selection.cu": ("groupScoresKernel",),
    # the candidates' exact C (bitwise the host driver's on the fp32 path) and the stop rule's threshold
    "pruned.cu": ("prunedScoreKernel", "prunedCountKernel", "prunedDecideKernel"),
}


@pytest.mark.parametrize("source", sorted(PRUNED_KERNELS))
def test_pruned_kernels_fuse_no_multiply_add(tmp_path, source):
    """The emulation runs the device code with g++ -ffp-contract=off; nvcc fuses a product into a following sum (FMA)
    unless it is rounded on its own (multiplyRounded), which would make the device's fp32 bounds (launchL1Bounds,
    bitwise the host driver's) and group scores differ from the host driver's in the last bit. Their PTX holds no
    fma.rn.f32."""
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(nvcc).exists():
        pytest.skip("nvcc not found")
    ptx = tmp_path / "kernels.ptx"
    result = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-ptx", "-O3", f"-I{PLUGINS / 'include'}",
                             f"-I{PLUGINS / 'kernels'}",
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
