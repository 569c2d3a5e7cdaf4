"""``python -m benchmarks.interference``: time to first token of a short request, alone and next to a long one.

Against one server (started here from ``--engine-dir``, or a running one at ``--url``), ``--repeats``
rounds, each measuring three cases one after the other (interleaved, so every case sees the same
machine load), after ``--warmup`` unmeasured rounds:

* ``idle``: the short request (``--short-isl`` prompt tokens, ``--short-osl`` new tokens) with nothing
  else on the server;
* ``decode``: a long request (``--long-isl`` / ``--long-osl``) is sent first; once it has streamed
  ``--decode-after-tokens`` tokens (its prefill is over, it is decoding) the short request is sent;
* ``prefill``: the long request is sent first and the short one ``--prefill-delay`` s later, while the
  long prompt is being prefilled. With chunked prefill (``criticalkv serve --prefill-chunk N``, N > 0) the
  scheduler runs the long prompt N tokens at a time and the short prompt's chunk goes first, so the short
  request waits for at most one chunk; with ``--prefill-chunk 0`` it waits for the whole rest of the prefill.

Every request is the same text each round (greedy, ``ignore_eos``: exact output lengths); the next
case starts only when the previous one's requests have all finished. Per case: the short request's
TTFT distribution (median, p90, ...); ratios of the loaded cases' median and p90 to the idle ones. The
targets of the serving issues: ``decode`` median TTFT <= 1.5x the ``idle`` median, and with chunked prefill
``prefill`` median TTFT <= 2x the ``idle`` median. Each round records the load average before and after, and
whether the short request really arrived in the intended phase of the long one (``phase_ok``; rounds where it
did not are kept in the JSON but left out of the statistics).

Chunk sizes compared in one run: ``--prefill-chunk 0,512,256`` starts one server per value (one after the other,
each with ``--prefill-chunk`` added to ``--server-args``) and measures every round on each; each server's
setting is recorded with its rounds (with ``--url``, ``--prefill-chunk`` only records the running server's).

Results (``--out STEM``): ``STEM.json`` (header with machine, versions, commit, ``uptime`` before and after; per chunk
size (``variants``) every round's timings), ``STEM.md`` (tables) and ``STEM.png`` (TTFT per round and case).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import benchmarks
from criticalkv.bench import machine, served
from criticalkv.bench.client import Endpoint, request_body, send_request
from criticalkv.bench.metrics import RequestRecord, distribution
from criticalkv.bench.report import add_out_argument

#: The cases of a round, in the order they are measured.
CASES = ("idle", "decode", "prefill")
#: The target: a short request during a long generation's decode gets its first token within
#: this factor of its idle time to first token (medians).
TARGET_RATIO = 1.5
#: With chunked prefill, a short request arriving during a long prompt's prefill: within this factor (medians).
PREFILL_TARGET_RATIO = 2.0
#: Seconds to wait for the long request's first tokens before a round is given up.
PHASE_TIMEOUT_S = 900.0


def uptime() -> str | None:
    """The ``uptime`` line (load averages of the whole machine), or None where there is no such command."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _tokens_by(record: RequestRecord, t: float) -> int:
    """Tokens of ``record`` that had arrived by time ``t``."""
    return sum(n for arrived, n in record.chunks if arrived <= t)


def _request_json(r: RequestRecord, t0: float) -> dict:
    return {"ok": r.ok, "error": r.error, "input_tokens": r.input_tokens,
            "output_tokens": r.num_output_tokens if r.ok else None,
            "ttft_ms": r.ttft * 1e3 if r.ok else None, "latency_ms": r.latency * 1e3 if r.ok else None,
            "start_s": round(r.start - t0, 6), "chunk_ms": [round((t - r.start) * 1e3, 3) for t, _ in r.chunks]}


