#!/usr/bin/env python3
"""SIGKILL the replica of a running `criticalkv serve --replicas` that holds the most requests in flight (as target.py
does), and print what was killed with the frontend's counters (GET /replicas): a kill by hand during a run.

    .venv/bin/python results/benchmarks/serving/replicas_edge/kill_replica.py PORT
"""
import json, os, signal, sys, time, urllib.request
port = int(sys.argv[1])
with urllib.request.urlopen(f"http://127.0.0.1:{port}/replicas", timeout=30) as r:
    state = json.loads(r.read())
live = [r for r in state["replicas"] if not r["stale"]]
victim = max(live, key=lambda r: (r["running"] + r["waiting"], r["requests"]))
os.kill(victim["pid"], signal.SIGKILL)
print(json.dumps({"utc": time.strftime("%H:%M:%S", time.gmtime()), "pid": victim["pid"], "replica": victim["replica"],
                  "in_flight": victim["running"] + victim["waiting"], "ingress": state.get("ingress")}))
