"""The GPU check's plumbing on the CPU: `criticalkv bench gpu --dry-run`, the targets and floors it judges by, and the
driver behind scripts/gpu_check.sh (steps, per-test limits, failures reported as they happen, the summary)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check
from criticalkv.bench import gpu
from criticalkv.policy import KVPolicy

ROOT = Path(__file__).resolve().parents[2]


def test_bench_gpu_dry_run_measures_every_section(tmp_path, capsys):
    out = tmp_path / "bench"
    code = gpu.main(["--dry-run", "--policies", "snapkv,criticalkv:value_norm=l2", "--lengths", "96",
                     "--batch-lengths", "32,64", "--repeats", "1", "--no-kvpress", "--out", str(out)])
    assert code == 0
    results = json.loads((out / "selection_gpu.json").read_text())
    assert results["dry_run"] and results["status"] == "complete" and not results["targets_apply"]
    assert results["floors"]["gemm_tflops"] > 0 and results["floors"]["copy_gbps"] > 0
    prefill = results["prefill"]["96"]["ms"]
    rows = {(r["policy"], r["n"]): r for r in results["selection"]}
    assert set(rows) == {("snapkv", 96), ("criticalkv:value_norm=l2", 96)}
    for row in rows.values():
        assert row["path"] == "reference (CPU)" and row["ms"] > 0 and row["met"] is None
        assert row["judged_by"] == "events" and row["share_percent"] == pytest.approx(100 * row["ms"] / prefill)
        assert row["kernels"] and all(k["ms"] > 0 and k["calls"] >= 1 for k in row["kernels"])  # CPU ops here
    batch = {r["policy"]: r for r in results["batch"]}
    assert set(batch) == {"snapkv", "criticalkv:value_norm=l2"}
    for row in batch.values():
        assert set(row["rows_ms"]) == {"32", "64"}
        assert row["judged_by"] == "events"
        assert row["ratio"] == pytest.approx(row["batch_ms"] / sum(row["rows_ms"].values()))
    assert results["kvpress"]["skipped"] == "--no-kvpress"
    md = (out / "selection_gpu.md").read_text()
    for heading in ("## Floors", "## Selection vs prefill", "## Batch of mixed lengths", "## kvpress presses"):
        assert heading in md
    assert "| criticalkv:value_norm=l2 | 96 | trained | reference (CPU) |" in md
    assert results["data"]["kind"] == "synthetic" and all(r["data"] == "trained" for r in rows.values())
    assert all(r["pruning"] is None for r in rows.values())  # neither prunes: no worst-case rows either
    assert "dry run" in capsys.readouterr().out


def test_bench_gpu_reports_the_pruning_beside_each_time_and_keeps_a_worst_case_row(tmp_path):
    """criticalkv (l1) prunes: at the first length its row on the trained-structure layer and its worst-case row on
    the random layer, each with the exact norms its pruned stage 2 computed and its rounds; only the trained row is
    judged."""
    out = tmp_path / "bench"
    assert gpu.main(["--dry-run", "--policies", "criticalkv,snapkv", "--lengths", "256,128", "--batch-lengths", "none",
                     "--repeats", "1", "--no-kvpress", "--no-profile", "--out", str(out)]) == 0
    results = json.loads((out / "selection_gpu.json").read_text())
    rows = {(r["policy"], r["n"], r["data"]): r for r in results["selection"]}
    assert set(rows) == {("criticalkv", 256, "trained"), ("snapkv", 256, "trained"), ("criticalkv", 256, "random"),
                         ("criticalkv", 128, "trained"), ("snapkv", 128, "trained")}
    for (policy, n, data), row in rows.items():
        if policy == "snapkv":
            assert row["pruning"] is None
            continue
        pruning = row["pruning"]
        assert 0 < pruning["exact_norms_percent"] <= 100 and pruning["rounds"] >= 1
    assert rows[("criticalkv", 256, "random")]["target"] == "worst case: no verdict"
    md = (out / "selection_gpu.md").read_text()
    assert "| criticalkv | 256 | random | reference (CPU) |" in md and "drawn from" in md


def test_bench_gpu_takes_a_checkpoints_layer_on_a_real_text(tmp_path):
    """--model: the checkpoint's middle layer's own queries, keys and values (the model run up to it on the text), its
    shape instead of Llama-3.1-8B's."""
    from export.tiny_engine import save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint(tmp_path / "tiny", seed=2)
    out = tmp_path / "bench"
    assert gpu.main(["--dry-run", "--model", str(checkpoint), "--prompt-file", str(ROOT / "examples" / "needle_2k.txt"),
                     "--policies", "criticalkv", "--lengths", "96", "--batch-lengths", "none", "--repeats", "1",
                     "--no-kvpress", "--no-profile", "--out", str(out)]) == 0
    results = json.loads((out / "selection_gpu.json").read_text())
    assert results["data"] == {"kind": "checkpoint", "model": str(checkpoint), "layer": 1,
                               "text": str(ROOT / "examples" / "needle_2k.txt")}
    assert results["shape_used"]["hidden"] == 96 and results["shape_used"]["num_layers"] == 3
    assert {(r["data"], r["n"]) for r in results["selection"]} == {("trained", 96), ("random", 96)}
    assert not results["errors"]
    with pytest.raises(SystemExit):
        gpu.main(["--dry-run", "--model", str(tmp_path), "--out", str(out)])  # no config.json there


