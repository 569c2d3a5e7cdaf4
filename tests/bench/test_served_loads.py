"""docqa, memory, cached-context and chunked interference without a server: workloads, statistics, targets from
hand-made result files (values computed by hand in the comments)."""

import json

import pytest

from benchmarks import cached
from criticalkv.bench import docqa, memory, served
from criticalkv.bench.client import parse_event, request_body
from benchmarks.interference import summarize_cases
from criticalkv.bench.metrics import RequestRecord, cache_hits, concurrency_profile, decoding_intervals, summarize
from criticalkv.bench.prompts import make_prompts, make_questions, question_ids
from criticalkv.bench.served import MetricsMonitor, kv_bytes_per_token, parse_gauges
from benchmarks.targets import _runs, check, render


# ---------------------------------------------------------------------- client, metrics
def test_request_body_carries_the_context_and_the_chat_flag():
    body = request_body("What is it?", 8, context="A long document.", chat=True)
    assert body["context"] == "A long document." and body["text_input"] == "What is it?"
    assert body["apply_chat_template"] is True
    plain = request_body("text", 8)
    assert "context" not in plain and "apply_chat_template" not in plain


def test_context_cache_hit_is_read_from_the_final_event():
    for value, expected in (([True], True), ([False], False), (True, True), ("false", False), ("true", True)):
        r = RequestRecord(start=0.0)
        parse_event(r, {"text_output": "a", "num_output_tokens": 1}, 0.1)
        assert r.context_cache_hit is None
        parse_event(r, {"text_output": "b", "num_output_tokens": 1, "finish_reason": "length",
                        "context_cache_hit": value}, 0.2)
        assert r.context_cache_hit is expected


def record(start, times, hit=None):
    return RequestRecord(start=start, chunks=[(t, 1) for t in times], context_cache_hit=hit)


def test_hit_rate_counts_only_requests_that_reported_one():
    rs = [record(0, [1, 2], True), record(0, [1, 2], False), record(0, [1, 2], True), record(0, [1, 2])]
    assert cache_hits(rs) == {"context_cache_hits": 2, "context_cache_misses": 1, "context_cache_hit_rate": 2 / 3}
    assert cache_hits([record(0, [1])])["context_cache_hit_rate"] is None
    assert summarize(rs)["context_cache_hit_rate"] == pytest.approx(2 / 3)


def test_concurrency_profile_peak_and_time_weighted_mean():
    # decoding from first to last token: [1, 5], [2, 4], [4, 8] -> levels 1 on [1,2], 2 on [2,4], 2 on [4,5]
    # (one ends as one starts at 4), 1 on [5,8]: area 1 + 4 + 2 + 3 = 10 over 7 s; peak 2
    rs = [record(0.0, [1.0, 3.0, 5.0]), record(0.5, [2.0, 4.0]), record(3.0, [4.0, 8.0])]
    assert decoding_intervals(rs) == [(1.0, 5.0), (2.0, 4.0), (4.0, 8.0)]
    p = concurrency_profile(decoding_intervals(rs))
    assert p["peak"] == 2 and p["mean"] == pytest.approx(10 / 7) and p["span_s"] == pytest.approx(7.0)
    assert concurrency_profile([]) == {"peak": 0, "mean": None, "span_s": 0.0}


