"""Cross-check with AIPerf (``aiperf==0.13.0`` in its own environment, see ``criticalkv.bench.peers``).

On one server and one workload (ISL, OSL, concurrency), ``cross_check`` runs this package's load
generator and then ``aiperf profile --endpoint-type template`` against the same ``generate_stream``
endpoint with the same prompts (an AIPerf ``single-turn`` JSONL file), the same request body (a Jinja2
payload template file: ``text_input``, ``sampling_parameters`` with ``max_tokens`` = OSL, greedy,
``ignore_eos``), the same warm-up and request counts. It compares:

* TTFT (avg, p50): the same definition in both tools;
* this package's TPOT with AIPerf's ``inter_token_latency`` (AIPerf's ITL *is* (latency - TTFT) / (OSL - 1));
* output token throughput.

AIPerf counts output tokens by re-tokenising the streamed text with ``--tokenizer`` (the engine's),
this package takes the server's ``num_output_tokens``; both are reported.
"""

from __future__ import annotations

import json
import resource
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from criticalkv.bench import machine, served
from criticalkv.bench.client import Endpoint, request_body, run_load
from criticalkv.bench.machine import header_lines
from criticalkv.bench.metrics import summarize
from criticalkv.bench.peers import peer_ready
from criticalkv.bench.prompts import make_prompts

#: Agreement asked for between the two tools (relative difference).
TOLERANCE = 0.10
#: (this package's summary key, stat, AIPerf metric tag, what) compared.
COMPARED = (
    ("ttft_ms", "avg", "time_to_first_token", "TTFT avg (ms)"),
    ("ttft_ms", "p50", "time_to_first_token", "TTFT p50 (ms)"),
    ("tpot_ms", "avg", "inter_token_latency", "TPOT avg (ms) vs AIPerf inter_token_latency"),
    ("tpot_ms", "p50", "inter_token_latency", "TPOT p50 (ms) vs AIPerf inter_token_latency"),
    ("output_throughput", None, "output_token_throughput", "output tokens/s"),
    ("latency_ms", "avg", "request_latency", "request latency avg (ms)"),
)


def payload_template(osl: int, kv_budget: int | None = None) -> str:
    """AIPerf's Jinja2 payload: the same body as ``client.request_body`` (``text`` is the prompt)."""
    sampling = json.dumps({"max_tokens": int(osl), "temperature": 0.0, "ignore_eos": True})
    body = ('{"text_input": {{ text|tojson }}, "stream": true, "exclude_input_in_output": true, '
            f'"sampling_parameters": {json.dumps(sampling)}, "return_num_input_tokens": true, '
            '"return_num_output_tokens": true')
    if kv_budget is not None:
        body += f', "kv_budget": {int(kv_budget)}'
    return body + "}"


def aiperf_command(aiperf: Path, url: str, model: str, tokenizer: Path, prompts_file: Path, template_file: Path,
                   concurrency: int, num_requests: int, warmup: int, artifact_dir: Path) -> list[str]:
    return [
        str(aiperf), "profile", "--model", model, "--url", url, "--endpoint-type", "template",
        "--custom-endpoint", f"/v2/models/{model}/generate_stream", "--streaming",
        "--extra-inputs", f"payload_template:{template_file}", "--extra-inputs", "response_field:text_output",
        "--input-file", str(prompts_file), "--custom-dataset-type", "single-turn",
        "--tokenizer", str(tokenizer), "--concurrency", str(concurrency), "--request-count", str(num_requests),
        "--warmup-request-count", str(warmup), "--artifact-dir", str(artifact_dir), "--random-seed", "0",
        "--dataset-sampling-strategy", "sequential", "--ui-type", "simple", "--no-gpu-telemetry",
        # few helper processes: AIPerf's own CPU time competes with the server on a small machine
        "--workers-max", "1", "--record-processors", "1", "--no-server-metrics",
    ]


