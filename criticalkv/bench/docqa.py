"""``criticalkv bench docqa``: document question answering with reuse, the workload the context cache is for.

``--docs`` D documents of ``--isl`` tokens each (cut from the benchmark prose as ``bench serve``'s prompts are:
``criticalkv.bench.prompts``) and ``--questions`` Q questions about each (``--question-tokens`` tokens: a fixed stem
and a quoted phrase of the document, seeded). The D x Q requests, each the document as ``context`` and the question
as ``text_input``, are sent in a random (seeded) order, closed loop at ``--concurrency`` (default 8), ``--osl`` new
tokens each (greedy, ``ignore_eos``), to one server after the other (``--engine-dir``, repeat: e.g. ``full`` and
criticalkv b=256), all started with the same flags: ``--kv-memory-mib`` M (``--kv-memory``, default 4 uncompressed
documents, from the ``full`` engine's KV bytes per token; printed) and ``--context-cache-mib`` M (the cache may use
all the KV memory running requests leave: the memory is the binding limit for both servers).

Before the measured requests, ``--warmup`` requests on documents of their own (the first one compresses its
document, the next ones hit it) warm each server's graphs; their cached entry is the least recently used and goes
first. The measured requests start on a cache without any of the D documents, so at most (Q - 1) / Q of them can
hit (the ceiling, printed).

Per server: the context-cache hit rate (from each response's ``context_cache_hit``), TTFT p50 / p90 (all requests,
and hits and misses apart), output tokens/s, the KV MiB the scheduler held (its ``criticalkv_kv_bytes_reserved``
gauge: running requests, prompts under prefill, cached contexts; peak and time-weighted mean), the contexts it kept
cached (``criticalkv_context_cache``: entries, and the evictions during the run) and the requests running at once;
then each server's ratios to ``full``. The targets (D = 16, Q = 8, ISL 2048): criticalkv
output tokens/s >= 3x ``full`` and TTFT p50 <= 0.25x ``full``, same memory.

``--facts``: the documents and questions of ``criticalkv eval shared-context`` instead (the four domains' evaluation
documents of ``--isl`` tokens, taken in turn: shakespeare, docs, legal, code; facts inserted at random depths; each
document's questions with a reference answer: ``key``, ``keys``, ``chain``, ``owner``), sent as plain text with the
context apart, each answered greedily up to its own length (8-16 tokens) and stopping at EOS, as the evaluation
answers them (not ``--osl`` with ``ignore_eos``). Every answer is scored by its question's metric; per server run the
accuracy with a 95 % cluster-bootstrap interval over documents, and against vLLM's first run (``--vllm``; else the
first server's) the paired difference on the same questions with its interval, wins, losses and sign test
(``criticalkv.eval.shared_stats``). What it answers: whether the context cache's throughput costs answers against a
lossless cache (vLLM's), on the same requests. Target: the paired interval's lower end >= -2 points.

Results (``--out STEM``): ``STEM.json`` (command, machine, load average, versions, settings, every request, its
answer and, with ``--facts``, its score), ``STEM.md`` (tables) and ``STEM.png``.
"""

from __future__ import annotations

import random
from pathlib import Path

from criticalkv.bench import machine, served
from criticalkv.bench.report import add_out_argument
from criticalkv.bench.client import Endpoint, request_body, run_load, send_request
from criticalkv.bench.metrics import distribution
from criticalkv.serving.context_cache import CONTEXT_CACHE_DTYPES, DEFAULT_CONTEXT_CACHE_DTYPE

#: The targets for this workload (D = 16, Q = 8, ISL 2048): criticalkv vs full, same KV memory.
TARGET_THROUGHPUT = 3.0
TARGET_TTFT_P50 = 0.25
TARGET_WORKLOAD = {"isl": 2048, "docs": 16, "questions": 8, "kv_contexts": 4.0, "concurrency": 8}
#: With ``--facts``: a server's answers against vLLM's (lossless), the paired 95 % interval's lower end >= -2 points.
TARGET_ACCURACY_POINTS = 2.0


def workload(tokenizer, isl: int, docs: int, questions: int, question_tokens: int, seed: int, chat: bool,
             warmup: int) -> dict:
    """The documents, the questions and the order they are sent in.

    Returns {"documents": [text] (D measured, then one for the warm-up), "questions": [[text] * Q] * D,
    "order": [(document, question)] (a seeded shuffle of every pair), "warmup": [(D, question)] * warmup}."""
    from criticalkv.bench.prompts import corpus_ids, make_prompts, make_questions

    ids = corpus_ids(tokenizer)
    documents = make_prompts(tokenizer, isl, docs + 1, seed=seed, ids=ids)
    asked = [make_questions(tokenizer, d, questions if i < docs else max(warmup, 1), question_tokens, seed, chat)
             for i, d in enumerate(documents)]
    order = [(d, q) for d in range(docs) for q in range(questions)]
    random.Random(f"bench-docqa-order/{seed}").shuffle(order)
    return {"documents": [d.text for d in documents], "questions": asked, "order": order,
            "warmup": [(docs, q) for q in range(warmup)]}


