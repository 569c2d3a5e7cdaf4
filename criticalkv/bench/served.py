"""What the served-load benchmarks (``docqa``, ``memory``, ``cached-context``) share: servers started one after the
other with the same flags, the KV memory they are given, a workload's record per server, ratios to ``full``.

A server run is a dict: ``engine`` (``engine_label``), ``server_args`` (the ``criticalkv serve`` flags it got),
``summary`` (``metrics.summarize`` of the measured requests), ``server_metrics`` (the scheduler's gauges sampled
during the run: requests running / waiting, KV bytes held; ``MetricsMonitor``), ``decoding`` (how many requests
were between their first and last token at once: ``metrics.concurrency_profile``), load averages, and every
request's stamps.
"""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

from criticalkv.bench import machine
from criticalkv.bench.client import Endpoint, is_ready
from criticalkv.bench.metrics import RequestRecord, concurrency_profile, decoding_intervals, summarize
from criticalkv.bench.report import write_atomic
from criticalkv.bench.server import (MetricsMonitor, ServerProcess, engine_label, kv_bytes_per_token, only_model,
                                     served_engine)

#: ``criticalkv serve`` flags a benchmark sets itself (from its own options), refused inside --server-args.
OWN_FLAGS = ("--kv-memory-mib", "--kv-pool-mib", "--context-cache-mib", "--prefill-chunk")


