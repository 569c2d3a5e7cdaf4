"""``criticalkv bench``: every speed measurement of the project, its results under ``results/benchmarks/``.

Served load: ``serve`` (TTFT/TPOT/ITL percentiles, throughput), ``interference`` (a short request next to a long
one), ``docqa`` (the compressed context cache), ``memory`` (memory-bound decode), ``cached-context``; one request:
``single`` (vs kvpress and transformers), ``aiperf`` (cross-check), ``peers`` (vs onnxruntime-genai and OpenVINO
GenAI, with the CPU's GEMM and bandwidth floors); the engine alone: ``latency`` (selection share of the prefill, decode
per token, decode memory), ``selection`` (the selection nodes of several policies), ``norm-flops``, ``profile`` (where
a prefill and a decode step spend their time), ``steps`` (a served request's steps: the graphs against the Python
around them), ``ops`` (the selection ops alone against torch); on a GPU: ``gpu`` (every policy's selection per layer
against the layer's prefill, with the GPU's floors, under ``results/gpu/``; ``scripts/gpu_check.sh`` runs it with the GPU tests)
and ``gpu-serve`` (the torch backend served in process); and ``targets`` / ``report`` (from the result files, no model
run)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from criticalkv.bench.report import add_out_argument


def command_line() -> str:
    """The command as typed (``criticalkv bench ...``)."""
    script = Path(sys.argv[0]).name
    prefix = f"python scripts/{script}" if script.endswith(".py") else "criticalkv"
    return " ".join([prefix, *map(shlex.quote, sys.argv[1:])])


def plain(doc: str | None) -> str:
    """A docstring for a terminal: without its ``markup``."""
    return (doc or "").replace("``", "")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmarks: serving (TTFT/TPOT/ITL, throughput), single request vs kvpress, AIPerf cross-check",
        description=plain(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    from criticalkv.bench import load_test

    serve = sub.add_parser("serve", help="load-test a criticalkv Triton server: TTFT/TPOT/ITL percentiles, throughput, KV, RSS",
                           description=plain(load_test.__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    load_test.add_arguments(serve)
    serve.set_defaults(func=run_serve)

    from criticalkv.bench import interference

    inter = sub.add_parser("interference", help="TTFT of a short request alone vs during a long one's decode and prefill",
                           description=plain(interference.__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    interference.add_arguments(inter)
    inter.set_defaults(func=run_interference)

    from criticalkv.bench import peers
    from criticalkv.bench.peers import cpu as cpu_peers
    from criticalkv.bench.peers import kvpress

    setup = sub.add_parser("setup-peers", help="create the peers' virtual environments (kvpress, transformers, aiperf, "
                           "onnxruntime-genai, openvino; vllm when asked)", description=plain(peers.__doc__), epilog=peers.PEERS_DIR_HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    setup.add_argument("--peers", "--only", dest="only", default=",".join(peers.DEFAULT_SETUP),
                       help=f"comma-separated subset of {','.join(peers.PEER_NAMES)} (default: all but vllm, which "
                            "the benchmarks that serve it create on first use)")
    setup.set_defaults(func=run_setup_peers)

    single = sub.add_parser("single", help="one request end to end: criticalkv (ONNX Runtime) vs kvpress vs transformers",
                            description=plain(kvpress.__doc__), epilog=peers.PEERS_DIR_HELP,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    single.add_argument("--engine-dir", required=True, type=Path, help="criticalkv engine (its budget is kvpress's)")
    single.add_argument("--model", help="HF folder or .gguf for the peers (default: the bundled SmolLM2-135M-Instruct)")
    single.add_argument("--isl", type=int, default=2048, help="prompt tokens, chat template included (default: 2048)")
    single.add_argument("--new-tokens", type=int, default=16, help="tokens generated per request (default: 16)")
    single.add_argument("--repeats", type=int, default=5, help="timed requests per implementation (default: 5)")
    single.add_argument("--peers", default="kvpress,transformers",
                        help="peers to compare (default: kvpress,transformers; a missing environment is created on "
                             "first use)")
    add_out_argument(single, "results/benchmarks/serving/single_request")
    single.set_defaults(func=run_single)

    cpu = sub.add_parser("peers", help="criticalkv engines vs onnxruntime-genai and OpenVINO GenAI on the same ids, with "
                         "the CPU's GEMM and bandwidth floors", description=plain(cpu_peers.__doc__),
                         epilog=peers.PEERS_DIR_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    cpu.add_argument("--engine-dir", action="append", type=Path, required=True,
                     help="a criticalkv engine built with --max-batch-size >= --batch (repeat: e.g. full and b=256), run "
                     "in its default forms (fused graphs, its --weights)")
    cpu.add_argument("--backends", default="onnxruntime",
                     help="criticalkv backends every --engine-dir runs on, comma-separated: onnxruntime and/or openvino "
                     "(its openvino graphs at the CPU's default precision; default: %(default)s)")
    cpu.add_argument("--portable-engine-dir", action="append", type=Path, default=[],
                     help="an engine run with its portable graphs (prefill.onnx, decode.onnx: fp32) as its own row "
                     "(repeat)")
    cpu.add_argument("--peers", default=",".join(cpu_peers.DEFAULT_PEERS),
                     help="CPU peers to run, comma-separated, each NAME or NAME:knob=value[:knob=value]: "
                     "onnxruntime-genai; openvino with precision=default+f32 (the compute precisions to run, each a row: "
                     "default, its CPU plugin's, bf16 on CPUs with BF16, and/or f32) and eviction=32/96/256 (the "
                     "CacheEvictionConfig START/RECENT/MAX tokens of its batch run with eviction); e.g. "
                     "onnxruntime-genai,openvino:precision=f32:eviction=32/96/512; vllm: vllm serve on the model "
                     "(its environment from `setup-peers --peers vllm`; bf16, its prefix cache emptied before each run) "
                     f"(default: {','.join(cpu_peers.DEFAULT_PEERS)} with those knobs; empty: none)")
    cpu.add_argument("--model", help="HF folder or .gguf the peers export (default: the bundled SmolLM2-135M-Instruct, "
                     "the engines' checkpoint)")
    cpu.add_argument("--isl", type=int, default=2025, help="prompt tokens, chat template included (default: 2025)")
    cpu.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per request (default: 64)")
    cpu.add_argument("--batch", type=int, default=8, help="prompts generated together (default: 8)")
    cpu.add_argument("--repeats", type=int, default=2, help="interleaved rounds after the warm-up (default: 2)")
    cpu.add_argument("--seed", type=int, default=0, help="prompt offsets (default: 0)")
    add_out_argument(cpu, "results/benchmarks/peers/cpu_peers")
    cpu.set_defaults(func=run_cpu_peers)

    from criticalkv.bench import profile

    prof = sub.add_parser("profile", help="per-op-class time of a prefill and a decode step (ONNX Runtime profile), "
                          "the Python side of a step, and the CPU's GEMM / bandwidth floors",
                          description=plain(profile.__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    prof.add_argument("--engine-dir", action="append", type=Path, required=True, help="an engine directory (repeat)")
    prof.add_argument("--isl", type=int, default=2025, help="prompt tokens, chat template included (default: 2025)")
    prof.add_argument("--steps", type=int, default=16, help="decode steps profiled and timed (default: 16)")
    prof.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads of the engines and the floors "
                      "(default: $CRITICALKV_ORT_THREADS, else ONNX Runtime's default, one per core)")
    prof.add_argument("--seed", type=int, default=0, help="prompt offset (default: 0)")
    add_out_argument(prof, "results/benchmarks/profile/profile")
    prof.set_defaults(func=run_profile)

    from criticalkv.bench import aiperf

    ai = sub.add_parser("aiperf", help="cross-check this load generator against AIPerf 0.13 on one workload",
                        description=plain(aiperf.__doc__), formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog=peers.PEERS_DIR_HELP)
    from criticalkv.bench import served

    served.add_server_arguments(ai, several=False)
    ai.add_argument("--isl", type=int, default=2048, help="input tokens (default: 2048)")
    ai.add_argument("--osl", type=int, default=64, help="output tokens (default: 64)")
    ai.add_argument("--concurrency", type=int, default=8, help="requests in flight (default: 8)")
    ai.add_argument("--num-requests", type=int, default=16, help="measured requests per tool (default: 16)")
    ai.add_argument("--warmup", type=int, default=2, help="warm-up requests per tool (default: 2)")
    ai.add_argument("--kv-budget", type=int, help="per-request kv_budget")
    ai.add_argument("--seed", type=int, default=0, help="prompt offsets (default: 0)")
    add_out_argument(ai, "results/benchmarks/serving/aiperf_crosscheck")
    ai.set_defaults(func=run_aiperf)

    _register_served_loads(sub)
    _register_engine_benchmarks(sub)

    from criticalkv.bench import gpu_serve

    gpu = sub.add_parser("gpu-serve", help="the torch backend served in process on a GPU (8B-shaped model, 8k/32k "
                         "prompts, concurrency 1-64, full vs compressed under one KV memory, kvpress): results/gpu/",
                         description=plain(gpu_serve.__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu_serve.add_arguments(gpu)
    gpu.set_defaults(func=run_gpu_serve)

    from criticalkv.bench import targets

    tg = sub.add_parser("targets", help="check the serving targets from the result files of a folder (no requests)",
                        description=plain(targets.__doc__),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    tg.add_argument("folder", type=Path, nargs="?", default=Path("results/benchmarks/serving"),
                    help="results folder (default: results/benchmarks/serving); writes FOLDER/targets.md and "
                         "FOLDER/summary.png (every serving run of the folder)")
    tg.set_defaults(func=run_targets)

    rep = sub.add_parser("report", help="redraw the tables, CSV and figure of a serving run from its JSON",
                         description="Rewrite NAME.txt, NAME.csv and NAME.png next to NAME.json without sending a request.")
    rep.add_argument("json", type=Path, help="a results JSON written by `criticalkv bench serve`")
    rep.set_defaults(func=run_report)


def run_setup_peers(args) -> int:
    from criticalkv.bench import peers

    peers.setup_peers(peers.peers_dir(), [n for n in args.only.split(",") if n])
    return 0


def _write(stem: Path, results: dict, text: str) -> None:
    """``STEM.json`` and ``STEM.txt`` (the printed table) of a peers or profile run."""
    from criticalkv.bench import report

    report.write_atomic(stem.with_suffix(".json"), json.dumps(results, indent=1) + "\n")
    report.write_atomic(stem.with_suffix(".txt"), text)
    print(text)


def run_single(args) -> int:
    from criticalkv.bench import machine, peers, served
    from criticalkv.bench.peers import kvpress

    if not (args.engine_dir / "manifest.json").is_file():
        raise FileNotFoundError(f"{args.engine_dir}: not an engine directory (no manifest.json)")
    if args.isl < 64 or args.new_tokens < 1 or args.repeats < 1:
        raise ValueError("--isl must be >= 64, --new-tokens and --repeats >= 1")
    names = served.comma_choices(args.peers, "--peers", ("kvpress", "transformers"), empty=True)
    results = machine.header(command_line())
    print("\n".join(machine.header_lines(results)), flush=True)
    results["single"] = kvpress.single_request(args.engine_dir, peers.peers_dir(), args.isl, args.new_tokens,
                                               args.repeats, model=args.model, peers=names)
    machine.finish(results)
    _write(args.out, results, kvpress.render_single(results))
    return 0


def _check_engines(dirs) -> None:
    for d in dirs:
        if not (Path(d) / "manifest.json").is_file():
            raise FileNotFoundError(f"{d}: not an engine directory (no manifest.json)")


def run_cpu_peers(args) -> int:
    from criticalkv.bench import machine, peers
    from criticalkv.bench.peers import cpu as cpu_peers

    _check_engines(args.engine_dir + args.portable_engine_dir)
    if args.isl < 64 or min(args.new_tokens, args.batch, args.repeats) < 1:
        raise ValueError("--isl must be >= 64, --new-tokens, --batch and --repeats >= 1")
    specs = cpu_peers.parse_peer_specs(args.peers)
    openvino = specs.get("openvino") or cpu_peers.parse_peer_specs("openvino")["openvino"]
    backends = cpu_peers.parse_backends(args.backends)
    root = peers.peers_dir()
    cpu_peers.check_ready(root, list(specs))
    results = machine.header(command_line())
    print("\n".join(machine.header_lines(results)), flush=True)
    results.update(cpu_peers.run(args.engine_dir, list(specs), root, args.isl, args.new_tokens, args.batch,
                                 args.repeats, openvino["eviction"], model=args.model, seed=args.seed,
                                 ov_precisions=openvino["precision"], portable_dirs=args.portable_engine_dir,
                                 backends=backends))
    machine.finish(results)
    _write(args.out, results, cpu_peers.render(results))
    return 0


def run_profile(args) -> int:
    from transformers import AutoTokenizer

    from criticalkv.bench import floors, machine, profile
    from criticalkv.bench.prompts import chat_ids, text_for_chat_length
    from criticalkv.runtime.manifest import read_manifest

    _check_engines(args.engine_dir)
    if args.isl < 64 or args.steps < 1 or (args.threads is not None and args.threads < 0):
        raise ValueError("--isl must be >= 64, --steps >= 1 and --threads >= 0")
    results = machine.header(command_line())
    print("\n".join(machine.header_lines(results)), flush=True)
    tokenizer = AutoTokenizer.from_pretrained(Path(args.engine_dir[0]) / "tokenizer")
    ids = chat_ids(tokenizer, text_for_chat_length(tokenizer, args.isl, args.seed))
    spec = read_manifest(Path(args.engine_dir[0]), verify=False)["model"]["spec"]
    import os

    from criticalkv.runtime.onnxruntime_backend import THREADS_ENV

    threads = args.threads if args.threads is not None else int(os.environ.get(THREADS_ENV, "0"))
    results["floors"] = floors.measure(spec, len(ids), threads)
    results["engines"] = [profile.profile_engine(Path(d), ids, args.steps, threads) for d in args.engine_dir]
    machine.finish(results)
    _write(args.out, results, profile.render(results))
    return 0


def run_aiperf(args) -> int:
    from criticalkv.bench import aiperf, peers, report, served

    served.check_server_arguments(args)
    if min(args.isl, args.osl, args.concurrency, args.num_requests) < 1 or args.warmup < 0:
        raise ValueError("--isl, --osl, --concurrency and --num-requests must be >= 1, --warmup >= 0")
    args.peers_dir = peers.peers_dir()
    peers.ensure_ready(args.peers_dir, ["aiperf"])
    args.command_line = command_line()
    results = aiperf.cross_check(args)
    stem = args.out
    report.write_atomic(stem.with_suffix(".json"), json.dumps(results, indent=1) + "\n")
    text = aiperf.render(results)
    report.write_atomic(stem.with_suffix(".txt"), text)
    print(text)
    return 0 if all(r["within"] for r in results["cross_check"]["comparison"] if r["within"] is not None) else 1


def run_targets(args) -> int:
    from criticalkv.bench import report, targets

    if not args.folder.is_dir():
        raise FileNotFoundError(f"{args.folder}: no such folder")
    text = targets.render(targets.check(args.folder))
    report.write_atomic(args.folder / "targets.md", text)
    runs = targets._runs(args.folder)
    if any(r["summary"].get("completed") for r in runs):  # every serving run of the folder in one figure
        report.plot({"runs": runs}, args.folder / "summary.png")
    print(text)
    return 0


def run_serve(args) -> int:
    from criticalkv.bench import load_test

    args.command_line = getattr(args, "command_line", None) or command_line()
    return load_test.main(args)


def run_gpu_serve(args) -> int:
    from criticalkv.bench import gpu_serve

    args.command_line = getattr(args, "command_line", None) or command_line()
    return gpu_serve.main(args)


def run_interference(args) -> int:
    from criticalkv.bench import interference

    args.command_line = getattr(args, "command_line", None) or command_line()
    return interference.main(args)


def run_report(args) -> int:
    from criticalkv.bench import report

    if not args.json.is_file():
        raise FileNotFoundError(f"{args.json}: no such file")
    results = json.loads(args.json.read_text())
    if "runs" not in results:
        raise ValueError(f"{args.json}: not a serving benchmark result (no 'runs')")
    report.write_all(results, args.json.with_suffix(""))
    print(report.render(results))
    return 0


def _register_engine_benchmarks(sub) -> None:
    """``latency``, ``selection``, ``steps``, ``norm-flops``, ``ops`` and ``gpu``: modules with their own argument
    parsers (``main(argv)``); the arguments after the name go to them, ``--help`` included."""
    for name, module_name, help_text in (
            ("latency", "criticalkv.bench.latency",
             "the engine alone: the selection nodes' share of a long prefill, decode per token, decode memory"),
            ("selection", "criticalkv.bench.selection", "the selection nodes of several policies on one prompt, "
                                                        "interleaved (seconds, per-operator profile)"),
            ("steps", "criticalkv.bench.steps", "the server's scheduler in process: each step's graph runs against "
                                                "the Python around them (a 2k prompt's chunks and selection, decode "
                                                "steps at batch 1 and 8)"),
            ("norm-flops", "criticalkv.bench.norm_flops", "FLOPs of CriticalKV's stage-2 value norms, unpruned and pruned"),
            ("ops", "criticalkv.bench.ops", "the selection ops alone (top_k, value_norms, window_scores, the model-level "
                                            "selection) vs torch.topk, a torch matmul, a softmax, the reference"),
            ("gpu", "criticalkv.bench.gpu", "on a GPU: every policy's selection per layer vs the layer's prefill "
                                            "(8k/32k/128k, Llama-3.1-8B layer), floors, batch 8, kvpress")):
        p = sub.add_parser(name, help=help_text, add_help=False,
                           description=f"{help_text} (`criticalkv bench {name} --help` lists its options)")
        p.add_argument("-h", "--help", action="store_true", dest="module_help", help=argparse.SUPPRESS)
        p.set_defaults(func=_run_main(module_name), passes_arguments=True, arguments=[])


def _run_main(module_name: str):
    def run(args) -> int:
        import importlib

        return importlib.import_module(module_name).main((["--help"] if args.module_help else []) + args.arguments)

    return run


def _register_served_loads(sub) -> None:
    """``docqa``, ``memory`` and ``cached-context``: workloads of the context cache and the KV memory budget."""
    from criticalkv.bench import cached, docqa, memory, replicas, versus_vllm

    for name, module, help_text in (
            ("docqa", docqa, "documents x questions in random order at concurrency 8, same KV memory for every "
                             "server: context-cache hit rate, TTFT, output tokens/s, KV held; ratios to full"),
            ("memory", memory, "memory-bound decode (ISL 2048, OSL 256, KV memory of 2 full sequences): output "
                               "tokens/s and the sequences each server holds at once; ratios to full"),
            ("cached-context", cached, "TTFT of a question after a cached context vs the same request uncached"),
            ("replicas", replicas, "docqa on Ray Serve replicas: 1 replica, N with power-of-two routing, N with "
                                   "context affinity + the shared store; then a replica SIGKILLed mid-request"),
            ("vllm", versus_vllm, "criticalkv's servers vs vllm serve on plain traffic, interleaved, medians of 3: "
                                  "2k request TTFT / decode step, the same prefix twice, 8 concurrent, AIPerf")):
        p = sub.add_parser(name, help=help_text, description=plain(module.__doc__),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(func=_run_module(module))


def _run_module(module):
    def run(args) -> int:
        args.command_line = getattr(args, "command_line", None) or command_line()
        return module.main(args)

    return run
