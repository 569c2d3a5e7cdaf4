"""Selection time of several policies on ONNX Runtime, in one run (medians over repeats, ratio to a base).

Each policy's engine is exported (same prompt, budget and build limits), and the prefill of the same long
prompt is profiled ``--repeats`` times per policy, the policies interleaved repeat by repeat so that a
change of machine load falls on all of them alike. The selection time of a run is the time of the inlined
``CriticalKVSelect`` body nodes (``criticalkv.runtime.profiling.selection_profile``, as
``python -m benchmarks.latency`` measures it), summed over the 30 layers.

    python -m benchmarks.selection --policies ada-criticalkv,defensivekv --base ada-criticalkv \\
        --output results/benchmarks/selection_defensivekv

writes OUTPUT.json (every per-run number, the machine, the load average at start and end, the command) and
OUTPUT.txt (the table). ``--op-profile`` adds, per policy, the body's time per operator type (median run).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

from benchmarks.latency import long_text, machine, make_engine
import benchmarks
from criticalkv.bench.report import write_results
from criticalkv.eval.specs import parse_policy_spec
from criticalkv.export import BuildConfig
from criticalkv.policy import KVPolicy
from criticalkv.runtime.profiling import SELECTION_MARK, selection_profile


def op_times(trace: str, run_index: int) -> dict[str, float]:
    """Seconds per operator type of the selection body's nodes in one run (nodes nested in the body's ``If``
    are counted once: the ``If`` itself is left out)."""
    events = json.loads(Path(trace).read_text())
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    run = runs[run_index]
    out: dict[str, float] = defaultdict(float)
    for e in events:
        name = e.get("name", "")
        if e.get("cat") != "Node" or SELECTION_MARK not in name or not name.endswith("_kernel_time"):
            continue
        if not run["ts"] <= e["ts"] <= run["ts"] + run["dur"]:
            continue
        op = e.get("args", {}).get("op_name", "?")
        if op == "If":
            continue
        out[op] += e["dur"] / 1e6
    return dict(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.selection", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default="ada-criticalkv,defensivekv", help="comma-separated policy specs")
    p.add_argument("--base", default="ada-criticalkv", help="the policy the ratios are taken against")
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=int(os.environ.get("CRITICALKV_ORT_THREADS", "0")))
    p.add_argument("--op-profile", action="store_true", help="also report the body's time per operator type")
    p.add_argument("--output", type=Path, required=True, help="OUTPUT.json / OUTPUT.txt")
    args = p.parse_args(argv)
    names = args.policies.split(",")
    if args.base not in names:
        p.error(f"--base {args.base} is not in --policies")

    from criticalkv.bench.machine import git_commit, load_average
    from criticalkv.hf import load_model

    command = "python -m benchmarks.selection " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv))
    from criticalkv.build import package_versions  # torch and the exporter: not for --help

    info = {"command": command, "machine": machine(), "versions": package_versions(), "commit": git_commit(),
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    print(f"# {command}\n# load {info['machine']['load_average_start']}", flush=True)
    model, tokenizer = load_model(None)
    ids = tokenizer(long_text())["input_ids"][: args.prompt_len]
    n = len(ids)
    feeds = (np.array([ids]), np.ones((1, n), np.int64), np.arange(n)[None])
    workdir = Path(tempfile.mkdtemp(prefix="criticalkv-selbench-"))
    results: dict = {**info, "policies": {}}
    engines = {}
    try:
        for name in names:
            policy = parse_policy_spec(name, KVPolicy("full").replace(budget=args.budget))
            engines[name] = make_engine(model, tokenizer, policy, BuildConfig(n, 2), workdir, args.threads, True)
        walls: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.repeats):
            for name in names:
                walls[name].append(engines[name].backend.prefill(*feeds).seconds)
        for name in names:
            trace = engines[name].backend.end_profiling()
            runs = selection_profile(trace)
            entry = {"prefill_wall_s": walls[name], "prefill_profiled_s": [r.total_s for r in runs],
                     "selection_s": [r.selection_s for r in runs]}
            if args.op_profile:
                k = int(np.argsort([r.selection_s for r in runs])[len(runs) // 2])
                entry["op_s_median_run"] = op_times(trace, k)
            os.remove(trace)
            results["policies"][name] = entry
    finally:
        for e in engines.values():
            e.close()
        shutil.rmtree(workdir, ignore_errors=True)
    results["machine"]["load_average_end"] = load_average()
    med = {name: statistics.median(r["selection_s"]) for name, r in results["policies"].items()}
    lines = [
        f"# {command}",
        f"# commit {info['commit']}; {info['machine']['cpu']}, {info['machine']['logical_cpus']} logical CPUs; load average "
        f"{', '.join(f'{x:.2f}' for x in info['machine']['load_average_start'])} (start) / "
        f"{', '.join(f'{x:.2f}' for x in results['machine']['load_average_end'])} (end); ORT threads "
        f"{args.threads or 'default'}; medians over {args.repeats} repeats (policies interleaved)",
        "",
        f"| policy | prefill s (wall) | selection s (30 layers) | selection / {args.base} |",
        "|---|---:|---:|---:|",
    ]
    for name in names:
        r = results["policies"][name]
        lines.append(f"| {name} | {statistics.median(r['prefill_wall_s']):.2f} | {med[name]:.3f} | {med[name] / med[args.base]:.2f} |")
    if args.op_profile:
        for name in names:
            ops = sorted(results["policies"][name]["op_s_median_run"].items(), key=lambda kv: -kv[1])
            lines += ["", f"{name}: body time per operator type (median run, s): "
                      + ", ".join(f"{op} {s:.3f}" for op, s in ops[:12])]
    results["summary"] = {"selection_median_s": med, "ratio_to_base": {k: v / med[args.base] for k, v in med.items()}}
    table = "\n".join(lines)
    print(table)
    write_results(args.output, results, table)
    return 0


if __name__ == "__main__":
    sys.exit(benchmarks.run("selection", main))