def uptime() -> str | None:
    """The ``uptime`` line (load averages of the whole machine), or None where there is no such command."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def check_engines(engine_dirs) -> None:
    for d in engine_dirs:
        if not (Path(d) / "manifest.json").is_file():
            raise FileNotFoundError(f"{d}: not an engine directory (no manifest.json)")


def split_server_args(text: str, own: tuple[str, ...] = OWN_FLAGS) -> list[str]:
    """``--server-args`` as a list; a flag the benchmark sets itself is refused (it would be given twice)."""
    extra = shlex.split(text) if text else []
    clash = [a for a in extra if a.split("=", 1)[0] in own]
    if clash:
        raise ValueError(f"--server-args: {', '.join(clash)} is set by this benchmark's own option "
                         f"(--{clash[0].split('=', 1)[0].lstrip('-')} of the benchmark)")
    return extra


def full_engine(engine_dirs) -> Path:
    """The engine whose uncompressed KV sizes the memory: the ``full`` one when given, else the first (every
    engine of a comparison serves the same model: the full cache's size is the same)."""
    for d in engine_dirs:
        if engine_label(Path(d))["policy"] == "full":
            return Path(d)
    return Path(engine_dirs[0])


def kv_mib(engine_dir: Path, tokens: int, count: float) -> float:
    """MiB of ``count`` uncompressed sequences of ``tokens`` tokens (the model's KV bytes per token)."""
    return count * tokens * kv_bytes_per_token(engine_dir) / 2**20


def mib_flag(mib: float) -> str:
    """``mib`` for a ``--*-mib`` flag, rounded up to 0.001 MiB: a budget meant to hold exactly k sequences must not
    come out a few bytes short of them (the server takes ``int(mib * 2**20)`` bytes)."""
    return f"{math.ceil(mib * 1000 - 1e-6) / 1000:.3f}"


def request_json(r: RequestRecord, t0: float, **extra) -> dict:
    """One request for the JSON: counts, TTFT, latency, cache hit, and its response stamps in ms after its start
    (``start_s``: seconds after the run's first request)."""
    return {"ok": r.ok, "error": r.error, "input_tokens": r.input_tokens,
            "output_tokens": r.num_output_tokens if r.ok else None, "finish_reason": r.finish_reason,
            "ttft_ms": r.ttft * 1e3 if r.ok else None, "latency_ms": r.latency * 1e3 if r.ok else None,
            "context_cache_hit": r.context_cache_hit, "kv_bytes_kept": r.kv_bytes_kept, "kv_bytes_full": r.kv_bytes_full,
            "start_s": round(r.start - t0, 6), "chunk_ms": [round((t - r.start) * 1e3, 3) for t, _ in r.chunks], **extra}


def measure_run(endpoint: Endpoint, metrics_url: str | None, engine: dict, server_args: list[str],
                send: Callable[[], list[RequestRecord]], extra: list[dict] | None = None) -> dict:
    """Run ``send()`` (the measured requests) while the server's gauges are sampled; the run's dict.
    ``extra``: per request, more fields for its JSON (e.g. its document and question numbers)."""
    load_before = machine.load_average()
    with MetricsMonitor(metrics_url) as monitor:
        records = send()
    ok = [r for r in records if r.ok]
    t0 = min((r.start for r in records), default=0.0)
    return {"engine": engine, "server_args": server_args, "summary": summarize(records),
            "server_metrics": monitor.summary(), "decoding": concurrency_profile(decoding_intervals(ok)),
            "first_error": next((r.error for r in records if r.error), None),
            "load_average_before": load_before, "load_average_after": machine.load_average(),
            "requests": [request_json(r, t0, **(extra[i] if extra else {})) for i, r in enumerate(records)]}


def on_each_server(args, server_args: list[str], work: Callable[[Endpoint, str | None, dict], None], results: dict,
                   log=print) -> None:
    """``work(endpoint, metrics_url, engine)`` on a running server (``--url``) or on each ``--engine-dir`` in turn,
    each started here with ``server_args`` (and stopped before the next starts)."""
    if args.url:
        url = args.url.rstrip("/")
        if not is_ready(url):
            raise ValueError(f"{url}: the server is not ready (GET /v2/health/ready)")
        model = args.model_name or only_model(url)
        engine = served_engine(url, model)
        results["server_note"] = f"running server {url}, model {model}"
        work(Endpoint(url, model), args.metrics_url, engine)
        return
    notes = []
    logs = Path(tempfile.mkdtemp(prefix="criticalkv-bench-logs-"))
    for engine_dir in args.engine_dir:
        engine = engine_label(Path(engine_dir))
        log_path = logs / f"server-{engine['label'].replace(' ', '').replace('=', '')}.log"
        started = time.perf_counter()
        log(f"starting criticalkv serve --engine-dir {engine['engine_dir']} {shlex.join(server_args)} ...")
        with ServerProcess(Path(engine_dir), server_args, log_path) as server:
            engine["server_ready_s"] = time.perf_counter() - started
            model = args.model_name or only_model(server.url)
            notes.append(f"{engine['label']}: criticalkv serve --engine-dir {engine['engine_dir']} "
                         f"{shlex.join(server_args)}".strip())
            work(Endpoint(server.url, model), server.metrics_url, engine)
    results["server_note"] = "; ".join(notes)


def add_server_arguments(p, url_help: str = "a running server instead, e.g. http://127.0.0.1:8000") -> None:
    """--engine-dir (repeatable) / --url and what describes a running server."""
    target = p.add_argument_group("server")
    target.add_argument("--engine-dir", action="append", metavar="DIR",
                        help="start `criticalkv serve` on this engine directory; repeat for a side-by-side run (the "
                             "servers run one after the other with the same flags)")
    target.add_argument("--url", help=url_help)
    target.add_argument("--metrics-url", help="with --url: its Prometheus endpoint (e.g. http://127.0.0.1:8002/metrics) "
                        "to sample the scheduler's gauges")
    target.add_argument("--model-name", help="the Triton model to call (default: the server's only ready model)")
    target.add_argument("--server-args", default="",
                        help="more arguments for `criticalkv serve`, one quoted string (not the flags this benchmark "
                             "sets itself)")
    target.add_argument("--tokenizer", help="tokenizer folder for the prompts (default: the first engine's tokenizer/)")


def check_server_arguments(args) -> None:
    if bool(args.url) == bool(args.engine_dir):
        raise ValueError("give either --url (a running server) or --engine-dir (one or more, started here)")
    if args.url and not args.tokenizer:
        raise ValueError("--url needs --tokenizer (the folder of the server's tokenizer)")
    check_engines(args.engine_dir or [])


def load_tokenizer(args):
    from transformers import AutoTokenizer

    folder = Path(args.tokenizer) if args.tokenizer else Path(args.engine_dir[0]) / "tokenizer"
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no tokenizer folder (give --tokenizer)")
    return AutoTokenizer.from_pretrained(folder)


def ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def versus_full(runs: list[dict], metrics: dict[str, Callable[[dict], float | None]]) -> list[dict]:
    """For each run of a policy other than ``full``: each metric's value, ``full``'s, and their ratio."""
    full = next((r for r in runs if r["engine"].get("policy") == "full"), None)
    if full is None:
        return []
    out = []
    for run in runs:
        if run is full:
            continue
        row = {"engine": run["engine"]["label"], "base": full["engine"]["label"]}
        for name, get in metrics.items():
            a, b = get(run), get(full)
            row[name] = {"value": a, "base": b, "ratio": ratio(a, b)}
        out.append(row)
    return out


def write_results(results: dict, stem: Path, render: Callable[[dict], str], plot: Callable[[dict, Path], None] | None) -> None:
    """stem.json, stem.md and (``plot``) stem.png, each written atomically."""
    write_atomic(stem.with_suffix(".json"), json.dumps(results, indent=1) + "\n")
    write_atomic(stem.with_suffix(".md"), render(results))
    if plot is not None:
        tmp = stem.with_name(f".{stem.name}.tmp.png")
        plot(results, tmp)
        tmp.replace(stem.with_suffix(".png"))


def fmt(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def header_block(results: dict) -> list[str]:
    return [*machine.header_lines(results), f"# uptime before: {results.get('uptime_before')}",
            f"# uptime after: {results.get('uptime_after')}", f"# server: {results.get('server_note')}", ""]
