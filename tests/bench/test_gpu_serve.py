"""``criticalkv bench gpu-serve``: its CPU dry run end to end (the plumbing: engines under one KV memory, the
scheduler's served levels about a cached document, the decode step against its floor, the report), and on a GPU a
short real run."""

import argparse
import json

import pytest
import torch

from criticalkv.bench import gpu_serve
from criticalkv.commands.bench import register


def parse(argv):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["bench", "gpu-serve", *argv])


def test_the_dry_run_serves_every_level_under_one_kv_memory(tmp_path):
    torch.set_num_threads(1)
    args = parse(["--dry-run", "--out", str(tmp_path / "serving"), "--policies", "full,criticalkv:value_norm=l2"])
    assert args.func(args) == 0
    results = json.loads((tmp_path / "serving.json").read_text())
    workload = results["workload"]
    assert workload["prompt_lengths"] == [96, 160] and workload["device"] == "cpu"
    budget = workload["kv_memory_gib"] * 2**30
    for run in results["runs"]:
        assert 1 <= run["rows"] <= max(workload["concurrency"]) and run["rows"] * run["row_bytes"] <= budget
        assert run["cold"]["ttft_s"] > 0 and run["cold"]["selection_s"] is not None
        assert [s["concurrency"] for s in run["served"]] == [4, 1, 2]  # the target's level first
        for served in run["served"]:
            assert served["finished"] == served["requests"] == served["completed"] == served["concurrency"]
            assert served["output_tokens"]["min"] == served["output_tokens"]["max"] == workload["new_tokens"]
            assert served["context_cache_hits"] == served["concurrency"]  # the document was compressed once
            assert served["output_throughput"] > 0 and served["tpot_ms"]["p50"] > 0
        assert run["context_cache"]["misses"] == 0 and run["context_cache"]["entries"] == 1
        step = run["step"]
        assert step["batch"] == min(4, run["rows"]) and step["floor_s"] > 0 and step["kept_kv_bytes"] > 0
        assert step["read_kv_bytes"] >= step["kept_kv_bytes"]
    rows = {(r["prompt_tokens"], r["name"]): r["rows"] for r in results["runs"]}
    assert rows[(160, "full")] < rows[(160, "criticalkv")]  # the same KV memory holds more compressed rows
    targets = results["targets"]
    assert len(targets) == 5 and all(t["met"] is None for t in targets)  # a dry run measures nothing
    assert targets[0]["value"] > 0 and targets[1]["value"] > 0 and targets[2]["value"] > 0
    for press in results["kvpress"]:  # kvpress runs when importable (not in the project's environment)
        assert "not importable" in press.get("skipped", "") or press["ttft_s"] > 0
    text = (tmp_path / "serving.md").read_text()
    assert "## Targets" in text and "## Decode step vs its memory floor" in text and "CPU dry run" in text


def test_a_bad_policy_fails_before_any_model_is_made(tmp_path):
    args = parse(["--dry-run", "--out", str(tmp_path / "serving"), "--policies", "full,nosuch"])
    with pytest.raises(ValueError, match="unknown KV policy 'nosuch'"):
        args.func(args)
    assert not (tmp_path / "serving.json").exists()


def test_the_time_limit_comes_from_the_check_and_a_sigterm_still_writes_the_results(tmp_path, monkeypatch):
    """--time-limit-s defaults to $CRITICALKV_TIME_BUDGET_S (the GPU check's step limit less 15 s); the check stops a
    step with SIGTERM, which unwinds like Ctrl-C, so what was measured is written."""
    import os
    import signal
    import subprocess
    import sys
    import time

    monkeypatch.setenv(gpu_serve.TIME_BUDGET_ENV, "12.5")
    assert gpu_serve.time_limit(None) == 12.5 and gpu_serve.time_limit(3.0) == 3.0
    monkeypatch.delenv(gpu_serve.TIME_BUDGET_ENV)
    assert gpu_serve.time_limit(None) == gpu_serve.Workload().time_limit_s
    out = tmp_path / "serving"
    command = [sys.executable, "-m", "criticalkv.cli", "bench", "gpu-serve", "--dry-run", "--out", str(out)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, gpu_serve.TIME_BUDGET_ENV: "600"})
    for line in proc.stdout:  # the model is made: the run is under way
        if "making the model" in line:
            break
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    results = json.loads(out.with_suffix(".json").read_text())
    assert results["workload"]["time_limit_s"] == 600.0 and "SystemExit" in results["error"]


@pytest.mark.gpu
def test_a_short_gpu_run_measures_every_step(tmp_path):
    """The 8B-shaped model on the GPU at short prompts, ``full`` and criticalkv: every step runs (CUDA graphs, events,
    the floor), in at most 25 s (the GPU check gives a test 30 s; its serve step runs this command at full size)."""
    args = parse(["--out", str(tmp_path / "serving"), "--prompt-lengths", "2048", "--concurrency", "1,4",
                  "--new-tokens", "16", "--budget", "256", "--kv-memory-gib", "8", "--policies", "full,criticalkv",
                  "--time-limit-s", "25"])
    assert args.func(args) == 0
    results = json.loads((tmp_path / "serving.json").read_text())
    assert results["gpu"]["name"] and not results["skipped"]
    for run in results["runs"]:
        assert "error" not in run, run.get("error")
        assert all(s["finished"] == s["concurrency"] for s in run["served"])
        assert run["step"]["timed_by"].startswith("cuda events") and run["step"]["floor_ratio"] > 0
    assert all(t["value"] is not None for t in results["targets"][:3])
