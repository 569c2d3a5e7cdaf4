"""``python -m benchmarks.steps``: where a served request's time goes, the graph runs against the Python around them.

Runs the server's scheduler (``criticalkv.serving.Scheduler`` with ``criticalkv serve``'s defaults: 512-token prefill
chunks, each in one run of the extend graph, the prefix cache on; ``--prefill-chunk`` / ``--prefill-run`` change the
first two) in this process on an engine, without Triton or the OpenAI frontend, and times three
nested spans of every scheduler step with ``time.perf_counter``:

* graph: the runtime running a compiled graph (ONNX Runtime's ``InferenceSession.run`` / ``run_with_iobinding``,
  OpenVINO's ``InferRequest.infer``);
* engine: the ``Engine`` call around it (``prefill_step``: a prompt chunk; ``finish_prefill``: the selection and its
  load into a slot; ``decode_greedy``: a decode step): feeds, KV copies into and out of the buffers, the argmax;
* step: the scheduler's step around that (``_prefill_step``, ``_decode_step``): sampling, each request's output,
  the prefix cache's copies of the prompt's blocks (``_cache_prefix``, also timed alone);

and the loop: the period of the scheduler's loop at the full batch (between consecutive decode steps with no prefill
chunk between them: admission, the lock, the cancelled-request checks, the step). Two workloads, each on a fresh
scheduler after a warm-up request: one ``--isl``-token chat with ``--osl`` new tokens (the prompt's chunks, the
selection, then batch-1 decode steps), and ``--batch`` concurrent ones (the decode steps with every request running
counted apart from those while prompts still come in). Greedy with ``ignore_eos``: every request runs ``--osl``
tokens. Prints one table per workload (--out: STEM.json and STEM.txt).

Compare on an idle machine; the spans are CPU wall time of the process, the graphs' own thread pools included.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import benchmarks

#: (row, its span, the graph runs inside it, the engine calls inside it: the rest is the span's own Python)
ROWS = (("prompt chunk (Engine.prefill_step)", "chunk/engine", ("chunk/graph",), ("chunk/graph",)),
        ("selection + load (Engine.finish_prefill)", "select/engine", ("select/graph",), ("select/graph",)),
        ("prefill step (Scheduler._prefill_step)", "prefill/step", ("chunk/graph", "select/graph", "prefill/graph"),
         ("chunk/engine", "select/engine", "prefill/graph")),
        ("of it the prefix cache's copies (Scheduler._cache_prefix)", "prefill/prefix_cache", (), ()),
        ("decode (Engine.decode_greedy)", "decode/engine", ("decode/graph",), ("decode/graph",)),
        ("decode step (Scheduler._decode_step)", "decode/step", ("decode/graph",), ("decode/engine",)))


class StepTimer:
    """Times the graph runs of both CPU runtimes and the engine's and scheduler's steps (the module docstring).

    ``install()`` wraps the runtimes' run methods (class-level: every session and request), ``watch(engine,
    scheduler, batch)`` the engine's and the scheduler's methods (instance attributes, undone by ``unwatch``)."""

    def __init__(self):
        self.times: dict[str, list[float]] = defaultdict(list)
        self.phase: str | None = None
        self.marks: list[tuple[float, int, int]] = []  # (start, prefill steps so far, batch) of every decode step
        self._undo: list = []

    def clear(self) -> None:
        self.times.clear()
        self.marks.clear()

    def _graph(self, fn):
        timer = self

        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timer.times[f"{timer.phase or 'other'}/graph"].append(time.perf_counter() - start)
        run.__wrapped__ = fn
        return run

    def install(self) -> None:
        import onnxruntime as ort

        targets = [(ort.InferenceSession, "run"), (ort.InferenceSession, "run_with_iobinding")]
        try:
            import openvino as ov

            targets.append((ov.InferRequest, "infer"))
        except ImportError:
            pass
        for cls, name in targets:
            original = getattr(cls, name)
            setattr(cls, name, self._graph(original))
            self._undo.append((cls, name, original))

    def uninstall(self) -> None:
        while self._undo:
            cls, name, original = self._undo.pop()
            setattr(cls, name, original)

    def _phased(self, obj, name: str, phase, span: str) -> None:
        fn = getattr(obj, name)
        timer = self

        def call(*args, **kwargs):
            outer = timer.phase
            timer.phase = phase if isinstance(phase, str) else phase()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timer.times[f"{timer.phase}/{span}"].append(time.perf_counter() - start)
                timer.phase = outer
        setattr(obj, name, call)

    def watch(self, engine, scheduler, batch: int) -> None:
        """Time ``engine``'s and ``scheduler``'s steps; decode steps with ``batch`` requests running count as
        ``decode``, the others (prompts still coming in) as ``decode_partial``."""
        def decode_phase():
            return "decode" if len(scheduler._running) == batch else "decode_partial"

        self._phased(engine, "prefill_step", "chunk", "engine")
        self._phased(engine, "finish_prefill", "select", "engine")
        self._phased(engine, "prefill", "whole", "engine")
        self._phased(engine, "decode_greedy", decode_phase, "engine")
        self._phased(scheduler, "_cache_prefix", "prefill", "prefix_cache")
        prefill_step, decode_step = scheduler._prefill_step, scheduler._decode_step

        def timed_prefill_step():  # the loop calls it every iteration: timed when a prompt is being prefilled
            if not scheduler._prefilling:
                return prefill_step()
            outer, self.phase = self.phase, "prefill"
            start = time.perf_counter()
            try:
                return prefill_step()
            finally:
                self.times["prefill/step"].append(time.perf_counter() - start)
                self.phase = outer

        def timed_decode_step():
            self.marks.append((time.perf_counter(), len(self.times["prefill/step"]), len(scheduler._running)))
            phase = decode_phase()
            start = time.perf_counter()
            try:
                return decode_step()
            finally:
                self.times[f"{phase}/step"].append(time.perf_counter() - start)
        scheduler._prefill_step, scheduler._decode_step = timed_prefill_step, timed_decode_step

    @staticmethod
    def unwatch(engine) -> None:
        for name in ("prefill_step", "finish_prefill", "prefill", "decode_greedy"):
            engine.__dict__.pop(name, None)  # back to the class's methods

    def summary(self, batch: int) -> dict:
        """Per span: runs, total and median (ms); ``decode/loop``: the loop's period at ``batch`` running requests."""
        out = {}
        for name, values in sorted(self.times.items()):
            if values:
                out[name] = {"n": len(values), "total_ms": 1e3 * sum(values),
                             "median_ms": 1e3 * statistics.median(values)}
        gaps = [b[0] - a[0] for a, b in zip(self.marks, self.marks[1:]) if a[1] == b[1] and a[2] == b[2] == batch]
        if gaps:
            out["decode/loop"] = {"n": len(gaps), "total_ms": 1e3 * sum(gaps),
                                  "median_ms": 1e3 * statistics.median(gaps)}
        return out