#: The shared-context kinds ``--facts`` asks: every kind with a reference answer that the bundled model answers with its
#: full cache (``criticalkv.eval.shared_context.DEFAULT_KINDS`` without ``open``): 8 questions a document.
FACT_KINDS = ("key", "keys", "chain", "owner")
#: The domains ``--facts`` takes its documents from, in turn.
FACT_DOMAINS = ("shakespeare", "docs", "legal", "code")


def facts_workload(tokenizer, isl: int, docs: int, questions: int, seed: int, warmup: int) -> dict:
    """``workload``'s dict for ``--facts``: ``docs`` shared-context documents of ``isl`` tokens (the domains' evaluation
    split, taken in turn) and one more for the warm-up, each with its first ``questions`` questions of ``FACT_KINDS``,
    as texts whose tokens are the document's context ids and each question's ids; ``facts[d][q]``: the question's key,
    kind, metric, reference answers and answer length (``max_tokens``); ``document_keys[d]``."""
    from criticalkv.eval.shared_context import shared_documents

    per_domain = -(-(docs + 1) // len(FACT_DOMAINS))
    shared = shared_documents(tokenizer, FACT_DOMAINS, per_domain, lengths=(isl,), seed=seed, split="eval",
                              kinds=FACT_KINDS, chat=True)[:docs + 1]
    if any(len(d.questions) < questions for d in shared):
        raise ValueError(f"--questions {questions}: a --facts document asks {min(len(d.questions) for d in shared)}")
    decode = lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False)  # noqa: E731
    documents, asked, facts = [], [], []
    for i, d in enumerate(shared):
        wanted = d.questions[:questions if i < docs else max(warmup, 1)]
        documents.append(decode(d.context_ids))
        asked.append([decode(q.ids) for q in wanted])
        facts.append([{"key": q.key, "kind": q.kind, "metric": q.metric, "answers": list(q.answers),
                       "max_tokens": q.max_new_tokens} for q in wanted])
    order = [(d, q) for d in range(docs) for q in range(questions)]
    random.Random(f"bench-docqa-order/{seed}").shuffle(order)
    return {"documents": documents, "questions": asked, "facts": facts, "document_keys": [d.key for d in shared],
            "order": order, "warmup": [(docs, q) for q in range(warmup)]}


def bodies(work: dict, pairs, osl: int, chat: bool, kv_budget: int | None) -> list[dict]:
    """The requests of (document, question) ``pairs``: ``osl`` tokens with ``ignore_eos``, or with ``--facts`` (a
    workload with ``facts``) each question's own answer length, stopping at EOS."""
    facts = work.get("facts")
    return [request_body(work["questions"][d][q], facts[d][q]["max_tokens"] if facts else osl, not facts, kv_budget,
                         context=work["documents"][d], chat=chat if chat else None) for d, q in pairs]


def score_run(run: dict, work: dict) -> None:
    """Score every answered request of a ``--facts`` run (its ``score``, by its question's metric) and set the run's
    ``accuracy``: (mean, low, high, n) with a 95 % cluster-bootstrap interval over documents."""
    from criticalkv.eval.shared_context import score_answer
    from criticalkv.eval.shared_stats import cluster_mean_ci

    for r in run["requests"]:
        fact = work["facts"][r["document"]][r["question"]]
        r["fact"] = fact["key"]
        r["kind"] = fact["kind"]
        r["score"] = score_answer(fact["metric"], r["answer"], fact["answers"]) if r["ok"] else None
        r["document_key"] = work["document_keys"][r["document"]]
    values, doc_of = run_scores(run)
    run["accuracy"] = list(cluster_mean_ci(values, doc_of))


def run_scores(run: dict) -> tuple[dict[str, float], dict[str, str]]:
    """({question key: score}, {question key: document key}) of a scored run's answered requests."""
    values = {r["fact"]: float(r["score"]) for r in run["requests"] if r.get("score") is not None}
    doc_of = {r["fact"]: r["document_key"] for r in run["requests"] if "fact" in r}
    return values, doc_of


def accuracy_versus(results: dict) -> list[dict]:
    """Every scored run against the base (vLLM's first run, else the first run): the paired difference in accuracy on
    the questions both answered (``criticalkv.eval.shared_stats.paired``), the target's verdict (lower end >= -2
    points)."""
    from criticalkv.eval.shared_stats import paired

    runs = [r for r in results["runs"] if r.get("accuracy")]
    base = next((r for r in runs if r["engine"]["label"] == "vllm"), runs[0] if runs else None)
    if base is None:
        return []
    b, doc_of = run_scores(base)
    out = []
    for run in runs:
        if run is base:
            continue
        a, _ = run_scores(run)
        p = paired(a, b, doc_of)
        out.append({"engine": run["engine"]["label"], "repeat": run["engine"].get("repeat"),
                    "base": base["engine"]["label"], **p,
                    "met": None if p["n"] == 0 else bool(p["ci95"][0] >= -TARGET_ACCURACY_POINTS / 100)})
    return out


