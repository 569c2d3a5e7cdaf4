#!/usr/bin/env python3
"""Where a replica's resident memory goes, and what a replica holds.

In one process (default): what one `criticalkv serve --replicas` replica loads (Ray and Serve imported, the engine,
its scheduler, the tokenizer), step by step, serving the README's requests through the scheduler: the context example
(needle_context.txt, 2 questions), then 12 needle chats (needle_2k.txt) and 12 questions about a new document, 8 at a
time (the engine's batch). After each step: resident (RSS), its anonymous part (the process's own: arenas, buffers,
prepacked weights, the Python heap) and its file-backed part (the memory-mapped weights and the libraries, shared
between the processes that map them), from /proc/self/smaps_rollup; whether torch is imported; with ``--trim`` the
resident after glibc's malloc_trim(0). ``--engine-option KEY=VALUE`` passes an option to ``Engine.load`` (prepack,
prefill_prepack, arena: true/false), as a replica does (``criticalkv.replicas.deployment.LEAN_ORT_OPTIONS``).

``--served``: the same requests through a real `criticalkv serve --replicas 2 --threads 1` (plus ``--server-args``),
the README's context example first, then the 12 needle chats and the 12 questions at once through the OpenAI API;
after each step every replica's own report of its memory (``GET /replicas``: resident, anonymous, file, PSS).

    PYTHONPATH=$PWD .venv/bin/python results/benchmarks/serving/replicas_edge/memory.py \\
        --engine-dir engines/smollm2-criticalkv --served --out results/benchmarks/serving/replicas_edge/memory_served.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))
from replicas_server import Server  # noqa: E402  (the launcher, shared with hang.py, target.py, edges.py)

QUESTIONS = ["Who was baptized in Stratford-upon-Avon?", "What was Shakespeare's profession?",
             "Where was Shakespeare born?", "When did Shakespeare die?", "Who did Shakespeare marry?",
             "How many children did Shakespeare have?", "What is the secret passcode?", "Name one of his plays.",
             "Which company did Shakespeare belong to?", "Where is Shakespeare buried?",
             "What did Shakespeare write besides plays?", "Summarize the text in one sentence."]


def smaps() -> dict:
    """Resident, anonymous and file-backed MiB of this process (/proc/self/smaps_rollup)."""
    fields = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if rest.strip().endswith("kB"):
                fields[name] = int(rest.split()[0]) / 1024
    rss, anonymous = fields["Rss"], fields["Anonymous"]
    return {"rss": round(rss, 1), "anonymous": round(anonymous, 1), "file": round(rss - anonymous, 1)}


TRIM = False


def memory() -> dict:
    out = {**smaps(), "torch_imported": "torch" in sys.modules}
    if TRIM:  # what glibc's allocator keeps freed but not returned: the same after malloc_trim(0)
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        out["rss_after_trim"] = smaps()["rss"]
    return out


def value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine-dir", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--trim", action="store_true", help="after each step, also the resident MiB after glibc's "
                        "malloc_trim(0) (what its allocator held freed)")
    parser.add_argument("--served", action="store_true", help="measure the replicas of a real `criticalkv serve "
                        "--replicas 2` instead (their reports)")
    parser.add_argument("--server-args", default="", help="with --served: more `criticalkv serve` flags")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    global TRIM
    TRIM = args.trim
    if args.served:
        return served(args)
    options = {k: value(v) for k, _, v in (o.partition("=") for o in args.engine_option)}
    steps = [("python", memory())]
    import ray  # noqa: F401
    from ray import serve  # noqa: F401

    import criticalkv.replicas.deployment  # noqa: F401
    steps.append(("ray, serve and criticalkv.replicas imported", memory()))
    from criticalkv.chat import chat_context_ids, chat_input_ids
    from criticalkv.request import Request, SamplingParams
    from criticalkv.runtime import Engine
    from criticalkv.serving import Scheduler

    started = time.monotonic()
    engine = Engine.load(args.engine_dir, verify=False, threads=args.threads, **options)
    steps.append((f"engine loaded ({time.monotonic() - started:.1f} s)", memory()))
    tokenizer = engine.tokenizer
    scheduler = Scheduler(engine)
    steps.append(("tokenizer and scheduler", memory()))

    def run(batch):
        handles = [scheduler.submit(Request(ids, SamplingParams(max_tokens=16), context_token_ids=ctx))
                   for ids, ctx in batch]
        return [h.result(600) for h in handles]

    def context_request(document, question):
        context, question_ids = chat_context_ids(tokenizer, [{"role": "user", "content": question}], document)
        return question_ids, context

    document = (ROOT / "examples" / "needle_context.txt").read_text()
    needle = (ROOT / "examples" / "needle_2k.txt").read_text()
    run([context_request(document, QUESTIONS[0])])
    run([context_request(document, QUESTIONS[1])])
    steps.append(("the README's context example (a miss, a hit)", memory()))
    needles = [(chat_input_ids(tokenizer, [{"role": "user", "content": needle}]), ()) for _ in range(12)]
    for i in range(0, 12, 8):
        run(needles[i:i + 8])
    steps.append(("12 needle chats (8 at a time)", memory()))
    other = f"Another document.\n\n{document}"
    run([context_request(other, q) for q in QUESTIONS[:8]])
    run([context_request(other, q) for q in QUESTIONS[8:]])
    steps.append(("12 questions about a new document", memory()))
    stats = scheduler.context_cache.stats.as_dict()
    scheduler.close()
    result = {"command": " ".join(sys.argv), "engine_options": options, "threads": args.threads,

              "load_average": os.getloadavg(), "context_cache": stats,
              "steps": [{"step": name, **m} for name, m in steps]}
    for name, m in steps:
        trimmed = f", {m['rss_after_trim']:6.0f} after malloc_trim" if "rss_after_trim" in m else ""
        print(f"{m['rss']:8.0f} MiB resident ({m['anonymous']:6.0f} anonymous, {m['file']:5.0f} file{trimmed})  "
              f"torch {'yes' if m['torch_imported'] else 'no '}  {name}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def served(args) -> int:
    """``--served``: the replicas' own reports after each step of the sequence."""
    import threading
    import urllib.request

    import openai

    from criticalkv.bench import machine
    from criticalkv.serving.launcher import free_port

    port = free_port()
    info = machine.header(" ".join(["results/benchmarks/serving/replicas_edge/memory.py", *sys.argv[1:]]))
    server = Server(args.engine_dir, port, args.server_args.split(), threads=args.threads)
    command = server.command
    steps = []

    def report(step):
        time.sleep(2.5)  # the replicas report every second
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/replicas", timeout=30) as response:
            state = json.loads(response.read())
        live = [r for r in state["replicas"] if not r["stale"]]
        steps.append({"step": step, "replicas": [{"pid": r["pid"], **r["memory_mib"]} for r in live]})
        print(f"{step}: " + "; ".join(f"pid {r['pid']} {r['memory_mib']['rss']:.0f} MiB resident "
                                      f"({r['memory_mib']['anonymous']:.0f} anonymous, {r['memory_mib']['file']:.0f} "
                                      f"file, PSS {r['memory_mib']['pss']:.0f})" for r in live), flush=True)

    try:
        server.wait_ready(900, tail=30)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
        report("ready")
        document = (ROOT / "examples" / "needle_context.txt").read_text()
        needle = (ROOT / "examples" / "needle_2k.txt").read_text()

        def chat(content, context=None):
            client.chat.completions.create(model="criticalkv", messages=[{"role": "user", "content": content}],
                                           max_tokens=24, extra_body={"context": context} if context else None)

        chat(QUESTIONS[0], document)
        chat(QUESTIONS[1], document)
        report("the README's context example (a miss, a hit)")
        threads = [threading.Thread(target=chat, args=(needle,)) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        report("12 needle chats at once")
        other = f"Another document.\n\n{document}"
        threads = [threading.Thread(target=chat, args=(q, other)) for q in QUESTIONS]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        report("12 questions about a new document at once")
    finally:
        server.stop()
    result = {**machine.finish(info), "server_command": command, "steps": steps}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