def test_gauges_are_summed_over_instances_and_monitored():
    text = "\n".join([
        "# HELP criticalkv_requests_running Requests decoding", "# TYPE criticalkv_requests_running gauge",
        'criticalkv_requests_running{model="m",version="1",instance="m_0"} 3',
        'criticalkv_requests_running{model="m",version="1",instance="m_1"} 2',
        'criticalkv_kv_bytes_reserved{model="m",version="1",instance="m_0"} 1.048576e+06',
        'criticalkv_context_cache{model="m",version="1",instance="m_0",stat="evictions"} 4',
        'criticalkv_context_cache{model="m",version="1",instance="m_1",stat="evictions"} 1',
        'criticalkv_context_cache{model="m",version="1",instance="m_0",stat="entries"} 2',
        'criticalkv_time_to_first_token_seconds_count{model="m"} 7', "nv_inference_count 9"])
    assert parse_gauges(text) == {"criticalkv_requests_running": 5.0, "criticalkv_kv_bytes_reserved": 1048576.0,
                                  "criticalkv_context_cache:evictions": 5.0, "criticalkv_context_cache:entries": 2.0}
    m = MetricsMonitor(None)
    # running 2 for 1 s, then 4 for 3 s, then 1 (last sample): mean (2*1 + 4*3) / 4 = 3.5, peak 4
    m.samples = [(10.0, {"criticalkv_requests_running": 2.0}), (11.0, {"criticalkv_requests_running": 4.0}),
                 (14.0, {"criticalkv_requests_running": 1.0})]
    s = m.summary()
    assert s["criticalkv_requests_running"] == {"peak": 4.0, "mean": pytest.approx(3.5), "first": 2.0, "last": 1.0}
    assert "criticalkv_kv_bytes_reserved" not in s and s["samples"] == 3


def manifest(tmp_path, policy="full", layers=30, heads=3, entry=512, batch=8, capacity=512):
    folder = tmp_path / policy
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({
        "policy": {"name": policy, "budget": 256}, "build": {"max_batch_size": batch, "max_input_len": 2048},
        "model": {"spec": {"num_layers": layers, "num_kv_heads": heads}},
        "shapes": {"decode_capacity": [capacity] * layers, "kv_buffer_bytes": entry * batch * heads * capacity * layers}}))
    return folder


def test_kv_memory_from_the_full_engine(tmp_path):
    # SmolLM2-135M: 30 layers x 3 KV heads x (K + V) 64 dims x fp32 = 512 bytes per head: 46,080 bytes per token,
    # 90 MiB per 2,048-token context (the serving README's number)
    full, ckv = manifest(tmp_path, "full"), manifest(tmp_path, "criticalkv", capacity=600)
    assert kv_bytes_per_token(full) == kv_bytes_per_token(ckv) == 30 * 3 * 512
    assert served.kv_mib(full, 2048, 1) == pytest.approx(90.0)
    assert served.full_engine([ckv, full]) == full and served.full_engine([ckv]) == ckv
    assert served.kv_mib(full, 2048, 4) == pytest.approx(360.0)
    # rounded up: two sequences of 272 tokens (11.953125 MiB each) must both fit
    assert float(served.mib_flag(2 * 11.953125)) * 2**20 >= 2 * 11.953125 * 2**20
    assert served.mib_flag(360.0) == "360.000"


def test_server_args_may_not_repeat_the_benchmarks_own_flags():
    assert served.split_server_args("--threads 1 --max-num-seqs 4") == ["--threads", "1", "--max-num-seqs", "4"]
    with pytest.raises(ValueError, match="--kv-memory-mib"):
        served.split_server_args("--threads 1 --kv-memory-mib=300")
    assert served.split_server_args("--prefill-chunk 256", own=("--kv-memory-mib",)) == ["--prefill-chunk", "256"]


# ---------------------------------------------------------------------- workloads
@pytest.mark.parametrize("chat", [False, True])
def test_questions_have_the_exact_token_count_and_are_reproducible(tokenizer, chat):
    doc = make_prompts(tokenizer, 300, 1, seed=2)[0]
    qs = make_questions(tokenizer, doc, 5, 32, seed=1, chat=chat)
    assert len(set(qs)) == 5
    assert all(len(question_ids(tokenizer, q, chat)) == 32 for q in qs)
    assert qs == make_questions(tokenizer, doc, 5, 32, seed=1, chat=chat)
    assert qs != make_questions(tokenizer, doc, 5, 32, seed=2, chat=chat)
    with pytest.raises(ValueError, match="no question of exactly 3 tokens"):
        make_questions(tokenizer, doc, 1, 3)