def test_bench_gpu_refuses_bad_input(capsys):
    for args, message in ((["--lengths", "4", "--dry-run"], "must be >= the window"),
                          (["--policies", "nope", "--dry-run"], "unknown KV policy 'nope'"),
                          (["--repeats", "0"], "--repeats must be >= 1")):
        with pytest.raises(SystemExit) as exit_:
            gpu.main(args)
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_issue_targets_and_the_floor_of_each_stage():
    l1, l2 = KVPolicy("criticalkv", budget=2048), KVPolicy("criticalkv", budget=2048, value_norm="l2")
    assert gpu.target_for(l1) == gpu.Target(0.8, 1.8, 2.0) and gpu.target_for(l2).ms_32k == 0.5
    assert gpu.target_for(KVPolicy("full", budget=2048)) is None
    snap = KVPolicy("snapkv", budget=2048)
    assert gpu.judge(snap, 32768, 0.2, 0.5, True) == ("<= 0.25 ms (0.6 %)", True)
    assert gpu.judge(snap, 32768, 0.3, 0.5, True)[1] is False
    assert gpu.judge(snap, 131072, 9.0, 0.9, True) == ("<= 1.0 %", True)
    assert gpu.judge(snap, 8192, 9.0, 50.0, True) == ("-", None)
    assert gpu.judge(snap, 32768, 0.2, 0.5, False) == ("<= 0.25 ms (0.6 %)", None)  # another shape: no verdict
    # the goals' figures for the Llama-3.1-8B layer at 32k: window scores 8.6 GFLOP, l1 norms 1.1 TFLOP, ~170 MB
    work = gpu.stage_work(gpu.LLAMA31_8B, 32768, 32, 2)
    assert work["window scores"]["flop"] == pytest.approx(8.6e9, rel=0.01)
    assert work["l1 value norms"]["flop"] == pytest.approx(1.1e12, rel=0.03)
    assert work["l2 norms (Gram)"]["flop"] == pytest.approx(34e9, rel=0.02)
    assert work["layer inputs once"]["bytes"] == pytest.approx(170e6, rel=0.02)
    assert [gpu.stage_of(k) for k in ("windowAttentionKernel", "gramNormsKernel", "valueNormsWmmaKernel",
                                      "selectSharedKernel")] == ["window scores", "l2 norms (Gram)", "l1 value norms",
                                                                 None]
    # 1.1 TFLOP in 2.2 ms at a 1000 TFLOP/s, 3000 GB/s floor: 500 TFLOP/s, half the floor's speed
    judged = gpu.against_floors(2.2, 1.1e12, 1e8, {"gemm_tflops": 1000.0, "copy_gbps": 3000.0})
    assert judged["tflops"] == pytest.approx(500) and judged["of_floor"] == pytest.approx(0.5)


