"""What one step of chunked prefill costs: the unit a short request waits for when it arrives during a long prefill.

The scheduler interleaves a long prompt's chunks (``Engine.prefill_step``, ``--prefill-chunk`` tokens, run through the
extend graph at most ``Engine.prefill_run`` tokens at a time) with the other requests' work; a short request that
arrives during a chunk waits for the rest of that chunk, then for its own prefill. This times, on one engine, with
the server's threads: the steps of a ``--isl``-token prompt for each ``--chunks`` size, the selection at its end
(``Engine.finish_prefill``) and a one-shot prefill of a ``--short``-token prompt, interleaved over ``--repeats``
rounds (medians):

    python -m benchmarks.chunks --engine-dir engines/ctx-ckv256 --chunks 512,256 --out results/benchmarks/serving

A size ``CHUNK:RUN`` also sets the most tokens per run of the extend graph (``Engine.prefill_run``), e.g.
``--backend openvino --chunks 512:256,512`` times 512-token chunks in runs of 256 and in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import benchmarks
from criticalkv.bench.report import write_atomic


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.chunks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", type=Path, required=True, help="an engine built with extend.onnx (format 2)")
    ap.add_argument("--isl", type=int, default=2048, help="the long prompt's tokens (default: 2048)")
    ap.add_argument("--short", type=int, default=128, help="the short prompt's tokens (default: 128)")
    ap.add_argument("--chunks", default="512,256",
                    help="prefill chunk sizes to time, comma-separated; CHUNK:RUN also sets the tokens per extend run")
    ap.add_argument("--backend", default=None, choices=("onnxruntime", "openvino", "torch"),
                    help="the runtime (default: the engine's)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds after one warm-up (default: 3)")
    ap.add_argument("--out", type=Path, default=None, help="folder for prefill_chunks.json / .md (default: print only)")
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    import numpy as np

    from criticalkv.request import Request, SamplingParams
    from criticalkv.runtime import Engine

    engine = Engine.load(args.engine_dir, backend=args.backend)
    default_run = engine.prefill_run
    rng = np.random.default_rng(0)  # the cost of a step does not depend on which tokens it runs
    long_ids = tuple(int(x) for x in rng.integers(100, engine.spec["vocab_size"], args.isl))
    short_ids = tuple(int(x) for x in rng.integers(100, engine.spec["vocab_size"], args.short))
    chunks = args.chunks.split(",")
    sizes = {c: (int(c.split(":")[0]), int(c.split(":")[1]) if ":" in c else default_run) for c in chunks}
    steps = {c: [] for c in chunks}
    select_s, short_s, one_shot_s = [], [], []
    for r in range(args.repeats + 1):
        for c in chunks:
            size, engine.prefill_run = sizes[c]
            job = engine.begin_prefill(Request(prompt_token_ids=long_ids, sampling=SamplingParams(max_tokens=1)))
            times = []
            done = False
            while not done:
                start = time.perf_counter()
                done = engine.prefill_step(job, size)
                times.append(time.perf_counter() - start)
            start = time.perf_counter()
            engine.finish_prefill(job, 0)
            if r:
                steps[c].append(times)
                select_s.append(time.perf_counter() - start)
            engine.release(0)
        start = time.perf_counter()
        engine.prefill(0, Request(prompt_token_ids=short_ids, sampling=SamplingParams(max_tokens=1)))
        elapsed = time.perf_counter() - start
        engine.release(0)
        start = time.perf_counter()
        engine.prefill(0, Request(prompt_token_ids=long_ids, sampling=SamplingParams(max_tokens=1)))
        elapsed_long = time.perf_counter() - start
        engine.release(0)
        if r:
            short_s.append(elapsed)
            one_shot_s.append(elapsed_long)
    result = {
        "command": "python -m benchmarks.chunks " + shlex.join(sys.argv[1:]),
        "load_average_end": list(os.getloadavg()), "isl": args.isl, "short": args.short,
        "extend_chunk": engine.extend_chunk, "prefill_run": default_run, "backend": engine.backend.name,
        "repeats": args.repeats,
        "short_prefill_ms": 1000 * statistics.median(short_s),
        "one_shot_prefill_ms": 1000 * statistics.median(one_shot_s),
        "select_ms": 1000 * statistics.median(select_s),
        "chunks": {c: {"steps": len(steps[c][0]), "run": sizes[c][1],
                            "step_ms_median_by_index": [1000 * statistics.median(t[i] for t in steps[c])
                                                        for i in range(len(steps[c][0]))],
                            "total_ms": 1000 * statistics.median(sum(t) for t in steps[c])} for c in chunks},
    }
    engine.close()
    return result


def markdown(res: dict) -> str:
    lines = [f"`{res['command']}`", "", f"load average at the end: {res['load_average_end'][0]:.2f}; {res['backend']}; "
             f"extend runs of up to {res['prefill_run']} tokens unless a size says; medians of {res['repeats']} rounds",
             "",
             f"- one-shot prefill of the {res['isl']}-token prompt: {res['one_shot_prefill_ms']:.0f} ms; of the "
             f"{res['short']}-token prompt: {res['short_prefill_ms']:.0f} ms; the selection after the last chunk: "
             f"{res['select_ms']:.0f} ms", "",
             "| prefill chunk | steps | each step, ms (first .. last) | all steps, ms | / one-shot prefill |",
             "|---|---:|---|---:|---:|"]
    for c, s in res["chunks"].items():
        each = ", ".join(f"{x:.0f}" for x in s["step_ms_median_by_index"])
        lines.append(f"| {c} | {s['steps']} | {each} | {s['total_ms']:.0f} | "
                     f"{s['total_ms'] / res['one_shot_prefill_ms']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    res = run(args)
    text = markdown(res)
    print(text)
    if args.out:
        write_atomic(args.out / "prefill_chunks.json", json.dumps(res, indent=1) + "\n")
        write_atomic(args.out / "prefill_chunks.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(benchmarks.run("chunks", main))
