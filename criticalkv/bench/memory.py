"""``criticalkv bench memory``: memory-bound decode, where eviction should let a server hold more sequences.

``--num-requests`` prompts of ``--isl`` tokens (``bench serve``'s prompts), ``--osl`` new tokens each (greedy,
``ignore_eos``), closed loop at ``--concurrency``, sent to one server after the other (``--engine-dir``, repeat: e.g.
``full`` and criticalkv b=256), every server started with the same ``--kv-memory-mib`` M (``--kv-memory``, default
2 full sequences of ISL + OSL tokens of the ``full`` engine; printed). ``full`` then decodes about 2 sequences at a
time; an evicting policy holds b + OSL entries per head instead of ISL + OSL, so more sequences fit the same memory
(while a prompt is prefilled it still holds its full K/V: admission counts it).

Per server: output tokens/s, TTFT and TPOT, and the sequences it held at once, measured two ways: from the requests
(between a request's first and last token it holds a decoding sequence: peak and time-weighted mean) and from the
scheduler's ``criticalkv_requests_running`` gauge (sampled every 0.1 s: peak and mean), with the KV MiB it held; then
the ratios to ``full``. The target (ISL 2048, OSL 256): criticalkv >= 1.4x ``full``'s output tokens/s.

Results (``--out STEM``): ``STEM.json`` (command, machine, load average, versions, settings, every request),
``STEM.md``, ``STEM.png``.
"""

from __future__ import annotations

from pathlib import Path

from criticalkv.bench import machine, served
from criticalkv.bench.report import add_out_argument
from criticalkv.bench.client import Endpoint, request_body, run_load

#: The target (ISL 2048, OSL 256, KV memory of 2 full sequences): criticalkv output tokens/s >= 1.4x full.
TARGET_THROUGHPUT = 1.4
TARGET_WORKLOAD = {"isl": 2048, "osl": 256, "kv_sequences": 2.0}

RATIOS = {
    "output_throughput": lambda r: r["summary"].get("output_throughput"),
    "decoding_mean": lambda r: r["decoding"].get("mean"),
    "running_mean": lambda r: (r["server_metrics"].get("criticalkv_requests_running")
                               or r["server_metrics"].get("vllm:num_requests_running") or {}).get("mean"),
    "ttft_p50_ms": lambda r: (r["summary"].get("ttft_ms") or {}).get("p50"),
    "tpot_p50_ms": lambda r: (r["summary"].get("tpot_ms") or {}).get("p50"),
}


def targets(results: dict) -> list[dict]:
    s = results["settings"]
    is_target = all(s.get(k) == v for k, v in TARGET_WORKLOAD.items())
    out = []
    for row in results.get("versus_full", []):
        r = row["output_throughput"]["ratio"]
        out.append({"engine": row["engine"], "what": f"output tokens/s >= {TARGET_THROUGHPUT:g}x full", "ratio": r,
                    "goal": TARGET_THROUGHPUT, "met": (None if r is None else r >= TARGET_THROUGHPUT) if is_target else None,
                    "target_workload": is_target})
    return out


