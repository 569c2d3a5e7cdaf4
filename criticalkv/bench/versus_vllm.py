"""``criticalkv bench vllm``: criticalkv's servers against vLLM on plain traffic, the workloads vLLM is built for.

Every server (``--engine-dir``, repeat for several; ``--server-args`` e.g. ``--backend openvino``; and ``vllm serve``
on the same model, ``criticalkv.bench.peers.vllm``) is started ``--rounds`` times (default 3), interleaved (vLLM,
criticalkv, criticalkv, vLLM, ...), and each fresh server runs the parts of ``--parts`` in this order, each on prompts
of its own (no part finds another's prefix cached), after one warm-up request of ``--isl`` tokens:

* ``single``: one chat request of ``--isl`` tokens (default 2048) alone, ``--osl`` new tokens (default 64): its
  first token (TTFT) and decode step (TPOT, the mean gap between tokens after the first);
* ``prefix``: a ``--isl``-token document asked two questions one after the other, each a plain chat message
  (document and question in one user message; no ``context`` field): the second request's first token, and the
  first's (vLLM's automatic prefix caching reuses the document; criticalkv's server recomputes it unless it
  reuses plain prefixes too);
* ``batch``: ``--batch`` (default 8) concurrent chat requests of ``--isl`` tokens, ``--osl`` new tokens each:
  output tokens/s (the first request sent to the last token received), TTFT;
* ``aiperf``: AIPerf 0.13 (``--aiperf-requests`` requests after 2 warm-up at concurrency ``--batch``, ISL ``--isl``,
  OSL ``--osl``) against the server's OpenAI chat endpoint, the same command for every server (only ``--url``
  differs; criticalkv's server started with its OpenAI frontend).

Both servers get the same token ids (criticalkv's server tokenises the chat; vLLM is sent the ids it gives:
``client.openai_completion``) and greedy decoding with ``ignore_eos``; each response's input token count is checked
against the other server's. vLLM's KV memory: ``--vllm-kv-mib`` (default 2048: plain traffic, no server is bound by
its cache here; ``bench docqa --vllm`` and ``bench memory --vllm`` give both the same budget). The load average
before and after every run is recorded: compare on an idle machine.

Results (``--out STEM``): ``STEM.json`` (command, machine, versions, every run and request), ``STEM.md`` (medians
per server, the ratios to vLLM, the targets: criticalkv's single-request TTFT and decode step <= 1.0x vLLM's, the
second prompt's TTFT <= 1.0x, batch output tokens/s >= 1.0x).
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from pathlib import Path

from criticalkv.bench import machine, served
from criticalkv.bench.client import Endpoint, request_body, run_load, send_request
from criticalkv.bench.report import add_out_argument

PARTS = ("single", "prefix", "batch", "aiperf")
#: The questions of ``prefix`` (after the shared document).
QUESTIONS = ("What is the main subject of the text above? Answer in one sentence.",
             "Which people or places does the text above mention? Answer with a list.")
#: (target, metric, direction, bound): criticalkv's median over vLLM's.
TARGETS = (("single 2k-token request: first token", "single_ttft_ms", "<=", 1.0),
           ("single 2k-token request: decode step", "single_tpot_ms", "<=", 1.0),
           ("same 2k prefix twice: the second's first token", "prefix_second_ttft_ms", "<=", 1.0),
           ("8 concurrent 2k-token requests: output tokens/s", "batch_output_tps", ">=", 1.0),
           ("AIPerf, same command: output tokens/s", "aiperf_output_tps", ">=", 1.0))
METRICS = {
    "single_ttft_ms": lambda r: _get(r, "single", "ttft_ms"),
    "single_tpot_ms": lambda r: _get(r, "single", "tpot_ms"),
    "prefix_first_ttft_ms": lambda r: _get(r, "prefix", "first_ttft_ms"),
    "prefix_second_ttft_ms": lambda r: _get(r, "prefix", "second_ttft_ms"),
    "batch_output_tps": lambda r: _get(r, "batch", "output_throughput"),
    "batch_ttft_p50_ms": lambda r: _get(r, "batch", "ttft_p50_ms"),
    "aiperf_output_tps": lambda r: _get(r, "aiperf", "output_token_throughput"),
    "aiperf_ttft_avg_ms": lambda r: _get(r, "aiperf", "time_to_first_token"),
    "aiperf_itl_avg_ms": lambda r: _get(r, "aiperf", "inter_token_latency"),
    "server_ready_s": lambda r: r["engine"].get("server_ready_s"),
    "peak_rss_mib": lambda r: r.get("peak_rss_mib"),
}


def _get(run: dict, part: str, key: str):
    return (run.get(part) or {}).get(key)


def workload(tokenizer, isl: int, batch: int, seed: int) -> dict:
    """Per round the prompts of every part: texts whose chat-wrapped form is ``isl`` tokens (the warm-up's too: a
    runtime that compiles per shape, as OpenVINO does, compiles before anything is measured)."""
    from criticalkv.bench.prompts import text_for_chat_length

    def text(total, s):
        return text_for_chat_length(tokenizer, total, seed=s)

    # the document of ``prefix``: its chat alone is ``isl`` tokens; each question adds its own
    return {"warmup": text(isl, seed + 100), "single": text(isl, seed + 102), "document": text(isl, seed + 101),
            "batch": [text(isl, seed + 110 + i) for i in range(batch)]}


def chat_body(text: str, osl: int) -> dict:
    return request_body(text, osl, True, chat=True)


def record_json(r) -> dict:
    return {"ok": r.ok, "error": r.error, "input_tokens": r.input_tokens,
            "output_tokens": r.num_output_tokens if r.ok else None,
            "ttft_ms": r.ttft * 1e3 if r.ok else None, "latency_ms": r.latency * 1e3 if r.ok else None,
            "tpot_ms": r.tpot * 1e3 if r.ok and r.num_output_tokens > 1 else None}


def check(record, what: str) -> None:
    if not record.ok:
        raise RuntimeError(f"{what}: {record.error}")


def run_parts(endpoint: Endpoint, engine: dict, work: dict, args, aiperf_url: str | None, tokenizer_dir: Path,
              workdir: Path) -> dict:
    """The parts on one fresh server; the run's dict."""
    from criticalkv.bench.metrics import summarize

    run = {"engine": engine, "load_average_before": machine.load_average()}
    check(send_request(endpoint, chat_body(work["warmup"], 8)), f"{engine['label']}: warm-up")
    if "single" in args.parts:
        r = send_request(endpoint, chat_body(work["single"], args.osl))
        check(r, f"{engine['label']}: single")
        run["single"] = record_json(r)
    if "prefix" in args.parts:
        first = send_request(endpoint, chat_body(work["document"] + "\n\n" + QUESTIONS[0], args.osl))
        second = send_request(endpoint, chat_body(work["document"] + "\n\n" + QUESTIONS[1], args.osl))
        check(first, f"{engine['label']}: prefix (first)")
        check(second, f"{engine['label']}: prefix (second)")
        run["prefix"] = {"first": record_json(first), "second": record_json(second),
                         "first_ttft_ms": first.ttft * 1e3, "second_ttft_ms": second.ttft * 1e3}
    if "batch" in args.parts:
        records = run_load(endpoint, [chat_body(t, args.osl) for t in work["batch"]], concurrency=args.batch)
        s = summarize(records)
        if s.get("failed"):
            raise RuntimeError(f"{engine['label']}: batch: {next(r.error for r in records if r.error)}")
        run["batch"] = {"output_throughput": s.get("output_throughput"),
                        "ttft_p50_ms": (s.get("ttft_ms") or {}).get("p50"),
                        "tpot_p50_ms": (s.get("tpot_ms") or {}).get("p50"),
                        "requests": [record_json(r) for r in records]}
    if "aiperf" in args.parts:
        run["aiperf"] = run_aiperf(args, aiperf_url, engine, tokenizer_dir, workdir)
    run["load_average_after"] = machine.load_average()
    return run