def pair_facts(short: RequestRecord, long: RequestRecord, case: str) -> dict:
    """Where the short request fell in the long one's life, and whether that is the intended ``case``.

    decode: the long request's first token had arrived when the short one was sent, and it was still
    streaming when the short one got its first token. prefill: the long request had been sent before
    the short one and its first token came after the short one was sent."""
    facts = {"long_tokens_at_short_start": None, "long_tokens_at_short_first_token": None,
             "long_first_token_after_short_start_ms": None, "long_max_gap_during_short_ms": None, "phase_ok": False}
    if not (short.ok and long.ok):
        return facts
    first = short.chunks[0][0]
    facts["long_tokens_at_short_start"] = _tokens_by(long, short.start)
    facts["long_tokens_at_short_first_token"] = _tokens_by(long, first)
    facts["long_first_token_after_short_start_ms"] = (long.chunks[0][0] - short.start) * 1e3
    # the longest wait the long request's user saw between two responses while the short one was served
    gaps = [(b - a) for (a, _), (b, _) in zip(long.chunks, long.chunks[1:]) if b >= short.start and a <= short.end]
    facts["long_max_gap_during_short_ms"] = max(gaps) * 1e3 if gaps else None
    if case == "decode":
        facts["phase_ok"] = long.chunks[0][0] <= short.start and long.end > first
    elif case == "prefill":
        facts["phase_ok"] = long.start < short.start < long.chunks[0][0]
    return facts


def run_case(endpoint: Endpoint, case: str, short_body: dict, long_body: dict, decode_after_tokens: int,
             prefill_delay_s: float) -> dict:
    """One case of one round; returns its JSON (the short request, the long one where there is one)."""
    load_before = machine.load_average()
    if case == "idle":
        short = send_request(endpoint, short_body)
        return {"case": case, "short": _request_json(short, short.start), "long": None, "phase_ok": short.ok,
                "load_average_before": load_before, "load_average_after": machine.load_average()}
    started = threading.Event()  # decode: set once the long request streamed enough tokens (or ended)
    holder: dict = {}

    def on_event(record: RequestRecord) -> None:
        if record.error or sum(n for _, n in record.chunks) >= decode_after_tokens:
            started.set()

    def long_worker():
        holder["long"] = send_request(endpoint, long_body, on_event=on_event if case == "decode" else None)
        started.set()

    thread = threading.Thread(target=long_worker, daemon=True)
    thread.start()
    if case == "decode":
        started.wait(PHASE_TIMEOUT_S)
    else:
        time.sleep(prefill_delay_s)
    short = send_request(endpoint, short_body)
    thread.join()
    long = holder["long"]
    t0 = min(long.start, short.start)
    facts = pair_facts(short, long, case)
    return {"case": case, "short": _request_json(short, t0), "long": _request_json(long, t0), **facts,
            "load_average_before": load_before, "load_average_after": machine.load_average()}