def test_docqa_sends_every_pair_once_in_a_seeded_order(tokenizer):
    work = docqa.workload(tokenizer, 200, docs=3, questions=4, question_tokens=24, seed=5, chat=False, warmup=2)
    assert len(work["documents"]) == 4 and all(len(tokenizer(d)["input_ids"]) == 200 for d in work["documents"])
    assert sorted(work["order"]) == [(d, q) for d in range(3) for q in range(4)]
    assert work["order"] != sorted(work["order"])  # shuffled
    assert work["order"] == docqa.workload(tokenizer, 200, 3, 4, 24, 5, False, 2)["order"]
    assert work["warmup"] == [(3, 0), (3, 1)]  # a document of its own
    bodies = docqa.bodies(work, work["order"][:2], 16, chat=False, kv_budget=None)
    d, q = work["order"][0]
    assert bodies[0]["context"] == work["documents"][d] and bodies[0]["text_input"] == work["questions"][d][q]
    assert "apply_chat_template" not in bodies[0]


def server_run(label, policy, throughput, ttft_p50, ttft_p90, hits, misses, held_mib=100.0):
    return {"engine": {"label": label, "policy": policy},
            "summary": {"completed": hits + misses or 16, "failed": 0, "duration_s": 10.0, "output_throughput": throughput,
                        "ttft_ms": {"p50": ttft_p50, "p90": ttft_p90},
                        "context_cache_hit_rate": hits / (hits + misses) if hits + misses else None,
                        "context_cache_hits": hits, "context_cache_misses": misses},
            "server_metrics": {"criticalkv_kv_bytes_reserved": {"peak": 2 * held_mib * 2**20, "mean": held_mib * 2**20},
                               "criticalkv_requests_running": {"peak": 8, "mean": 6.5}},
            "decoding": {"peak": 8, "mean": 6.0}, "requests": [
                {"ok": True, "ttft_ms": 100.0, "context_cache_hit": True}] * hits + [
                {"ok": True, "ttft_ms": 5000.0, "context_cache_hit": False}] * misses}


def docqa_results(docs=16, questions=8, isl=2048, kv_contexts=4.0):
    runs = [server_run("full", "full", 10.0, 8000.0, 20000.0, 40, 88),
            server_run("criticalkv b=256", "criticalkv", 35.0, 1600.0, 6000.0, 112, 16, held_mib=180.0)]
    for r in runs:
        r["docqa"] = docqa.summarize_run(r)
    return {"benchmark": "docqa", "command": "criticalkv bench docqa", "commit": "x", "versions": {"python": "3"},
            "machine": {"cpu": "cpu", "logical_cpus": 2, "load_average_start": [1.0, 1.0, 1.0]},
            "settings": {"isl": isl, "docs": docs, "questions": questions, "question_tokens": 32, "osl": 64,
                         "concurrency": 8, "warmup": 2, "chat": False, "seed": 0, "kv_memory_mib": 360.0,
                         "kv_memory_note": "4 contexts", "context_cache_mib": 360.0, "kv_contexts": kv_contexts,
                         "hit_rate_ceiling": (questions - 1) / questions},
            "runs": runs, "versus_full": served.versus_full(runs, docqa.RATIOS)}


def test_docqa_ratios_targets_and_table():
    results = docqa_results()
    d = results["runs"][1]["docqa"]
    assert d["hit_rate"] == pytest.approx(112 / 128) and d["kv_mib_held_mean"] == pytest.approx(180.0)
    assert d["ttft_ms_hit"]["p50"] == 100.0 and d["ttft_ms_miss"]["p50"] == 5000.0
    (row,) = results["versus_full"]
    assert row["output_throughput"]["ratio"] == pytest.approx(3.5) and row["ttft_p50_ms"]["ratio"] == pytest.approx(0.2)
    tput, ttft = docqa.targets(results)
    assert tput["met"] is True and ttft["met"] is True
    md = docqa.render(results)
    assert "| criticalkv b=256 / full | 3.50x | 0.20x |" in md and "87.5 % (112 of 128)" in md
    assert "output tokens/s >= 3x full): 3.50x, met." in md
    # another workload: the same ratios, no verdict
    small = docqa_results(docs=2, questions=2, isl=256)
    assert [t["met"] for t in docqa.targets(small)] == [None, None]
    assert "not the target's workload" in docqa.render(small)


