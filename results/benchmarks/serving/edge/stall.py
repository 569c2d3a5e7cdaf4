#!/usr/bin/env python3
"""One oversized request next to a small one: does a big body stall everybody else?

Starts `criticalkv serve --engine-dir ENGINE` on free ports, then for each big body in ``--big``:

1. idle: a small chat's time to its first content token (streamed) and ``GET /health``, ``--repeats`` times each;
2. loaded: the big body is sent to ``/v1/chat/completions`` on its own thread, and ``--delay`` seconds later the
   small chat, ``/health`` and Triton's own ``/v2/models/criticalkv/generate`` (a 16-token prompt, 4 tokens), each
   timed; then the big body's status and time.

Big bodies: ``Nmb`` = a chat whose one message is "x" * N MB (the repro), ``Nkc`` = N thousand characters of
"x " (a prompt whose characters pass the bound, tokenised in full before it is refused), ``Nkw`` = N thousand "w "
words (the same through the chat template).

    PYTHONPATH=$PWD .venv/bin/python results/benchmarks/serving/edge/stall.py --engine-dir engines/smollm2-criticalkv \
        --big 20mb --big 5mb --out results/benchmarks/serving/edge/stall_after.json

Prints one line per measurement and writes the JSON (with the load average before and after each phase).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))

SMALL = {"model": "criticalkv", "messages": [{"role": "user", "content": "What is the capital of France?"}],
         "max_tokens": 8, "stream": True}


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def big_body(spec: str) -> bytes:
    if spec.endswith("mb"):
        content = "x" * int(float(spec[:-2]) * 1_000_000)
    elif spec.endswith("kc"):
        content = "x " * (int(float(spec[:-2]) * 1000) // 2)
    elif spec.endswith("kw"):
        content = "w " * int(float(spec[:-2]) * 1000)
    else:
        raise SystemExit(f"--big {spec}: give Nmb, Nkc or Nkw")
    return json.dumps({"model": "criticalkv", "messages": [{"role": "user", "content": content}]}).encode()


def first_token(port: int, timeout: float = 300) -> float:
    """Seconds from sending SMALL to its first content delta."""
    started = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("POST", "/v1/chat/completions", json.dumps(SMALL), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"small chat: {response.status} {response.read()[:200]!r}")
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if event.get("choices") and event["choices"][0]["delta"].get("content"):
                    return time.perf_counter() - started
        raise RuntimeError("small chat: no content")
    finally:
        connection.close()


def timed(port: int, method: str, path: str, body: dict | None = None, timeout: float = 300) -> float:
    """Seconds of one request (its whole answer read); RuntimeError unless it answers 200."""
    started = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        connection.request(method, path, None if body is None else json.dumps(body), headers)
        response = connection.getresponse()
        response.read()
        if response.status != 200:
            raise RuntimeError(f"{method} {path}: {response.status}")
        return time.perf_counter() - started
    finally:
        connection.close()


def get(port: int, path: str) -> float:
    return timed(port, "GET", path)


def triton_generate(port: int) -> float:
    return timed(port, "POST", "/v2/models/criticalkv/generate", {"text_input": "The capital of France is", "max_tokens": 4})


class Big:
    """The big body on its own thread: its status, the start of its answer and the end of the exchange."""

    def __init__(self, port: int, body: bytes):
        self.status = self.message = None
        self.seconds = None
        self.started = time.perf_counter()
        self.thread = threading.Thread(target=self._run, args=(port, body), daemon=True)
        self.thread.start()

    def _run(self, port, body):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        try:
            connection.putrequest("POST", "/v1/chat/completions")
            connection.putheader("Content-Type", "application/json")
            connection.putheader("Content-Length", str(len(body)))
            connection.endheaders()
            try:
                view = memoryview(body)
                for i in range(0, len(body), 1 << 20):
                    connection.send(view[i:i + (1 << 20)])
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server answered (413) and closed before the whole body was sent
            response = connection.getresponse()
            self.status = response.status
            text = response.read()
            self.seconds = time.perf_counter() - self.started
            try:
                self.message = json.loads(text)["error"]["message"][:160]
            except (ValueError, KeyError, TypeError):
                self.message = text[:160].decode(errors="replace")
        except Exception as err:
            self.seconds = time.perf_counter() - self.started
            self.status, self.message = "error", f"{type(err).__name__}: {err}"
        finally:
            connection.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-dir", type=Path, required=True)
    p.add_argument("--big", action="append", default=None, help="20mb, 5mb, 300kc, ... (repeatable; default 20mb)")
    p.add_argument("--delay", type=float, default=2.0, help="seconds between the big body and the small requests")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path)
    p.add_argument("--serve-arg", action="append", default=[], help="extra `criticalkv serve` argument")
    args = p.parse_args()
    from criticalkv.serving.launcher import free_port

    ports = {flag: free_port() for flag in ("--http-port", "--grpc-port", "--metrics-port", "--openai-port")}
    tmp = tempfile.mkdtemp(prefix="stall-")
    command = [sys.executable, "-m", "criticalkv.cli", "serve", "--engine-dir", str(args.engine_dir),
               *[a for kv in ports.items() for a in map(str, kv)], *args.serve_arg]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "TMPDIR": tmp, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    lines = []
    ready = threading.Event()

    def read():
        for line in server.stdout:
            lines.append(line)
            if line.startswith("ready:"):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    result = {"command": " ".join(sys.argv), "serve": " ".join(command[1:]), "engine_dir": str(args.engine_dir),
              "rounds": []}
    openai_port, http_port = ports["--openai-port"], ports["--http-port"]
    try:
        while not ready.wait(0.5):
            if server.poll() is not None:
                raise SystemExit("serve exited:\n" + "".join(lines))
        first_token(openai_port)  # warm-up
        for spec in args.big or ["20mb"]:
            body = big_body(spec)
            row = {"big": spec, "big_bytes": len(body), "load_before": load()}
            row["idle_first_token_s"] = [first_token(openai_port) for _ in range(args.repeats)]
            row["idle_health_s"] = [get(openai_port, "/health") for _ in range(args.repeats)]
            row["idle_triton_generate_s"] = [triton_generate(http_port) for _ in range(args.repeats)]
            big = Big(openai_port, body)
            time.sleep(args.delay)
            row["loaded_first_token_s"] = first_token(openai_port)
            row["loaded_health_s"] = get(openai_port, "/health")
            row["loaded_triton_generate_s"] = triton_generate(http_port)
            big.thread.join(600)
            row.update(big_status=big.status, big_seconds=big.seconds, big_message=big.message, load_after=load())
            idle = statistics.median(row["idle_first_token_s"])
            row["first_token_ratio"] = row["loaded_first_token_s"] / idle
            result["rounds"].append(row)
            print(f"{spec} ({len(body) / 1e6:.1f} MB): big -> {big.status} in {big.seconds:.2f} s "
                  f"({big.message!r}); small chat first token {row['loaded_first_token_s']:.3f} s vs idle "
                  f"{idle:.3f} s ({row['first_token_ratio']:.2f}x); /health {row['loaded_health_s']:.3f} s "
                  f"(idle {statistics.median(row['idle_health_s']):.3f}); Triton generate "
                  f"{row['loaded_triton_generate_s']:.3f} s (idle {statistics.median(row['idle_triton_generate_s']):.3f});"
                  f" load {row['load_before']} -> {row['load_after']}", flush=True)
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