def read_aiperf(artifact_dir: Path) -> dict:
    """AIPerf's summary (``profile_export_aiperf.json``): metric tag -> its stats dict."""
    path = Path(artifact_dir) / "profile_export_aiperf.json"
    if not path.is_file():
        found = sorted(Path(artifact_dir).rglob("profile_export_aiperf.json"))
        if not found:
            raise FileNotFoundError(f"{artifact_dir}: AIPerf wrote no profile_export_aiperf.json")
        path = found[0]
    data = json.loads(path.read_text())
    metrics = data.get("records", data)  # summary metrics at top level or under "records"
    return {k: v for k, v in metrics.items() if isinstance(v, dict) and "avg" in v}


def compare(ours: dict, theirs: dict) -> list[dict]:
    rows = []
    for key, stat, tag, what in COMPARED:
        mine = ours.get(key) if stat is None else (ours.get(key) or {}).get(stat)
        other = (theirs.get(tag) or {}).get(stat or "avg")
        if mine is None or other is None:
            rows.append({"what": what, "ours": mine, "aiperf": other, "ratio": None, "within": None})
            continue
        ratio = mine / other if other else None
        rows.append({"what": what, "ours": mine, "aiperf": other, "ratio": ratio,
                     "within": ratio is not None and abs(ratio - 1.0) <= TOLERANCE})
    return rows


def _num(x, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def render(results: dict) -> str:
    c = results["cross_check"]
    lines = header_lines(results) + [
        f"# aiperf: {c['aiperf_command']}",
        "",
        f"## {c['engine']} | ISL {c['isl']} OSL {c['osl']} | concurrency {c['concurrency']} | "
        f"{c['num_requests']} requests after {c['warmup']} warm-up, each tool in turn on the same server",
        f"| metric | this script | AIPerf 0.13 | ratio | within {TOLERANCE:.0%} |",
        "|---|---|---|---|---|",
    ]
    for r in c["comparison"]:
        within = "-" if r["within"] is None else ("yes" if r["within"] else "NO")
        lines.append(f"| {r['what']} | {_num(r['ours'], 2)} | {_num(r['aiperf'], 2)} | {_num(r['ratio'], 3)} | {within} |")
    osl = c.get("aiperf_output_sequence_length") or {}
    for name, u in c.get("client_cpu", {}).items():
        lines.append(f"client CPU, {name}: {u['cpu_s']:.1f} s over {u['wall_s']:.1f} s = {u['cores']:.2f} cores")
    lines.append(f"\noutput tokens per request: server {c['server_output_tokens']}, AIPerf (re-tokenised text) "
                 f"avg {osl.get('avg')}, min {osl.get('min')}, max {osl.get('max')}")
    return "\n".join(lines) + "\n"


def run_aiperf(peers_dir: Path, url: str, model: str, tokenizer: Path, prompts: list, osl: int, concurrency: int,
               num_requests: int, warmup: int, workdir: Path, kv_budget: int | None = None) -> tuple[dict, str, dict]:
    """Write the prompts and the template into ``workdir``, run AIPerf, return (its metrics, the command, OSL stats)."""
    if not peer_ready(peers_dir, "aiperf"):
        raise FileNotFoundError(f"{peers_dir / 'aiperf'}: AIPerf environment missing: run `criticalkv bench setup-peers`")
    workdir.mkdir(parents=True, exist_ok=True)
    prompts_file = workdir / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"text": p.text}) + "\n" for p in prompts))
    template_file = workdir / "payload_template.json"
    template_file.write_text(payload_template(osl, kv_budget))
    artifact_dir = workdir / "artifacts"
    cmd = aiperf_command(peers_dir / "aiperf" / "bin" / "aiperf", url, model, tokenizer, prompts_file, template_file,
                         concurrency, num_requests, warmup, artifact_dir)
    log = workdir / "aiperf.log"
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    with open(log, "w") as f:
        run = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    after, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter() - start
    if run.returncode != 0:  # its log lives in a folder removed afterwards: its end goes into the message
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-12:]
        raise RuntimeError(f"aiperf exited with {run.returncode}; the end of its log:\n" + "\n".join(tail))
    metrics = read_aiperf(artifact_dir)
    # AIPerf's own CPU use (its processes are waited for: they count as this process's children)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    metrics["_client_cpu"] = {"cpu_s": cpu, "wall_s": wall, "cores": cpu / wall if wall else None}
    return metrics, shlex.join(cmd), metrics.get("output_sequence_length", {})


