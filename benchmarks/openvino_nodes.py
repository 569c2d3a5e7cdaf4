"""``python -m benchmarks.openvino_nodes``: where a served prompt's time goes on OpenVINO, node type by node type, for
one engine or several side by side (an engine before and after a change of its graphs).

For each ``--engine-dir`` (OpenVINO backend, the plugin's default precision, ``PERF_COUNT`` on) one chat-wrapped
prompt of ``--isl`` tokens is prefilled the way ``criticalkv serve`` does it: ``--chunk``-token chunks through the
extend graph (``Engine.prefill_step``), then the selection and its load into a slot (``Engine.finish_prefill``).
After a warm-up prompt per engine, ``--rounds`` rounds run the engines one after the other (interleaved, so that the
machine's drift falls on every engine alike). Per engine and round: the chunks' wall time, the selection's, and the
sum of the executed nodes' times by node type (``InferRequest.get_profiling_info``; a node's time is its own
kernel's, so the types' sums show what a change of the graph moved). Printed: medians over the rounds, and each
engine's ratio to the first one's.

With several engines it also says whether each gives the first one's results: the last prompt token's logits and the
kept entries (every layer's lengths, keys and values of the slot), bitwise. A graph change that only re-expresses the
same computation should keep both.

Compare on an idle machine; the load average is recorded at the start and the end (--out: STEM.json and STEM.txt).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

import benchmarks

GRAPHS = ("extend_openvino", "select_openvino")


def load(folder: Path, **options):
    """``folder``'s engine on OpenVINO (``options``: the backend's, e.g. ``threads``), its prompt graphs compiled with
    ``PERF_COUNT`` on."""
    from criticalkv.runtime import Engine

    engine = Engine.load(folder, backend="openvino", verify=False, **options)
    engine.backend.config["PERF_COUNT"] = True  # before the graphs below are compiled
    for graph in GRAPHS:
        engine.backend._compiled.pop(graph, None)
    return engine


def profile_prompt(engine, ids: list[int], chunk: int) -> dict:
    """One prompt through ``engine``'s chunked prefill and selection; times, node-type sums and what came out."""
    from criticalkv.request import Request

    backend = engine.backend
    nodes: Counter = Counter()

    def collect(graph: str) -> None:
        for info in backend._requests[graph].get_profiling_info():
            if info.status.name == "EXECUTED":
                nodes[f"{'select' if graph == 'select_openvino' else 'extend'}: {info.node_type}"] += \
                    info.real_time.total_seconds() * 1e3

    start = time.perf_counter()
    job = engine.begin_prefill(Request(prompt_token_ids=ids))
    done = False
    while not done:
        done = engine.prefill_step(job, chunk)
        collect("extend_openvino")  # one run of the graph per chunk (Engine.prefill_run >= chunk)
    chunks_ms = (time.perf_counter() - start) * 1e3
    slot = engine.free_slots()[0]
    start = time.perf_counter()
    engine.finish_prefill(job, slot)
    select_ms = (time.perf_counter() - start) * 1e3
    collect("select_openvino")
    snapshot = engine.save(slot)
    engine.release(slot)
    return {"chunks_ms": chunks_ms, "select_ms": select_ms, "nodes": dict(nodes),
            "logits": np.array(job.logits), "row": snapshot.row}


def same_row(a, b) -> bool:
    arrays = list(zip(a.lengths, b.lengths)) + list(zip(a.keys + a.values, b.keys + b.values))
    return all(x.shape == y.shape and np.array_equal(x, y) for x, y in arrays)