def aiperf_command(aiperf: Path, url: str, model: str, tokenizer: Path, args, artifact_dir: Path) -> list[str]:
    """AIPerf on an OpenAI chat endpoint: synthetic prompts of ``--isl`` tokens (no spread), ``--osl`` tokens
    (``ignore_eos``), streamed; the same for every server but ``--url`` and ``--model``."""
    return [str(aiperf), "profile", "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
            "--tokenizer", str(tokenizer), "--synthetic-input-tokens-mean", str(args.isl),
            "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(args.osl),
            "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
            "--concurrency", str(args.batch), "--request-count", str(args.aiperf_requests),
            "--warmup-request-count", "2", "--random-seed", str(args.seed), "--artifact-dir", str(artifact_dir),
            "--ui-type", "simple", "--no-gpu-telemetry", "--workers-max", "1", "--record-processors", "1",
            "--no-server-metrics"]


def run_aiperf(args, url: str, engine: dict, tokenizer_dir: Path, workdir: Path) -> dict:
    import subprocess

    from criticalkv.bench.aiperf import read_aiperf
    from criticalkv.bench.peers import ensure_ready, peers_dir

    root = peers_dir()
    ensure_ready(root, ["aiperf"])
    artifacts = workdir / f"aiperf-{engine['label'].replace(' ', '').replace('=', '')}-{engine.get('repeat', 0)}"
    model = engine.get("openai_model") or engine["label"]
    cmd = aiperf_command(root / "aiperf" / "bin" / "aiperf", url, model, tokenizer_dir, args,
                         artifacts)
    with open(workdir / "aiperf.log", "a") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"aiperf exited with {done.returncode} on {engine['label']}; see {workdir / 'aiperf.log'}")
    metrics = read_aiperf(artifacts)
    shown = " ".join(cmd).replace(str(artifacts), "ARTIFACTS").replace(str(tokenizer_dir), "TOKENIZER") \
        .replace(str(root), "$CRITICALKV_PEERS_DIR").replace(url, "URL")
    out = {"command": shown}
    for tag in ("output_token_throughput", "time_to_first_token", "inter_token_latency", "request_latency",
                "request_throughput"):
        out[tag] = (metrics.get(tag) or {}).get("avg")
    out["failed"] = (metrics.get("error_request_count") or {}).get("avg")
    return out


