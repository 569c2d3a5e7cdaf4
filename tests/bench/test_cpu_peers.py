"""`criticalkv bench peers`: argument checks, the table and the targets (the peers themselves are not run in CI)."""

import json
import re
import os
import sys

import pytest

from criticalkv.bench.peers import cpu as cpu_peers
from criticalkv.cli import main


def _system(prefill, decode, batch, eviction=None, agree=64):
    s = {"prefill_s": [prefill, prefill + 0.2], "decode_ms": [decode, decode + 2], "batch_tokens_per_s": [batch, batch],
         "agree_with_first_system": agree, "load_s": 1.0, "versions": None}
    if eviction is not None:
        s["batch_eviction_tokens_per_s"] = [eviction, eviction]
    for key in ("prefill_s", "decode_ms", "batch_tokens_per_s", "batch_eviction_tokens_per_s"):
        if key in s:
            s[key + "_median"] = sum(s[key]) / len(s[key])
    return s


def _results(ckv_decode=20.0):
    return {
        "command": "criticalkv bench peers ...",
        "machine": {"cpu": "test cpu", "logical_cpus": 2, "platform": "x", "load_average_start": [0.1, 0.1, 0.1],
                    "load_average_end": [0.2, 0.1, 0.1]},
        "versions": {"python": "3.11"}, "commit": "abc",
        "isl": 2025, "new_tokens": 64, "batch": 8, "repeats": 2,
        "eviction": {"start_size": 32, "recent_size": 96, "max_cache_size": 256},
        "floors_start": {"gemm": {"gflops": 180.0}, "gemv": {"gbps": 27.0, "bytes": 540_000_000}, "copy": {"gbps": 35.0}},
        "exports": {"openvino": "optimum-cli export openvino ..."},
        "systems": {
            "criticalkv full": _system(4.9, 36.5, 10.0),
            "criticalkv b=256": _system(3.5, ckv_decode, 16.0, agree=20),
            cpu_peers.LABELS["onnxruntime-genai"]: _system(9.1, 42.0, 5.4),
            cpu_peers.ov_label("bf16"): _system(3.7, 25.0, 14.9, eviction=15.2),
            cpu_peers.ov_label("f32"): _system(6.0, 50.0, 8.0, eviction=8.5),
        },
    }


def test_render_prints_every_system_with_its_medians_and_the_load():
    text = cpu_peers.render(_results())
    assert "load average [0.1, 0.1, 0.1] (start) / [0.2, 0.1, 0.1] (end)" in text
    assert "| criticalkv b=256 | 3.60 | 21.0 | 16.00 | - | 20 / 64 |" in text
    assert "| OpenVINO GenAI (fp32 export, bf16 compute) | 3.80 | 26.0 | 14.90 | 15.20 | 64 / 64 |" in text
    assert "| OpenVINO GenAI (fp32 export, f32 compute) | 6.10 | 51.0 | 8.00 | 8.50 | 64 / 64 |" in text
    assert "floor 20.0 ms/token" in text  # 540 MB at 27 GB/s
    assert "CacheEvictionConfig(start_size=32, recent_size=96, max_cache_size=256, NORM_SUM)" in text