def accuracy_text(accuracy) -> str:
    """(mean, low, high, n) as '40.6 [35.0, 46.2]' (percent)."""
    mean, lo, hi = accuracy[:3]
    return f"{100 * mean:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"


def summarize_run(run: dict) -> dict:
    """The docqa figures of one server run: hit rate, TTFT by hit / miss, KV MiB held."""
    s, m = run["summary"], run["server_metrics"]
    rows = [r for r in run["requests"] if r["ok"]]
    held = m.get("criticalkv_kv_bytes_reserved") or {}
    running = m.get("criticalkv_requests_running") or {}
    cache_held, cache_entries = (m.get(f"criticalkv_context_cache:{k}") or {} for k in ("bytes_held", "entries"))
    evictions = m.get("criticalkv_context_cache:evictions") or {}
    return {
        "hit_rate": s.get("context_cache_hit_rate"), "hits": s.get("context_cache_hits"),
        "misses": s.get("context_cache_misses"),
        "ttft_ms_hit": distribution([r["ttft_ms"] for r in rows if r["context_cache_hit"] is True]),
        "ttft_ms_miss": distribution([r["ttft_ms"] for r in rows if r["context_cache_hit"] is False]),
        "kv_mib_held_peak": None if held.get("peak") is None else held["peak"] / 2**20,
        "kv_mib_held_mean": None if held.get("mean") is None else held["mean"] / 2**20,
        "running_peak": running.get("peak"), "running_mean": running.get("mean"),
        "cache_mib_held_mean": None if cache_held.get("mean") is None else cache_held["mean"] / 2**20,
        "cached_contexts_mean": cache_entries.get("mean"), "cached_contexts_peak": cache_entries.get("peak"),
        # the gauge counts since the server started: what this run evicted (warm-up and sampling gaps aside)
        "cache_evictions": None if not evictions else evictions["last"] - evictions["first"],
        **vllm_figures(m),
    }


def vllm_figures(m: dict) -> dict:
    """vLLM's counterparts from its gauges (``served.VLLM_GAUGES``): its prefix cache's hit rate over the run (tokens
    found cached / tokens looked up), its KV blocks in use (mean and peak share), the preemptions during the run."""
    def grew(name):
        g = m.get(name) or {}
        return None if not g else g["last"] - g["first"]

    queries, hits = grew("vllm:prefix_cache_queries_total"), grew("vllm:prefix_cache_hits_total")
    usage, running = m.get("vllm:kv_cache_usage_perc") or {}, m.get("vllm:num_requests_running") or {}
    if not (usage or running):
        return {}
    return {"prefix_token_hit_rate": hits / queries if queries else None,
            "kv_usage_mean": usage.get("mean"), "kv_usage_peak": usage.get("peak"),
            "preemptions": grew("vllm:num_preemptions_total"),
            "running_peak": running.get("peak"), "running_mean": running.get("mean")}


def answer_pairs(run: dict, ref: dict) -> list[tuple[str, str, bool | None]]:
    """(``run``'s answer, ``ref``'s answer, whether ``run`` answered from a cache hit) for every (document, question)
    both answered."""
    answers = {(q["document"], q["question"]): q.get("answer") for q in ref["requests"] if q["ok"]}
    pairs = [(q.get("answer"), answers.get((q["document"], q["question"])), q.get("context_cache_hit"))
             for q in run["requests"] if q["ok"]]
    return [p for p in pairs if p[0] is not None and p[1] is not None]


def agreement(results: dict, base: str = "vllm") -> list[dict]:
    """Per run of another server: the share of its answers equal to ``base``'s answer to the same (document,
    question) (``base``'s first run; its cache is lossless), over the first ``chars`` characters (32) and whole."""
    ref = next((r for r in results["runs"] if r["engine"]["label"] == base), None)
    if ref is None:
        return []
    out = []
    for run in results["runs"]:
        if run["engine"]["label"] == base:
            continue
        pairs = [(a, b) for a, b, _ in answer_pairs(run, ref)]
        n = len(pairs)
        out.append({"engine": run["engine"]["label"], "repeat": run["engine"].get("repeat"), "base": base, "n": n,
                    "same_32_chars": sum(a.strip()[:32] == b.strip()[:32] for a, b in pairs) / n if n else None,
                    "same_answer": sum(a.strip() == b.strip() for a, b in pairs) / n if n else None})
    return out


