"""``criticalkv bench``: the benchmarks a user runs against a server or a GPU, their results under ``results/``.

Served load: ``serve`` (TTFT/TPOT/ITL percentiles, throughput), ``docqa`` (the compressed context cache), ``memory``
(memory-bound decode), ``vllm`` (against vllm serve); one request: ``single`` (vs kvpress and transformers), ``aiperf``
(cross-check), ``peers`` (vs onnxruntime-genai and OpenVINO GenAI, with the CPU's GEMM and bandwidth floors); on a
GPU: ``gpu`` (every policy's selection per layer against the layer's prefill, with the GPU's floors, under
``results/gpu/``) and ``gpu-serve`` (the torch backend served in process); ``report`` redraws a serving run from its
JSON. The laboratory's benchmarks (the engine's internals, the scheduler, the replicas, the committed targets) run
from a checkout as ``python -m benchmarks.NAME`` (docs/benchmarks.md)."""

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


def run_aiperf(args) -> int:
    from criticalkv.bench import aiperf, peers, report, served

    if getattr(args, "vllm", False):
        raise ValueError("--vllm: bench aiperf checks AIPerf against this package's load generator on criticalkv's "
                         "Triton endpoint (generate_stream), which vllm serve does not have; `criticalkv bench vllm "
                         "--parts aiperf` runs the same AIPerf command on both servers' OpenAI endpoints")
    if getattr(args, "rounds", 1) != 1:
        raise ValueError("--rounds: bench aiperf runs one round on one server (its table holds that run)")
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


def run_serve(args) -> int:
    from criticalkv.bench import load_test

    args.command_line = getattr(args, "command_line", None) or command_line()
    return load_test.main(args)


def run_gpu_serve(args) -> int:
    from criticalkv.bench import gpu_serve

    args.command_line = getattr(args, "command_line", None) or command_line()
    return gpu_serve.main(args)


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
    """``gpu``: a module with its own argument parser (``main(argv)``); the arguments after the name go to it,
    ``--help`` included."""
    for name, module_name, help_text in (
            ("gpu", "criticalkv.bench.gpu", "on a GPU: every policy's selection per layer vs the layer's prefill "
                                            "(8k/32k/128k, Llama-3.1-8B layer), floors, batch 8, kvpress"),):
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
    """``docqa``, ``memory`` and ``vllm``: workloads of the context cache and the KV memory budget, and vLLM beside."""
    from criticalkv.bench import docqa, memory, versus_vllm

    for name, module, help_text in (
            ("docqa", docqa, "documents x questions in random order at concurrency 8, same KV memory for every "
                             "server: context-cache hit rate, TTFT, output tokens/s, KV held; ratios to full"),
            ("memory", memory, "memory-bound decode (ISL 2048, OSL 256, KV memory of 2 full sequences): output "
                               "tokens/s and the sequences each server holds at once; ratios to full"),
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
