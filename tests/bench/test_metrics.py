"""Serving metrics on hand-made timestamp sequences (values computed by hand in the comments)."""

import math

import pytest

from criticalkv.bench.client import parse_event, parse_openai_event, poisson_offsets
from criticalkv.bench.metrics import RequestRecord, distribution, peak_in_flight, summarize


def record(start, times, tokens=None, out=None, **kw):
    counts = tokens or [1] * len(times)
    return RequestRecord(start=start, chunks=list(zip(times, counts)), output_tokens=out, **kw)


def test_single_request_ttft_tpot_itl_latency():
    # sent at 10.0; tokens at 10.5, 10.6, 10.8, 11.1
    r = record(10.0, [10.5, 10.6, 10.8, 11.1])
    assert r.ttft == pytest.approx(0.5)
    assert r.latency == pytest.approx(1.1)
    assert r.tpot == pytest.approx((1.1 - 0.5) / 3)  # 0.2
    assert r.itl() == pytest.approx([0.1, 0.2, 0.3])
    assert r.num_output_tokens == 4


def test_multi_token_chunks_split_their_gap():
    # 3 tokens in the first response, then 2 tokens arriving 0.4 s later, then 1 token 0.1 s later
    r = record(0.0, [1.0, 1.4, 1.5], tokens=[3, 2, 1])
    assert r.num_output_tokens == 6
    assert r.itl() == pytest.approx([0.0, 0.0, 0.2, 0.2, 0.1])  # one entry per token after the first
    assert r.tpot == pytest.approx(0.5 / 5)


def test_server_count_larger_than_chunks_goes_to_the_last_chunk():
    r = record(0.0, [1.0, 2.0], out=3)  # two responses, three tokens
    assert r.itl() == pytest.approx([0.5, 0.5])
    assert r.tpot == pytest.approx(0.5)


def test_single_token_has_no_tpot():
    r = record(0.0, [0.3])
    assert r.tpot is None and r.itl() == []


def test_summary_matches_hand_computation():
    a = record(0.0, [1.0, 1.5, 2.0], input_tokens=100, kv_bytes_kept=10 * 2**20, kv_bytes_full=40 * 2**20)
    b = record(0.5, [2.0, 2.2, 2.4, 2.6, 3.0], input_tokens=100, kv_bytes_kept=10 * 2**20, kv_bytes_full=40 * 2**20)
    bad = RequestRecord(start=0.2, error="HTTP 400: bad")
    s = summarize([a, b, bad])
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["duration_s"] == pytest.approx(3.0)  # first start 0.0, last end 3.0
    assert s["request_throughput"] == pytest.approx(2 / 3)
    assert s["output_throughput"] == pytest.approx(8 / 3)
    assert s["total_token_throughput"] == pytest.approx(208 / 3)
    # TTFT 1.0 and 1.5 s; TPOT 0.5 and 0.25 s; latency 2.0 and 2.5 s
    assert s["ttft_ms"]["avg"] == pytest.approx(1250) and s["ttft_ms"]["p50"] == pytest.approx(1250)
    assert s["ttft_ms"]["p90"] == pytest.approx(1000 + 0.9 * 500)
    assert s["tpot_ms"]["avg"] == pytest.approx(375)
    assert s["latency_ms"]["max"] == pytest.approx(2500)
    # ITL pooled over both: [0.5, 0.5] and [0.2, 0.2, 0.2, 0.4]
    assert s["itl_ms"]["count"] == 6
    assert s["itl_ms"]["avg"] == pytest.approx(1000 * 2.0 / 6)
    assert s["itl_ms"]["p50"] == pytest.approx(300)  # sorted 0.2 0.2 0.2 0.4 0.5 0.5 -> between 0.2 and 0.4
    assert s["per_user_output_throughput"] == pytest.approx((3 / 2.0 + 5 / 2.5) / 2)
    assert s["per_user_output_speed"] == pytest.approx((2 + 4) / 2)
    assert s["kv_mib_kept_per_seq"]["avg"] == pytest.approx(10)
    assert s["kv_mib_kept_peak_in_flight"] == pytest.approx(20)  # both in flight during [0.5, 2.0]
    assert s["peak_requests_in_flight"] == 2