def dtype_agreement(results: dict) -> list[dict]:
    """Per run of a ``[cache float16]`` server: the share of its answers equal to the same engine's ``[cache float32]``
    server's (its first run: the exact copies) to the same (document, question), all of them and those it answered
    from a cache hit apart (greedy, ``--osl`` tokens; the float32 server's own answers may differ where its batches
    did: ONNX Runtime rounds a batch of one and of several apart, ~1e-7)."""
    runs = results["runs"]
    out = []
    for run in runs:
        if run["engine"].get("variant") != "cache float16":
            continue
        base_label = run["engine"]["label"].replace("[cache float16]", "[cache float32]")
        ref = next((r for r in runs if r["engine"]["label"] == base_label), None)
        if ref is None:
            continue
        pairs = answer_pairs(run, ref)
        hits = [p for p in pairs if p[2]]
        out.append({"engine": run["engine"]["label"], "repeat": run["engine"].get("repeat"), "base": base_label,
                    "n": len(pairs), "same_answer": sum(a.strip() == b.strip() for a, b, _ in pairs),
                    "same_32_chars": sum(a.strip()[:32] == b.strip()[:32] for a, b, _ in pairs),
                    "n_hits": len(hits), "same_answer_hits": sum(a.strip() == b.strip() for a, b, _ in hits)})
    return out


RATIOS = {
    "output_throughput": lambda r: r["summary"].get("output_throughput"),
    "ttft_p50_ms": lambda r: (r["summary"].get("ttft_ms") or {}).get("p50"),
    "ttft_p90_ms": lambda r: (r["summary"].get("ttft_ms") or {}).get("p90"),
    "hit_rate": lambda r: r["docqa"]["hit_rate"],
    "kv_mib_held_mean": lambda r: r["docqa"]["kv_mib_held_mean"],
}


def versus_vllm(results: dict) -> None:
    """Each server's medians over its runs and their ratios to vLLM's (``results["medians"]``, ``["versus_vllm"]``),
    with each round's ratio (``rounds``: the two servers of a round ran one after the other, so the machine's drift
    between rounds cancels in it)."""
    results["medians"] = served.median_runs(results["runs"], RATIOS)
    results["versus_vllm"] = served.versus_peer(results["medians"])
    for row in results["versus_vllm"]:
        row["rounds"] = {k: served.paired_ratios(results["runs"], RATIOS[k], row["engine"], row["base"])
                         for k in ("output_throughput", "ttft_p50_ms", "ttft_p90_ms")}


def targets(results: dict) -> list[dict]:
    """The two docqa targets (``TARGET_THROUGHPUT``, ``TARGET_TTFT_P50``), per non-full server; ``met`` None when
    the run is not the target's workload."""
    s = results["settings"]
    is_target = all(s.get(k) == v for k, v in TARGET_WORKLOAD.items())
    out = []
    for row in results.get("versus_full", []):
        tput, ttft = row["output_throughput"]["ratio"], row["ttft_p50_ms"]["ratio"]
        for what, value, goal, ok in (
                (f"output tokens/s >= {TARGET_THROUGHPUT:g}x full", tput, TARGET_THROUGHPUT,
                 None if tput is None else tput >= TARGET_THROUGHPUT),
                (f"TTFT p50 <= {TARGET_TTFT_P50:g}x full", ttft, TARGET_TTFT_P50,
                 None if ttft is None else ttft <= TARGET_TTFT_P50)):
            out.append({"engine": row["engine"], "what": what, "ratio": value, "goal": goal,
                        "met": ok if is_target else None, "target_workload": is_target})
    return out


def dtype_note(dtypes: list[str] | None) -> str:
    """The context cache's element type(s) of a run, for its header ('' when serve's default was used)."""
    if not dtypes:
        return ""
    if len(dtypes) == 1:
        return f", --context-cache-dtype {dtypes[0]}"
    return f", each engine once per --context-cache-dtype ({', '.join(dtypes)})"