def test_live_outcomes_count_failures_and_tests_never_reached(tmp_path):
    path = tmp_path / "live.jsonl"
    passed = {"event": "outcome", "when": "call", "outcome": "passed", "message": ""}
    records = [{"event": "collected", "nodeids": ["t::a", "t::b", "t::c", "t::d"]},
               {**passed, "nodeid": "t::a", "duration": 0.1}, {**passed, "nodeid": "t::b", "duration": 2.0},
               {"event": "outcome", "nodeid": "t::b", "when": "teardown", "outcome": "failed", "duration": 0.0,
                "message": "E boom"},
               {"event": "outcome", "nodeid": "t::c", "when": "setup", "outcome": "skipped", "duration": 0.0,
                "message": "needs a GPU"}]
    path.write_text("\n".join(map(json.dumps, records)) + "\n{torn line")
    live = gpu_check.summarize_live(path)
    assert live["collected"] == 4 and live["counts"] == {"passed": 1, "error": 1, "skipped": 1}
    assert live["not_reached"] == ["t::d"] and [f["nodeid"] for f in live["failures"]] == ["t::b"]
    assert "pytest did not start" in gpu_check.summarize_live(tmp_path / "absent.jsonl")["problem"]


def test_driver_arguments():
    assert gpu_check.parse_budgets(["pytest=200"])["pytest"] == 200.0
    assert sum(gpu_check.DEFAULT_BUDGETS.values()) <= gpu_check.DEFAULT_TOTAL <= 360  # one call of at most 6 minutes
    for bad in (["pytest"], ["nope=3"], ["bench=x"], ["bench=0"]):
        with pytest.raises(ValueError):
            gpu_check.parse_budgets(bad)
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--steps", "build,bogus"])
    args = gpu_check.parse_args(["--steps", "pytest", "--out", "x"])
    assert args.steps == ["pytest"] and args.steps_given


def test_the_check_runs_cheap_decisive_tests_first_and_builds_without_werror(tmp_path):
    """The GPU test files every step would run, in PYTEST_ORDER (the op, then the kernel matrix, the torch backend, the
    TensorRT tests, the served path last), every one of them existing; the build and the tests get CKV_WERROR=OFF
    (a new compiler's warning must not stop the one run a GPU machine gives)."""
    check = gpu_check.Check(gpu_check.parse_args(["--dry-run", "--out", str(tmp_path / "out")]))
    try:
        files = check.pytest_files()
        assert all((ROOT / f).is_file() for f in gpu_check.PYTEST_ORDER)
        named = [f for f in files if f in gpu_check.PYTEST_ORDER]
        assert named == [f for f in gpu_check.PYTEST_ORDER if f in files] and files[:len(named)] == named
        assert files[0] == "tests/selection/test_select_op.py" and "tests/plugins/test_plugin_gpu.py" in files
        # the kernel matrix before the torch backend, the served path last (a step of its own runs it at full size)
        order = {f: i for i, f in enumerate(files)}
        assert order["tests/plugins/test_plugin_gpu.py"] < order["tests/runtime/test_torch_backend.py"]
        assert max(order, key=order.get) == "tests/bench/test_gpu_serve.py"
        assert check.args.test_timeout == gpu_check.TEST_TIMEOUT_S == 30  # no single test over 30 s
        for step, test in gpu_check.RUN_BY_STEP.items():  # what a step runs itself exists as a GPU test
            path, name = test.split("::")
            assert step in gpu_check.STEPS and f"def {name}(" in (ROOT / path).read_text()
        assert check.env("build", 60)["CKV_WERROR"] == "OFF" == check.env("pytest", 60, tests=True)["CKV_WERROR"]
    finally:
        check.log.file.close()


def test_the_sanitizer_runs_the_decisive_shapes_first():
    listed = "usage: ckv_sanitizer_driver [--list] [SHAPE ...] (no SHAPE: all)\nshapes: small d128 longrow model extra\n"
    assert gpu_check.sanitizer_shapes(listed) == ["d128", "longrow", "model", "small", "extra"]
    assert gpu_check.sanitizer_shapes("") == [""]  # an older driver: one run of every shape