def summarize_cases(rounds: list[dict], goal: float = TARGET_RATIO, prefill_chunk: int | None = None,
                    prefill_goal: float = PREFILL_TARGET_RATIO) -> dict:
    """Per case the short request's TTFT distribution (ms) over the rounds whose phase was right; the
    loaded cases' median and p90 ratios to ``idle``; the targets (``decode`` median ratio <= ``goal``; with
    ``prefill_chunk`` > 0, ``prefill`` median ratio <= ``prefill_goal``, else no goal: the prefill is not chunked)."""
    cases = {}
    for case in CASES:
        rows = [r for r in rounds if r["case"] == case]
        good = [r for r in rows if r["short"]["ok"] and r["phase_ok"]]
        cases[case] = {"rounds": len(rows), "used": len(good),
                       "failed": sum(1 for r in rows if not r["short"]["ok"] or (r["long"] and not r["long"]["ok"])),
                       "ttft_ms": distribution([r["short"]["ttft_ms"] for r in good])}
        gaps = [r.get("long_max_gap_during_short_ms") for r in good]
        if case != "idle":
            cases[case]["long_max_gap_during_short_ms"] = distribution(gaps)
    idle = cases["idle"]["ttft_ms"]
    idle_by_round = {r.get("round"): r["short"]["ttft_ms"] for r in rounds
                     if r["case"] == "idle" and r["short"]["ok"] and r["phase_ok"]}
    for case in CASES[1:]:
        d = cases[case]["ttft_ms"]
        for stat in ("p50", "p90"):
            ok = d[stat] is not None and idle[stat]
            cases[case][f"ratio_{stat}"] = d[stat] / idle[stat] if ok else None
        # the same round's idle request, seconds before: a ratio that the machine's load drifting between
        # rounds (other work on a shared machine) affects much less than the ratio of the medians
        paired = [r["short"]["ttft_ms"] / idle_by_round[r.get("round")] for r in rounds
                  if r["case"] == case and r["short"]["ok"] and r["phase_ok"] and idle_by_round.get(r.get("round"))]
        cases[case]["paired_ratio"] = distribution(paired)
    ratio = cases["decode"]["ratio_p50"]
    chunked = bool(prefill_chunk)
    pre = cases["prefill"]["ratio_p50"]
    return {"cases": cases, "target": {"what": f"short request during a long one's decode: median TTFT <= {goal:g}x idle",
                                       "ratio": ratio, "goal": goal, "met": None if ratio is None else ratio <= goal,
                                       "paired_ratio_p50": cases["decode"]["paired_ratio"]["p50"]},
            "prefill_target": {"what": (f"short request during a long one's prefill (chunks of {prefill_chunk}): median "
                                        f"TTFT <= {prefill_goal:g}x idle") if chunked else
                               "short request during a long one's prefill (not chunked: it waits; no goal)",
                               "ratio": pre, "goal": prefill_goal if chunked else None,
                               "met": None if pre is None or not chunked else pre <= prefill_goal,
                               "paired_ratio_p50": cases["prefill"]["paired_ratio"]["p50"]}}


def variants(results: dict) -> list[dict]:
    """The measured servers of a result: its ``variants`` (one per ``--prefill-chunk``), or, in a file written before
    chunked prefill existed, the file itself as one variant (its server prefilled every prompt whole: chunk 0)."""
    if "variants" in results:
        return results["variants"]
    if "rounds" in results:
        return [{"prefill_chunk": 0, "prefill_chunk_note": "before chunked prefill", "engine": results.get("engine", {}),
                 "server_note": results.get("server_note"), "rounds": results["rounds"],
                 "warmup_rounds": results.get("warmup_rounds", []), "summary": results.get("summary")}]
    return []


def chunk_label(variant: dict) -> str:
    c = variant.get("prefill_chunk")
    if c is None:
        return "prefill chunk unknown"
    return "prefill not chunked" if c == 0 else f"prefill chunks of {c}"