def render(results: dict) -> str:
    s = results["settings"]
    f = served.fmt
    asked = (f"questions of `criticalkv eval shared-context` ({', '.join(FACT_KINDS)}; each answered up to its own "
             "length, 8-16 tokens, stopping at EOS)") if s.get("facts") else \
        f"questions ({s['question_tokens']} tokens) each"
    osl = "" if s.get("facts") else f", OSL {s['osl']}"
    lines = served.header_block(results) + [
        f"{s['docs']} {'evaluation documents (' + ', '.join(FACT_DOMAINS) + ' in turn)' if s.get('facts') else 'documents'} "
        f"of {s['isl']} tokens x {s['questions']} {asked}, "
        f"{s['docs'] * s['questions']} requests in a random order (seed {s['seed']}), concurrency {s['concurrency']}"
        f"{osl}{', chat template' if s['chat'] else ''}. Every server: --kv-memory-mib {f(s['kv_memory_mib'], 1)} "
        f"({s['kv_memory_note']}), --context-cache-mib {f(s['context_cache_mib'], 1)}"
        f"{dtype_note(s.get('context_cache_dtypes'))}. Hit rate ceiling "
        f"{f(100 * s['hit_rate_ceiling'], 1)} % (each document's first request must miss).", "",
        "| server | ok / failed | hit rate | TTFT p50 (ms) | TTFT p90 (ms) | TTFT p50 hit / miss (ms) | output tokens/s "
        "| KV MiB held, mean (peak) | cached contexts, mean (peak; evictions) | running, mean (peak) | duration (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in results["runs"]:
        sm, d = run["summary"], run["docqa"]
        if not sm.get("completed"):
            lines.append(f"| {run['engine']['label']} | 0 / {sm.get('failed')} | all failed: {run.get('first_error')} "
                         "| | | | | | | | |")
            continue
        hit = "-" if d["hit_rate"] is None else f"{100 * d['hit_rate']:.1f} % ({d['hits']} of {d['hits'] + d['misses']})"
        lines.append(
            f"| {run['engine']['label']} | {sm['completed']} / {sm['failed']} | {hit} | {f(sm['ttft_ms']['p50'])} "
            f"| {f(sm['ttft_ms']['p90'])} | {f(d['ttft_ms_hit']['p50'])} / {f(d['ttft_ms_miss']['p50'])} "
            f"| {f(sm['output_throughput'], 2)} | {f(d['kv_mib_held_mean'])} ({f(d['kv_mib_held_peak'])}) "
            f"| {f(d.get('cached_contexts_mean'), 2)} ({f(d.get('cached_contexts_peak'), 0)}; {f(d.get('cache_evictions'), 0)}) "
            f"| {f(d['running_mean'], 2)} ({f(d['running_peak'], 0)}) | {f(sm['duration_s'], 1)} |")
    scored = [r for r in results["runs"] if r.get("accuracy")]
    if scored:
        lines += ["", "Accuracy (the mean score of the answers, % with a 95 % cluster-bootstrap interval over documents):",
                  "", "| server | round | accuracy % | questions |", "|---|---|---|---|"]
        for run in scored:
            lines.append(f"| {run['engine']['label']} | {(run['engine'].get('repeat') or 0) + 1} "
                         f"| {accuracy_text(run['accuracy'])} | {run['accuracy'][3]} |")
    if results.get("accuracy_versus"):
        lines += ["", f"Paired on the same questions (points; target: the interval's lower end >= "
                      f"-{TARGET_ACCURACY_POINTS:g}):", "", "| server - base | round | difference [95 % interval] "
                  "| won / lost | sign test p | questions | met |", "|---|---|---|---|---|---|---|"]
        for v in results["accuracy_versus"]:
            lo, hi = v["ci95"]
            lines.append(f"| {v['engine']} - {v['base']} | {(v['repeat'] or 0) + 1} | {100 * v['mean_diff']:+.1f} "
                         f"[{100 * lo:+.1f}, {100 * hi:+.1f}] | {v['wins']} / {v['losses']} | {v['sign_test_p']:.2g} "
                         f"| {v['n']} | {'-' if v['met'] is None else 'yes' if v['met'] else 'no'} |")
    if results.get("versus_full"):
        lines += ["", "| server / full | output tokens/s | TTFT p50 | TTFT p90 | hit rate | KV MiB held (mean) |",
                  "|---|---|---|---|---|---|"]
        for row in results["versus_full"]:
            lines.append(f"| {row['engine']} / {row['base']} | " + " | ".join(
                f"{f(row[k]['ratio'], 2)}x" if row[k]["ratio"] is not None else "-"
                for k in ("output_throughput", "ttft_p50_ms", "ttft_p90_ms", "hit_rate", "kv_mib_held_mean")) + " |")
    if results.get("versus_vllm"):
        lines += ["", "Medians over each server's runs (" + ", ".join(f"{m['engine']}: {m['runs']}" for m in results["medians"]) + "), "
                  "ratios to vLLM's (same KV memory, its prefix caching on):", "",
                  "| server / vllm | output tokens/s | TTFT p50 | TTFT p90 |", "|---|---|---|---|"]
        for row in results["versus_vllm"]:
            lines.append(f"| {row['engine']} | " + " | ".join(
                f"{f(row[k]['value'], 1)} / {f(row[k]['base'], 1)} = {f(row[k]['ratio'], 2)}x"
                for k in ("output_throughput", "ttft_p50_ms", "ttft_p90_ms")) + " |")
        for row in results["versus_vllm"]:
            rounds = (row.get("rounds") or {}).get("output_throughput") or []
            if len(rounds) > 1:
                lines.append(f"\n{row['engine']}: output tokens/s per round, each against that round's vLLM (the two "
                             f"servers of a round ran one after the other): {', '.join(f'{r:.2f}x' for r in rounds)}")
        vllm_runs = [r for r in results["runs"] if r["engine"]["label"] == "vllm"]
        for r in vllm_runs:
            d = r["docqa"]
            lines.append(f"\nvLLM (round {r['engine'].get('repeat', 0) + 1}): prefix-cache token hit rate "
                         f"{f(None if d.get('prefix_token_hit_rate') is None else 100 * d['prefix_token_hit_rate'])} %, "
                         f"KV blocks in use mean {f(None if d.get('kv_usage_mean') is None else 100 * d['kv_usage_mean'])} % "
                         f"(peak {f(None if d.get('kv_usage_peak') is None else 100 * d['kv_usage_peak'])} %), "
                         f"preemptions {f(d.get('preemptions'), 0)}, running mean {f(d.get('running_mean'), 2)} "
                         f"(peak {f(d.get('running_peak'), 0)}); KV {r['engine'].get('vllm_kv')}")
        for a in results.get("agreement_with_vllm", []):
            lines.append(f"\nAnswers equal to vLLM's ({a['engine']}, round {(a['repeat'] or 0) + 1}, {a['n']} answers): "
                         f"first 32 characters {f(None if a['same_32_chars'] is None else 100 * a['same_32_chars'])} %, "
                         f"whole answer {f(None if a['same_answer'] is None else 100 * a['same_answer'])} %")
    for a in results.get("agreement_with_float32_cache", []):
        lines.append(f"\nAnswers of {a['engine']} (round {(a['repeat'] or 0) + 1}) equal to {a['base']}'s (greedy): "
                     f"{a['same_answer']} of {a['n']} whole ({a['same_32_chars']} of {a['n']} on their first 32 "
                     f"characters); of its {a['n_hits']} cache hits, {a['same_answer_hits']} whole")
    rows = targets(results)
    if rows:
        lines.append("")
        for t in rows:
            met = ("met" if t["met"] else "NOT met") if t["met"] is not None else \
                ("-" if t["target_workload"] else "- (not the target's workload: D 16, Q 8, ISL 2048, 4 contexts of memory, "
                 "concurrency 8)")
            lines.append(f"Target ({t['engine']}: {t['what']}): {f(t['ratio'], 2)}x, {met}.")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in results["runs"] if r["summary"].get("completed")]
    several = len({r["engine"].get("repeat") for r in runs}) > 1
    labels = [r["engine"]["label"] + (f" #{r['engine']['repeat'] + 1}" if several else "") for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    ax.bar(labels, [r["summary"]["output_throughput"] for r in runs], color="tab:blue")
    for i, r in enumerate(runs):
        rate, accuracy = r["docqa"]["hit_rate"], r.get("accuracy")
        label = ", ".join(([] if rate is None else [f"hits {100 * rate:.0f} %"]) +
                          ([] if not accuracy else [f"accuracy {100 * accuracy[0]:.1f} %"]))
        ax.text(i, r["summary"]["output_throughput"], label, ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput (context-cache hit rate)")
    ax = axes[1]
    width = 0.2
    for k, (key, name) in enumerate((("p50", "p50"), ("p90", "p90"))):
        ax.bar([i + (k - 1.5) * width for i in range(len(runs))], [r["summary"]["ttft_ms"][key] for r in runs],
               width, label=f"TTFT {name}, all")
    for k, (key, name) in enumerate((("ttft_ms_hit", "hits"), ("ttft_ms_miss", "misses"))):
        ax.bar([i + (k + 0.5) * width for i in range(len(runs))], [r["docqa"][key]["p50"] or 0 for r in runs],
               width, label=f"TTFT p50, {name}")
    ax.set_xticks(range(len(runs)), labels)
    ax.set_yscale("log")
    ax.set_ylabel("ms")
    ax.set_title("time to first token")
    ax.legend(fontsize=7)
    ax = axes[2]
    for r, marker in zip(runs, "os^vDPX*h<>" * 4):
        for hit, color in ((True, "tab:green"), (False, "tab:red"), (None, "tab:gray")):
            pts = [(q["start_s"], q["ttft_ms"]) for q in r["requests"] if q["ok"] and q["context_cache_hit"] is hit]
            if pts:
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], c=color, marker=marker, s=14, alpha=0.7,
                           label=f"{r['engine']['label']}, {'hit' if hit else 'miss' if hit is False else 'no context cache'}")
    ax.set_yscale("log")
    ax.set_xlabel("request start (s after the first)")
    ax.set_ylabel("TTFT (ms, log)")
    ax.set_title("each request")
    ax.legend(fontsize=7)
    s = results["settings"]
    memory = "the server's" if s["kv_memory_mib"] is None else f"{s['kv_memory_mib']:.0f} MiB"
    answers = "fact questions, answers of 8-16 tokens" if s.get("facts") else f"questions, OSL {s['osl']}"
    fig.suptitle(f"docqa: {s['docs']} docs x {s['questions']} {answers}, ISL {s['isl']}, "
                 f"conc {s['concurrency']}, KV memory {memory}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args) -> int:
    served.check_server_arguments(args)
    if min(args.isl, args.docs, args.questions, args.question_tokens, args.osl, args.concurrency) < 1:
        raise ValueError("--isl, --docs, --questions, --question-tokens, --osl and --concurrency must be >= 1")
    if args.facts and args.chat:
        raise ValueError("--facts sends each document with its own chat framing (the evaluation's); leave out --chat")
    if args.warmup < 0:
        raise ValueError("--warmup must be >= 0")
    given_mib, contexts = args.kv_memory
    extra = served.split_server_args(args.server_args, served.OWN_FLAGS + ("--context-cache-dtype",))
    dtypes = cache_dtypes(args.context_cache_dtype, several=True)
    if dtypes and args.url:
        raise ValueError("--context-cache-dtype: the running server (--url) keeps its own; start one with "
                         "--engine-dir instead")
    if given_mib is not None:
        memory, note = given_mib, "given"
    elif args.engine_dir and not args.url:
        full = served.full_engine(args.engine_dir)
        memory = served.kv_mib(full, args.isl, contexts)
        note = (f"{contexts:g} uncompressed {args.isl}-token contexts of {Path(full).name}: "
                f"{served.kv_mib(full, args.isl, 1):.2f} MiB each")
    else:
        memory, note = None, "the running server's"
    cache = memory if args.context_cache_mib is None else args.context_cache_mib
    server_args = extra + ([] if memory is None else ["--kv-memory-mib", served.mib_flag(memory)]) + \
        ([] if cache is None else ["--context-cache-mib", served.mib_flag(cache)]) + \
        (["--context-cache-dtype", dtypes[0]] if len(dtypes) == 1 else [])
    # several dtypes: each engine once per dtype (interleaved), labelled [cache DTYPE]
    variants = [(f"cache {d}", ["--context-cache-dtype", d]) for d in dtypes] if len(dtypes) > 1 else None
    stem = args.out
    results = machine.header(args.command_line)
    results["benchmark"] = "docqa"
    results["uptime_before"] = served.uptime()
    results["settings"] = {"isl": args.isl, "docs": args.docs, "questions": args.questions,
                           "question_tokens": args.question_tokens, "osl": args.osl, "concurrency": args.concurrency,
                           "warmup": args.warmup, "chat": args.chat, "seed": args.seed, "kv_budget": args.kv_budget,
                           "facts": args.facts,
                           "kv_memory_mib": memory, "kv_memory_note": note, "context_cache_mib": cache,
                           "context_cache_dtypes": dtypes or None,
                           "kv_contexts": contexts if given_mib is None and not args.url else None,
                           "server_args": server_args, "hit_rate_ceiling": (args.questions - 1) / args.questions}
    results["runs"] = served.previous_runs(args, stem, results)
    print("\n".join(machine.header_lines(results)), flush=True)
    print(f"KV memory per server: {'-' if memory is None else f'{memory:.2f}'} MiB ({note}); context cache "
          f"{'-' if cache is None else f'{cache:.2f}'} MiB", flush=True)
    tokenizer = served.load_tokenizer(args)
    work = facts_workload(tokenizer, args.isl, args.docs, args.questions, args.seed, args.warmup) if args.facts else \
        workload(tokenizer, args.isl, args.docs, args.questions, args.question_tokens, args.seed, args.chat, args.warmup)
    measured = bodies(work, work["order"], args.osl, args.chat, args.kv_budget)
    warm = bodies(work, work["warmup"], args.osl, args.chat, args.kv_budget)
    labels = [{"document": d, "question": q} for d, q in work["order"]]

    def on_server(endpoint: Endpoint, metrics_url, engine: dict) -> None:
        for body in warm:  # one after the other: the first compresses the warm-up document, the next hit it
            record = send_request(endpoint, body)
            if record.error:
                raise RuntimeError(f"{engine['label']}: warm-up request failed: {record.error}")
        run = served.measure_run(endpoint, metrics_url, engine, server_args, lambda: run_load(
            endpoint, measured, concurrency=args.concurrency,
            progress=f"docqa {engine['label']}"), extra=labels)
        run["docqa"] = summarize_run(run)
        if args.facts:
            score_run(run, work)
        results["runs"].append(run)
        results["accuracy_versus"] = accuracy_versus(results)
        results["versus_full"] = served.versus_full(results["runs"], RATIOS)
        served.write_results(results, stem, render, None)
        d, sm = run["docqa"], run["summary"]
        print(f"{engine['label']}: {sm.get('completed', 0)} ok, {sm.get('failed', 0)} failed; hit rate "
              f"{served.fmt(None if d['hit_rate'] is None else 100 * d['hit_rate'])} %, TTFT p50 "
              f"{served.fmt((sm.get('ttft_ms') or {}).get('p50'))} ms, {served.fmt(sm.get('output_throughput'), 2)} "
              "output tokens/s" + (f", accuracy {accuracy_text(run['accuracy'])}" if run.get("accuracy") else ""),
              flush=True)

    served.on_each_server(args, server_args, on_server, results, variants=variants)
    if args.vllm:
        versus_vllm(results)
        results["agreement_with_vllm"] = agreement(results)
    if len(dtypes) > 1:
        results["agreement_with_float32_cache"] = dtype_agreement(results)
    results["uptime_after"] = served.uptime()
    machine.finish(results)
    served.write_results(results, stem, render, plot)
    print(render(results), flush=True)
    print(f"results: {stem}.json / .md / .png", flush=True)
    failed = sum(r["summary"].get("failed", 0) for r in results["runs"])
    return 1 if failed else 0


def add_workload_arguments(load, per: str = "server", docs: int = 16, docs_why: str = "") -> None:
    """The doc-QA workload's options (``bench docqa`` and ``python -m benchmarks.replicas``, which runs the same
    workload with its own default number of documents, ``docs``, and why, ``docs_why``)."""
    load.add_argument("--isl", type=int, default=2048, help="tokens per document (default: 2048)")
    load.add_argument("--docs", type=int, default=docs, help=f"documents, D (default: {docs}{docs_why})")
    load.add_argument("--questions", type=int, default=8, help="questions per document, Q (default: 8)")
    load.add_argument("--question-tokens", type=int, default=32,
                      help="tokens of each question as the server runs it after the context (default: 32)")
    load.add_argument("--osl", type=int, default=64, help="new tokens per request (default: 64)")
    load.add_argument("--concurrency", type=int, default=8, help="requests in flight, closed loop (default: 8)")
    load.add_argument("--warmup", type=int, default=2,
                      help=f"warm-up requests per {per} on a document of their own, not measured (default: 2)")
    load.add_argument("--seed", type=int, default=0, help="documents, questions and their order (default: 0)")


def add_memory_arguments(mem, per: str = "server", several_dtypes: bool = False) -> None:
    """Every server's KV memory and context cache, sized in uncompressed documents (``bench docqa``, ``replicas``).
    ``several_dtypes``: ``--context-cache-dtype`` may name several, each engine then started once per dtype."""
    served.add_kv_memory_argument(mem, "4", "uncompressed --isl-token documents")
    mem.add_argument("--context-cache-mib", type=float,
                     help=f"each {per}'s --context-cache-mib (default: the KV memory: the cache may use all of it)")
    mem.add_argument("--context-cache-dtype", metavar="DTYPE" + ("[,DTYPE...]" if several_dtypes else ""),
                     help=f"each {per}'s --context-cache-dtype ({' or '.join(CONTEXT_CACHE_DTYPES)}; default: serve's, "
                          f"{DEFAULT_CONTEXT_CACHE_DTYPE})" + (
                              "; several, comma-separated (float32,float16): each engine started once per dtype, "
                              "interleaved, labelled [cache DTYPE]" if several_dtypes else ""))


def cache_dtypes(text: str | None, several: bool) -> list[str]:
    """``--context-cache-dtype``'s names (empty: serve's default); ValueError on an unknown one, or on several where
    ``several`` is False."""
    if text is None:
        return []
    names = served.comma_choices(text, "--context-cache-dtype", CONTEXT_CACHE_DTYPES)
    if len(names) != len(set(names)):
        raise ValueError(f"--context-cache-dtype: {text!r} names a dtype twice")
    if len(names) > 1 and not several:
        raise ValueError(f"--context-cache-dtype: give one of {', '.join(CONTEXT_CACHE_DTYPES)}, got {text!r}")
    return names


def add_arguments(p) -> None:
    served.add_server_arguments(p)
    load = p.add_argument_group("workload")
    add_workload_arguments(load)
    load.add_argument("--chat", action="store_true",
                      help="send apply_chat_template: context and question form one user message of the chat template")
    load.add_argument("--kv-budget", type=int, help="per-request kv_budget (default: the engine's)")
    load.add_argument("--facts", action="store_true",
                      help="documents and questions of `criticalkv eval shared-context` (the domains' evaluation "
                           "documents of --isl tokens, facts inserted; --questions of their 8 questions with a reference "
                           "answer), each answered up to its own length and stopping at EOS (not --osl), every answer "
                           "scored: accuracy per server with a 95 %% interval, and paired against vLLM's (--vllm)")
    add_memory_arguments(p.add_argument_group("memory (the same for every server)"), several_dtypes=True)
    out = p.add_argument_group("output")
    add_out_argument(out, "results/benchmarks/serving/docqa")