def run_requests(scheduler, prompts: list[list[int]], osl: int, firsts: dict | None = None) -> float:
    """Submit every prompt at once (greedy, ``ignore_eos``, ``osl`` tokens) and wait for all; the wall time (s).
    ``firsts``: filled with each request's first token time from its submission (``ttft_s``) and the gap from its
    first output to its second (``second_s``), as the scheduler stamped its outputs."""
    from criticalkv.request import Request, SamplingParams

    sampling = SamplingParams(max_tokens=osl, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    handles = [scheduler.submit(Request(prompt_token_ids=tuple(p), sampling=sampling)) for p in prompts]
    for handle in handles:
        outputs = list(handle)
        out = outputs[-1]
        if out.finish_reason != "length" or len(out.token_ids) != osl:
            raise RuntimeError(f"request {handle.request_id}: finished with {out.finish_reason!r} ({out.error}) after "
                               f"{len(out.token_ids)} of {osl} tokens")
        if firsts is not None:
            firsts.setdefault("ttft_s", []).append(outputs[0].ttft_s)
            if len(outputs) > 1:
                firsts.setdefault("second_s", []).append(outputs[1].elapsed_s - outputs[0].elapsed_s)
    return time.perf_counter() - start


def profile_workloads(engine, workloads: dict[str, list[list[int]]], warmup: list[int], osl: int,
                      scheduler_options: dict | None = None) -> dict:
    """Each workload (name -> its prompts, submitted together) on a fresh ``Scheduler`` of ``engine`` after a warm-up
    request (``warmup``, 4 tokens): its wall time and ``StepTimer.summary``."""
    from criticalkv.serving import Scheduler

    timer = StepTimer()
    timer.install()
    report = {}
    try:
        for name, prompts in workloads.items():
            scheduler = Scheduler(engine, **(scheduler_options or {}))
            try:
                run_requests(scheduler, [warmup], 4)
                timer.watch(engine, scheduler, len(prompts))
                timer.clear()
                firsts = {}
                wall = run_requests(scheduler, prompts, osl, firsts)
            finally:
                scheduler.close()
                timer.unwatch(engine)
            report[name] = {"requests": len(prompts), "prompt_tokens": [len(p) for p in prompts], "wall_s": wall,
                            "spans": timer.summary(len(prompts)), **firsts}
    finally:
        timer.uninstall()
    return report


def render(results: dict) -> str:
    from criticalkv.bench import machine

    lines = list(machine.header_lines(results)) + [""]
    for name, r in results["workloads"].items():
        spans = r["spans"]
        chunks = f", prefill chunk {results['prefill_chunk']} in runs of up to {results['prefill_run']}" \
            if "prefill_chunk" in results else ""
        lines.append(f"{name}: {r['requests']} x {r['prompt_tokens'][0]}-token prompt, {results['osl']} new tokens "
                     f"each, {results['backend']}{chunks}, wall {r['wall_s']:.2f} s "
                     f"({r['requests'] * results['osl'] / r['wall_s']:.2f} output tokens/s)")
        if r.get("ttft_s"):  # the scheduler's stamps: no server, no network
            line = f"first token {1e3 * statistics.median(r['ttft_s']):.0f} ms from submission (median)"
            if r.get("second_s"):
                line += f", the second {1e3 * statistics.median(r['second_s']):.0f} ms after it (median)"
            lines.append(line)
        lines.append("| span | runs | total ms | median ms | graph ms | graph % | outside the graph ms | of it in the "
                     "span's own Python ms |")
        lines.append("|---|---|---|---|---|---|---|---|")
        def total(keys):
            return sum((spans.get(k) or {}).get("total_ms", 0.0) for k in keys)

        for label, key, graph_keys, inner_keys in ROWS:
            span = spans.get(key)
            if not span:
                continue
            graph, whole = total(graph_keys), span["total_ms"]
            lines.append(f"| {label} | {span['n']} | {whole:.1f} | {span['median_ms']:.2f} | {graph:.1f} | "
                         f"{100 * graph / whole:.1f} | {whole - graph:.1f} | {whole - total(inner_keys):.1f} |")
        loop, graph = spans.get("decode/loop"), spans.get("decode/graph")
        if loop and graph:
            per, g = loop["total_ms"] / loop["n"], graph["total_ms"] / graph["n"]
            lines.append(f"\ndecode at batch {r['requests']}: a loop period of {per:.2f} ms (mean of {loop['n']}), "
                         f"the graph {g:.2f} ms of it (mean of {graph['n']}): {per - g:.2f} ms "
                         f"({100 * (per - g) / per:.1f} %) outside the graph")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.steps", description=__doc__.replace("``", ""),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine-dir", required=True, type=Path, help="the engine (scripts/build_engine.py's output)")
    parser.add_argument("--backend", default="onnxruntime", choices=("onnxruntime", "openvino"),
                        help="the runtime (default: onnxruntime)")
    parser.add_argument("--isl", type=int, default=2048, help="prompt tokens, chat template included (default: 2048)")
    parser.add_argument("--osl", type=int, default=64, help="new tokens per request (default: 64)")
    parser.add_argument("--batch", type=int, default=8, help="concurrent requests of the second workload (default: 8)")
    parser.add_argument("--workloads", default="single,batch",
                        help="comma-separated subset of single,batch (default: both)")
    parser.add_argument("--seed", type=int, default=0, help="the prompts (default: 0)")
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="the scheduler's prefill chunk (default: serve's, criticalkv.serving.scheduler."
                             "DEFAULT_PREFILL_CHUNK)")
    parser.add_argument("--prefill-run", type=int, default=None,
                        help="most prompt tokens per run of the extend graph (default: the engine's prefill_run, "
                             "criticalkv.runtime.engine.PREFILL_RUN where the graph takes any number)")
    parser.add_argument("--out", type=Path, help="also write STEM.json and STEM.txt")
    args = parser.parse_args(argv)
    if any(v is not None and v < 1 for v in (args.prefill_chunk, args.prefill_run)):
        parser.error("--prefill-chunk and --prefill-run must be >= 1")
    if args.isl < 64 or min(args.osl, args.batch) < 2:
        parser.error("--isl must be >= 64, --osl and --batch >= 2")
    wanted = [w for w in args.workloads.split(",") if w]
    if not wanted or any(w not in ("single", "batch") for w in wanted):
        parser.error(f"--workloads: expected a comma-separated subset of single,batch, got {args.workloads!r}")
    if not (args.engine_dir / "manifest.json").is_file():
        parser.error(f"{args.engine_dir}: not an engine directory (no manifest.json)")

    import json
    import shlex

    from criticalkv.bench import machine, report
    from criticalkv.bench.prompts import chat_ids, text_for_chat_length
    from criticalkv.runtime import Engine
    from criticalkv.serving.scheduler import DEFAULT_PREFILL_CHUNK

    results = machine.header(" ".join(["python -m benchmarks.steps", *map(shlex.quote, sys.argv[1:] if argv is None
                                                                       else argv)]))
    print("\n".join(machine.header_lines(results)), flush=True)
    engine = Engine.load(args.engine_dir, backend=args.backend, verify=False)
    if args.prefill_run is not None:
        engine.prefill_run = args.prefill_run
    options = {} if args.prefill_chunk is None else {"prefill_chunk": args.prefill_chunk}
    try:
        tok = engine.tokenizer

        def prompt(seed):
            return chat_ids(tok, text_for_chat_length(tok, args.isl, seed=seed))

        workloads = {"single": lambda: [prompt(args.seed + 1)],
                     "batch": lambda: [prompt(args.seed + 10 + i) for i in range(args.batch)]}
        workloads = {name: make() for name, make in workloads.items() if name in wanted}
        results.update(backend=args.backend, isl=args.isl, osl=args.osl, batch=args.batch,
                       prefill_chunk=options.get("prefill_chunk", DEFAULT_PREFILL_CHUNK), prefill_run=engine.prefill_run,
                       workloads=profile_workloads(engine, workloads, prompt(args.seed + 1000), args.osl, options))
    finally:
        engine.close()
    machine.finish(results)
    text = render(results)
    print(text)
    if args.out:
        report.write_atomic(args.out.with_suffix(".json"), json.dumps(results, indent=1) + "\n")
        report.write_atomic(args.out.with_suffix(".txt"), text)
    return 0


if __name__ == "__main__":
    sys.exit(benchmarks.run("steps", main))
