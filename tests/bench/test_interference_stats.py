"""`python -m benchmarks.interference` without a server: phase checks, statistics, target from a result file."""

import json

import pytest

from benchmarks.interference import pair_facts, render, summarize_cases
from criticalkv.bench.metrics import RequestRecord
from benchmarks.targets import _runs, check, render as render_targets


def record(start, arrivals, tokens=1):
    return RequestRecord(start=start, chunks=[(t, tokens) for t in arrivals])


def test_phase_of_the_short_request():
    long = record(0.0, [5.0, 5.1, 5.2, 5.3, 5.4, 5.5, 5.6])  # prefill until 5.0, then decoding
    during_decode = pair_facts(record(5.25, [5.45, 5.5]), long, "decode")
    assert during_decode["phase_ok"] is True
    assert during_decode["long_tokens_at_short_start"] == 3 and during_decode["long_tokens_at_short_first_token"] == 5
    assert during_decode["long_max_gap_during_short_ms"] == pytest.approx(100.0)
    # sent before the long request's first token: not the decode case
    assert pair_facts(record(4.0, [5.45]), long, "decode")["phase_ok"] is False
    # first token after the long request ended: the long one was no longer decoding
    assert pair_facts(record(5.5, [5.7]), long, "decode")["phase_ok"] is False
    during_prefill = pair_facts(record(0.5, [5.2, 5.3]), long, "prefill")
    assert during_prefill["phase_ok"] is True
    assert during_prefill["long_first_token_after_short_start_ms"] == pytest.approx(4500.0)
    assert pair_facts(record(5.2, [5.3]), long, "prefill")["phase_ok"] is False
    failed = RequestRecord(start=1.0, error="HTTP 400: bad")
    assert pair_facts(failed, long, "prefill")["phase_ok"] is False


def rounds(case, ttfts, phase_ok=True):
    return [{"case": case, "round": i, "short": {"ok": True, "ttft_ms": t}, "long": None if case == "idle" else {"ok": True},
             "phase_ok": phase_ok, "long_max_gap_during_short_ms": None if case == "idle" else 2 * t}
            for i, t in enumerate(ttfts)]


def test_statistics_and_target():
    rows = (rounds("idle", [100, 120, 110, 130, 90]) + rounds("decode", [150, 200, 170, 160, 180])
            + rounds("decode", [10_000], phase_ok=False)  # wrong phase: left out of the statistics
            + rounds("prefill", [5000, 6000, 5500, 5200, 5800]))
    s = summarize_cases(rows, goal=1.5)
    c = s["cases"]
    assert c["idle"]["ttft_ms"]["p50"] == pytest.approx(110) and c["idle"]["used"] == 5
    assert c["decode"]["rounds"] == 6 and c["decode"]["used"] == 5 and c["decode"]["ttft_ms"]["max"] == 200
    assert c["decode"]["ratio_p50"] == pytest.approx(170 / 110)
    assert c["decode"]["ratio_p90"] == pytest.approx(c["decode"]["ttft_ms"]["p90"] / c["idle"]["ttft_ms"]["p90"])
    assert c["prefill"]["ratio_p50"] == pytest.approx(5500 / 110)
    assert s["target"]["ratio"] == pytest.approx(170 / 110) and s["target"]["met"] is False  # 1.55 > 1.5
    assert summarize_cases(rows, goal=1.6)["target"]["met"] is True
    # same-round ratios: 150/100, 200/120, 170/110, 160/130, 180/90 (the wrong-phase round is left out)
    paired = c["decode"]["paired_ratio"]
    assert paired["count"] == 5 and paired["p50"] == pytest.approx(170 / 110) and paired["max"] == pytest.approx(2.0)
    assert s["target"]["paired_ratio_p50"] == pytest.approx(170 / 110)
    # a failed short request is counted as failed and not used
    bad = rounds("idle", [100]) + [{"case": "decode", "short": {"ok": False, "ttft_ms": None}, "long": {"ok": True},
                                    "phase_ok": False}]
    s2 = summarize_cases(bad)
    assert s2["cases"]["decode"]["failed"] == 1 and s2["target"]["ratio"] is None and s2["target"]["met"] is None


def result_file(tmp_path, idle, decode, prefill):
    rows = rounds("idle", idle) + rounds("decode", decode) + rounds("prefill", prefill)
    data = {"command": "python -m benchmarks.interference", "commit": "x",
            "machine": {"cpu": "cpu", "logical_cpus": 2, "load_average_start": [3.0, 2.0, 1.0], "load_average_end": [3.1, 2.0, 1.0]},
            "versions": {"python": "3"}, "uptime_before": "up", "uptime_after": "up",
            "engine": {"label": "criticalkv b=256"},
            "settings": {"short_isl": 128, "short_osl": 16, "long_isl": 2048, "long_osl": 256, "repeats": 5, "warmup": 1,
                         "decode_after_tokens": 4, "prefill_delay_s": 0.5, "kv_budget": None, "seed": 0, "goal": 1.5},
            "rounds": rows, "summary": summarize_cases(rows)}
    (tmp_path / "interference.json").write_text(json.dumps(data))
    return data


def test_target_rows_from_the_result_file(tmp_path):
    data = result_file(tmp_path, [100, 100, 100, 100, 100], [120, 130, 140, 150, 400], [4000, 4100, 4200, 4300, 4400])
    rows = check(tmp_path)
    assert len(rows) == 2 and _runs(tmp_path) == []  # not mistaken for a serve run
    decode, prefill = rows
    assert decode["target"].startswith("short request during a long one's decode (interference: criticalkv b=256, short ISL 128")
    assert decode["ratio"] == pytest.approx(1.4) and decode["met"] is True and decode["files"] == ["interference.json"]
    assert prefill["ratio"] == pytest.approx(42.0) and prefill["met"] is None
    text = render_targets(rows)
    assert "| 1.400 | 1.5 | met |" in text and "| 42.000 | - | - |" in text
    md = render(data)
    assert "| decode | 5 of 5 | 140.0 |" in md and "1.40x, met" in md
    # the same check reports a miss from another file
    result_file(tmp_path, [100, 100, 100, 100, 100], [200, 210, 220, 230, 240], [4000] * 5)
    assert check(tmp_path)[0]["met"] is False and "NOT met" in render_targets(check(tmp_path))