def render(results: dict) -> str:
    names = [e["name"] for e in results["engines"]]
    first = results["engines"][0]
    lines = [f"{results['isl']}-token prompt in {results['chunk']}-token chunks (extend graph), then the selection; "
             f"OpenVINO, medians of {results['rounds']} interleaved rounds", "",
             "| | " + " | ".join(names) + " |" + (" ratio to the first |" * (len(names) > 1)),
             "|---|" + "---|" * len(names) + "---|" * (len(names) > 1)]

    def row(label: str, values: list[float]) -> str:
        cells = " | ".join(f"{v:.1f}" for v in values)
        ratios = " / ".join(f"{v / values[0]:.2f}x" if values[0] else "-" for v in values[1:])
        return f"| {label} | {cells} |" + (f" {ratios} |" if len(values) > 1 else "")

    lines.append(row("prompt chunks, wall (ms)", [e["chunks_ms"] for e in results["engines"]]))
    lines.append(row("selection + load, wall (ms)", [e["select_ms"] for e in results["engines"]]))
    lines.append(row("extend nodes, sum (ms)", [e["extend_nodes_ms"] for e in results["engines"]]))
    types = sorted({t for e in results["engines"] for t in e["nodes"]},
                   key=lambda t: -max(e["nodes"].get(t, 0.0) for e in results["engines"]))
    for node_type in types[:results["top"]]:
        lines.append(row(node_type, [e["nodes"].get(node_type, 0.0) for e in results["engines"]]))
    lines.append("")
    lines.append(f"per round, prompt chunks wall (ms): " + "; ".join(
        f"{e['name']} {', '.join(f'{v:.0f}' for v in e['rounds_chunks_ms'])}" for e in results["engines"]))
    for e in results["engines"][1:]:
        lines.append(f"{e['name']} against {first['name']}: last logits {'equal' if e['same_logits'] else 'DIFFERENT'}"
                     f" (max |diff| {e['logits_max_diff']:.3g}), kept entries {'equal' if e['same_kept'] else 'DIFFERENT'}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=benchmarks.prog("openvino_nodes"), description=benchmarks.plain(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine-dir", action="append", type=Path, required=True,
                        help="an engine directory (repeat: engines side by side; the first is the reference)")
    parser.add_argument("--isl", type=int, default=2048, help="prompt tokens, chat template included (default: 2048)")
    parser.add_argument("--chunk", type=int, default=512,
                        help="prefill chunk (default: 512, criticalkv serve's, one extend run each)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds after the warm-up (default: 5)")
    parser.add_argument("--top", type=int, default=12, help="node types listed, slowest first (default: 12)")
    parser.add_argument("--seed", type=int, default=0, help="the prompt (default: 0)")
    parser.add_argument("--out", type=Path, help="also write STEM.json and STEM.txt")
    args = parser.parse_args(argv)
    if args.isl < 64 or args.chunk < 1 or args.rounds < 1 or args.top < 1:
        parser.error("--isl must be >= 64; --chunk, --rounds and --top >= 1")
    for folder in args.engine_dir:
        if not (folder / "manifest.json").is_file():
            parser.error(f"{folder}: not an engine directory (no manifest.json)")

    from criticalkv.bench import machine, report
    from criticalkv.bench.prompts import chat_ids, text_for_chat_length

    results = machine.header(benchmarks.command_line("openvino_nodes", argv))
    print("\n".join(machine.header_lines(results)), flush=True)
    engines = []
    try:
        for folder in args.engine_dir:
            engine = load(folder)
            engines.append(engine)
            if engine.prefill_run < args.chunk:
                raise ValueError(f"{folder}: its extend graph takes at most {engine.prefill_run} tokens a run, "
                                 f"--chunk {args.chunk} would split a chunk")
        tok = engines[0].tokenizer
        ids = chat_ids(tok, text_for_chat_length(tok, args.isl, seed=args.seed))
        for engine in engines:  # warm-up: compiles (or loads) the graphs
            profile_prompt(engine, ids, args.chunk)
        runs: list[list[dict]] = [[] for _ in engines]
        for r in range(args.rounds):
            for i, engine in enumerate(engines):
                runs[i].append(profile_prompt(engine, ids, args.chunk))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{folder.name} {run[-1]['chunks_ms']:.0f} ms" for folder, run in zip(args.engine_dir, runs)), flush=True)
    finally:
        for engine in engines:
            engine.close()
    machine.finish(results)
    summary = []
    for folder, engine_runs in zip(args.engine_dir, runs):
        types = {t for run in engine_runs for t in run["nodes"]}
        entry = {"name": folder.name, "engine_dir": str(folder),
                 "chunks_ms": statistics.median(run["chunks_ms"] for run in engine_runs),
                 "select_ms": statistics.median(run["select_ms"] for run in engine_runs),
                 "extend_nodes_ms": statistics.median(sum(v for t, v in run["nodes"].items() if t.startswith("extend"))
                                                      for run in engine_runs),
                 "nodes": {t: statistics.median(run["nodes"].get(t, 0.0) for run in engine_runs) for t in types},
                 "rounds_chunks_ms": [run["chunks_ms"] for run in engine_runs]}
        if summary:
            reference, last = runs[0][-1], engine_runs[-1]
            entry.update(same_logits=bool(np.array_equal(reference["logits"], last["logits"])),
                         logits_max_diff=float(np.abs(reference["logits"] - last["logits"]).max()),
                         same_kept=same_row(reference["row"], last["row"]))
        summary.append(entry)
    results.update(isl=args.isl, chunk=args.chunk, rounds=args.rounds, top=args.top, engines=summary)
    text = render(results)
    print(text)
    if args.out:
        report.write_atomic(args.out.with_suffix(".json"), json.dumps(results, indent=1) + "\n")
        report.write_atomic(args.out.with_suffix(".txt"), "\n".join(machine.header_lines(results)) + "\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(benchmarks.run("openvino_nodes", main))