def summary(results: dict) -> None:
    results["medians"] = served.median_runs(results["runs"], METRICS)
    results["versus_vllm"] = served.versus_peer(results["medians"])
    rows = []
    for item in results["versus_vllm"]:
        for what, key, direction, bound in TARGETS:
            ratio = (item.get(key) or {}).get("ratio")
            met = None if ratio is None else (ratio <= bound if direction == "<=" else ratio >= bound)
            rounds = served.paired_ratios(results["runs"], METRICS[key], item["engine"], item["base"])
            rows.append({"engine": item["engine"], "target": what, "metric": key, "ratio": ratio,
                         "bound": f"{direction} {bound:g}x", "met": met, "rounds": rounds})
    results["targets"] = rows


def render(results: dict) -> str:
    fmt = served.fmt
    lines = served.header_block(results)
    s = results.get("settings", {})
    lines.append(f"ISL {s.get('isl')} (chat), OSL {s.get('osl')}, batch {s.get('batch')}, medians over each server's runs, "
                 f"parts {', '.join(s.get('parts') or [])}\n")
    lines.append("| server | runs | single TTFT ms | single TPOT ms | prefix 1st TTFT ms | prefix 2nd TTFT ms | "
                 "batch out tok/s | batch TTFT p50 ms | AIPerf out tok/s | AIPerf TTFT ms | ready s | load before |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for m in results.get("medians", []):
        def med(k, d=1):
            return fmt((m.get(k) or {}).get("median"), d)
        loads = ", ".join(str(x[0]) if x else "?" for x in m["load_average_before"])
        lines.append(f"| {m['engine']} | {m['runs']} | {med('single_ttft_ms')} | {med('single_tpot_ms', 2)} | "
                     f"{med('prefix_first_ttft_ms')} | {med('prefix_second_ttft_ms')} | {med('batch_output_tps', 2)} | "
                     f"{med('batch_ttft_p50_ms')} | {med('aiperf_output_tps', 2)} | {med('aiperf_ttft_avg_ms')} | "
                     f"{med('server_ready_s')} | {loads} |")
    if results.get("targets"):
        lines += ["", "| server | target | ratio to vLLM | per round (each against that round's vLLM) | bound | met |",
                  "|---|---|---|---|---|---|"]
        for t in results["targets"]:
            met = "-" if t["met"] is None else ("yes" if t["met"] else "no")
            rounds = ", ".join(fmt(r, 3) for r in t.get("rounds") or []) or "-"
            lines.append(f"| {t['engine']} | {t['target']} | {fmt(t['ratio'], 3)} | {rounds} | {t['bound']} | {met} |")
        lines.append("\nThe ratio is of the medians over each server's runs; a round's ratio pairs the two servers of that "
                     "round, which ran one after the other (the machine's drift between rounds cancels in it).")
    commands = sorted({(r.get("aiperf") or {}).get("command") for r in results.get("runs", [])} - {None})
    for c in commands:
        lines.append(f"\nAIPerf (every server): `{c}`")
    return "\n".join(lines) + "\n"


def main(args) -> int:
    served.check_server_arguments(args)
    parts = args.parts = served.comma_choices(args.parts, "--parts", PARTS)
    variants = served.backend_variants(args.backends, args.server_args)
    backends = [name for name, _ in variants or ()]
    if min(args.isl, args.osl, args.batch, args.aiperf_requests) < 2:
        raise ValueError("--isl, --osl, --batch and --aiperf-requests must be >= 2")
    if args.url:
        raise ValueError("bench vllm starts its servers (--engine-dir): --url is not supported")
    results = machine.header(args.command_line)
    results["benchmark"] = "vllm"
    results["uptime_before"] = served.uptime()
    results["settings"] = {"isl": args.isl, "osl": args.osl, "batch": args.batch, 
                           "parts": parts, "seed": args.seed, "backends": backends, "vllm": args.vllm,
                           "server_args": served.split_server_args(args.server_args, own=())}
    results["runs"] = served.previous_runs(args, args.out, results)
    print("\n".join(machine.header_lines(results)), flush=True)
    tokenizer_dir = served.tokenizer_folder(args)
    tokenizer = served.load_tokenizer(args)
    work = workload(tokenizer, args.isl, args.batch, args.seed)
    server_args = results["settings"]["server_args"]
    workdir = Path(tempfile.mkdtemp(prefix="criticalkv-vllm-"))
    lock = threading.Lock()

    def on_server(endpoint: Endpoint, metrics_url, engine: dict) -> None:
        aiperf_url = None
        if "aiperf" in parts:
            aiperf_url = engine.get("openai_url") or endpoint.url
            engine["openai_model"] = engine.get("openai_model") or endpoint.model
        with served.RssMonitor(engine.get("server_pid")) as rss:
            run = run_parts(endpoint, engine, work, args, aiperf_url, tokenizer_dir, workdir)
        run["peak_rss_mib"] = (rss.peak_bytes / 2**20) if rss.peak_bytes else None
        engine.pop("server_pid", None)
        with lock:
            results["runs"].append(run)
            summary(results)
            served.write_results(results, args.out, render, None)
        print(f"{engine['label']} (round {engine.get('repeat', 0) + 1}): " + ", ".join(
            f"{k} {served.fmt(v(run), 2)}" for k, v in METRICS.items() if v(run) is not None), flush=True)

    try:
        served.on_each_server(args, server_args, on_server, results, openai="aiperf" in parts, variants=variants)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["uptime_after"] = served.uptime()
    machine.finish(results)
    summary(results)
    served.write_results(results, args.out, render, None)
    print(render(results), flush=True)
    print(f"results: {args.out}.json / .md", flush=True)
    return 0


def add_arguments(p) -> None:
    served.add_server_arguments(p)
    p.set_defaults(vllm=True, rounds=3)
    load = p.add_argument_group("workload")
    load.add_argument("--parts", default="single,prefix,batch",
                      help=f"comma-separated subset of {','.join(PARTS)} (default: single,prefix,batch; aiperf needs "
                           "AIPerf's environment, created on first use)")
    load.add_argument("--isl", type=int, default=2048, help="prompt tokens, chat template included (default: 2048)")
    load.add_argument("--osl", type=int, default=64, help="new tokens per request (default: 64)")
    load.add_argument("--batch", type=int, default=8, help="concurrent requests of batch and aiperf (default: 8)")
    load.add_argument("--aiperf-requests", type=int, default=16, help="AIPerf's measured requests (default: 16)")
    load.add_argument("--seed", type=int, default=0, help="the prompts (default: 0)")
    load.add_argument("--backends", default="",
                      help="comma-separated criticalkv serve backends, each engine started once per backend "
                           "(e.g. onnxruntime,openvino; default: the engine's own)")
    out = p.add_argument_group("output")
    add_out_argument(out, "results/benchmarks/vllm/plain")