def test_targets_compare_the_budgeted_engine_with_openvino_and_the_floor():
    """Against OpenVINO's first row (its default precision, what a user gets), not its f32 row."""
    rows = {what: (value, ok) for what, value, _, ok in cpu_peers.targets(_results(ckv_decode=20.0))}
    assert rows["prefill: criticalkv b / OpenVINO"] == (pytest.approx(3.6 / 3.8), True)
    assert rows["decode: criticalkv b / OpenVINO (full cache)"] == (pytest.approx(21.0 / 26.0), False)  # 0.81 > 0.8
    assert rows["decode: criticalkv b / weight-bandwidth floor"] == (pytest.approx(21.0 / 20.0), True)
    assert rows["batch: criticalkv b / OpenVINO with eviction (tokens/s)"] == (pytest.approx(16.0 / 15.2), True)
    assert rows["onnxruntime-genai behind criticalkv b on all three"] == (None, True)
    # the f32 row (the same arithmetic as criticalkv's fp32 engine) is judged beside it
    assert rows["prefill: criticalkv b / OpenVINO f32"] == (pytest.approx(3.6 / 6.1), True)
    assert rows["decode: criticalkv b / OpenVINO f32 (full cache)"] == (pytest.approx(21.0 / 51.0), True)
    assert rows["batch: criticalkv b / OpenVINO f32 with eviction (tokens/s)"] == (pytest.approx(16.0 / 8.5), True)
    slow = {what: ok for what, _, _, ok in cpu_peers.targets(_results(ckv_decode=45.0))}
    assert slow["decode: criticalkv b / weight-bandwidth floor"] is False
    assert slow["onnxruntime-genai behind criticalkv b on all three"] is False  # 42 ms beats 46


def test_targets_without_openvino_are_not_judged():
    results = _results()
    for precision in ("bf16", "f32"):
        del results["systems"][cpu_peers.ov_label(precision)]
    rows = {what: (value, ok) for what, value, _, ok in cpu_peers.targets(results)}
    assert rows["prefill: criticalkv b / OpenVINO"] == (None, None)
    assert "| prefill: criticalkv b / OpenVINO | - | <= 1.0 | - |" in cpu_peers.render(results)


def test_summarize_takes_medians_and_counts_the_agreeing_tokens():
    runs = {"load_s": 2.0, "versions": None,
            "single": [{"prefill_s": 1.0, "decode_s_per_token": 0.030, "tokens": [1, 2, 3, 9], "load_average": [1, 1, 1]},
                       {"prefill_s": 3.0, "decode_s_per_token": 0.020, "tokens": [1, 2, 3, 9], "load_average": [1, 1, 1]},
                       {"prefill_s": 2.0, "decode_s_per_token": 0.010, "tokens": [1, 2, 3, 9], "load_average": [1, 1, 1]}],
            "batch": [{"seconds": 4.0, "output_tokens": 16, "load_average": [2, 1, 1]}], "batch_eviction": []}
    s = cpu_peers.summarize(runs, 4, reference=[1, 2, 4, 9])
    assert s["prefill_s_median"] == 2.0 and s["decode_ms_median"] == pytest.approx(20.0)
    assert s["batch_tokens_per_s_median"] == 4.0 and "batch_eviction_tokens_per_s_median" not in s
    assert s["agree_with_first_system"] == 2  # the first difference ends the agreement
    assert len(s["load_average"]) == 4


