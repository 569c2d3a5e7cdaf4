#!/usr/bin/env python3
"""Ctrl-C after a busy run, N times: how long `criticalkv serve` takes to stop, and its exit statuses.

Each run starts `criticalkv serve --engine-dir ENGINE` on free ports (its own process group, as from a shell), then
plays a new user's sequence on the OpenAI API: 3 chats one after the other, 12 chats at once, one 5 MB chat body,
and 3 streams (``max_tokens`` 200, ``ignore_eos``) left running; once every stream has produced a token it sends
SIGINT to the launcher and times its exit. It records the launcher's exit status, tritonserver's (the launcher's
"tritonserver stopped (exit code N)" line), and, for a run that took longer than ``--slow`` seconds or exited
non-zero, the launcher's output and tritonserver's log (followed while it exists: the launcher removes it).

    PYTHONPATH=$PWD .venv/bin/python results/benchmarks/serving/edge/ctrl_c.py --engine-dir engines/smollm2-criticalkv \
        --runs 10 --out results/benchmarks/serving/edge/ctrl_c_after.json
"""

from __future__ import annotations

import argparse
import glob
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))


def chat(port: int, content: str, max_tokens: int = 16, stream: bool = False, on_token=None, timeout=600):
    """(status, error message or None) of one chat; with ``stream``, ``on_token()`` at the first content."""
    body = json.dumps({"model": "criticalkv", "messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens, "stream": stream, "ignore_eos": stream})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if not stream or response.status != 200:
            text = response.read()
            if on_token is not None:
                on_token()
            return response.status, None if response.status == 200 else text[:200].decode(errors="replace")
        seen = False
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data: {") and '"content"' in line and not seen:
                seen = True
                on_token()
        return response.status, None
    except (ConnectionError, http.client.HTTPException, OSError) as err:
        return "error", f"{type(err).__name__}: {err}"
    finally:
        connection.close()


class LogFollower:
    """Keeps a copy of every tritonserver.log under ``tmp`` (the launcher removes its temporary folder on exit)."""

    def __init__(self, tmp: str):
        self.tmp, self.text, self.stop = tmp, {}, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            for path in glob.glob(os.path.join(self.tmp, "criticalkv-serve-*", "tritonserver.log")):
                try:
                    with open(path, errors="replace") as f:
                        self.text[path] = f.read()
                except OSError:
                    pass
            time.sleep(0.05)

    def close(self) -> str:
        self.stop.set()
        self.thread.join()
        return "\n".join(self.text.values())


def one_run(engine_dir: Path, index: int, serve_args: list[str]) -> dict:
    from criticalkv.serving.launcher import free_port

    ports = {flag: free_port() for flag in ("--http-port", "--grpc-port", "--metrics-port", "--openai-port")}
    tmp = tempfile.mkdtemp(prefix="ctrlc-")
    command = [sys.executable, "-m", "criticalkv.cli", "serve", "--engine-dir", str(engine_dir),
               *[a for kv in ports.items() for a in map(str, kv)], *serve_args]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "TMPDIR": tmp, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    follower = LogFollower(tmp)
    lines, ready = [], threading.Event()

    def read():
        for line in server.stdout:
            lines.append(line)
            if line.startswith("ready:"):
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    port = ports["--openai-port"]
    row = {"run": index, "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg())}
    try:
        while not ready.wait(0.5):
            if server.poll() is not None:
                raise RuntimeError("serve exited:\n" + "".join(lines))
        phases = {}
        started = time.monotonic()
        row["chats"] = [chat(port, f"Say a word about the number {i}.")[0] for i in range(3)]
        phases["chats_s"] = time.monotonic() - started
        results = [None] * 12

        def one(i):
            results[i] = chat(port, f"Count from {i} to {i + 5}.", max_tokens=24)[0]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        phases["concurrent_s"] = time.monotonic() - started
        row["concurrent"] = results
        started = time.monotonic()
        row["big"] = chat(port, "x" * 5_000_000)
        phases["big_s"] = time.monotonic() - started
        tokens = threading.Semaphore(0)
        row["streams"] = [None] * 3

        def stream(i):
            row["streams"][i] = chat(port, f"Write a long story about ship {i}.", max_tokens=200, stream=True,
                                     on_token=tokens.release)

        streams = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(3)]
        for t in streams:
            t.start()
        for _ in streams:
            if not tokens.acquire(timeout=300):
                raise RuntimeError("a stream produced no token")
        time.sleep(0.5)
        row["phases"] = phases
        row["load_at_ctrl_c"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
        started = time.monotonic()
        server.send_signal(signal.SIGINT)
        row["exit_status"] = server.wait(120)
        row["stop_s"] = time.monotonic() - started
        reader.join(30)
        output = "".join(lines)
        match = re.search(r"tritonserver stopped \(exit code (-?\d+|None)\)", output)
        row["tritonserver_exit"] = match.group(1) if match else None
        for t in streams:
            t.join(30)
        return row
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(30)
        log = follower.close()
        row["output"] = "".join(lines)
        row["triton_log"] = log


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-dir", type=Path, required=True)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--slow", type=float, default=5.0, help="keep the output and the log of runs slower than this")
    p.add_argument("--out", type=Path)
    p.add_argument("--serve-arg", action="append", default=[])
    args = p.parse_args()
    rows = []
    for i in range(args.runs):
        row = one_run(args.engine_dir, i + 1, args.serve_arg)
        bad = row.get("stop_s") is None or row["stop_s"] > args.slow or row.get("exit_status") != 0 or \
            row.get("tritonserver_exit") != "0"
        if not bad:
            row.pop("output"), row.pop("triton_log")
        rows.append(row)
        print(f"run {i + 1}: Ctrl-C -> exit {row.get('exit_status')} in {row.get('stop_s', float('nan')):.2f} s, "
              f"tritonserver exit {row.get('tritonserver_exit')}; big body {row.get('big')}; concurrent "
              f"{sorted(set(map(str, row.get('concurrent', []))))}; phases {row.get('phases')}; load "
              f"{row['load_before']} / {row.get('load_at_ctrl_c')}", flush=True)
    ok = sum(1 for r in rows if r.get("exit_status") == 0 and r.get("tritonserver_exit") == "0" and
             r.get("stop_s", 1e9) < args.slow)
    times = sorted(r["stop_s"] for r in rows if r.get("stop_s") is not None)
    print(f"{ok} of {len(rows)} runs under {args.slow:.0f} s with exit status 0 for both; stop times {times}")
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "runs": rows, "ok": ok}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
