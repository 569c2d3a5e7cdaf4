#!/usr/bin/env python3
"""1,000 context requests through `criticalkv serve --replicas 2`, a replica SIGKILLed twice on the way: does every
request get an answer or a JSON error within 60 s?

The server: `criticalkv serve --engine-dir ENGINE --replicas 2 --threads 1` plus ``--server-args`` (its own process
group, stopped with Ctrl-C at the end). The load: ``--docs`` documents of ``--isl`` tokens (bench docqa's, seeded) and
``--requests`` streamed ``/v1/completions``, each a question about a document drawn at random (seeded) sent with the
document as criticalkv's ``context`` field, ``--osl`` tokens each, greedy; closed loop at ``--concurrency``. After
``--kill-at`` requests have ended (default: a third and two thirds of them), the replica holding the most requests
in flight (``GET /replicas``) gets SIGKILL (Ray Serve starts another one).

Each request is one of: answered (its last event has a finish_reason, then ``data: [DONE]``); a JSON error (OpenAI's
error object, as the response or as a stream's last event: its status and message are recorded); or neither within
``--limit`` seconds (60): no byte, a cut connection, text that is not an error object. The target: 0 of the last
kind. Records: ``--out`` (JSON: the command, machine, versions, settings, every request, the kills and the replicas'
counters) and the same stem's ``.md`` (the table).

    PYTHONPATH=$PWD .venv/bin/python results/benchmarks/serving/replicas_edge/target.py \\
        --engine-dir engines/smollm2-criticalkv --out results/benchmarks/serving/replicas_edge/target_1000.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))
from replicas_server import Server  # noqa: E402  (the launcher, shared with hang.py, edges.py, memory.py)


def live_state(server: Server) -> dict:
    """``GET /replicas`` with ``live``: the replicas whose report is not stale."""
    state = server.state()
    state["live"] = [r for r in state["replicas"] if not r["stale"]]
    return state


def one_request(port: int, body: dict, limit: float) -> dict:
    """POST a streamed completion; what came back, classified: answered, error (a JSON error object) or silent."""
    started = time.monotonic()
    out = {"outcome": "silent", "status": None}
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=limit)
    try:
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        out["status"] = response.status
        if response.status != 200:
            text = response.read()
            try:
                error = json.loads(text)["error"]
                out.update(outcome="error", code=error.get("code"), message=error.get("message"))
            except (ValueError, KeyError, TypeError):
                out["text"] = text[:300].decode(errors="replace")
            return out
        last, done = None, False
        for raw in response:
            if time.monotonic() - started > limit:
                break
            line = raw.decode(errors="replace").strip()
            if line == "data: [DONE]":
                done = True
                break
            if line.startswith("data: {"):
                last = json.loads(line[6:])
                if out.get("first_token_s") is None and last.get("choices"):
                    out["first_token_s"] = round(time.monotonic() - started, 3)
        if done and last is not None and "error" in last:
            out.update(outcome="error", code=last["error"].get("code"), message=last["error"].get("message"))
        elif done and last is not None and last.get("choices") and last["choices"][0].get("finish_reason"):
            out.update(outcome="answered", finish_reason=last["choices"][0]["finish_reason"],
                       context_cache_hit=last.get("context_cache_hit"))
        else:
            out["text"] = f"the stream ended without an answer or an error (last event {json.dumps(last)[:200]})"
    except (OSError, http.client.HTTPException, ValueError) as err:
        out["text"] = f"{type(err).__name__}: {err}"
    finally:
        connection.close()
        out["seconds"] = round(time.monotonic() - started, 3)
    if out["seconds"] > limit and out["outcome"] != "silent":
        out.update(outcome="silent", late=out["outcome"])
    return out


def main() -> int:
    from criticalkv.bench import machine
    from criticalkv.bench.docqa import workload
    from criticalkv.runtime.manifest import load_tokenizer
    from criticalkv.serving.launcher import free_port

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine-dir", required=True)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--isl", type=int, default=1024, help="tokens per document (default 1024)")
    parser.add_argument("--osl", type=int, default=16)
    parser.add_argument("--limit", type=float, default=60.0, help="seconds a request may take (default 60)")
    parser.add_argument("--kill-at", default=None, help="request counts after which a replica is SIGKILLed "
                                                        "(default: a third and two thirds of --requests)")
    parser.add_argument("--server-args", default="--request-timeout 50",
                        help="more `criticalkv serve` flags (default: --request-timeout 50, so that a request the "
                             "replicas cannot answer in time gets its 504 within the limit)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="send no new request after this many seconds of load (the run then counts the requests "
                             "that were sent: what fits in the time there is; default: no bound)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    kill_at = ([int(x) for x in args.kill_at.split(",")] if args.kill_at else
               [args.requests // 3, 2 * args.requests // 3])
    info = machine.header(" ".join(["results/benchmarks/serving/replicas_edge/target.py", *sys.argv[1:]]))
    tokenizer = load_tokenizer(Path(args.engine_dir))
    work = workload(tokenizer, args.isl, args.docs, 16, 24, args.seed, False, 0)
    rng = random.Random(f"replicas-target/{args.seed}")
    plan = [(rng.randrange(args.docs), rng.randrange(16)) for _ in range(args.requests)]
    server = Server(args.engine_dir, free_port(), args.server_args.split())
    records: list = [None] * args.requests
    kills, lock, ended = [], threading.Lock(), [0]
    cursor = iter(range(args.requests))
    t0, duration, state = None, 0.0, None
    try:
        server.wait_ready(900)
        t0 = time.monotonic()

        def kill_one(after: int) -> None:
            state = live_state(server)
            live = state["live"]
            victim = max(live, key=lambda r: (r["running"] + r["waiting"], r["requests"]))
            os.kill(victim["pid"], signal.SIGKILL)
            kills.append({"after_requests": after, "at_s": round(time.monotonic() - t0, 3), "pid": victim["pid"],
                          "replica": victim["replica"], "in_flight": victim["running"] + victim["waiting"]})
            print(f"killed replica {victim['replica']} (pid {victim['pid']}) after {after} requests", flush=True)

        def worker() -> None:
            while True:
                with lock:
                    late = args.max_seconds is not None and time.monotonic() - t0 > args.max_seconds
                    i = None if late else next(cursor, None)
                if i is None:
                    return
                d, q = plan[i]
                body = {"model": "criticalkv", "prompt": work["questions"][d][q], "max_tokens": args.osl,
                        "temperature": 0, "ignore_eos": True, "stream": True, "context": work["documents"][d]}
                sent = time.monotonic() - t0
                record = {"i": i, "doc": d, "sent_s": round(sent, 3), **one_request(server.port, body, args.limit)}
                records[i] = record
                with lock:
                    ended[0] += 1
                    n = ended[0]
                    if n % 100 == 0:
                        print(f"{n} ended, {sum(1 for r in records if r and r['outcome'] == 'silent')} silent",
                              flush=True)
                    due = [k for k in kill_at if k == n]
                if due:
                    threading.Thread(target=kill_one, args=(n,), daemon=True).start()

        threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        duration = time.monotonic() - t0
        try:
            state = live_state(server)
        except Exception as err:
            state = f"{type(err).__name__}: {err}"
    finally:
        exit_code = server.stop()
    done = [r for r in records if r is not None]
    outcomes = {k: sum(1 for r in done if r["outcome"] == k) for k in ("answered", "error", "silent")}
    errors: dict[str, int] = {}
    for r in done:
        if r["outcome"] == "error":
            key = f"{r.get('code')} {str(r.get('message'))[:90]}"
            errors[key] = errors.get(key, 0) + 1
    seconds = sorted(r["seconds"] for r in done)
    result = {**machine.finish(info), "settings": {k: getattr(args, k) for k in (
        "requests", "concurrency", "docs", "isl", "osl", "limit", "server_args", "max_seconds", "seed")},
        "requests_sent": len(done), "kill_at": kill_at,
        "server_command": server.command, "server_exit_code": exit_code, "duration_s": round(duration, 1),
        "outcomes": outcomes, "errors": errors, "kills": kills,
        "seconds_max": seconds[-1] if seconds else None,
        "seconds_p50": seconds[len(seconds) // 2] if seconds else None,
        "seconds_p99": seconds[int(len(seconds) * 0.99)] if seconds else None,
        "context_cache_hits": sum(1 for r in done if r.get("context_cache_hit") is True),
        "final_state": state, "requests": done,
        "server_output": [line.replace(f"{ROOT}/", "") for line in server.lines[-200:]]}  # no machine's paths
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    tmp.replace(out)
    lines = [*machine.header_lines(result), "",
             f"{len(done)} streamed /v1/completions (of {args.requests} planned"
             f"{f', sending stopped after {args.max_seconds:g} s' if len(done) < args.requests else ''}), each a "
             "question "
             f"about one of {args.docs} documents of "
             f"{args.isl} tokens (criticalkv's `context`), {args.osl} tokens, concurrency {args.concurrency}, through "
             f"`criticalkv serve --replicas 2 --threads 1 {args.server_args}`; a replica SIGKILLed after "
             f"{' and '.join(map(str, kill_at))} requests ended. Duration {duration:.1f} s.", "",
             "| outcome | requests |", "|---|---|",
             f"| answered | {outcomes['answered']} |", f"| a JSON error (OpenAI's error object) | {outcomes['error']} |",
             f"| **neither within {args.limit:g} s** | **{outcomes['silent']}** |", "",
             f"Seconds per request: p50 {result['seconds_p50']}, p99 {result['seconds_p99']}, max "
             f"{result['seconds_max']}; context-cache hits {result['context_cache_hits']} of {outcomes['answered']} "
             "answered.", ""]
    if errors:
        lines += ["| error | requests |", "|---|---|", *[f"| {k} | {v} |" for k, v in sorted(errors.items())], ""]
    lines += ["| kill | after requests | at (s) | replica pid | its requests in flight |", "|---|---|---|---|---|",
              *[f"| {n + 1} | {k['after_requests']} | {k['at_s']} | {k['pid']} | {k['in_flight']} |"
                for n, k in enumerate(kills)], ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0 if outcomes["silent"] == 0 and len(done) == args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
