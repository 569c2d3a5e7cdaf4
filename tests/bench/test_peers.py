"""``criticalkv.bench.peers``: where the peers' environments live, their creation on first use, the peer specs of
``bench peers`` and the kvpress runner's independence (no peer is installed or run in CI)."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from criticalkv.bench import peers
from criticalkv.bench.peers import cpu, kvpress
from criticalkv.cli import main


def test_the_peers_folder_is_a_machine_setting(monkeypatch, tmp_path):
    monkeypatch.delenv(peers.PEERS_DIR_ENV, raising=False)
    assert peers.peers_dir() == Path(".peers")
    monkeypatch.setenv(peers.PEERS_DIR_ENV, str(tmp_path))
    assert peers.peers_dir() == tmp_path
    assert peers.setup_command(Path(".peers"), ["kvpress"]) == "criticalkv bench setup-peers --peers kvpress"
    assert (peers.setup_command(tmp_path, ["a", "b"])
            == f"CRITICALKV_PEERS_DIR={tmp_path} criticalkv bench setup-peers --peers a,b")


def test_a_missing_environment_is_created_on_first_use_with_one_line(monkeypatch, tmp_path):
    made, lines = [], []
    monkeypatch.setattr(peers, "setup_peers", lambda root, names, log=print: made.append((root, list(names))))
    (tmp_path / "kvpress").mkdir()
    (tmp_path / "kvpress" / ".criticalkv-ready").write_text("x")
    peers.ensure_ready(tmp_path, ["kvpress", "transformers"], log=lines.append)
    assert made == [(tmp_path, ["transformers"])]
    assert len(lines) == 1 and "creating the peer environment(s) transformers" in lines[0]
    peers.ensure_ready(tmp_path, ["kvpress"], log=pytest.fail)  # ready: nothing said, nothing made
    assert len(made) == 1


@pytest.mark.parametrize("leaf", ["setup-peers", "single", "peers", "aiperf"])
def test_the_help_of_every_peer_leaf_names_the_folder_setting(capsys, leaf):
    with pytest.raises(SystemExit):
        main(["bench", leaf, "--help"])
    out = capsys.readouterr().out
    assert "CRITICALKV_PEERS_DIR" in out and "--peers-dir" not in out and "--setup-peers" not in out


def test_peer_specs_carry_openvinos_knobs_with_their_defaults():
    specs = cpu.parse_peer_specs("onnxruntime-genai,openvino")
    assert specs == {"onnxruntime-genai": {}, "openvino": {
        "precision": ["default", "f32"], "eviction": {"start_size": 32, "recent_size": 96, "max_cache_size": 256}}}
    specs = cpu.parse_peer_specs("openvino:precision=f32:eviction=16/48/512")
    assert specs["openvino"] == {"precision": ["f32"],
                                 "eviction": {"start_size": 16, "recent_size": 48, "max_cache_size": 512}}
    assert cpu.parse_peer_specs("") == {}
    assert cpu.parse_peer_specs("openvino,vllm")["vllm"] == {}  # vLLM, served, has no knobs


@pytest.mark.parametrize("text, message", [
    ("sglang", "--peers: unknown sglang"),
    ("openvino:budget=256", "'budget=256' is not a knob of openvino (its knobs: precision=, eviction=)"),
    ("onnxruntime-genai:precision=f32", "is not a knob of onnxruntime-genai (its knobs: none)"),
    ("openvino:precision", "'precision' is not a knob of openvino"),
    ("openvino,openvino:precision=f32", "--peers: openvino given twice"),
    ("openvino:precision=f32+f32", "openvino:precision= expected"),
])
def test_bad_peer_specs_are_one_clear_line(text, message):
    with pytest.raises(ValueError, match=None) as err:
        cpu.parse_peer_specs(text)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("runner", [kvpress.RUNNER, cpu.RUNNER])
def test_the_runners_import_nothing_from_criticalkv(runner):
    tree = ast.parse(runner.read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(m.split(".")[0] == "criticalkv" for m in modules)
    assert runner.parent == Path(peers.__file__).parent


def test_the_kvpress_runner_has_its_two_commands():
    """Without torch in a peer environment the runner cannot start; its argument parser is checked through its text."""
    text = kvpress.RUNNER.read_text()
    assert 'add_parser("time"' in text and 'add_parser("answer"' in text


@pytest.mark.parametrize("argv, message", [
    (["bench", "single", "--engine-dir", "{tmp}/e", "--peers", "vllm"], "--peers: unknown vllm"),
    (["bench", "single", "--engine-dir", "{tmp}/none"], "{tmp}/none: not an engine directory"),
])
def test_single_refuses_in_one_line(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.setenv(peers.PEERS_DIR_ENV, str(tmp_path / "p"))
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "manifest.json").write_text(json.dumps({}))
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message.format(tmp=tmp_path) in err
    assert not (tmp_path / "p").exists()  # nothing created for a refused command


def test_the_cpu_needle_comparison_takes_an_out_stem():
    args = cpu.parse_args(["needle", "--engine-dir", "engines/full", "--out", "r/needle_x"])
    assert args.out == Path("r/needle_x") and args.precision == "default+f32"
    run = subprocess.run([sys.executable, "-m", "criticalkv.bench.peers.cpu", "--help"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0 and "CRITICALKV_PEERS_DIR" in run.stdout


def test_bench_aiperf_refuses_vllm_and_rounds_before_starting_anything(capsys):
    # its cross-check runs on criticalkv's Triton endpoint, which vllm serve lacks; its table holds one run
    engine = str(Path(__file__).resolve().parents[2] / "engines" / "none")
    assert main(["bench", "aiperf", "--engine-dir", engine, "--vllm"]) == 2
    assert "criticalkv bench vllm --parts aiperf" in capsys.readouterr().err
    assert main(["bench", "aiperf", "--url", "http://127.0.0.1:9", "--rounds", "2"]) == 2
    assert "--rounds: bench aiperf runs one round" in capsys.readouterr().err


def test_a_failed_aiperf_run_says_why_in_its_error(tmp_path):
    # the run's folder is removed afterwards: the end of AIPerf's log travels in the error (a stand-in executable
    # that fails the way AIPerf does, with a message and exit status 1)
    from criticalkv.bench.aiperf import run_aiperf
    from criticalkv.bench.prompts import BenchPrompt

    tool = tmp_path / "peers" / "aiperf" / "bin" / "aiperf"
    tool.parent.mkdir(parents=True)
    tool.write_text("#!/bin/sh\necho starting\necho 'ValueError: endpoint /v2/models/x/generate_stream: 404'\nexit 1\n")
    tool.chmod(0o755)
    (tmp_path / "peers" / "aiperf" / ".criticalkv-ready").write_text("x")
    with pytest.raises(RuntimeError) as err:
        run_aiperf(tmp_path / "peers", "http://127.0.0.1:9", "m", tmp_path, [BenchPrompt(0, "hi", (1,))], 4, 1, 1, 0,
                   tmp_path / "work")
    assert "aiperf exited with 1" in str(err.value) and "generate_stream: 404" in str(err.value)