def test_gpu_check_reports_failures_as_they_happen_and_summarizes(tmp_path):
    """The whole driver on the CPU (prepare + the pytest step) on three planted tests: a pass, a failure, and (with
    pytest-timeout) a test past its per-test limit. The failure is printed before pytest's own end-of-run summary."""
    timeout = importlib.util.find_spec("pytest_timeout") is not None
    tests = tmp_path / "test_planted.py"
    tests.write_text("import time\n\ndef test_pass():\n    pass\n\ndef test_fail():\n    assert 1 + 1 == 3\n"
                     + ("\ndef test_hang():\n    time.sleep(60)\n" if timeout else ""))
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--steps", "pytest",
                          "--marker", "", "--pytest-paths", str(tests), "--test-timeout", "3", "--wheels", "",
                          "--out", str(out), f"--pytest-args=--rootdir={tmp_path}"],
                         capture_output=True, text=True, timeout=240, env={**__import__("os").environ,
                                                                           "PYTHON": sys.executable})
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]  # a step failed
    summary = (out / "summary.md").read_text()
    data = json.loads((out / "gpu_check.json").read_text())
    steps = {s["name"]: s for s in data["steps"]}
    assert set(steps) == {"prepare", "pytest"} and steps["pytest"]["status"] == "failed"
    failed = {f["nodeid"].split("::")[-1] for f in steps["pytest"]["details"]["failures"]}
    assert failed == ({"test_fail", "test_hang"} if timeout else {"test_fail"})
    assert steps["pytest"]["details"]["counts"] == {"passed": 1, "failed": len(failed)}
    assert "## Failed tests" in summary and "test_fail" in summary and "assert (1 + 1) == 3" in summary
    log = (out / "gpu_check.log").read_text()
    live = log.index("FAILED test_planted.py::test_fail")
    assert live < log.index("short test summary info")
    if not timeout:
        assert "pytest-timeout absent" in summary
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.log", "summary.md"]


def test_gpu_check_script_help():
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--help"], capture_output=True, text=True,
                         timeout=60, env={**__import__("os").environ, "PYTHON": sys.executable})
    assert run.returncode == 0 and "build/trt-headers" in run.stdout and "--commit" in run.stdout
    bad = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--steps", "nope"], capture_output=True,
                         text=True, timeout=60, env={**__import__("os").environ, "PYTHON": sys.executable})
    assert bad.returncode == 2 and "--steps: nope" in bad.stderr


def test_bench_gpu_lists_what_the_time_budget_left_out(tmp_path):
    out = tmp_path / "bench"
    assert gpu.main(["--dry-run", "--policies", "snapkv", "--lengths", "64", "--batch-lengths", "32,64",
                     "--time-budget", "0.001", "--no-kvpress", "--out", str(out)]) == 0
    results = json.loads((out / "selection_gpu.json").read_text())
    assert results["status"] == "partial" and results["selection"] == [] and results["batch"] == []
    assert [x["what"] for x in results["not_measured"]] == ["n=64", "batch"]
    assert all(x["reason"].startswith("time budget") for x in results["not_measured"])
    assert "## Not measured" in (out / "selection_gpu.md").read_text()


def test_a_lost_cuda_context_stops_the_run(tmp_path):
    import types

    import torch

    args = types.SimpleNamespace(time_budget=None, out=str(tmp_path), name="x")
    results = {"errors": [], "not_measured": [], "selection": [], "batch": [], "kvpress": {}, "prefill": {},
               "settings": {"dtype": "float32", "window": 8, "budget": 64, "repeats": 1}, "shape_used": {},
               "policy_order": [], "command": "x"}
    run = gpu.Run(args, torch, torch.device("cpu"), gpu.DRY_SHAPE, results)
    run.cuda = True  # as on a GPU
    run.error("snapkv n=8", RuntimeError("out of memory"))
    assert run.broken is None and run.refusal(0.0) is None  # an allocation failure leaves the context usable
    run.error("criticalkv n=8", RuntimeError("criticalkv::select_layer: an illegal memory access was encountered"))
    assert "CUDA context was lost" in run.refusal(0.0) and "criticalkv n=8" in run.refusal(0.0)


@pytest.mark.skipif(importlib.util.find_spec("kvpress") is None,
                    reason="kvpress is not installed (pip install --no-deps --target DIR kvpress==0.5.5)")
def test_bench_gpu_times_kvpress_presses_on_the_same_tensors(tmp_path):
    out = tmp_path / "bench"
    assert gpu.main(["--dry-run", "--policies", "snapkv", "--lengths", "128", "--batch-lengths", "none",
                     "--repeats", "1", "--no-profile", "--budget", "40", "--out", str(out)]) == 0
    results = json.loads((out / "selection_gpu.json").read_text())
    rows = {r["press"]: r for r in results["kvpress"]["rows"]}
    assert set(rows) == {"SnapKVPress", "CriticalKVPress(SnapKV)", "AdaKVPress(SnapKV)"}
    assert rows["SnapKVPress"]["kept_per_head"] == rows["CriticalKVPress(SnapKV)"]["kept_per_head"] == 40
    assert rows["AdaKVPress(SnapKV)"]["kept_per_head"] == 128  # masks, frees nothing
    assert all(r["ms"] > 0 for r in rows.values())
