"""``python -m benchmarks.cached``: time to first token of a question after a cached context vs uncached.

On one server after the other (``--engine-dir``, repeat), ``--warmup`` unmeasured rounds then ``--repeats`` rounds;
round i takes a document of its own (``--isl`` tokens, never sent before, so not in the cache) and a question
(``--question-tokens`` tokens as the server runs it after the context) and sends, one after the other:

* ``uncached``: the document as ``context`` and the question as ``text_input``: the server prefills and compresses
  the document, caches it, then runs the question (its response says ``context_cache_hit`` false);
* ``cached``: the same request again: the compressed document comes from the cache, only the question runs
  (``context_cache_hit`` true).

Both ask ``--osl`` new tokens (greedy, ``ignore_eos``); nothing else runs on the server. Per server: TTFT of each
case (median, p90, min-max) and the ratio cached / uncached, of the medians and per round (the same round's two
requests, seconds apart: little exposed to load drifting between rounds). The target (ISL 2048 context,
32-token question): cached TTFT <= 0.1x uncached. Rounds where the hit flags are not (false, true) are kept in
the JSON and left out of the statistics (``flags_ok``).

``--scoring-cost`` also measures, in this process on each ``--engine-dir`` (before its server starts, alone), what
compressing one of those documents as a context costs on the engine: the prefill of the context (its extend chunks),
the context reconstruction that scores it when the context policy re-reads contexts (kvzip), and the selection, per
round; the target for the reconstruction: <= 1.1x the prefill (``SCORING_GOAL``).

Results (``--out STEM``): ``STEM.json`` (command, machine, load average, versions, every request), ``STEM.md``,
``STEM.png``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import benchmarks
from criticalkv.bench import machine, served
from criticalkv.bench.report import add_out_argument
from criticalkv.bench.client import Endpoint, request_body, send_request
from criticalkv.bench.metrics import distribution

CASES = ("uncached", "cached")
#: The target: a cached-context question's TTFT <= this fraction of the same request uncached.
TARGET_RATIO = 0.1
TARGET_WORKLOAD = {"isl": 2048, "question_tokens": 32}
#: The target for a context policy that re-reads the context (kvzip): reconstruction <= this x the prefill.
SCORING_GOAL = 1.1


def scoring_cost(engine_dir: Path, contexts: list[list[int]], threads: int = 0) -> dict:
    """Per context (token ids): seconds of its prefill (extend chunks), of its reconstruction (kvzip's scoring pass,
    0 for a context policy that does not re-read) and of its selection, on the engine in this process
    (``Engine.begin_prefill(context=True)`` ... ``finish_prefill``, as the scheduler compresses a context); medians and
    the ratio reconstruction / prefill against ``SCORING_GOAL``."""
    import time

    from criticalkv.policy import policy_spec
    from criticalkv.request import Request
    from criticalkv.runtime import Engine

    engine = Engine.load(engine_dir, threads=threads)
    rows = []
    try:
        for ids in contexts:
            job = engine.begin_prefill(Request(list(ids)), context=True)
            engine.prefill_step(job, job.remaining)
            prefill_s = job.seconds
            start = time.perf_counter()
            result = engine.finish_prefill(job, engine.free_slots()[0])
            rest = time.perf_counter() - start
            engine.release_all()
            rows.append({"tokens": len(ids), "prefill_s": prefill_s, "scoring_s": result.scoring_s,
                         "selection_s": rest - result.scoring_s})
        policy = engine.policy_for(True)
    finally:
        engine.close()
    out = {"context_policy": policy_spec(policy), "rounds": rows}
    for key in ("prefill_s", "scoring_s", "selection_s"):
        out[key] = distribution([r[key] for r in rows])
    ratios = [r["scoring_s"] / r["prefill_s"] for r in rows]
    out["ratio"] = distribution(ratios)
    out["target"] = {"goal": SCORING_GOAL, "met": None if not ratios else out["ratio"]["p50"] <= SCORING_GOAL}
    return out


def summarize_rounds(rounds: list[dict], goal: float = TARGET_RATIO) -> dict:
    """TTFT distributions (ms) of both cases over the rounds whose hit flags were (false, true) and both succeeded,
    the ratio of the medians, the per-round ratios, and the target."""
    good = [r for r in rounds if r["flags_ok"]]
    out = {"rounds": len(rounds), "used": len(good)}
    for case in CASES:
        out[case] = distribution([r[case]["ttft_ms"] for r in good])
    a, b = out["cached"]["p50"], out["uncached"]["p50"]
    out["ratio_p50"] = a / b if a is not None and b else None
    out["paired_ratio"] = distribution([r["cached"]["ttft_ms"] / r["uncached"]["ttft_ms"] for r in good])
    out["target"] = {"goal": goal, "met": None if out["ratio_p50"] is None else out["ratio_p50"] <= goal}
    return out


def render(results: dict) -> str:
    s = results["settings"]
    labels = [run["engine"]["label"] for run in results["runs"]]
    f = served.fmt
    lines = served.header_block(results) + [
        f"Each round: a new {s['isl']}-token document as the context and a {s['question_tokens']}-token question, sent "
        f"twice in a row (uncached, then cached), OSL {s['osl']}; {s['repeats']} rounds after {s['warmup']} warm-up"
        f"{', chat template' if s['chat'] else ''}.", "",
        "| server | rounds used | uncached TTFT p50 (ms) | cached TTFT p50 (ms) | cached p90 | cached / uncached (medians) "
        "| same-round ratio p50 (min-max) | target |",
        "|---|---|---|---|---|---|---|---|"]
    for run in results["runs"]:
        c = run["cached_context"]
        pr = c["paired_ratio"]
        paired = "-" if pr["p50"] is None else f"{pr['p50']:.3f} ({pr['min']:.3f}-{pr['max']:.3f})"
        t = c["target"]
        met = "-" if t["met"] is None else ("met" if t["met"] else "NOT met")
        if not is_target_workload(s):
            met = "- (not the target's workload: ISL 2048 context, 32-token question)"
        lines.append(f"| {server_name(run, labels)} | {c['used']} of {c['rounds']} | {f(c['uncached']['p50'])} "
                     f"| {f(c['cached']['p50'])} | {f(c['cached']['p90'])} | {f(c['ratio_p50'], 3)} | {paired} "
                     f"| <= {t['goal']:g}x: {met} |")
    scored = [run for run in results["runs"] if run.get("scoring_cost")]
    if scored:
        lines += ["", "Compressing one document as a context on the engine, in the bench's process before its server "
                  "started (medians, seconds):", "",
                  "| server | context policy | prefill | reconstruction | selection | reconstruction / prefill p50 "
                  "(min-max) | target |", "|---|---|---|---|---|---|---|"]
        for run in scored:
            c = run["scoring_cost"]
            r = c["ratio"]
            met = "-" if c["target"]["met"] is None else ("met" if c["target"]["met"] else "NOT met")
            lines.append(f"| {server_name(run, labels)} | {c['context_policy']} | {f(c['prefill_s']['p50'], 3)} "
                         f"| {f(c['scoring_s']['p50'], 3)} | {f(c['selection_s']['p50'], 3)} "
                         f"| {f(r['p50'], 3)} ({f(r['min'], 3)}-{f(r['max'], 3)}) | <= {c['target']['goal']:g}x: {met} |")
    return "\n".join(lines) + "\n"


def server_name(run: dict, labels: list[str]) -> str:
    """A run's server in the tables: its engine's label, with the engine directory when another run has the same."""
    label = run["engine"]["label"]
    where = run["engine"].get("engine_dir")
    return f"{label} ({where})" if where and labels.count(label) > 1 else label


def is_target_workload(settings: dict) -> bool:
    return all(settings.get(k) == v for k, v in TARGET_WORKLOAD.items())


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, run in enumerate(results["runs"]):
        for j, case in enumerate(CASES):
            ys = [r[case]["ttft_ms"] for r in run["rounds"] if r[case]["ok"]]
            x = 2 * i + j
            ax.scatter([x] * len(ys), ys, alpha=0.7, color="tab:red" if case == "uncached" else "tab:green", zorder=3)
            med = run["cached_context"][case]["p50"]
            if med is not None:
                ax.hlines(med, x - 0.3, x + 0.3, colors="black", zorder=4)
    ax.set_xticks(range(2 * len(results["runs"])),
                  [f"{r['engine']['label']}\n{c}" for r in results["runs"] for c in CASES], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (ms, log)")
    s = results["settings"]
    ax.set_title(f"question ({s['question_tokens']} tokens) after a {s['isl']}-token context: uncached vs cached",
                 fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:
    from criticalkv.bench.prompts import corpus_ids, make_prompts, make_questions

    served.check_server_arguments(args)
    if min(args.isl, args.question_tokens, args.osl, args.repeats) < 1 or args.warmup < 0:
        raise ValueError("--isl, --question-tokens, --osl and --repeats must be >= 1, --warmup >= 0")
    server_args = served.split_server_args(args.server_args, own=())
    stem = args.out
    results = machine.header(args.command_line)
    results["benchmark"] = "cached-context"
    results["uptime_before"] = served.uptime()
    results["settings"] = {"isl": args.isl, "question_tokens": args.question_tokens, "osl": args.osl,
                           "repeats": args.repeats, "warmup": args.warmup, "chat": args.chat, "seed": args.seed,
                           "kv_budget": args.kv_budget, "server_args": server_args, "goal": TARGET_RATIO}
    results["runs"] = []
    print("\n".join(machine.header_lines(results)), flush=True)
    tokenizer = served.load_tokenizer(args)
    rounds = args.warmup + args.repeats
    documents = make_prompts(tokenizer, args.isl, rounds, seed=args.seed, ids=corpus_ids(tokenizer))
    questions = [make_questions(tokenizer, d, 1, args.question_tokens, args.seed, args.chat)[0] for d in documents]
    bodies = [request_body(q, args.osl, True, args.kv_budget, context=d.text, chat=args.chat if args.chat else None)
              for d, q in zip(documents, questions)]

    scoring = {}
    if args.scoring_cost:  # each engine alone in this process, before any server runs
        from criticalkv.chat import encode_context_question, encode_text

        contexts = [encode_context_question(tokenizer, d.text, q, True)[0] if args.chat else encode_text(tokenizer, d.text)
                    for d, q in zip(documents, questions)][args.warmup:]
        for engine_dir in args.engine_dir or []:
            print(f"scoring cost of {len(contexts)} contexts on {engine_dir} (in this process) ...", flush=True)
            scoring[str(engine_dir)] = scoring_cost(Path(engine_dir), contexts)

    def on_server(endpoint: Endpoint, metrics_url, engine: dict) -> None:
        run = {"engine": engine, "server_args": server_args, "rounds": [], "warmup_rounds": []}
        for engine_dir, cost in scoring.items():
            if Path(engine_dir).resolve() == Path(engine.get("engine_dir") or "").resolve():
                run["scoring_cost"] = cost
        results["runs"].append(run)
        for i, body in enumerate(bodies):
            row = {"round": i - args.warmup, "load_average_before": machine.load_average()}
            for case in CASES:
                record = send_request(endpoint, body)
                row[case] = served.request_json(record, record.start)
            row["load_average_after"] = machine.load_average()
            row["flags_ok"] = (row["uncached"]["ok"] and row["cached"]["ok"]
                               and row["uncached"]["context_cache_hit"] is False and row["cached"]["context_cache_hit"] is True)
            (run["warmup_rounds"] if i < args.warmup else run["rounds"]).append(row)
            if i >= args.warmup:
                run["cached_context"] = summarize_rounds(run["rounds"], TARGET_RATIO)
                served.write_results(results, stem, render, None)
            ttft = [row[c]["ttft_ms"] for c in CASES]
            print(f"{engine['label']} round {row['round']}: TTFT uncached {served.fmt(ttft[0])} ms, cached "
                  f"{served.fmt(ttft[1])} ms, hits {row['uncached']['context_cache_hit']} / "
                  f"{row['cached']['context_cache_hit']}", flush=True)

    served.on_each_server(args, server_args, on_server, results)
    results["uptime_after"] = served.uptime()
    machine.finish(results)
    served.write_results(results, stem, render, plot)
    print(render(results), flush=True)
    print(f"results: {stem}.json / .md / .png", flush=True)
    used = all(r["cached_context"]["used"] == r["cached_context"]["rounds"] for r in results["runs"])
    return 0 if used else 1


def add_arguments(p) -> None:
    served.add_server_arguments(p)
    load = p.add_argument_group("workload")
    load.add_argument("--isl", type=int, default=2048, help="tokens of each round's document (default: 2048)")
    load.add_argument("--question-tokens", type=int, default=32,
                      help="tokens of the question as the server runs it after the context (default: 32)")
    load.add_argument("--osl", type=int, default=4, help="new tokens per request (default: 4)")
    load.add_argument("--repeats", type=int, default=5, help="measured rounds per server (default: 5)")
    load.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first (default: 1)")
    load.add_argument("--chat", action="store_true", help="send apply_chat_template (context and question in one user "
                      "message of the chat template)")
    load.add_argument("--kv-budget", type=int, help="per-request kv_budget (default: the engine's)")
    load.add_argument("--seed", type=int, default=0, help="documents and questions (default: 0)")
    load.add_argument("--scoring-cost", action="store_true",
                      help="also time, in this process on each --engine-dir, a context's prefill, its reconstruction "
                           f"(a context policy that re-reads contexts: kvzip) and its selection (target: reconstruction "
                           f"<= {SCORING_GOAL:g}x the prefill)")
    out = p.add_argument_group("output")
    add_out_argument(out, "results/benchmarks/serving/cached_context")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=benchmarks.prog("cached"), description=benchmarks.plain(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    args.command_line = benchmarks.command_line("cached", argv)
    return args


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(benchmarks.run("cached", main))
