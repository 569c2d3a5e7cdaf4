#!/usr/bin/env python3
"""A new user's sequence on `criticalkv serve --replicas 2`, in a loop, until a request gets no answer.

Each round: 12 needle chats at once (examples/needle_2k.txt, the README's), then 12 threads asking one new document
12 questions at once (examples/needle_context.txt under a line naming the round, as criticalkv's `context` field),
all through the official `openai` client (non-streaming, no retries). A request that gets neither an answer nor an
error within ``--client-timeout`` seconds is lost: the script then records what the server says about it before it
touches anything else: ``GET /replicas`` (the ingress's and every replica's requests in flight with the stage each
reached, the scheduler's own state of each, their counters), Ray Serve's replica logs (errors and tracebacks), and
the Python stacks of every process of the launcher's tree (py-spy), then stops the server. Every round's counters
are checked too: ingress requests = replica requests, and each replica's context-cache hits + misses = the context
requests it served.

    PYTHONPATH=$PWD .venv/bin/python results/benchmarks/serving/replicas_edge/hang.py \\
        --engine-dir engines/smollm2-criticalkv --rounds 20 --out results/benchmarks/serving/replicas_edge/hang.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))
from replicas_server import Server  # noqa: E402  (the launcher, shared with target.py, edges.py, memory.py)


QUESTIONS = ["Who was baptized in Stratford-upon-Avon?", "What was Shakespeare's profession?",
             "Where was Shakespeare born?", "When did Shakespeare die?", "Who did Shakespeare marry?",
             "How many children did Shakespeare have?", "What is the secret passcode?", "Name one of his plays.",
             "Which company did Shakespeare belong to?", "Where is Shakespeare buried?",
             "What did Shakespeare write besides plays?", "Summarize the text in one sentence."]


def ask(client, kind: str, round_: int, i: int, messages, context, timeout: float, records: list) -> None:
    import openai

    start = time.monotonic()
    record = {"kind": kind, "round": round_, "thread": i, "start": start}
    try:
        out = client.chat.completions.create(model="criticalkv", messages=messages, max_tokens=16, timeout=timeout,
                                             extra_body={"context": context} if context else None)
        record.update(status=200, text=out.choices[0].message.content,
                      context_cache_hit=getattr(out, "context_cache_hit", None) or (out.model_extra or {}).get(
                          "context_cache_hit"))
    except openai.APITimeoutError:
        record.update(status="lost", error=f"no answer within {timeout:g} s")
    except openai.APIStatusError as err:
        record.update(status=err.status_code, error=str(err.body)[:300])
    except Exception as err:
        record.update(status="error", error=f"{type(err).__name__}: {err}"[:300])
    record["seconds"] = round(time.monotonic() - start, 3)
    records.append(record)


def run_threads(target, args_list) -> None:
    threads = [threading.Thread(target=target, args=a, daemon=True) for a in args_list]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def evidence(server: Server) -> dict:
    """What the server and Ray say while the lost request is still lost."""
    out = {}
    try:
        out["replicas"] = server.state()
    except Exception as err:
        out["replicas"] = f"{type(err).__name__}: {err}"
    stacks, session = {}, None
    for p in server.family():
        try:
            cmd = " ".join(p.cmdline())
            if session is None and "--raylet_socket_name=" in cmd:
                session = cmd.split("--raylet_socket_name=")[1].split("/sockets/")[0]
            name = p.name()
        except Exception:
            continue
        if name.startswith("ray::") or p.pid == server.process.pid:
            spy = subprocess.run([str(Path(sys.executable).parent / "py-spy"), "dump", "--pid", str(p.pid)],
                                 capture_output=True, text=True, timeout=60)
            stacks[f"{p.pid} {name}"] = (spy.stdout + spy.stderr)[-20000:]
    out["stacks"] = stacks
    logs = {}
    if session:
        for path in sorted(glob.glob(os.path.join(session, "logs", "serve", "*.log")) +
                           glob.glob(os.path.join(session, "logs", "worker-*.err"))):
            text = Path(path).read_text(errors="replace")
            keep = [line for line in text.splitlines() if any(w in line for w in (
                "ERROR", "Error", "Traceback", "WARNING", "Exception", "cancel"))]
            if keep:
                logs[os.path.basename(path)] = keep[-200:]
    out["ray_session"] = session
    out["logs"] = logs
    return out


def main() -> int:
    import openai

    from criticalkv.serving.launcher import free_port

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine-dir", required=True)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--client-timeout", type=float, default=180.0,
                        help="seconds after which a request without an answer counts as lost (default 180)")
    parser.add_argument("--server-args", default="", help="more `criticalkv serve` flags, one string")
    parser.add_argument("--out", required=True, help="JSON of every request, the counters and any evidence")
    args = parser.parse_args()
    needle = (ROOT / "examples" / "needle_2k.txt").read_text()
    document = (ROOT / "examples" / "needle_context.txt").read_text()
    server = Server(args.engine_dir, free_port(), args.server_args.split())
    result = {"command": " ".join(sys.argv), "rounds": [], "lost": None, "load": os.getloadavg()}
    started = time.monotonic()
    try:
        server.wait_ready(900)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)
        for r in range(args.rounds):
            records: list = []
            run_threads(ask, [(client, "needle", r, i, [{"role": "user", "content": needle}], None,
                               args.client_timeout, records) for i in range(12)])
            context = f"Document {r} of the replicas' loop.\n\n{document}"
            run_threads(ask, [(client, "context", r, i, [{"role": "user", "content": QUESTIONS[i]}], context,
                               args.client_timeout, records) for i in range(12)])
            lost = [x for x in records if x["status"] == "lost"]
            state = server.state()
            row = {"round": r, "requests": len(records), "by_status": {}, "seconds_max": max(x["seconds"] for x in records),
                   "ingress": {k: v for k, v in state["ingress"].items() if k != "in_flight"},
                   "replicas": [{k: r_[k] for k in ("pid", "requests", "running", "waiting", "context_cache",
                                                    "store_loads", "store_misses", "store_errors")}
                                for r_ in state["replicas"] if not r_["stale"]],
                   "load": os.getloadavg()}
            for x in records:
                row["by_status"][str(x["status"])] = row["by_status"].get(str(x["status"]), 0) + 1
            row["records"] = records
            result["rounds"].append(row)
            print(f"round {r}: {row['by_status']}  max {row['seconds_max']:.1f} s  load {row['load'][0]:.1f}",
                  flush=True)
            if lost:
                result["lost"] = {"requests": lost, **evidence(server)}
                print(f"LOST {len(lost)} request(s) in round {r}: evidence in {args.out}", flush=True)
                break
    finally:
        result["seconds"] = round(time.monotonic() - started, 1)
        server.stop(wait=120)
        result["server_output"] = server.lines[-300:]
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(args.out).with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=str))
        tmp.replace(args.out)
    return 1 if result["lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
