"""``criticalkv bench serve``: drive a criticalkv Triton server over a grid of workloads.

For every engine (a server started from ``--engine-dir``, several for a side-by-side run) or for a
running server (``--url``), and every input length (ISL) x output length (OSL) x load (each
``--concurrency`` or ``--request-rate``): ``--warmup`` requests, then ``--num-requests`` measured
requests with prompts of exactly ISL tokens (``criticalkv.bench.prompts``; the same prompts for every
engine) asking for exactly OSL tokens (``max_tokens`` = OSL, ``ignore_eos``). Results:
``STEM.json`` (``--out STEM``) (header, every run's summary and per-request timings, written after each run),
``.csv`` (one row per run), ``.txt`` (tables, ratios) and ``.png``.
"""

from __future__ import annotations

from pathlib import Path

from criticalkv.bench import machine, report, served
from criticalkv.bench.client import Endpoint, request_body, run_load
from criticalkv.bench.metrics import summarize
from criticalkv.bench.prompts import corpus_ids, make_prompts
from criticalkv.bench.report import add_out_argument
from criticalkv.bench.served import PySpyProfile, RssMonitor, profile_breakdown


def int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{what}: expected positive integers, got {text!r}")
    return values


def float_list(text: str, what: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated numbers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise ValueError(f"{what}: expected positive numbers, got {text!r}")
    return values


def request_record_json(r, t0: float) -> dict:
    """One request for the JSON: counts, TTFT, latency, and its response stamps in ms after its start
    (``start_s``: seconds after the run's first request)."""
    return {"ok": r.ok, "error": r.error, "input_tokens": r.input_tokens, "output_tokens": r.num_output_tokens if r.ok else None,
            "finish_reason": r.finish_reason, "ttft_ms": r.ttft * 1e3 if r.ok else None,
            "latency_ms": r.latency * 1e3 if r.ok else None, "kv_bytes_kept": r.kv_bytes_kept, "kv_bytes_full": r.kv_bytes_full,
            "start_s": round(r.start - t0, 6), "chunk_ms": [round((t - r.start) * 1e3, 3) for t, _ in r.chunks]}


def run_workloads(endpoint: Endpoint, engine: dict, pid: int | None, prompts: dict, args, results: dict, stem: Path) -> None:
    """Every ISL x OSL x load on one server; appends to ``results['runs']`` and rewrites the files."""
    loads = [("concurrency", c) for c in args.concurrency_list] + [("request_rate", r) for r in args.rate_list]
    counts = args.num_requests_list * len(loads) if len(args.num_requests_list) == 1 else args.num_requests_list
    for isl in args.isl_list:
        for osl in args.osl_list:
            for (kind, value), num_requests in zip(loads, counts):
                warm = [request_body(p.text, osl, not args.keep_eos, args.kv_budget) for p in prompts[isl][: args.warmup]]
                bodies = [request_body(p.text, osl, not args.keep_eos, args.kv_budget)
                          for p in prompts[isl][args.warmup: args.warmup + num_requests]]
                load = {"concurrency": value} if kind == "concurrency" else {"request_rate": value}
                if kind == "request_rate":
                    load["max_concurrency"] = args.max_concurrency
                label = f"{engine['label']} ISL {isl} OSL {osl} {report.load_label(load)}"
                if warm:
                    run_load(endpoint, warm, concurrency=value if kind == "concurrency" else min(len(warm), args.max_concurrency or len(warm)),
                             progress=f"warm-up {label}")
                profiler = None
                if args.profile and pid is not None:
                    slug = "".join(c if c.isalnum() else "-" for c in label).strip("-")
                    profiler = PySpyProfile(pid, stem.parent / f"{stem.name}-profile-{slug}.txt").start()
                try:
                    with RssMonitor(pid) as monitor:
                        load_start = machine.load_average()
                        records = run_load(endpoint, bodies, concurrency=load.get("concurrency"),
                                           request_rate=load.get("request_rate"), max_concurrency=load.get("max_concurrency"),
                                           seed=args.seed, progress=label)
                finally:
                    collapsed = profiler.stop() if profiler else None
                peak = monitor.peak_bytes if pid is not None else None
                summary = summarize(records)
                ok = [r for r in records if r.ok]
                run = {"engine": engine, "isl": isl, "osl": osl, **load, "kv_budget": args.kv_budget,
                       "num_requests": len(bodies), "warmup": len(warm), "summary": summary,
                       "osl_exact": bool(ok) and all(r.num_output_tokens == osl for r in ok),
                       "isl_exact": None if not ok or any(r.input_tokens is None for r in ok)
                       else all(r.input_tokens == isl for r in ok),
                       "first_error": next((r.error for r in records if r.error), None),
                       "server_peak_rss_mib": None if peak is None else peak / 2**20,
                       "load_average_before": load_start, "load_average_after": machine.load_average(),
                       "requests": [request_record_json(r, min(x.start for x in records)) for r in records]}
                if collapsed is not None:
                    run["profile"] = {"file": collapsed.name, **profile_breakdown(collapsed)}
                results["runs"].append(run)
                report.write_all(results, stem, figures=False)
                print("\n".join(report.run_block(run)), flush=True)


def main(args) -> int:
    args.isl_list = int_list(args.isl, "--isl")
    args.osl_list = int_list(args.osl, "--osl")
    args.concurrency_list = int_list(args.concurrency, "--concurrency") if args.concurrency else []
    args.rate_list = float_list(args.request_rate, "--request-rate") if args.request_rate else []
    if not args.concurrency_list and not args.rate_list:
        raise ValueError("give --concurrency and/or --request-rate")
    served.check_server_arguments(args)
    args.num_requests_list = int_list(str(args.num_requests), "--num-requests")
    n_loads = len(args.concurrency_list) + len(args.rate_list)
    if len(args.num_requests_list) not in (1, n_loads):
        raise ValueError(f"--num-requests: give one count or one per load ({n_loads}: concurrencies, then rates)")
    if args.warmup < 0:
        raise ValueError("--warmup must be >= 0")
    stem = args.out
    results = machine.header(args.command_line)
    results["settings"] = {"isl": args.isl_list, "osl": args.osl_list, "concurrency": args.concurrency_list,
                           "request_rate": args.rate_list, "max_concurrency": args.max_concurrency,
                           "num_requests": args.num_requests_list, "warmup": args.warmup, "kv_budget": args.kv_budget,
                           "seed": args.seed, "ignore_eos": not args.keep_eos}
    results["runs"] = []
    print("\n".join(machine.header_lines(results)), flush=True)

    tokenizer = served.load_tokenizer(args)
    ids = corpus_ids(tokenizer)
    count = args.warmup + max(args.num_requests_list)
    prompts = {isl: make_prompts(tokenizer, isl, count, seed=args.seed, ids=ids) for isl in args.isl_list}

    def on_server(endpoint: Endpoint, metrics_url, engine: dict) -> None:
        run_workloads(endpoint, engine, engine.get("server_pid"), prompts, args, results, stem)

    served.on_each_server(args, served.split_server_args(args.server_args, own=()), on_server, results)
    machine.finish(results)
    report.write_all(results, stem, figures=True)
    text = report.render(results)
    print(text[text.find("## output tokens/s ratios"):] if "## output tokens/s ratios" in text else "", flush=True)
    print(f"results: {stem}.json / .csv / .txt / .png", flush=True)
    failed = sum(r["summary"].get("failed", 0) for r in results["runs"])
    return 1 if failed else 0


def add_arguments(p) -> None:
    served.add_server_arguments(p)
    load = p.add_argument_group("workload")
    load.add_argument("--isl", default="2048", help="input lengths in tokens, comma-separated (default: 2048)")
    load.add_argument("--osl", default="64", help="output lengths in tokens, comma-separated (default: 64)")
    load.add_argument("--concurrency", default="", help="closed-loop concurrencies, e.g. 1,2,4,8")
    load.add_argument("--request-rate", default="", help="open-loop Poisson request rates in requests/s, e.g. 0.5,1")
    load.add_argument("--max-concurrency", type=int, help="cap on requests in flight in --request-rate mode")
    load.add_argument("--num-requests", default="16",
                      help="measured requests per workload: one count, or one per load in order (concurrencies, then "
                           "rates), e.g. --concurrency 1,8 --num-requests 3,8 (default: 16)")
    load.add_argument("--warmup", type=int, default=2, help="warm-up requests per workload, not measured (default: 2)")
    load.add_argument("--kv-budget", type=int, help="per-request kv_budget sent with every request (default: the engine's)")
    load.add_argument("--keep-eos", action="store_true", help="let requests stop at EOS (default: ignore_eos, exact OSL)")
    load.add_argument("--seed", type=int, default=0, help="prompt offsets and Poisson arrivals (default: 0)")
    out = p.add_argument_group("output")
    add_out_argument(out, "results/benchmarks/serving/serving")
    out.add_argument("--profile", action="store_true",
                     help="sample the server's process tree with py-spy during each measured workload: share of "
                          "time in prefill / decode / other, collapsed stacks next to the results")