def test_docqa_against_vllm_pairs_each_round():
    # two rounds, the second on a slower machine: the medians' ratio and each round's, in the table
    runs = []
    for repeat, (vllm, ckv) in enumerate(((30.0, 75.0), (20.0, 40.0))):
        for label, policy, tput in (("vllm", "vllm", vllm), ("criticalkv b=256", "criticalkv", ckv)):
            run = server_run(label, policy, tput, 1000.0, 2000.0, 112, 16)
            run["engine"]["repeat"] = repeat
            run["docqa"] = docqa.summarize_run(run)
            runs.append(run)
    results = {**docqa_results(), "runs": runs, "versus_full": []}
    docqa.versus_vllm(results)
    (row,) = results["versus_vllm"]
    assert row["output_throughput"]["ratio"] == pytest.approx(57.5 / 25.0)
    assert row["rounds"]["output_throughput"] == [2.5, 2.0]
    md = docqa.render(results)
    assert "| criticalkv b=256 | 57.5 / 25.0 = 2.30x |" in md
    assert "criticalkv b=256: output tokens/s per round, each against that round's vLLM" in md and "2.50x, 2.00x" in md


def test_docqa_context_cache_dtypes_and_answer_agreement():
    assert docqa.cache_dtypes(None, several=True) == []
    assert docqa.cache_dtypes("float32,float16", several=True) == ["float32", "float16"]
    for text, several, message in (("float32,float16", False, "give one of float32, float16"),
                                   ("bf16", True, "unknown bf16"), ("float16,float16", True, "names a dtype twice")):
        with pytest.raises(ValueError, match=message):
            docqa.cache_dtypes(text, several)
    results = docqa_results()
    exact, half = (dict(server_run(f"criticalkv b=256 [cache {d}]", "criticalkv", 20.0, 900.0, 8000.0, 2, 1),
                        engine={"label": f"criticalkv b=256 [cache {d}]", "variant": f"cache {d}"})
                   for d in ("float32", "float16"))
    def answered(rows):
        return [{"ok": True, "ttft_ms": 100.0, "document": 0, "question": q, "answer": a, "context_cache_hit": h}
                for q, a, h in rows]

    exact["requests"] = answered(((0, "one", False), (1, "two", True), (2, "three", True)))
    half["requests"] = answered(((2, "three", False), (0, "one", True), (1, "two but longer", True)))
    results["runs"] = [exact, half]
    for r in results["runs"]:
        r["docqa"] = docqa.summarize_run(r)
    (a,) = docqa.dtype_agreement(results)
    assert (a["n"], a["same_answer"], a["same_32_chars"], a["n_hits"], a["same_answer_hits"]) == (3, 2, 2, 2, 1)
    results["agreement_with_float32_cache"] = [a]
    results["settings"]["context_cache_dtypes"] = ["float32", "float16"]
    md = docqa.render(results)
    assert "each engine once per --context-cache-dtype (float32, float16)" in md
    assert "2 of 3 whole (2 of 3 on their first 32 characters); of its 2 cache hits, 1 whole" in md