@pytest.mark.parametrize("text, message", [
    ("32/96", "expected START/RECENT/MAX"),
    ("a/b/c", "expected START/RECENT/MAX"),
    ("32/96/128", "MAX > START + RECENT"),
    ("0/96/256", "START, RECENT >= 1"),
])
def test_bad_eviction_sizes_are_refused(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        cpu_peers.parse_eviction(text)


def test_precisions_parse():
    assert cpu_peers.parse_precisions("default+f32") == ["default", "f32"]
    for bad in ("", "bf16", "f32+fp16"):
        with pytest.raises(ValueError, match="openvino:precision="):
            cpu_peers.parse_precisions(bad)


def test_eviction_sizes_parse():
    assert cpu_peers.parse_eviction("32/96/256") == {"start_size": 32, "recent_size": 96, "max_cache_size": 256}
    assert cpu_peers.parse_peers("openvino") == ["openvino"] and cpu_peers.parse_peers("") == []


def test_a_missing_peer_environment_names_the_setup_command(tmp_path):
    (tmp_path / "openvino").mkdir()
    (tmp_path / "openvino" / ".criticalkv-ready").write_text("x")
    cpu_peers.check_ready(tmp_path, ["openvino"])
    with pytest.raises(FileNotFoundError, match="criticalkv bench setup-peers --peers onnxruntime-genai"):
        cpu_peers.check_ready(tmp_path, ["onnxruntime-genai", "openvino"])


def test_export_commands_are_the_documented_ones(tmp_path):
    og = cpu_peers.export_command(tmp_path, "onnxruntime-genai", tmp_path / "hf", tmp_path / "out")
    assert og[1:3] == ["-m", "onnxruntime_genai.models.builder"] and og[og.index("-p") + 1] == "fp32"
    ov = cpu_peers.export_command(tmp_path, "openvino", tmp_path / "hf", tmp_path / "out")
    assert ov[0].endswith("optimum-cli") and ov[ov.index("--weight-format") + 1] == "fp32"
    assert "text-generation-with-past" in ov


def test_an_existing_export_is_reused_without_running_anything(tmp_path):
    target = tmp_path / "models" / "openvino-hf"
    target.mkdir(parents=True)
    (target / ".criticalkv-exported").write_text("done\n")
    folder, command = cpu_peers.ensure_export(tmp_path, "openvino", tmp_path / "hf", log=pytest.fail)
    assert folder == target and "export" in command


def test_display_hides_the_home_directory():
    home = os.path.expanduser("~")
    assert cpu_peers._display(["x", os.path.join(home, "m"), "/opt/y"]) == "x ~/m /opt/y"


@pytest.mark.parametrize("argv, message", [
    (["bench", "peers", "--engine-dir", "{tmp}/none"], "{tmp}/none: not an engine directory"),
    (["bench", "peers", "--engine-dir", "{tmp}/e", "--peers", "sglang"], "--peers: unknown sglang"),
    (["bench", "peers", "--engine-dir", "{tmp}/e", "--repeats", "0"], "--repeats >= 1"),
    (["bench", "peers", "--engine-dir", "{tmp}/e", "--peers", "openvino:eviction=1/2"], "openvino:eviction="),
    (["bench", "peers", "--engine-dir", "{tmp}/e", "--peers", "openvino:precision=int8"], "openvino:precision="),
    (["bench", "peers", "--engine-dir", "{tmp}/e"], "setup-peers --peers onnxruntime-genai,openvino"),
])
def test_bad_arguments_give_one_line(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.setenv("CRITICALKV_PEERS_DIR", str(tmp_path / "p"))
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "manifest.json").write_text(json.dumps({}))
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message.format(tmp=tmp_path) in err


def test_help_says_what_to_install(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "peers", "--help"])
    out = capsys.readouterr().out
    assert "criticalkv bench setup-peers --peers onnxruntime-genai,openvino" in out