def scrub_paths(folder: Path, replacements: dict[str, str]) -> None:
    """Replace this machine's absolute paths in AIPerf's text artifacts (JSON, CSV, JSONL) before they are kept."""
    for path in folder.rglob("*"):
        if path.is_file() and path.suffix in (".json", ".csv", ".jsonl", ".txt", ".yaml"):
            text = path.read_text(errors="replace")
            for old, new in replacements.items():
                text = text.replace(old, new)
            path.write_text(text)


def cross_check(args, log=print) -> dict:
    """``criticalkv bench aiperf``: both tools on one server and workload; returns the results dict."""
    results = machine.header(args.command_line)
    log("\n".join(machine.header_lines(results)))
    tokenizer_dir = served.tokenizer_folder(args)
    from transformers import AutoTokenizer  # here: `criticalkv --help` and argument errors do not load it

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompts = make_prompts(tokenizer, args.isl, args.warmup + args.num_requests, seed=args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="criticalkv-aiperf-"))
    bodies = [request_body(p.text, args.osl, True, args.kv_budget) for p in prompts]

    def on_server(endpoint: Endpoint, metrics_url, engine: dict) -> None:
        log(f"this script: ISL {args.isl} OSL {args.osl} concurrency {args.concurrency}, {args.num_requests} requests ...")
        if args.warmup:
            run_load(endpoint, bodies[: args.warmup], concurrency=args.concurrency)
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        records = run_load(endpoint, bodies[args.warmup:], concurrency=args.concurrency, progress="this script")
        after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - start
        log("AIPerf ...")
        theirs, command, osl_stats = run_aiperf(Path(args.peers_dir), endpoint.url, endpoint.model, tokenizer_dir,
                                                prompts, args.osl, args.concurrency, args.num_requests, args.warmup,
                                                workdir / "aiperf", args.kv_budget)
        ours = summarize(records)
        our_cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        results["cross_check"] = {
            "engine": engine["label"], "isl": args.isl, "osl": args.osl, "concurrency": args.concurrency,
            "num_requests": args.num_requests, "warmup": args.warmup, "kv_budget": args.kv_budget,
            "aiperf_command": command.replace(str(workdir / "aiperf"), "WORKDIR").replace(
                str(Path(args.peers_dir)), "$CRITICALKV_PEERS_DIR"),
            "ours": ours, "aiperf": theirs, "comparison": compare(ours, theirs),
            "server_output_tokens": sorted({r.num_output_tokens for r in records if r.ok}),
            "aiperf_output_sequence_length": osl_stats,
            "failed_requests": ours.get("failed"),
            # client CPU seconds / wall seconds while each tool ran: what it took from the server's cores
            "client_cpu": {"this script (warm-up excluded)": {"cpu_s": our_cpu, "wall_s": wall, "cores": our_cpu / wall},
                           "aiperf (all its processes, start-up and warm-up included)": theirs.pop("_client_cpu")},
        }

    try:
        served.on_each_server(args, served.split_server_args(args.server_args, own=()), on_server, {}, log=log)
        out_dir = args.out.with_name(f"{args.out.name}_aiperf_artifacts")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        shutil.copytree(workdir / "aiperf" / "artifacts", out_dir,
                        ignore=shutil.ignore_patterns("*_raw.jsonl", "*.log"))
        shutil.copy(workdir / "aiperf" / "payload_template.json", out_dir / "payload_template.json")
        scrub_paths(out_dir, {str(workdir / "aiperf"): "WORKDIR", str(Path.cwd()): "."})
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    machine.finish(results)
    return results