def memory_results(kv_sequences=2.0):
    runs = [server_run("full", "full", 8.0, 5000.0, 9000.0, 0, 0), server_run("criticalkv b=256", "criticalkv", 10.0,
                                                                             6000.0, 9000.0, 0, 0)]
    runs[0]["decoding"], runs[1]["decoding"] = {"peak": 2, "mean": 1.8}, {"peak": 8, "mean": 5.4}
    for r in runs:
        r["summary"].update({"tpot_ms": {"p50": 40.0}, "kv_mib_kept_per_seq": {"avg": 1.0}, "kv_mib_full_per_seq": {"avg": 8.0}})
    return {"benchmark": "memory", "command": "criticalkv bench memory", "commit": "x", "versions": {"python": "3"},
            "machine": {"cpu": "cpu", "logical_cpus": 2, "load_average_start": [1.0, 1.0, 1.0]},
            "settings": {"isl": 2048, "osl": 256, "concurrency": 8, "num_requests": 16, "warmup": 1, "kv_memory_mib": 202.5,
                         "kv_memory_note": "2 full sequences", "kv_sequences": kv_sequences},
            "runs": runs, "versus_full": served.versus_full(runs, memory.RATIOS)}


def test_memory_target_and_table():
    results = memory_results()
    (row,) = results["versus_full"]
    assert row["output_throughput"]["ratio"] == pytest.approx(1.25) and row["decoding_mean"]["ratio"] == pytest.approx(3.0)
    (t,) = memory.targets(results)
    assert t["met"] is False and t["ratio"] == pytest.approx(1.25)
    md = memory.render(results)
    assert "| criticalkv b=256 / full | 1.25x | 3.00x |" in md and "1.25x, NOT met" in md
    assert memory.targets(memory_results(kv_sequences=3.0))[0]["met"] is None


def cached_round(uncached_ms, cached_ms, flags=(False, True)):
    return {"uncached": {"ok": True, "ttft_ms": uncached_ms, "context_cache_hit": flags[0]},
            "cached": {"ok": True, "ttft_ms": cached_ms, "context_cache_hit": flags[1]}, "flags_ok": flags == (False, True)}


def test_cached_context_statistics_leave_out_rounds_without_a_miss_then_a_hit():
    rounds = [cached_round(5000, 300), cached_round(5200, 400), cached_round(4800, 600),
              cached_round(5000, 5000, flags=(False, False))]  # the cache did not keep it: left out
    s = cached.summarize_rounds(rounds)
    assert s["used"] == 3 and s["rounds"] == 4
    assert s["uncached"]["p50"] == 5000 and s["cached"]["p50"] == 400
    assert s["ratio_p50"] == pytest.approx(0.08) and s["target"]["met"] is True
    assert s["paired_ratio"]["p50"] == pytest.approx(400 / 5200)
    assert cached.summarize_rounds(rounds, goal=0.05)["target"]["met"] is False


def interference_round(case, ttft, i):
    return {"case": case, "round": i, "phase_ok": True, "short": {"ok": True, "ttft_ms": ttft},
            "long": None if case == "idle" else {"ok": True}, "long_max_gap_during_short_ms": 50.0}


def interference_variant(chunk, idle, decode, prefill):
    rounds = [interference_round(c, t, i) for i in range(3) for c, t in (("idle", idle), ("decode", decode),
                                                                         ("prefill", prefill))]
    return {"prefill_chunk": chunk, "engine": {"label": "criticalkv b=256"}, "rounds": rounds,
            "summary": summarize_cases(rounds, 1.5, chunk)}


def test_chunked_prefill_gets_the_prefill_target():
    v0, v256 = interference_variant(0, 200, 250, 3000), interference_variant(256, 200, 250, 380)
    assert v0["summary"]["prefill_target"]["goal"] is None and v0["summary"]["prefill_target"]["met"] is None
    t = v256["summary"]["prefill_target"]
    assert t["goal"] == 2.0 and t["ratio"] == pytest.approx(1.9) and t["met"] is True
    assert interference_variant(512, 200, 250, 500)["summary"]["prefill_target"]["met"] is False


