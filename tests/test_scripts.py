"""The scripts and the package metadata: bad input gives one line (no traceback), --help explains every option."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def benchmark_latency():
    """benchmarks.latency (``python -m benchmarks.latency``; its main() takes argv)."""
    from benchmarks import latency

    return latency


@pytest.mark.parametrize("args, message", [
    (["--budget", "0"], "budget: must be a positive number of tokens, got 0"),
    (["--budget", "4096"], "budget 4096 >= --prompt-len 4096: nothing would be evicted"),
    (["--memory-budgets", "128,x"], "--memory-budgets: expected comma-separated integers"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--replot"], "--replot: no {out}.json to redraw from"),
])
def test_benchmark_latency_bad_inputs_give_one_line(benchmark_latency, tmp_path, capsys, args, message):
    out = tmp_path / "bench"
    assert benchmark_latency.main([*args, "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m benchmarks.latency: error: " + message.format(out=out))
    assert len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_benchmark_latency_writes_nothing_unless_told_where_and_explains_every_option(benchmark_latency, capsys):
    with pytest.raises(SystemExit) as exit_:
        benchmark_latency.main([])  # the committed results are replaced only when named
    assert exit_.value.code == 2 and "the following arguments are required: --output" in capsys.readouterr().err
    parser = benchmark_latency.build_parser()
    undocumented = [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help]
    assert undocumented == []


def test_build_plugin_help_builds_nothing(tmp_path):
    for args, code in ((["--help"], 0), (["-h"], 0), (["--bogus"], 2)):
        run = subprocess.run(["bash", str(ROOT / "scripts" / "build_plugin.sh"), *args], capture_output=True, text=True,
                             env={"PATH": "/usr/bin:/bin", "BUILD_DIR": str(tmp_path / "build"), "HOME": str(tmp_path)},
                             timeout=30)
        assert run.returncode == code, run.stderr
        assert not (tmp_path / "build").exists()
    help_run = subprocess.run(["bash", str(ROOT / "scripts" / "build_plugin.sh"), "--help"], capture_output=True,
                              text=True)
    assert help_run.stdout.startswith("Build the CriticalKV kernels") and "TRT_INCLUDE_DIR" in help_run.stdout
    assert "#" not in help_run.stdout.splitlines()[0]


def test_build_plugin_fails_naming_nvcc_when_the_kernels_are_asked_for_without_it(tmp_path):
    """CKV_CUDA_ARCHS asks for the CUDA kernels: without nvcc the script fails at once (status 2, nvcc named, nothing
    written) instead of building the host library and saying "built"; CMake's own configure refuses as well."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "BUILD_DIR": str(tmp_path / "build"),
           "CUDA_HOME": str(tmp_path / "no-cuda"), "CKV_CUDA_ARCHS": "90"}
    if shutil.which("nvcc", path=env["PATH"]):
        pytest.skip("nvcc is installed in /usr/bin here")
    run = subprocess.run(["bash", str(ROOT / "scripts" / "build_plugin.sh")], capture_output=True, text=True, env=env,
                         timeout=60)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.strip() == (
        f"build_plugin.sh: error: the CUDA kernels were asked for (CKV_CUDA_ARCHS=90) but nvcc is not on PATH nor in "
        f"{tmp_path / 'no-cuda'}/bin: install the CUDA toolkit (12.x or 13.x, docs/gpu.md) or set CUDA_HOME to it; "
        "without CKV_CUDA_ARCHS only the host library is built")
    assert not (tmp_path / "build").exists()
    configure = subprocess.run(["cmake", "-S", str(ROOT / "plugins"), "-B", str(tmp_path / "cmake"),
                                "-DCKV_REQUIRE_CUDA=ON"], capture_output=True, text=True, env=env, timeout=120)
    assert configure.returncode != 0
    assert "nvcc not found, and CKV_REQUIRE_CUDA asks for the CUDA kernels" in " ".join(configure.stderr.split())


