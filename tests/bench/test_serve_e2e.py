"""`criticalkv bench serve` end to end: a real tritonserver (started by the benchmark from a tiny engine)."""

import json

import pytest

from benchmarks import interference
from criticalkv.cli import main
from serving.servers import build_tiny_engine


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    from criticalkv.serving import launcher

    if not launcher.is_set_up():
        pytest.fail("tritonserver is not set up: run `criticalkv serve --setup` (scripts/install.sh does)")
    # 1000 new tokens: the interference test's long request (tiny model: ~0.2 ms a token) still decodes when its
    # short one arrives
    return build_tiny_engine(tmp_path_factory.mktemp("engine"), max_batch_size=2, max_new_tokens=1000)


def test_bench_serve_on_a_started_server(tiny_engine, tmp_path):
    out = tmp_path / "results"
    code = main(["bench", "serve", "--engine-dir", str(tiny_engine), "--isl", "60", "--osl", "6",
                 "--concurrency", "1,2", "--request-rate", "50", "--max-concurrency", "2", "--num-requests", "3", "--warmup", "1", "--out", str(out / "serving"),
                 "--server-args", "--threads 1"])
    assert code == 0
    results = json.loads((out / "serving.json").read_text())
    assert results["machine"]["load_average_end"] and results["commit"]
    assert [(r.get("concurrency"), r.get("request_rate")) for r in results["runs"]] == [(1, None), (2, None), (None, 50.0)]
    for run in results["runs"]:
        s = run["summary"]
        assert s["completed"] == 3 and s["failed"] == 0
        assert run["osl_exact"] and run["isl_exact"]  # ignore_eos: exactly 6 tokens; prompts of exactly 60
        assert 0 < s["ttft_ms"]["p50"] <= s["latency_ms"]["p50"]
        assert s["itl_ms"]["count"] == 3 * 5  # one gap per token after the first
        assert s["output_throughput"] == pytest.approx(18 / s["duration_s"])
        # budget 40 of 60 prompt tokens in every KV head of every layer: kept / full = 40 / 60
        assert s["kv_mib_kept_per_seq"]["avg"] / s["kv_mib_full_per_seq"]["avg"] == pytest.approx(40 / 60)
        assert run["server_peak_rss_mib"] > 50  # tritonserver + the Python stub holding the engine
    assert results["runs"][1]["summary"]["peak_requests_in_flight"] == 2
    assert results["runs"][2]["summary"]["peak_requests_in_flight"] <= 2  # Poisson arrivals, capped at 2 in flight
    text = (out / "serving.txt").read_text()
    assert "vs conc 1" in text and "TPOT" in text
    csv_lines = (out / "serving.csv").read_text().splitlines()
    assert len(csv_lines) == 4 and csv_lines[0].startswith("engine,policy,budget,isl,osl,concurrency")
    assert (out / "serving.png").stat().st_size > 10_000


def test_bench_interference_on_a_started_server(tiny_engine, tmp_path):
    # two servers, one after the other: the prefill not chunked, then in chunks of 64 tokens
    out = tmp_path / "results"
    code = interference.main(["--engine-dir", str(tiny_engine), "--short-isl", "48", "--short-osl", "4",
                               "--long-isl", "200", "--long-osl", "1000", "--decode-after-tokens", "2",
                               "--prefill-delay", "0", "--repeats", "2", "--warmup", "0", "--prefill-chunk", "0,64",
                               "--out", str(out / "interference"), "--server-args", "--threads 1"])
    assert code == 0
    results = json.loads((out / "interference.json").read_text())
    assert results["machine"]["load_average_end"] and "load average" in results["uptime_after"]
    assert results["benchmark"] == "interference" and results["settings"]["prefill_chunks"] == [0, 64]
    assert [v["prefill_chunk"] for v in results["variants"]] == [0, 64]
    for variant in results["variants"]:
        assert variant["server_args"] == ["--threads", "1", "--prefill-chunk", str(variant["prefill_chunk"])]
        assert [r["case"] for r in variant["rounds"]] == ["idle", "decode", "prefill"] * 2
        for r in variant["rounds"]:
            assert r["short"]["ok"] and r["short"]["output_tokens"] == 4 and r["short"]["input_tokens"] == 48
            assert r["load_average_before"] and r["load_average_after"]
            if r["case"] != "idle":
                assert r["long"]["ok"] and r["long"]["output_tokens"] == 1000
        for r in variant["rounds"]:
            if r["case"] == "decode":  # sent after the long request's 2nd token, first token before its last
                assert r["phase_ok"] and r["long_tokens_at_short_start"] >= 2
                assert r["long_tokens_at_short_first_token"] < 1000
        summary = variant["summary"]
        cases = summary["cases"]
        assert cases["idle"]["used"] == 2 and cases["decode"]["used"] == 2
        assert cases["decode"]["ratio_p50"] == pytest.approx(cases["decode"]["ttft_ms"]["p50"] / cases["idle"]["ttft_ms"]["p50"])
        assert summary["target"]["met"] == (cases["decode"]["ratio_p50"] <= 1.5)
        # the prefill case has a goal only when the prefill is chunked
        assert (summary["prefill_target"]["goal"] is None) == (variant["prefill_chunk"] == 0)
    md = (out / "interference.md").read_text()
    assert md.count("| decode | 2 of 2 |") == 2 and "prefill chunks of 64" in md and "chunk sizes compared" in md
    assert (out / "interference.png").stat().st_size > 10_000


def test_a_running_server_is_named_by_its_url_alone(tiny_engine, tmp_path):
    # --url without --engine-dir: the model from the URL, the tokenizer from the folder the server's model config
    # names, the scheduler's gauges at the HTTP port + 2 (where `criticalkv serve` puts its metrics)
    from criticalkv.bench.served import ServerProcess

    out = tmp_path / "memory"
    with ServerProcess(tiny_engine, ["--threads", "1"]) as server:
        code = main(["bench", "memory", "--url", f"{server.url}/v2/models/criticalkv", "--isl", "48", "--osl", "4",
                     "--concurrency", "1", "--num-requests", "2", "--warmup", "0", "--out", str(out)])
        assert code == 0
        (run,) = json.loads(out.with_suffix(".json").read_text())["runs"]
        assert run["summary"]["completed"] == 2 and run["summary"]["failed"] == 0
        assert run["engine"]["policy"] == "criticalkv" and run["engine"]["server_pid"] is not None
        assert run["server_metrics"]["samples"] > 0 and run["server_metrics"]["errors"] == 0
        assert main(["bench", "memory", "--url", f"{server.url}/v2/models/nosuch", "--out", str(out)]) != 0