def test_targets_read_the_new_benchmarks(tmp_path):
    (tmp_path / "docqa.json").write_text(json.dumps(docqa_results()))
    (tmp_path / "memory_bound.json").write_text(json.dumps(memory_results()))
    c = {"benchmark": "cached-context", "settings": {"isl": 2048, "question_tokens": 32, "goal": 0.1},
         "runs": [{"engine": {"label": "criticalkv b=256"}, "rounds": [cached_round(5000, 300), cached_round(5000, 700)],
                   "cached_context": {}}]}
    (tmp_path / "cached_context.json").write_text(json.dumps(c))
    settings = {"short_isl": 128, "short_osl": 16, "long_isl": 2048, "long_osl": 256, "goal": 1.5, "prefill_goal": 2.0}
    (tmp_path / "interference_chunked.json").write_text(json.dumps({
        "benchmark": "interference", "settings": settings,
        "variants": [interference_variant(0, 200, 250, 3000), interference_variant(256, 200, 250, 380)]}))
    assert _runs(tmp_path) == []  # none of them is a serve run
    rows = {r["target"]: r for r in check(tmp_path)}
    docqa_rows = [r for k, r in rows.items() if k.startswith("docqa")]
    assert [r["met"] for r in docqa_rows] == [True, True]
    assert "hit rate 87.5 % vs 31.2 %" in docqa_rows[0]["measured"]
    (mem,) = [r for k, r in rows.items() if k.startswith("memory-bound")]
    assert mem["met"] is False and mem["ratio"] == pytest.approx(1.25)
    (cc,) = [r for k, r in rows.items() if k.startswith("cached context")]
    assert cc["ratio"] == pytest.approx(500 / 5000) and cc["met"] is True  # 0.1: met at the goal
    pre = [r for k, r in rows.items() if k.startswith(("same, arriving during", "short request during a long one's prefill"))]
    assert [(r["goal"], r["met"]) for r in pre] == [("-", None), (2.0, True)]
    assert "prefill chunk 256" in pre[1]["target"] and "prefill not chunked" in pre[0]["target"]
    text = render(list(rows.values()))
    assert text.count("| met |") == 1 + 6 and text.count("NOT met") == 1  # the header, then docqa 2, cached 1, interference 3


def test_comma_options_and_backend_variants_are_checked_in_one_place():
    names = served.comma_choices("onnxruntime,openvino", "--backends", served.SERVE_BACKENDS)
    assert names == ["onnxruntime", "openvino"]
    with pytest.raises(ValueError, match=r"--parts: unknown nope \(a comma-separated subset of single, batch\)"):
        served.comma_choices("single,nope", "--parts", ("single", "batch"))
    with pytest.raises(ValueError, match="--parts: none given"):
        served.comma_choices(",", "--parts", ("single", "batch"))
    assert served.comma_choices("", "--peers", ("kvpress",), empty=True) == []
    assert served.backend_variants("") is None
    assert served.backend_variants("openvino,onnxruntime") == [("openvino", ["--backend", "openvino"]),
                                                              ("onnxruntime", ["--backend", "onnxruntime"])]
    for server_args in ("--backend openvino", "--threads 1 --backend=torch"):
        with pytest.raises(ValueError, match="not --backend in --server-args"):
            served.backend_variants("onnxruntime", server_args)
    assert served.backend_variants("onnxruntime", "--backends-note x") == [
        ("onnxruntime", ["--backend", "onnxruntime"])]


def test_append_takes_the_earlier_runs_of_the_same_settings_only(tmp_path):
    from types import SimpleNamespace

    stem = tmp_path / "run"
    earlier = {"command": "first", "machine": {"cpu": "x"}, "settings": {"isl": 2048}, "runs": [{"n": 1}]}
    stem.with_suffix(".json").write_text(json.dumps(earlier))
    assert served.previous_runs(SimpleNamespace(append=False), stem) == []
    results = {"settings": {"isl": 2048}}
    assert served.previous_runs(SimpleNamespace(append=True), stem, results) == [{"n": 1}]
    assert results["earlier_calls"] == [{"command": "first", "machine": {"cpu": "x"}, "uptime_before": None,
                                         "uptime_after": None}]
    with pytest.raises(ValueError, match="has other settings"):
        served.previous_runs(SimpleNamespace(append=True), stem, {"settings": {"isl": 1024}})
    with pytest.raises(FileNotFoundError, match="does not exist yet"):
        served.previous_runs(SimpleNamespace(append=True), tmp_path / "none", results)