def test_build_plugin_builds_the_rest_without_trt_headers_and_past_a_failing_torch_cmake(tmp_path):
    """No TensorRT headers (an empty header folder, no network) and a torch whose CMake config fails (find_package(Torch)
    -> cuda.cmake, stood in for by a config that stops with an error): the script says why each is skipped, configures
    again without the torch ops and builds the rest (here without nvcc: the host library), exit 0, no stale outputs."""
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "build_plugin.sh", checkout / "scripts")
    shutil.copytree(ROOT / "plugins", checkout / "plugins")
    torch_cmake = tmp_path / "torch-cmake"
    (torch_cmake / "Torch").mkdir(parents=True)
    (torch_cmake / "Torch" / "TorchConfig.cmake").write_text(
        'message(FATAL_ERROR "cuda.cmake: the CUDA toolkit differs from the one torch was built with")\n')
    python = tmp_path / "python"
    python.write_text(f"#!/bin/bash\nif [ \"$1\" = -c ] && [[ \"$2\" == *cmake_prefix_path* ]]; then\n"
                      f"  echo {torch_cmake}; echo ON; exit 0\nfi\nexec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    build = tmp_path / "build"
    build.mkdir()
    (build / "libcriticalkv_torch.so").write_bytes(b"stale")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "BUILD_DIR": str(build), "PYTHON": str(python),
           "CUDA_HOME": str(tmp_path / "no-cuda"), "TRT_HEADERS_DIR": str(tmp_path / "no-headers"),
           "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "CKV_BUILD_JOBS": "2"}
    if shutil.which("nvcc", path=env["PATH"]):
        pytest.skip("nvcc is installed in /usr/bin here (this test builds the host library only)")
    run = subprocess.run(["bash", "scripts/build_plugin.sh"], cwd=checkout, capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    lines = run.stdout.splitlines()
    assert any(line.startswith("TensorRT plugin: skipped (no TensorRT headers") for line in lines), run.stdout
    assert any(line.startswith("torch ops: skipped (torch's CMake config failed") for line in lines), run.stdout
    assert "the CUDA toolkit differs" in (build / "configure-torch.log").read_text()
    assert f"built into {build}: the host library" in lines
    assert any(line.startswith("not built: the torch ops (torch's CMake config failed") for line in lines)
    assert (build / "libcriticalkv_host.so").is_file()
    assert not (build / "libcriticalkv_torch.so").exists() and not (build / "libcriticalkv_trt_plugin.so").exists()


def test_container_serve_explains_itself_and_refuses_to_run_outside_the_container(tmp_path):
    """scripts/container_serve.sh (docs/gpu.md): --help, no engine directory (status 2), and outside NVIDIA's
    tritonserver container a one-line error before it installs or builds anything."""
    script = str(ROOT / "scripts" / "container_serve.sh")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "VENV": str(tmp_path / "venv"),
           "TRITON_DIR": str(tmp_path / "no-triton")}
    run = subprocess.run(["bash", script, "--help"], capture_output=True, text=True, env=env, timeout=30)
    assert run.returncode == 0 and run.stdout.startswith("Serve an engine with TensorRT") and "CKV_BUILD_ARGS" in run.stdout
    run = subprocess.run(["bash", script], capture_output=True, text=True, env=env, timeout=30)
    assert run.returncode == 2 and "give the engine directory" in run.stderr
    run = subprocess.run(["bash", script, str(tmp_path / "engine")], capture_output=True, text=True, env=env, timeout=30)
    assert run.returncode == 2 and f"no {tmp_path / 'no-triton'}/bin/tritonserver" in run.stderr
    assert not (tmp_path / "venv").exists()


def test_the_package_metadata_installs_without_a_license_warning():
    """project.license is an SPDX string (a TOML table makes setuptools warn three times per install)."""
    import warnings

    pytest.importorskip("setuptools", minversion="77")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert [str(w.message) for w in caught if "license" in str(w.message)] == []
    assert dist.metadata.license_expression == "Apache-2.0"


def test_norm_flops_prints_both_model_shapes_with_fewer_pruned_flops():
    import sys

    run = subprocess.run([sys.executable, "-m", "benchmarks.norm_flops", "--prompt-lens", "4096"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    rows = [line.split("|") for line in run.stdout.splitlines() if line.startswith("| SmolLM2") or line.startswith("| Llama")]
    assert len(rows) == 2
    for row in rows:
        unpruned, pruned = float(row[3]), float(row[6])
        assert 0 < pruned < unpruned / 3  # budget 256 at 4k tokens: far fewer norm FLOPs


def test_the_readme_and_docs_gpu_share_one_gpu_install():
    """The README's "On an NVIDIA GPU" commands install exactly as docs/gpu.md section 1 says (a .venv, the same pinned
    CUDA torch, install.sh, build_plugin.sh), and both name every prerequisite the build needs."""
    import re

    def blocks(text):
        return [b.splitlines() for b in re.findall(r"```bash\n(.*?)```", text, re.S)]

    readme = (ROOT / "README.md").read_text()
    gpu = (ROOT / "docs" / "gpu.md").read_text()
    section = readme[readme.index("## On an NVIDIA GPU"):]
    readme_install = [line for line in blocks(section)[0] if not line.startswith("#")][:4]
    gpu_install = [line.split("  #")[0].rstrip() for line in blocks(gpu[gpu.index("## 1. Install"):])[0]]
    assert readme_install == gpu_install[:4], (readme_install, gpu_install)
    assert readme_install[0] == "python3 -m venv .venv" and re.fullmatch(
        r"\.venv/bin/pip install torch==[\d.]+ --index-url https://download\.pytorch\.org/whl/cu\d+", readme_install[1])
    needs = section[:section.index("## What it buys")]
    assert all(p in needs for p in ("CUDA toolkit", "CMake >= 3.24", "C++ compiler")), needs
    table = gpu[gpu.index("## 1. Install"):gpu.index("## 2.")]
    assert all(p in table for p in ("| CUDA toolkit (`nvcc`) |", "| CMake | 3.24 or newer |", "| a C++17 compiler |")), table


def test_the_option_counter_counts_every_leafs_options(capsys):
    """scripts/count_cli_options.py (issue 37's measure): generate's options are its parser's, --help left out, and the
    total is the sum over the leaves it lists."""
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("count_cli_options", ROOT / "scripts" / "count_cli_options.py")
    counter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(counter)
    from criticalkv.cli import build_parser

    found = dict((" ".join(path), parser) for path, parser in counter.leaves(build_parser(), []))
    generate = found["generate"]
    own = [a for a in generate._actions if a.option_strings and not isinstance(a, argparse._HelpAction)
           and a.help != argparse.SUPPRESS]
    assert counter.options(generate) == len(own) and any("--max-tokens" in a.option_strings for a in own)
    assert "bench serve" in found and "serve" in found
    assert counter.main([]) == 0
    total = sum(counter.options(p) for p in found.values())
    assert capsys.readouterr().out.strip() == f"{len(found)} leaves, {total} options" and total > len(found)