def test_the_peer_runner_imports_nothing_from_criticalkv():
    import ast

    tree = ast.parse(cpu_peers.RUNNER.read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(m.split(".")[0] == "criticalkv" for m in modules)


def test_the_peer_runner_answers_errors_per_request(tmp_path):
    """The worker protocol without a peer installed: an unknown --impl is refused by argparse."""
    import subprocess

    run = subprocess.run([sys.executable, str(cpu_peers.RUNNER), "--impl", "vllm", "--model", str(tmp_path)],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "invalid choice" in run.stderr


def test_cpu_peer_environments_pin_the_cpu_torch_in_the_peer_step():
    """optimum-intel and the model builder accept any torch: pip keeps the CPU build only when the same step pins it."""
    from criticalkv.bench import peers

    for name in ("onnxruntime-genai", "openvino"):
        steps = peers.peer_requirements(name)
        assert steps[0] == [peers.TORCH] and peers.TORCH in steps[1], name
    assert "onnxruntime-genai==0.18.0" in peers.peer_requirements("onnxruntime-genai")[1]
    assert {"openvino-genai==2026.4.1.0", "optimum-intel==2.2.0"} <= set(peers.peer_requirements("openvino")[1])
    assert peers.UNINSTALL_AFTER["openvino"] == ["torchvision"]
    with pytest.raises(ValueError, match="unknown peer 'sglang'"):
        peers.peer_requirements("sglang")


def test_targets_judge_criticalkvs_openvino_backend_against_openvino_genai():
    results = _results()
    results["systems"]["criticalkv b=256 on OpenVINO (bf16)"] = _system(2.5, 15.0, 20.0)
    results["systems"]["criticalkv full on OpenVINO (bf16)"] = _system(2.4, 30.0, 18.0)
    rows = {what: (value, ok) for what, value, _, ok in cpu_peers.targets(results)}
    assert rows["prefill: criticalkv b / OpenVINO"] == (pytest.approx(3.6 / 3.8), True)  # the ONNX Runtime row as before
    assert rows["prefill: criticalkv b on OpenVINO / OpenVINO"] == (pytest.approx(2.6 / 3.8), True)
    assert rows["decode: criticalkv b on OpenVINO / OpenVINO (full cache)"] == (pytest.approx(16.0 / 26.0), True)
    assert rows["batch: criticalkv b on OpenVINO / OpenVINO with eviction (tokens/s)"] == (pytest.approx(20.0 / 15.2), True)
    with pytest.raises(ValueError, match="--backends"):
        cpu_peers.parse_backends("onnxruntime,tensorrt")
    assert cpu_peers.parse_backends("onnxruntime,openvino") == ["onnxruntime", "openvino"]


def test_an_engine_runs_in_its_own_worker_process(tmp_path):
    """``criticalkv.bench.peers.engine_worker`` over a tiny engine on both CPU backends: the row's label, and the tokens of
    the engine run in this process (ONNX Runtime)."""
    pytest.importorskip("openvino")
    from criticalkv import KVPolicy
    from criticalkv.runtime import Engine
    from export.tiny_engine import export_tiny_engine
    from hf.conftest import tiny_model

    folder = export_tiny_engine(tiny_model("llama", seed=4), KVPolicy("criticalkv", budget=40, window=8),
                                tmp_path / "tiny")
    ids = list(range(5, 125))
    engine = Engine.load(folder)
    want = engine.generate([ids], max_new_tokens=4, stop_token_ids=[]).tokens[0]
    engine.close()
    for backend in ("onnxruntime", "openvino"):
        worker = cpu_peers.CriticalKVWorker(tmp_path, folder, backend)
        try:
            assert worker.label.startswith("criticalkv b=40") and (cpu_peers.ON_OPENVINO in worker.label) == (backend == "openvino")
            out = worker.single(ids, 4)
            assert len(out["tokens"]) == 4 and out["prefill_s"] > 0
            if backend == "onnxruntime":
                assert out["tokens"] == want
            batch = worker.batch([ids, ids[::-1]], 3)
            assert batch["output_tokens"] == 6
        finally:
            worker.close()
        assert worker.proc.returncode == 0


def test_a_worker_killed_between_requests_is_named_with_its_status(tmp_path):
    """A worker the kernel kills (its OOM killer sends SIGKILL) fails the run with the worker's name and the reason,
    not a bare broken pipe."""
    script = tmp_path / "worker.py"
    script.write_text("import json, os, signal, sys\n"
                      "print(json.dumps({'ready': True, 'load_s': 0.0}), flush=True)\n"
                      "for line in sys.stdin:\n"
                      "    if json.loads(line)['op'] == 'info':\n"
                      "        print(json.dumps({'versions': {}}), flush=True)\n"
                      "    else:\n"
                      "        sys.stderr.write('dying\\n'); sys.stderr.flush(); os.kill(os.getpid(), signal.SIGKILL)\n")
    worker = cpu_peers.WorkerProcess("toy", [sys.executable, str(script)], tmp_path / "logs" / "toy.log")
    with pytest.raises(RuntimeError, match=r"toy exited \(status -9 \(SIGKILL: most often the kernel's out-of-memory"):
        worker.single([1, 2], 4)
    with pytest.raises(RuntimeError, match=r"toy exited \(status -9.*\n.*dying"):  # the pipe is broken now
        worker.single([1, 2], 4)