def render(results: dict) -> str:
    s = results["settings"]
    f = served.fmt
    lines = served.header_block(results) + [
        f"{s['num_requests']} requests, ISL {s['isl']}, OSL {s['osl']}, concurrency {s['concurrency']} (after "
        f"{s['warmup']} warm-up). Every server: --kv-memory-mib {f(s['kv_memory_mib'], 1)} ({s['kv_memory_note']}).", "",
        "| server | ok / failed | output tokens/s | TTFT p50 (ms) | TPOT p50 (ms) | sequences decoding, mean (peak) "
        "| server's running gauge, mean (peak) | KV MiB held, mean (peak) | KV MiB per sequence kept / full | duration (s) |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for run in results["runs"]:
        sm, dec, m = run["summary"], run["decoding"], run["server_metrics"]
        if not sm.get("completed"):
            lines.append(f"| {run['engine']['label']} | 0 / {sm.get('failed')} | all failed: {run.get('first_error')} "
                         "| | | | | | | |")
            continue
        running = m.get("criticalkv_requests_running") or m.get("vllm:num_requests_running") or {}
        held = m.get("criticalkv_kv_bytes_reserved") or {}
        kept, full = (sm.get(k) or {} for k in ("kv_mib_kept_per_seq", "kv_mib_full_per_seq"))
        mib = (lambda x: None if x is None else x / 2**20)
        lines.append(
            f"| {run['engine']['label']} | {sm['completed']} / {sm['failed']} | {f(sm['output_throughput'], 2)} "
            f"| {f(sm['ttft_ms']['p50'])} | {f(sm['tpot_ms']['p50'])} | {f(dec['mean'], 2)} ({dec['peak']}) "
            f"| {f(running.get('mean'), 2)} ({f(running.get('peak'), 0)}) | {f(mib(held.get('mean')))} "
            f"({f(mib(held.get('peak')))}) | {f(kept.get('avg'), 2)} / {f(full.get('avg'), 2)} "
            f"| {f(sm['duration_s'], 1)} |")
    if results.get("versus_full"):
        lines += ["", "| server / full | output tokens/s | sequences decoding (mean) | running gauge (mean) | TTFT p50 "
                  "| TPOT p50 |", "|---|---|---|---|---|---|"]
        for row in results["versus_full"]:
            lines.append(f"| {row['engine']} / {row['base']} | " + " | ".join(
                f"{f(row[k]['ratio'], 2)}x" if row[k]["ratio"] is not None else "-"
                for k in ("output_throughput", "decoding_mean", "running_mean", "ttft_p50_ms", "tpot_p50_ms")) + " |")
    if results.get("versus_vllm"):
        lines += ["", "Medians over each server's runs, ratios to vLLM's (same KV memory; vLLM's running gauge is its "
                  "requests scheduled, preempted ones waiting):", "",
                  "| server / vllm | output tokens/s | sequences decoding (mean) | running gauge (mean) | TTFT p50 | "
                  "TPOT p50 |", "|---|---|---|---|---|---|"]
        for row in results["versus_vllm"]:
            lines.append(f"| {row['engine']} | " + " | ".join(
                f"{f(row[k]['value'], 2)} / {f(row[k]['base'], 2)} = {f(row[k]['ratio'], 2)}x"
                for k in ("output_throughput", "decoding_mean", "running_mean", "ttft_p50_ms", "tpot_p50_ms")) + " |")
        for r in results["runs"]:
            if r["engine"]["label"] == "vllm":
                pre = r["server_metrics"].get("vllm:num_preemptions_total") or {}
                use = r["server_metrics"].get("vllm:kv_cache_usage_perc") or {}
                lines.append(f"\nvLLM (round {r['engine'].get('repeat', 0) + 1}): preemptions during the run "
                             f"{f(None if not pre else pre['last'] - pre['first'], 0)}, KV blocks in use mean "
                             f"{f(None if use.get('mean') is None else 100 * use['mean'])} %; KV {r['engine'].get('vllm_kv')}")
    rows = targets(results)
    if rows:
        lines.append("")
        for t in rows:
            met = ("met" if t["met"] else "NOT met") if t["met"] is not None else \
                "- (not the target's workload: ISL 2048, OSL 256, 2 full sequences of memory)"
            lines.append(f"Target ({t['engine']}: {t['what']}): {f(t['ratio'], 2)}x, {met}.")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in results["runs"] if r["summary"].get("completed")]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    ax = axes[0]
    labels = [r["engine"]["label"] for r in runs]
    ax.bar(labels, [r["summary"]["output_throughput"] for r in runs], color="tab:blue")
    for i, r in enumerate(runs):
        ax.text(i, r["summary"]["output_throughput"], f"{r['decoding']['mean'] or 0:.2f} seqs (mean)", ha="center",
                va="bottom", fontsize=8)
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput (sequences decoding at once)")
    ax = axes[1]
    for r in runs:  # sequences decoding over time, from the requests' first and last tokens
        events = sorted([(q["start_s"] + q["chunk_ms"][0] / 1e3, 1) for q in r["requests"] if q["ok"]]
                        + [(q["start_s"] + q["chunk_ms"][-1] / 1e3, -1) for q in r["requests"] if q["ok"]])
        xs, ys, level = [], [], 0
        for t, d in events:
            xs.append(t)
            ys.append(level)
            level += d
            xs.append(t)
            ys.append(level)
        ax.plot(xs, ys, label=r["engine"]["label"])
    ax.set_xlabel("s after the first request")
    ax.set_ylabel("sequences decoding")
    ax.set_title("sequences held at once")
    ax.legend(fontsize=8)
    s = results["settings"]
    memory = "the server's" if s["kv_memory_mib"] is None else f"{s['kv_memory_mib']:.0f} MiB"
    fig.suptitle(f"memory-bound decode: ISL {s['isl']}, OSL {s['osl']}, conc {s['concurrency']}, KV memory {memory}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args) -> int:
    from criticalkv.bench.prompts import make_prompts

    served.check_server_arguments(args)
    if min(args.isl, args.osl, args.concurrency, args.num_requests) < 1 or args.warmup < 0:
        raise ValueError("--isl, --osl, --concurrency and --num-requests must be >= 1, --warmup >= 0")
    given_mib, sequences = args.kv_memory
    extra = served.split_server_args(args.server_args, own=("--kv-memory-mib", "--kv-pool-mib"))
    if given_mib is not None:
        memory, note = given_mib, "given"
    elif args.engine_dir and not args.url:
        full = served.full_engine(args.engine_dir)
        memory = served.kv_mib(full, args.isl + args.osl, sequences)
        note = (f"{sequences:g} full sequences of {args.isl} + {args.osl} tokens of {Path(full).name}: "
                f"{served.kv_mib(full, args.isl + args.osl, 1):.2f} MiB each")
    else:
        memory, note = None, "the running server's"
    server_args = extra + ([] if memory is None else ["--kv-memory-mib", served.mib_flag(memory)])
    stem = args.out
    results = machine.header(args.command_line)
    results["benchmark"] = "memory"
    results["uptime_before"] = served.uptime()
    results["settings"] = {"isl": args.isl, "osl": args.osl, "concurrency": args.concurrency,
                           "num_requests": args.num_requests, "warmup": args.warmup, "seed": args.seed,
                           "kv_budget": args.kv_budget, "kv_memory_mib": memory, "kv_memory_note": note,
                           "kv_sequences": sequences if given_mib is None and not args.url else None,
                           "server_args": server_args}
    results["runs"] = served.previous_runs(args, stem, results)
    print("\n".join(machine.header_lines(results)), flush=True)
    print(f"KV memory per server: {'-' if memory is None else f'{memory:.2f}'} MiB ({note})", flush=True)
    prompts = make_prompts(served.load_tokenizer(args), args.isl, args.warmup + args.num_requests, seed=args.seed)
    bodies = [request_body(p.text, args.osl, True, args.kv_budget) for p in prompts]
    warm, measured = bodies[: args.warmup], bodies[args.warmup:]

    def on_server(endpoint: Endpoint, metrics_url, engine: dict) -> None:
        if warm:
            run_load(endpoint, warm, concurrency=min(args.concurrency, len(warm)))
        run = served.measure_run(endpoint, metrics_url, engine, server_args, lambda: run_load(
            endpoint, measured, concurrency=args.concurrency,
            progress=f"memory {engine['label']}"))
        results["runs"].append(run)
        results["versus_full"] = served.versus_full(results["runs"], RATIOS)
        served.write_results(results, stem, render, None)
        sm = run["summary"]
        print(f"{engine['label']}: {sm.get('completed', 0)} ok, {sm.get('failed', 0)} failed; "
              f"{served.fmt(sm.get('output_throughput'), 2)} output tokens/s, sequences decoding mean "
              f"{served.fmt(run['decoding']['mean'], 2)} (peak {run['decoding']['peak']})", flush=True)

    served.on_each_server(args, server_args, on_server, results)
    if args.vllm:
        results["medians"] = served.median_runs(results["runs"], RATIOS)
        results["versus_vllm"] = served.versus_peer(results["medians"])
    results["uptime_after"] = served.uptime()
    machine.finish(results)
    served.write_results(results, stem, render, plot)
    print(render(results), flush=True)
    print(f"results: {stem}.json / .md / .png", flush=True)
    return 1 if any(r["summary"].get("failed", 0) for r in results["runs"]) else 0


def add_arguments(p) -> None:
    served.add_server_arguments(p)
    load = p.add_argument_group("workload")
    load.add_argument("--isl", type=int, default=2048, help="prompt tokens (default: 2048)")
    load.add_argument("--osl", type=int, default=256, help="new tokens per request (default: 256)")
    load.add_argument("--concurrency", type=int, default=8, help="requests in flight, closed loop (default: 8)")
    load.add_argument("--num-requests", type=int, default=16, help="measured requests per server (default: 16)")
    load.add_argument("--warmup", type=int, default=1, help="warm-up requests per server, not measured (default: 1)")
    load.add_argument("--kv-budget", type=int, help="per-request kv_budget (default: the engine's)")
    load.add_argument("--seed", type=int, default=0, help="prompt offsets (default: 0)")
    mem = p.add_argument_group("memory (the same for every server)")
    served.add_kv_memory_argument(mem, "2", "full sequences of ISL + OSL tokens")
    out = p.add_argument_group("output")
    add_out_argument(out, "results/benchmarks/serving/memory_bound")
