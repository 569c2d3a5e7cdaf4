"""``python -m benchmarks.replicas``: the doc-QA workload of ``bench docqa`` on Ray Serve replicas, then a replica killed.

Each configuration (``--configs``) is one ``criticalkv serve --replicas`` process started here (a local Ray), one after
the other, every replica with the same ``--kv-memory-mib`` and ``--context-cache-mib``:

* ``single``: one replica (``--threads`` x ``--replicas`` ONNX Runtime threads: the same cores as N replicas);
* ``pow2``: N replicas behind Ray Serve's default power-of-two-choices router, no shared store (a plain load balancer:
  each replica compresses the documents it is sent);
* ``affinity``: N replicas behind ``ContextAffinityRouter`` with the shared context store (``pow2-store`` and
  ``affinity-nostore`` separate the two).

The workload is ``bench docqa``'s (the same documents, questions and order for a seed): D documents x Q questions,
closed loop at ``--concurrency``, each request a streamed ``/v1/completions`` with the document as ``context``
(criticalkv's field), greedy, ``ignore_eos``. Per configuration: the requests answered without a prefill of their
document (``context_cache_hit``: from the replica's own cache or, with the store, loaded from it; the replicas'
reports say which), TTFT, output tokens/s, and per replica the requests, compressions and store loads; the router's
decisions (affinity / nobody held it / holders too busy).

Then (``--fault``, on the ``affinity`` deployment): two new documents are compressed (their first tokens: cold
prefills); four streams are started on one of them (the router sends them to its holder) and that replica is SIGKILLed
once each has its first token; every stream must end (an answer, or OpenAI's error object) within 30 s; a new question
on that document goes to the other replica, which loads it from the store: its first token against the cold ones; and
Ray Serve's replacement replica must report within 60 s.

The default workload, D 32 x Q 8 at 360 MiB per replica, holds more documents than one replica's cache keeps beside
its running requests and fewer than two replicas keep: the case a router that keeps each context on one replica is
for. With 16 documents, float16 copies (the context cache's default) fit every document in every replica, so power of
two compresses each at most twice (75 % hits against the ceiling of 87.5 %) and the routers can differ by 1.17x at most.

The targets (2 replicas, D 32 x Q 8, concurrency 8): affinity's hit rate >= single's and >= 1.5x pow2's;
affinity's output tokens/s >= pow2's; the store's first token <= 0.25x a cold prefill's; the kill as above.
Results (``--out STEM``): ``STEM.json`` and ``STEM.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import benchmarks
from criticalkv.bench import machine, served
from criticalkv.bench.report import add_out_argument
from criticalkv.bench.client import run_load, send_openai
from criticalkv.bench.docqa import add_memory_arguments, add_workload_arguments, cache_dtypes, workload
from criticalkv.bench.metrics import RequestRecord, distribution, summarize

#: configuration -> (replicas: None = --replicas, router, shared store)
CONFIGS = {"single": (1, "pow2", False), "pow2": (None, "pow2", False), "pow2-store": (None, "pow2", True),
           "affinity": (None, "affinity", True), "affinity-nostore": (None, "affinity", False)}
LABELS = {"single": "1 replica", "pow2": "{n} replicas, power of two",
          "pow2-store": "{n} replicas, power of two + store", "affinity": "{n} replicas, affinity + store",
          "affinity-nostore": "{n} replicas, affinity"}
#: the ratios a run reports (when it ran both configurations)
RATIO_PAIRS = (("affinity", "single"), ("affinity", "pow2"), ("affinity", "pow2-store"), ("pow2-store", "pow2"),
               ("affinity-nostore", "pow2"))
TARGET_HIT_VS_POW2 = 1.5
TARGET_CROSS_TTFT = 0.25
TARGET_KILL_END_S = 30.0
TARGET_SERVING_AGAIN_S = 60.0
FAULT_STREAMS = 4
#: The model name the replicas serve (`criticalkv serve`'s default --model-name).
MODEL = "criticalkv"


class ReplicaServer:
    """A ``criticalkv serve --replicas`` process (its log in ``log_path``), stopped with Ctrl-C (SIGINT)."""

    def __init__(self, engine_dir: Path, flags: list[str], log_path: Path, ready_timeout: float = 900.0):
        from criticalkv.serving.launcher import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "criticalkv.cli", "serve", "--engine-dir", str(engine_dir),
                        "--openai-port", str(self.port), *flags]
        self.log_path, self.ready_timeout = Path(log_path), ready_timeout
        self.process = None

    def __enter__(self) -> "ReplicaServer":
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.ready_timeout
        while True:
            text = self.log_path.read_text(errors="replace")
            if any(line.startswith("ready:") for line in text.splitlines()):
                return self
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"criticalkv serve --replicas did not start:\n{text[-3000:]}")
            time.sleep(0.5)

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(180)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)
        self.log.close()

    def state(self) -> dict:
        """``GET /replicas`` with ``live``: the replicas whose report is current."""
        with urllib.request.urlopen(f"{self.url}/replicas", timeout=30) as response:
            state = json.loads(response.read())
        state["live"] = [r for r in state["replicas"] if not r["stale"]]
        return state

    def settled(self, check, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            state = self.state()
            if check(state) or time.monotonic() > deadline:
                return state
            time.sleep(0.25)


def openai_body(question: str, document: str | None, osl: int, model: str) -> dict:
    body = {"model": model, "prompt": question, "max_tokens": osl, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if document is not None:
        body["context"] = document
    return body


def record_json(r: RequestRecord, t0: float, **extra) -> dict:
    return {"ok": r.ok, "error": r.error, "ttft_ms": r.ttft * 1e3 if r.ok else None,
            "latency_ms": r.latency * 1e3 if r.ok else None, "output_tokens": r.num_output_tokens if r.ok else None,
            "context_cache_hit": r.context_cache_hit, "start_s": round(r.start - t0, 6), **extra}


def replica_deltas(before: dict, after: dict) -> list[dict]:
    """Per replica (by id) what the run added: requests, context-cache hits / misses (= compressions), store loads."""
    old = {r["replica"]: r for r in before["replicas"]}
    out = []
    for r in after["replicas"]:
        b = old.get(r["replica"], {"requests": 0, "store_loads": 0, "published": 0,
                                   "context_cache": {"hits": 0, "misses": 0, "evictions": 0}})
        out.append({"replica": r["replica"], "requests": r["requests"] - b["requests"],
                    "hits": r["context_cache"]["hits"] - b["context_cache"]["hits"],
                    "compressions": r["context_cache"]["misses"] - b["context_cache"]["misses"],
                    "evictions": r["context_cache"]["evictions"] - b["context_cache"]["evictions"],
                    "store_loads": r["store_loads"] - b["store_loads"],
                    "contexts_held": len(r["contexts"])})
    return out


def digest_of(tokenizer, document: str) -> str:
    from criticalkv.chat import encode_text
    from criticalkv.replicas.store import route_digest
    from criticalkv.serving.context_cache import context_key

    return route_digest(context_key(encode_text(tokenizer, document), "", None)[0])


def fault_phase(server: ReplicaServer, tokenizer, args, model: str) -> dict:
    """Cold prefills of two new documents; four streams on one, its holder SIGKILLed; the same document asked again
    (the other replica loads it from the store); the replacement replica."""
    from criticalkv.bench.prompts import make_prompts, make_questions

    documents = make_prompts(tokenizer, args.isl, 2, seed=args.seed + 7919)
    questions = [make_questions(tokenizer, d, FAULT_STREAMS + 2, args.question_tokens, args.seed + 7919)
                 for d in documents]
    texts = [d.text for d in documents]
    cold = []
    for d in range(2):  # one at a time on an idle deployment: a cold prefill each
        record = send_openai(server.url, openai_body(questions[d][0], texts[d], 8, model))
        if not record.ok or record.context_cache_hit is not False:
            raise RuntimeError(f"fault phase: a new document's first request: {record.error or 'not a miss'}")
        cold.append(record.ttft * 1e3)
    digest = digest_of(tokenizer, texts[0])
    state = server.settled(lambda s: any(digest in r["contexts"] for r in s["live"]) and len(s["live"]) >= 2)
    holder = next(r for r in state["live"] if digest in r["contexts"])
    records: list[RequestRecord | None] = [None] * FAULT_STREAMS
    ended: list[float | None] = [None] * FAULT_STREAMS
    started = [threading.Event() for _ in range(FAULT_STREAMS)]

    def stream(i: int) -> None:
        records[i] = send_openai(server.url, openai_body(questions[0][1 + i], texts[0], args.fault_osl, model),
                                 timeout=120, on_event=lambda r: r.chunks and started[i].set())
        ended[i] = time.monotonic()
        started[i].set()

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(FAULT_STREAMS)]
    for thread in threads:
        thread.start()
    for event in started:
        event.wait(300)
    in_flight = sum(1 for i in range(FAULT_STREAMS) if ended[i] is None)
    killed = time.monotonic()
    os.kill(holder["pid"], signal.SIGKILL)
    for thread in threads:
        thread.join(120)
    outcomes = [{"ok": r.ok if r else False, "error": r.error if r else "no record",
                 "tokens": r.num_output_tokens if r and r.chunks else 0,
                 "ended_s_after_kill": None if e is None else round(e - killed, 3)} for r, e in zip(records, ended)]
    loads_before = sum(r["store_loads"] for r in server.state()["replicas"])
    again = send_openai(server.url, openai_body(questions[0][FAULT_STREAMS + 1], texts[0], 8, model))
    served_again = time.monotonic() - killed
    after = server.settled(lambda s: sum(r["store_loads"] for r in s["replicas"]) > loads_before, timeout=10)
    replaced = server.settled(lambda s: len(s["live"]) >= args.replicas and holder["pid"] not in
                              [r["pid"] for r in s["live"]], timeout=120)
    replaced_s = time.monotonic() - killed if len(replaced["live"]) >= args.replicas else None
    cold_ms = distribution(cold)["p50"]
    return {"cold_ttft_ms": cold, "holder": {"replica": holder["replica"], "pid": holder["pid"]},
            "in_flight_at_kill": in_flight, "streams": outcomes,
            "all_ended_within_s": max((o["ended_s_after_kill"] or 1e9) for o in outcomes),
            "again": {"ok": again.ok, "error": again.error, "context_cache_hit": again.context_cache_hit,
                      "ttft_ms": again.ttft * 1e3 if again.ok else None,
                      "store_loads": sum(r["store_loads"] for r in after["replicas"]) - loads_before},
            "cross_ttft_ratio": (again.ttft * 1e3 / cold_ms) if again.ok and cold_ms else None,
            "served_again_s": served_again if again.ok else None, "replaced_s": replaced_s,
            "router": replaced.get("router"), "ingress": replaced.get("ingress")}


def run_config(name: str, args, work: dict, tokenizer, log_dir: Path, model: str) -> dict:
    count, router, store = CONFIGS[name]
    replicas = args.replicas if count is None else count
    threads = args.threads * (args.replicas if name == "single" else 1)
    options = f"router={router},context_store_mib={args.store_mib if store else 0},replica_cpus={threads}"
    flags = ["--replicas", str(replicas), "--replica-options", options, "--threads", str(threads),
             "--prefill-chunk", str(args.prefill_chunk), *args.memory_flags]
    label = LABELS[name].format(n=replicas)
    print(f"{label}: criticalkv serve {' '.join(flags)} ...", flush=True)
    started = time.perf_counter()
    with ReplicaServer(Path(args.engine_dir), flags, log_dir / f"serve-{name}.log") as server:
        ready_s = time.perf_counter() - started
        # the warm-up document as a plain prompt (no context: each request goes to the least loaded replica)
        warm = [openai_body(work["documents"][-1] + " " + q, None, args.osl, model)
                for q in work["questions"][-1][: max(1, args.warmup)]] * replicas
        for record in run_load(server.url, warm, concurrency=replicas, send=send_openai):
            if record.error:
                raise RuntimeError(f"{label}: warm-up request failed: {record.error}")
        # the replicas' reports (every second) once they count the warm-up requests
        before = server.settled(lambda s: len(s["live"]) == replicas and
                                sum(r["requests"] for r in s["live"]) >= len(warm))
        load_before = machine.load_average()
        bodies = [openai_body(work["questions"][d][q], work["documents"][d], args.osl, model) for d, q in work["order"]]
        records = run_load(server.url, bodies, concurrency=args.concurrency, send=send_openai,
                           progress=label)
        load_after = machine.load_average()
        after = server.settled(lambda s: sum(r["requests"] for r in s["replicas"]) >= len(warm) + len(bodies))
        deltas = replica_deltas(before, after)
        t0 = min(r.start for r in records)
        run = {"config": name, "label": label, "replicas": replicas, "router": router, "store": store,
               "server_args": flags, "server_ready_s": ready_s, "summary": summarize(records),
               "first_error": next((r.error for r in records if r.error), None),
               "per_replica": deltas, "store_stats": after["store"], "router_decisions": after["router"],
               "load_average_before": load_before, "load_average_after": load_after,
               "requests": [record_json(r, t0, document=d, question=q) for r, (d, q) in zip(records, work["order"])]}
        ok = [r for r in records if r.ok and r.context_cache_hit is not None]
        store_loads = sum(d["store_loads"] for d in deltas)
        hits = sum(1 for r in ok if r.context_cache_hit)
        run["docqa"] = {"no_prefill": hits, "requests": len(ok), "hit_rate": hits / len(ok) if ok else None,
                        "store_loads": store_loads, "local_hit_rate": (hits - store_loads) / len(ok) if ok else None,
                        "compressions": sum(d["compressions"] for d in deltas),
                        "ttft_ms_hit": distribution([r.ttft for r in ok if r.context_cache_hit], 1e3),
                        "ttft_ms_miss": distribution([r.ttft for r in ok if not r.context_cache_hit], 1e3)}
        if name == args.fault:
            print(f"{label}: fault phase (a replica SIGKILLed with {FAULT_STREAMS} streams in flight) ...", flush=True)
            run["fault"] = fault_phase(server, tokenizer, args, model)
    return run


def ratios(results: dict) -> dict:
    runs = {r["config"]: r for r in results["runs"]}
    out = {}

    def get(name, what):
        run = runs.get(name)
        if run is None or "docqa" not in run:
            return None
        return run["docqa"]["hit_rate"] if what == "hit" else run["summary"].get("output_throughput")

    for a, b in RATIO_PAIRS:
        for what in ("hit", "tokens"):
            x, y = get(a, what), get(b, what)
            out[f"{a}/{b}:{what}"] = served.ratio(x, y)
    return out


def targets(results: dict) -> list[tuple[str, float | None, str, bool | None]]:
    """(what, measured, goal, met) of the targets above that this run can say."""
    r, out = results["ratios"], []
    out.append(("hit rate, affinity + store / 1 replica", r.get("affinity/single:hit"), ">= 1",
                 None if r.get("affinity/single:hit") is None else r["affinity/single:hit"] >= 1 - 1e-9))
    out.append(("hit rate, affinity + store / power of two", r.get("affinity/pow2:hit"), f">= {TARGET_HIT_VS_POW2:g}",
                 None if r.get("affinity/pow2:hit") is None else r["affinity/pow2:hit"] >= TARGET_HIT_VS_POW2))
    out.append(("output tokens/s, affinity + store / power of two", r.get("affinity/pow2:tokens"), ">= 1",
                 None if r.get("affinity/pow2:tokens") is None else r["affinity/pow2:tokens"] >= 1 - 1e-9))
    fault = next((run.get("fault") for run in results["runs"] if run.get("fault")), None)
    if fault:
        c = fault["cross_ttft_ratio"]
        out.append(("first token of a context compressed on A, asked on B (store) / cold prefill", c,
                    f"<= {TARGET_CROSS_TTFT:g}", None if c is None else c <= TARGET_CROSS_TTFT))
        end = fault["all_ended_within_s"]
        out.append((f"replica SIGKILLed with {fault['in_flight_at_kill']} streams in flight: every one answered or a "
                    "JSON error within (s)", end, f"<= {TARGET_KILL_END_S:g}",
                    end <= TARGET_KILL_END_S and all(o["ok"] or o["error"] for o in fault["streams"])))
        again = fault["served_again_s"]
        out.append(("serving again after the kill (s)", again, f"<= {TARGET_SERVING_AGAIN_S:g}",
                    None if again is None else again <= TARGET_SERVING_AGAIN_S))
        out.append(("the replacement replica reporting (s)", fault["replaced_s"], f"<= {TARGET_SERVING_AGAIN_S:g}",
                    None if fault["replaced_s"] is None else fault["replaced_s"] <= TARGET_SERVING_AGAIN_S))
    return out


def render(results: dict) -> str:
    f = served.fmt
    s = results["settings"]
    lines = [f"# {results['command']}", *machine.header_lines(results)[1:],
             f"# uptime before: {results.get('uptime_before')}", f"# uptime after: {results.get('uptime_after')}", "",
             f"{s['docs']} documents of {s['isl']} tokens x {s['questions']} questions ({s['question_tokens']} tokens), "
             f"{s['docs'] * s['questions']} streamed /v1/completions in a random order (seed {s['seed']}, bench docqa's), "
             f"concurrency {s['concurrency']}, OSL {s['osl']}, greedy. Every replica: {' '.join(s['memory_flags'])}, "
             f"--prefill-chunk {s['prefill_chunk']}, ONNX Runtime threads {s['threads']} per replica (the single "
             f"replica {s['threads'] * s['replicas']}). Hit = answered without a prefill of its document (from the "
             f"replica's cache or loaded from the store); ceiling {f(100 * (s['questions'] - 1) / s['questions'])} %.",
             "",
             "| configuration | ok / failed | hit rate (local; store loads) | compressions | TTFT p50 (ms) | TTFT p90 "
             "(ms) | TTFT p50 hit / miss (ms) | output tokens/s | requests per replica | router: affinity / nobody "
             "held it / too busy | duration (s) | load avg before -> after |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in results["runs"]:
        sm, d = run["summary"], run.get("docqa")
        if not sm.get("completed") or d is None:
            lines.append(f"| {run['label']} | 0 / {sm.get('failed')} | all failed: {run.get('first_error')} |" + " |" * 9)
            continue
        router = run.get("router_decisions") or {}
        decisions = (f"{router.get('affinity', 0)} / {router.get('no_holder', 0)} / {router.get('imbalanced', 0)}"
                     if run["router"] == "affinity" and isinstance(router, dict) else "-")
        per = " / ".join(str(p["requests"]) for p in run["per_replica"] if p["requests"])
        lines.append(
            f"| {run['label']} | {sm['completed']} / {sm['failed']} | {f(100 * d['hit_rate'])} % "
            f"({f(100 * d['local_hit_rate'])} %; {d['store_loads']}) | {d['compressions']} | {f(sm['ttft_ms']['p50'])} "
            f"| {f(sm['ttft_ms']['p90'])} | {f(d['ttft_ms_hit']['p50'])} / {f(d['ttft_ms_miss']['p50'])} "
            f"| {f(sm['output_throughput'], 2)} | {per} | {decisions} | {f(sm['duration_s'])} "
            f"| {run['load_average_before'][:1]} -> {run['load_average_after'][:1]} |")
    labels = {run["config"]: run["label"] for run in results["runs"]}
    pairs = [(a, b) for a, b in RATIO_PAIRS if a in labels and b in labels]
    if pairs:
        lines += ["", "| ratio | hit rate | output tokens/s |", "|---|---|---|"]
        for a, b in pairs:
            hit, tokens = (results["ratios"].get(f"{a}/{b}:{what}") for what in ("hit", "tokens"))
            lines.append(f"| {labels[a]} / {labels[b]} | {f(hit, 2)}x | {f(tokens, 2)}x |")
    fault = next((run.get("fault") for run in results["runs"] if run.get("fault")), None)
    if fault:
        ends = ", ".join(f"{'answer' if o['ok'] else 'error'} at {f(o['ended_s_after_kill'], 2)} s ({o['tokens']} tokens)"
                         for o in fault["streams"])
        lines += ["", f"Fault ({next(r['label'] for r in results['runs'] if r.get('fault'))}): cold first tokens "
                      f"{', '.join(f(c) for c in fault['cold_ttft_ms'])} ms; {fault['in_flight_at_kill']} streams in "
                      f"flight on replica {fault['holder']['replica']} (pid {fault['holder']['pid']}) when it was "
                      f"SIGKILLed: {ends}; the same document asked again: first token {f(fault['again']['ttft_ms'])} ms "
                      f"(context_cache_hit {fault['again']['context_cache_hit']}, store loads +"
                      f"{fault['again']['store_loads']}), answered {f(fault['served_again_s'], 2)} s after the kill; "
                      f"the replacement replica reported {f(fault['replaced_s'], 1)} s after the kill."]
    lines += ["", "| target | measured | goal | met |", "|---|---|---|---|"]
    for what, value, goal, met in targets(results):
        lines.append(f"| {what} | {f(value, 3)} | {goal} | {'-' if met is None else ('met' if met else 'NOT met')} |")
    return "\n".join(lines) + "\n"


def run(args) -> int:
    if not args.engine_dir:
        raise ValueError("give --engine-dir (its replicas are started here)")
    served.check_engines([args.engine_dir])
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        raise ValueError(f"--configs: unknown {', '.join(unknown)} (choose from {', '.join(CONFIGS)})")
    if args.replicas < 2 and any(CONFIGS[c][0] is None for c in args.configs):
        raise ValueError("--replicas must be >= 2 for the multi-replica configurations")
    if args.fault != "none" and args.fault not in args.configs:
        raise ValueError(f"--fault {args.fault}: that configuration is not in --configs (add it, or --fault none)")
    given_mib, contexts = args.kv_memory
    memory = given_mib if given_mib is not None else served.kv_mib(Path(args.engine_dir), args.isl, contexts)
    cache = memory if args.context_cache_mib is None else args.context_cache_mib
    args.memory_flags = ["--kv-memory-mib", served.mib_flag(memory), "--context-cache-mib", served.mib_flag(cache)] + \
        [flag for d in cache_dtypes(args.context_cache_dtype, several=False) for flag in ("--context-cache-dtype", d)]
    stem = args.out
    results = machine.header(args.command_line)
    results["benchmark"] = "replicas"
    results["uptime_before"] = served.uptime()
    results["settings"] = {"isl": args.isl, "docs": args.docs, "questions": args.questions,
                           "question_tokens": args.question_tokens, "osl": args.osl, "concurrency": args.concurrency,
                           "seed": args.seed, "replicas": args.replicas, "threads": args.threads,
                           "memory_flags": args.memory_flags, "prefill_chunk": args.prefill_chunk,
                           "store_mib": args.store_mib, "configs": args.configs, "fault_osl": args.fault_osl}
    results["runs"] = []
    print("\n".join(machine.header_lines(results)), flush=True)
    tokenizer = served.load_tokenizer(args)
    work = workload(tokenizer, args.isl, args.docs, args.questions, args.question_tokens, args.seed, False, args.warmup)
    logs = Path(tempfile.mkdtemp(prefix="criticalkv-bench-replicas-"))
    print(f"server logs: {logs}", flush=True)
    for name in args.configs:
        try:
            results["runs"].append(run_config(name, args, work, tokenizer, logs, MODEL))
        except (RuntimeError, OSError) as err:  # a deployment that failed (e.g. Ray's memory monitor killed it)
            label = LABELS[name].format(n=CONFIGS[name][0] or args.replicas)
            print(f"{label}: FAILED: {type(err).__name__}: {err} (server log: {logs})", flush=True)
            results["runs"].append({"config": name, "label": label, "router": CONFIGS[name][1],
                                    "summary": {"completed": 0, "failed": len(work["order"])},
                                    "first_error": f"{type(err).__name__}: {err}"})
            results["ratios"] = ratios(results)
            served.write_results(results, stem, render, None)
            continue
        results["ratios"] = ratios(results)
        served.write_results(results, stem, render, None)
        d, sm = results["runs"][-1]["docqa"], results["runs"][-1]["summary"]
        print(f"{results['runs'][-1]['label']}: {sm.get('completed', 0)} ok, {sm.get('failed', 0)} failed; hit rate "
              f"{served.fmt(None if d['hit_rate'] is None else 100 * d['hit_rate'])} % ({d['store_loads']} from the "
              f"store), TTFT p50 {served.fmt((sm.get('ttft_ms') or {}).get('p50'))} ms, "
              f"{served.fmt(sm.get('output_throughput'), 2)} output tokens/s", flush=True)
    results["uptime_after"] = served.uptime()
    machine.finish(results)
    results["ratios"] = ratios(results)
    served.write_results(results, stem, render, None)
    print(render(results), flush=True)
    print(f"results: {stem}.json / .md", flush=True)
    failed = sum(r["summary"].get("failed", 0) for r in results["runs"])
    return 1 if failed else 0


def add_arguments(p) -> None:
    target = p.add_argument_group("replicas")
    target.add_argument("--engine-dir", metavar="DIR", help="the engine the replicas serve (its tokenizer makes the "
                        "prompts)")
    target.add_argument("--replicas", type=int, default=2, help="replicas of the multi-replica configurations (2)")
    target.add_argument("--configs", type=lambda s: s.split(","), default=["single", "pow2", "affinity"],
                        help=f"comma-separated, run in this order (default: single,pow2,affinity; of "
                             f"{', '.join(CONFIGS)})")
    target.add_argument("--threads", type=int, default=1,
                        help="ONNX Runtime threads per replica (default: 1; the single replica gets this x --replicas)")
    target.add_argument("--store-mib", type=float, default=1024.0, help="the shared store's MiB where it is on (1024)")
    target.add_argument("--prefill-chunk", type=int, default=512, help="every replica's --prefill-chunk (512)")
    add_workload_arguments(p.add_argument_group("workload (bench docqa's)"), per="replica", docs=32,
                           docs_why=": more documents than one replica's cache holds as float16 copies beside its "
                                    "running requests, fewer than two replicas hold, the case a router that keeps "
                                    "a context on one replica is for; with 16 every replica holds every document")
    add_memory_arguments(p.add_argument_group("memory (every replica)"), per="replica")
    fault = p.add_argument_group("fault")
    fault.add_argument("--fault", default="affinity", metavar="CONFIG",
                       help="the configuration whose replica is killed mid-stream, or none (default: affinity)")
    fault.add_argument("--fault-osl", type=int, default=256, help="new tokens of the streams in flight (256)")
    out = p.add_argument_group("output")
    add_out_argument(out, "results/benchmarks/serving/replicas")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=benchmarks.prog("replicas"), description=benchmarks.plain(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    args.command_line = benchmarks.command_line("replicas", argv)
    return args


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(benchmarks.run("replicas", main))
