#!/usr/bin/env python3
"""Three edges of a running `criticalkv serve --replicas 2 --threads 1` (plus ``--server-args``), measured in one run:

1. where it listens: every listening TCP socket of the launcher and its descendants (Ray's head processes, agents,
   workers, replicas), from psutil, and those outside ``--host`` (default 127.0.0.1; target: 0);
2. a 20 MB chat body sent by Python's http.client (which writes its whole body before it reads): the status, whether
   the answer is OpenAI's error object, and the seconds from the first byte sent to the answer read (``--bodies``
   times; target: a 413 it can read within 1 s);
3. orphans: the launcher SIGKILLed, then how long until none of its descendants (as listed just before the kill)
   runs any more (zombies count as gone; target: within 10 s), polled every 0.1 s for up to ``--orphan-wait`` s.

Records: ``--out`` (JSON: command, machine, versions, the sockets, every body's timing, the processes and when each
was last seen) and the same stem's ``.md``.

    PYTHONPATH=$PWD .venv/bin/python results/benchmarks/serving/replicas_edge/edges.py \\
        --engine-dir engines/smollm2-criticalkv --out results/benchmarks/serving/replicas_edge/edges.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))
from replicas_server import Server  # noqa: E402  (the launcher, shared with hang.py, target.py, memory.py)


def main() -> int:
    import psutil

    from criticalkv.bench import machine
    from criticalkv.serving.launcher import free_port

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine-dir", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--bodies", type=int, default=5, help="20 MB bodies sent, one after another (default 5)")
    parser.add_argument("--orphan-wait", type=float, default=60.0)
    parser.add_argument("--server-args", default="")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    info = machine.header(" ".join(["results/benchmarks/serving/replicas_edge/edges.py", *sys.argv[1:]]))
    port = free_port()
    server = Server(args.engine_dir, port, args.server_args.split(), host=args.host)
    process, lines, command = server.process, server.lines, server.command
    result: dict = {"server_command": command}
    family: list = []
    try:
        server.wait_ready(900, tail=30)
        time.sleep(3)  # the agents and the replicas' own servers are up by now; sockets listed after
        launcher = psutil.Process(process.pid)
        family = [launcher, *launcher.children(recursive=True)]
        pids = {p.pid: p for p in family}
        listening = []
        for c in psutil.net_connections("inet"):
            if c.status == psutil.CONN_LISTEN and c.pid in pids:
                try:
                    name = pids[c.pid].name()
                except psutil.NoSuchProcess:
                    name = "?"
                listening.append({"ip": c.laddr.ip, "port": c.laddr.port, "pid": c.pid, "process": name})
        allowed = {args.host, f"::ffff:{args.host}"} | ({"::1"} if args.host == "127.0.0.1" else set())
        outside = [s for s in listening if s["ip"] not in allowed]
        result["sockets"] = {"processes": len(family), "listening": listening, "outside_host": outside}
        print(f"{len(listening)} listening sockets in {len(family)} processes, {len(outside)} outside {args.host}",
              flush=True)

        body = json.dumps({"model": "criticalkv",
                           "messages": [{"role": "user", "content": "w5 " * 6_700_000}]}).encode()
        bodies = []
        for _ in range(args.bodies):
            connection = http.client.HTTPConnection(args.host, port, timeout=60)
            started = time.monotonic()
            row = {"bytes": len(body)}
            try:
                connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
                response = connection.getresponse()
                text = response.read()
                row["seconds"] = round(time.monotonic() - started, 4)
                row["status"] = response.status
                try:
                    row["error"] = json.loads(text)["error"]
                except (ValueError, KeyError, TypeError):
                    row["text"] = text[:200].decode(errors="replace")
            except (OSError, http.client.HTTPException) as err:
                row.update(seconds=round(time.monotonic() - started, 4), failure=f"{type(err).__name__}: {err}")
            finally:
                connection.close()
            bodies.append(row)
            print(f"20 MB body: {row.get('status', row.get('failure'))} in {row['seconds']} s", flush=True)
        result["bodies"] = bodies

        family = [launcher, *launcher.children(recursive=True)]
        names = {}
        for p in family:
            try:
                names[p.pid] = p.name()
            except psutil.NoSuchProcess:
                pass
        os.kill(process.pid, signal.SIGKILL)
        killed = time.monotonic()
        last_seen: dict[int, float] = {}
        while time.monotonic() - killed < args.orphan_wait:
            alive = []
            for p in family[1:]:
                try:
                    if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                        alive.append(p.pid)
                except psutil.NoSuchProcess:
                    pass
            now = round(time.monotonic() - killed, 2)
            for pid in alive:
                last_seen[pid] = now
            if not alive:
                break
            time.sleep(0.1)
        left = [p.pid for p in family[1:] if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        result["orphans"] = {"descendants": len(family) - 1, "all_gone_s": None if left else
                             (round(max(last_seen.values()) + 0.1, 2) if last_seen else 0.0),
                             "still_running": [{"pid": pid, "process": names.get(pid)} for pid in left],
                             "last_seen_s": [{"pid": pid, "process": names.get(pid), "s": s}
                                             for pid, s in sorted(last_seen.items(), key=lambda kv: -kv[1])]}
        print(f"orphans: {len(family) - 1} descendants, all gone within {result['orphans']['all_gone_s']} s; "
              f"{len(left)} still running", flush=True)
    finally:
        server.stop()
        for p in family[1:]:  # nothing of this run is left behind, whatever happened
            try:
                p.kill()
            except Exception:
                pass
    result = {**machine.finish(info), **result, "server_output": lines[-60:]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    tmp.replace(out)
    s, b, o = result["sockets"], result["bodies"], result["orphans"]
    seconds = sorted(r["seconds"] for r in b)
    md = [*machine.header_lines(result), "",
          f"`{' '.join(['criticalkv', *command[3:]])}`", "",
          "| edge | measured | target |", "|---|---|---|",
          f"| listening sockets outside --host {args.host} | {len(s['outside_host'])} (of {len(s['listening'])}, in "
          f"{s['processes']} processes) | 0 |",
          f"| a 20 MB chat body from http.client | statuses {sorted({r.get('status') for r in b}, key=str)}, OpenAI's "
          f"error object {sum(1 for r in b if 'error' in r)}/{len(b)}; seconds min {seconds[0]}, median "
          f"{seconds[len(seconds) // 2]}, max {seconds[-1]} | a 413 it reads, within 1 s |",
          f"| descendants still running after the launcher's SIGKILL | all {o['descendants']} gone within "
          f"{o['all_gone_s']} s ({len(o['still_running'])} left after {args.orphan_wait:g} s) | within 10 s |", ""]
    out.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))
    ok = not s["outside_host"] and all(r.get("status") == 413 and r["seconds"] < 1 for r in b) and \
        o["all_gone_s"] is not None and o["all_gone_s"] <= 10
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
