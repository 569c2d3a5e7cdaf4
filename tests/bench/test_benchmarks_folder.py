"""benchmarks/: the laboratory's benchmarks beside the package, each run as ``python -m benchmarks.NAME`` from the
repository root, its ``--help`` explaining it; none of them is a ``criticalkv bench`` subcommand any more."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NAMES = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__")


def test_the_folder_holds_the_laboratory():
    assert {"latency", "selection", "ops", "profile", "steps", "chunks", "interference", "cached", "replicas",
            "targets", "served_needles", "norm_flops", "gpu_check"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_every_benchmark_explains_itself(name, capsys):
    module = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    prog = "scripts/gpu_check.sh" if name == "gpu_check" else f"python -m benchmarks.{name}"
    assert out.startswith(f"usage: {prog}") and len(out.splitlines()) > 5


def test_criticalkv_bench_keeps_only_the_products_benchmarks(capsys):
    from criticalkv.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    for kept in ("serve", "docqa", "memory", "single", "peers", "aiperf", "vllm", "gpu", "gpu-serve", "report"):
        assert f"    {kept} " in out or f"    {kept}\n" in out, kept
    for moved in ("latency", "selection", "ops", "profile", "steps", "interference", "cached-context", "replicas",
                  "targets", "norm-flops"):
        assert f"    {moved} " not in out and f"    {moved}\n" not in out, moved


def test_a_benchmark_runs_from_the_repository_root_and_errors_in_one_line(tmp_path):
    run = subprocess.run([sys.executable, "-m", "benchmarks.targets", str(tmp_path / "none")], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert run.stderr.strip() == f"python -m benchmarks.targets: error: {tmp_path / 'none'}: no such folder"