def test_docqa_facts_sends_the_evaluation_documents_ids_and_scores_them_against_vllm(tokenizer):
    from criticalkv.bench.client import prompt_ids
    from criticalkv.eval.shared_context import shared_documents

    work = docqa.facts_workload(tokenizer, 2048, docs=5, questions=8, seed=0, warmup=2)
    assert len(work["documents"]) == 6 and [len(q) for q in work["questions"]] == [8] * 5 + [2]
    assert work["document_keys"][:5] == ["shakespeare/eval/d0", "docs/eval/d0", "legal/eval/d0", "code/eval/d0",
                                         "shakespeare/eval/d1"]
    assert sorted(work["order"]) == [(d, q) for d in range(5) for q in range(8)] and work["warmup"] == [(5, 0), (5, 1)]
    # the servers run exactly the evaluation's ids: the context's, then the question's
    shared = shared_documents(tokenizer, docqa.FACT_DOMAINS, 2, lengths=(2048,), kinds=docqa.FACT_KINDS)
    pairs = [(0, 0), (3, 7), (4, 5)]
    for (d, q), body in zip(pairs, docqa.bodies(work, pairs, 64, chat=False, kv_budget=None)):
        assert prompt_ids(body, tokenizer) == [*shared[d].context_ids, *shared[d].questions[q].ids]
        sampling = json.loads(body["sampling_parameters"])
        assert sampling["ignore_eos"] is False and sampling["max_tokens"] == shared[d].questions[q].max_new_tokens
    with pytest.raises(ValueError, match="--questions 9"):
        docqa.facts_workload(tokenizer, 2048, docs=1, questions=9, seed=0, warmup=0)

    # scoring: vLLM answers every question right, criticalkv misses the first three of document 0
    def run(label, wrong):
        requests = []
        for d, q in work["order"]:
            fact = work["facts"][d][q]
            right = " " + " and ".join(fact["answers"]) + "."
            requests.append({"ok": True, "document": d, "question": q,
                             "answer": " 0000." if (d, q) in wrong else right})
        return {"engine": {"label": label, "repeat": 0}, "requests": requests}

    results = {"runs": [run("vllm", set()), run("criticalkv b=256", {(0, 0), (0, 1), (0, 2)})]}
    for r in results["runs"]:
        docqa.score_run(r, work)
    ours, theirs = results["runs"][1]["accuracy"], results["runs"][0]["accuracy"]
    assert theirs[:3] == [1.0, 1.0, 1.0] and theirs[3] == 40
    assert ours[0] == pytest.approx(37 / 40) and ours[3] == 40 and ours[1] < ours[0] < ours[2] <= 1.0
    (versus,) = docqa.accuracy_versus(results)
    assert versus["base"] == "vllm" and versus["n"] == 40 and (versus["wins"], versus["losses"]) == (0, 3)
    assert versus["mean_diff"] == pytest.approx(-3 / 40) and versus["met"] is False  # lower end below -2 points
    results["runs"][1]["requests"][0]["answer"] = None  # an unanswered request counts in neither
    results["runs"][1]["requests"][0]["ok"] = False
    docqa.score_run(results["runs"][1], work)
    assert results["runs"][1]["accuracy"][3] == 39
    table = docqa_results()
    table["settings"]["facts"] = True
    for row, scored in zip(table["runs"], results["runs"]):
        row.update(engine=scored["engine"], requests=scored["requests"], accuracy=scored["accuracy"])
    table["accuracy_versus"] = docqa.accuracy_versus(table)
    md = docqa.render(table)
    assert "questions of `criticalkv eval shared-context` (key, keys, chain, owner;" in md and "OSL" not in md
    assert "| vllm | 1 | 100.0 [100.0, 100.0] | 40 |" in md
    assert "| criticalkv b=256 - vllm | 1 | -7.7 [" in md and "| 0 / 3 |" in md and "| 39 | no |" in md