def test_percentiles_interpolate_linearly():
    d = distribution([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert d["p50"] == pytest.approx(5.5)
    assert d["p90"] == pytest.approx(9.1)
    assert d["p99"] == pytest.approx(9.91)
    assert distribution([])["avg"] is None


def test_peak_in_flight_counts_back_to_back_requests_once():
    a, b = record(0.0, [1.0]), record(1.0, [2.0])  # b starts exactly when a ends
    assert peak_in_flight([a, b], None) == 1


def test_all_failed_summary():
    s = summarize([RequestRecord(start=0.0, error="x")])
    assert s == {"completed": 0, "failed": 1}


def test_events_fold_into_a_record():
    # criticalkv's streamed responses: num_output_tokens = tokens carried by that response
    r = RequestRecord(start=0.0)
    for t, event in [(0.4, {"text_output": "Hello", "num_output_tokens": 1}),
                     (0.7, {"text_output": " wor", "num_output_tokens": 2}),  # a token that completed no character
                     (0.8, {"text_output": "ld", "num_output_tokens": 1, "finish_reason": "length",
                            "num_input_tokens": 7, "kv_bytes_kept": [1024], "kv_bytes_full": [4096]})]:
        parse_event(r, event, t)
    assert r.chunks == [(0.4, 1), (0.7, 2), (0.8, 1)]
    assert r.num_output_tokens == 4 and r.itl() == pytest.approx([0.15, 0.15, 0.1])
    assert (r.input_tokens, r.kv_bytes_kept, r.kv_bytes_full) == (7, 1024, 4096)
    assert r.finish_reason == "length" and r.latency == pytest.approx(0.8)
    plain = RequestRecord(start=0.0)  # a server without counts: one token per response
    for t in (0.1, 0.2):
        parse_event(plain, {"text_output": "x"}, t)
    assert plain.num_output_tokens == 2
    err = RequestRecord(start=0.0)
    parse_event(err, {"error": "max_tokens must be > 0"}, 0.1)
    assert not err.ok and "max_tokens" in err.error


def test_openai_stream_events_fold_into_a_record():
    # `criticalkv serve --replicas` (bench replicas): completions chunks, chat deltas, the usage chunk, the error object
    r = RequestRecord(start=0.0)
    for t, event in [(0.3, {"choices": [{"index": 0, "text": "Hel", "finish_reason": None}]}),
                     (0.5, {"choices": [{"index": 0, "text": "", "finish_reason": None}]}),  # no text: no chunk
                     (0.6, {"choices": [{"index": 0, "text": "lo", "finish_reason": "length"}], "context_cache_hit": True}),
                     (0.61, {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}})]:
        parse_openai_event(r, event, t)
    assert r.chunks == [(0.3, 1), (0.6, 1)] and r.num_output_tokens == 3 and r.input_tokens == 9
    assert r.context_cache_hit is True and r.finish_reason == "length" and r.ttft == pytest.approx(0.3)
    chat = RequestRecord(start=0.0)
    for t, delta in [(0.2, {"role": "assistant", "content": ""}), (0.4, {"content": "Hi"})]:
        parse_openai_event(chat, {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}, t)
    assert chat.chunks == [(0.4, 1)]
    err = RequestRecord(start=0.0)
    parse_openai_event(err, {"error": {"message": "the replica serving this request stopped", "code": 503}}, 0.1)
    assert not err.ok and err.error == "the replica serving this request stopped"


def test_poisson_offsets_have_the_requested_rate_and_are_reproducible():
    offsets = poisson_offsets(4000, rate=2.0, seed=1)
    assert offsets[0] == 0.0 and offsets == poisson_offsets(4000, rate=2.0, seed=1)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    mean = sum(gaps) / len(gaps)
    assert abs(mean - 0.5) < 0.03  # mean gap 1 / rate
    var = sum((g - mean) ** 2 for g in gaps) / len(gaps)
    assert abs(math.sqrt(var) - 0.5) < 0.04  # exponential: std = mean
    with pytest.raises(ValueError, match="request-rate"):
        poisson_offsets(3, rate=0)


def test_profile_breakdown_classifies_collapsed_stacks(tmp_path):
    from criticalkv.bench.served import profile_breakdown

    stub = 'process 9:"triton_python_backend_stub"'
    path = tmp_path / "stacks.txt"
    path.write_text("\n".join([
        f"{stub};Scheduler._loop (scheduler.py:10);Scheduler._admit (scheduler.py:20);OnnxRuntimeBackend.prefill (onnxruntime_backend.py:131);Session.run (x.py:1) 6",
        f"{stub};Scheduler._loop (scheduler.py:10);Scheduler._decode_step (scheduler.py:392);OnnxRuntimeBackend.decode (onnxruntime_backend.py:203) 3",
        f"{stub};TritonPythonModel._send (model.py:174) 1",
    ]) + "\n")
    b = profile_breakdown(path)
    assert b["samples"] == 10
    assert (b["prefill_fraction"], b["decode_fraction"], b["other_fraction"]) == (0.6, 0.3, 0.1)