def _f(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def _variant_table(variant: dict) -> list[str]:
    summary = variant["summary"]
    lines = [f"## {variant.get('engine', {}).get('label', '')}, {chunk_label(variant)}"
             + (f" (server: {variant['server_note']})" if variant.get("server_note") else ""), "",
             "| case | rounds used | TTFT p50 (ms) | TTFT p90 (ms) | TTFT min-max (ms) | p50 / idle | p90 / idle "
             "| same-round ratio p50 (min-max) | long request's longest stall while the short one ran, p50 (ms) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for case in CASES:
        c = summary["cases"][case]
        d = c["ttft_ms"]
        stall = (c.get("long_max_gap_during_short_ms") or {}).get("p50")
        pr = c.get("paired_ratio") or {}
        paired = "-" if pr.get("p50") is None else f"{pr['p50']:.2f} ({pr['min']:.2f}-{pr['max']:.2f})"
        lines.append(f"| {case} | {c['used']} of {c['rounds']} | {_f(d['p50'])} | {_f(d['p90'])} | {_f(d['min'])}-{_f(d['max'])} "
                     f"| {_f(c.get('ratio_p50'), 2) if case != 'idle' else '1'} | {_f(c.get('ratio_p90'), 2) if case != 'idle' else '1'} "
                     f"| {paired} | {_f(stall) if case != 'idle' else '-'} |")
    lines.append("")
    for key in ("target", "prefill_target"):
        t = summary.get(key)
        if not t:
            continue
        met = "-" if t["met"] is None else ("met" if t["met"] else "NOT met")
        ratio = "-" if t["ratio"] is None else f"{t['ratio']:.2f}x"
        paired = t.get("paired_ratio_p50")
        lines.append(f"Target ({t['what']}): {ratio}, {met}."
                     + ("" if paired is None else f" Median of the same-round ratios: {paired:.2f}x."))
    return lines + [""]


def render(results: dict) -> str:
    """Markdown: header, settings, one table per chunk size (cases), the targets, a comparison of the chunk sizes."""
    s = results["settings"]
    lines = [*machine.header_lines(results), f"# uptime before: {results.get('uptime_before')}",
             f"# uptime after: {results.get('uptime_after')}", f"# server: {results.get('server_note')}", "",
             f"Short request: ISL {s['short_isl']}, OSL {s['short_osl']}. Long request: ISL {s['long_isl']}, "
             f"OSL {s['long_osl']}. {s['repeats']} rounds (after {s['warmup']} warm-up), cases interleaved in each. "
             f"decode: the short request is sent once the long one streamed {s['decode_after_tokens']} tokens; "
             f"prefill: {s['prefill_delay_s']} s after the long one was sent.", ""]
    measured = [v for v in variants(results) if v.get("summary")]
    for v in measured:
        lines += _variant_table(v)
    if len(measured) > 1:
        lines += ["## chunk sizes compared (medians; ratios to the same server's idle TTFT)", "",
                  "| prefill chunk | idle TTFT (ms) | decode TTFT (ms) | decode / idle | prefill TTFT (ms) | prefill / idle |",
                  "|---|---|---|---|---|---|"]
        for v in measured:
            c = v["summary"]["cases"]
            lines.append(f"| {v.get('prefill_chunk')} | {_f(c['idle']['ttft_ms']['p50'])} | {_f(c['decode']['ttft_ms']['p50'])} "
                         f"| {_f(c['decode'].get('ratio_p50'), 2)} | {_f(c['prefill']['ttft_ms']['p50'])} "
                         f"| {_f(c['prefill'].get('ratio_p50'), 2)} |")
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [v for v in variants(results) if v.get("summary")]
    fig, axes = plt.subplots(1, len(measured), figsize=(5.5 * len(measured), 4), sharey=True, squeeze=False)
    for ax, v in zip(axes[0], measured):
        for i, case in enumerate(CASES):
            rows = [r for r in v["rounds"] if r["case"] == case and r["short"]["ok"]]
            ys = [r["short"]["ttft_ms"] for r in rows]
            colors = ["tab:blue" if r["phase_ok"] else "tab:gray" for r in rows]
            ax.scatter([i] * len(ys), ys, c=colors, alpha=0.7, zorder=3)
            med = v["summary"]["cases"][case]["ttft_ms"]["p50"]
            if med is not None:
                ax.hlines(med, i - 0.25, i + 0.25, colors="black", zorder=4)
        idle = v["summary"]["cases"]["idle"]["ttft_ms"]["p50"]
        if idle:
            goal = v["summary"]["target"]["goal"]
            ax.axhline(idle * goal, color="tab:red", linestyle="--", label=f"{goal:g}x idle median (decode target)")
            pgoal = (v["summary"].get("prefill_target") or {}).get("goal")
            if pgoal:
                ax.axhline(idle * pgoal, color="tab:orange", linestyle=":", label=f"{pgoal:g}x idle median (prefill target)")
            ax.legend(fontsize=7)
        ax.set_xticks(range(len(CASES)), list(CASES))
        ax.set_yscale("log")
        ax.set_title(f"{v.get('engine', {}).get('label', '')}, {chunk_label(v)}", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].set_ylabel("short request TTFT (ms, log)")
    s = results["settings"]
    fig.suptitle(f"short ISL {s['short_isl']} OSL {s['short_osl']} vs long ISL {s['long_isl']} OSL {s['long_osl']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_all(results: dict, stem: Path, figure: bool) -> None:
    import json

    from criticalkv.bench.report import write_atomic

    write_atomic(stem.with_suffix(".json"), json.dumps(results, indent=1) + "\n")
    if any(v.get("summary") for v in variants(results)):
        write_atomic(stem.with_suffix(".md"), render(results))
        if figure:
            plot(results, stem.with_suffix(".png"))


def measure(endpoint: Endpoint, args, results: dict, variant: dict, stem: Path, bodies: tuple[dict, dict]) -> None:
    """Every round on one server; fills ``variant`` (a member of ``results['variants']``) and rewrites the files."""
    short_body, long_body = bodies
    from tqdm import tqdm

    total = (args.warmup + args.repeats) * len(CASES)
    # a bar on a terminal only (disable=None)
    bar = tqdm(total=total, desc=f"interference, {chunk_label(variant)}", unit="case", disable=None)
    variant["rounds"], variant["warmup_rounds"] = [], []
    try:
        for i in range(args.warmup + args.repeats):
            for case in CASES:
                row = run_case(endpoint, case, short_body, long_body, args.decode_after_tokens, args.prefill_delay)
                row["round"] = i - args.warmup
                (variant["warmup_rounds"] if i < args.warmup else variant["rounds"]).append(row)
                bar.update(1)
                bar.set_postfix_str(f"{case} TTFT {row['short']['ttft_ms'] or float('nan'):.0f} ms")
            if i >= args.warmup:
                variant["summary"] = summarize_cases(variant["rounds"], TARGET_RATIO, variant.get("prefill_chunk"),
                                                     PREFILL_TARGET_RATIO)
            write_all(results, stem, figure=False)
    finally:
        bar.close()


def chunk_list(text: str | None) -> list[int | None]:
    """``--prefill-chunk`` as a list of chunk sizes (>= 0); None when not given (the server's default is used)."""
    if text is None or not str(text).strip():
        return [None]
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--prefill-chunk: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise ValueError(f"--prefill-chunk: expected integers >= 0 (0: not chunked), got {text!r}")
    return values


def run(args) -> int:
    from criticalkv.bench.prompts import corpus_ids, make_prompts
    served.check_server_arguments(args)
    if min(args.short_isl, args.short_osl, args.long_isl, args.long_osl, args.repeats, args.decode_after_tokens) < 1:
        raise ValueError("--short-isl/--short-osl/--long-isl/--long-osl, --repeats and --decode-after-tokens must be >= 1")
    if args.warmup < 0 or args.prefill_delay < 0:
        raise ValueError("--warmup and --prefill-delay must be >= 0")
    if args.decode_after_tokens >= args.long_osl:
        raise ValueError("--decode-after-tokens must be below --long-osl (the long request must still be decoding)")
    chunks = chunk_list(args.prefill_chunk)
    if args.url and len(chunks) > 1:
        raise ValueError("--url: give one --prefill-chunk (the running server's), or start servers with --engine-dir")
    extra = shlex.split(args.server_args) if args.server_args else []
    if any(a.split("=", 1)[0] == "--prefill-chunk" for a in extra):
        raise ValueError("--server-args: give the chunk size with this command's --prefill-chunk (it may list several)")
    stem = args.out
    results = machine.header(args.command_line)
    results["benchmark"] = "interference"
    results["uptime_before"] = uptime()
    results["settings"] = {k: getattr(args, k) for k in ("short_isl", "short_osl", "long_isl", "long_osl", "repeats",
                                                           "warmup", "decode_after_tokens", "kv_budget", "seed")}
    results["settings"].update(goal=TARGET_RATIO, prefill_goal=PREFILL_TARGET_RATIO)
    results["settings"]["prefill_delay_s"] = args.prefill_delay
    results["settings"]["prefill_chunks"] = chunks
    results["variants"] = []
    print("\n".join(machine.header_lines(results)), flush=True)
    tokenizer = served.load_tokenizer(args)
    ids = corpus_ids(tokenizer)
    short_text = make_prompts(tokenizer, args.short_isl, 1, seed=args.seed, ids=ids)[0].text
    long_text = make_prompts(tokenizer, args.long_isl, 1, seed=args.seed, ids=ids)[0].text
    bodies = (request_body(short_text, args.short_osl, True, args.kv_budget),
              request_body(long_text, args.long_osl, True, args.kv_budget))
    notes = []
    for chunk in chunks:
        server_args = extra + ([] if chunk is None or args.url else ["--prefill-chunk", str(chunk)])

        def on_server(endpoint: Endpoint, metrics_url, engine: dict, chunk=chunk, server_args=server_args) -> None:
            note = (f"criticalkv serve --engine-dir {engine['engine_dir']} {shlex.join(server_args)}".strip()
                    if engine.get("engine_dir") else f"running server {endpoint.url}, model {endpoint.model}")
            variant = {"prefill_chunk": chunk, "engine": engine, "server_note": note, "server_args": server_args}
            results["variants"].append(variant)
            notes.append(note)
            measure(endpoint, args, results, variant, stem, bodies)

        served.on_each_server(args, server_args, on_server, {}, log=lambda _: None)
    results["server_note"] = "; ".join(notes)
    results["uptime_after"] = uptime()
    machine.finish(results)
    write_all(results, stem, figure=True)
    print(render(results), flush=True)
    print(f"results: {stem}.json / .md / .png", flush=True)
    failed = sum(c["failed"] for v in results["variants"] for c in v["summary"]["cases"].values())
    return 1 if failed else 0


def add_arguments(p) -> None:
    served.add_server_arguments(p, several=False)
    load = p.add_argument_group("workload")
    load.add_argument("--short-isl", type=int, default=128, help="short request's prompt tokens (default: 128)")
    load.add_argument("--short-osl", type=int, default=16, help="short request's new tokens (default: 16)")
    load.add_argument("--long-isl", type=int, default=2048, help="long request's prompt tokens (default: 2048)")
    load.add_argument("--long-osl", type=int, default=256, help="long request's new tokens (default: 256)")
    load.add_argument("--repeats", type=int, default=5, help="measured rounds, each with every case (default: 5)")
    load.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first (default: 1)")
    load.add_argument("--decode-after-tokens", type=int, default=4,
                      help="decode case: send the short request once the long one streamed this many tokens (default: 4)")
    load.add_argument("--prefill-delay", type=float, default=0.5,
                      help="prefill case: seconds between the long request and the short one (default: 0.5)")
    load.add_argument("--kv-budget", type=int, help="per-request kv_budget sent with every request (default: the engine's)")
    load.add_argument("--prefill-chunk", metavar="N[,N...]",
                      help="the servers' --prefill-chunk, comma-separated to compare several in one run (one server "
                           "each, one after the other), e.g. 0,512,256 (0: not chunked); default: the server's own. "
                           "With --url: the running server's setting, recorded only")
    load.add_argument("--seed", type=int, default=0, help="prompt offsets (default: 0)")
    out = p.add_argument_group("output")
    add_out_argument(out, "results/benchmarks/serving/interference")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=benchmarks.prog("interference"), description=benchmarks.plain(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    args.command_line = benchmarks.command_line("interference", argv)
    return args


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(benchmarks.run("interference", main))
