"""``python -m benchmarks.openvino_attention``: a prompt chunk's attention on OpenVINO's CPU plugin, in the forms a graph
can take, at an engine's shapes; and the plugin's GEMM rate, the floor under the chunk's projections.

A chunk of N prompt tokens over P held ones (``extend_openvino.onnx``: N queries, P + N keys, the causal order and
each head's held entries masked) is built three ways, each one small model of that attention alone:

* ``repeat``: the extend graph's form (``DecoderGraphBuilder.causal_attention``): K and V repeated to the H query
  heads, Q K^T, two Wheres (the held entries per head, the causal order per query), Softmax, @ V; the plugin fuses
  it into one attention subgraph;
* ``grouped``: the G query heads of a KV head as G x N rows of one product over that head's K and V (no repeated
  K/V; the decode graph's form), the causal mask tiled over the G row blocks;
* ``sdpa``: OpenVINO's ScaledDotProductAttention (opset 13) over the repeated K/V with both masks as one boolean
  input (its ``causal`` flag aligns the mask top-left, which is wrong once P > 0).

Each model is compiled with the plugin's default precision (``--precision f32``: full), the same random inputs run
through all of them, interleaved for ``--rounds`` rounds after a warm-up; printed: per (P, N) the median time of each
form, its ratio to ``repeat``'s and its largest difference from ``repeat``'s output (0: bitwise equal). Then the
GEMM rate: an [N, hidden] x [hidden, intermediate] MatMul (the MLP's up projection), its median and GFLOP/s.

Compare on an idle machine (the load average is recorded; ``--out``: STEM.json and STEM.txt).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

import benchmarks

FORMS = ("repeat", "grouped", "sdpa")
MASKED = float(np.finfo(np.float32).min)


def attention_model(form: str, heads: int, kv_heads: int, head_dim: int):
    """One chunk's attention as an OpenVINO model: q [1, H, N, d], k, v [1, H_kv, P + N, d], seen [1, H_kv, P + N]
    bool (a head's held entries and the new ones), causal [N, P + N] bool -> [1, N, H d]."""
    import openvino as ov
    import openvino.opset13 as ops

    group = heads // kv_heads

    def const(values, dtype=np.int64):
        return ops.constant(np.array(values, dtype))

    def repeat(x):  # [1, H_kv, K, d] -> [1, H, K, d]: the Unsqueeze-Broadcast-Reshape of exported Llama graphs
        grown = ops.broadcast(ops.unsqueeze(x, const([2])), const([1, 1, group, 1, 1]), broadcast_spec="BIDIRECTIONAL")
        return ops.reshape(grown, const([0, heads, -1, head_dim]), special_zero=True)

    q = ops.parameter([1, heads, -1, head_dim], np.float32, name="q")
    k = ops.parameter([1, kv_heads, -1, head_dim], np.float32, name="k")
    v = ops.parameter([1, kv_heads, -1, head_dim], np.float32, name="v")
    seen = ops.parameter([1, kv_heads, -1], np.bool_, name="seen")
    causal = ops.parameter([-1, -1], np.bool_, name="causal")
    scale = np.float32(1 / np.sqrt(head_dim))
    masked = ops.constant(np.float32(MASKED))
    if form == "repeat":
        seen_h = ops.reshape(ops.broadcast(ops.unsqueeze(seen, const([2])), const([1, 1, group, 1]),
                                           broadcast_spec="BIDIRECTIONAL"), const([0, heads, 1, -1]), special_zero=True)
        scores = ops.matmul(ops.multiply(q, ops.constant(scale)), repeat(k), False, True)
        scores = ops.select(causal, ops.select(seen_h, scores, masked), masked)
        out = ops.matmul(ops.softmax(scores, -1), repeat(v), False, False)
    elif form == "grouped":
        rows = ops.reshape(ops.multiply(q, ops.constant(scale)), const([0, kv_heads, -1, head_dim]), special_zero=True)
        scores = ops.matmul(rows, k, False, True)  # [1, H_kv, G N, K]
        scores = ops.select(ops.tile(causal, const([group, 1])), ops.select(ops.unsqueeze(seen, const([2])), scores,
                                                                             masked), masked)
        out = ops.reshape(ops.matmul(ops.softmax(scores, -1), v, False, False), const([0, heads, -1, head_dim]),
                          special_zero=True)
    elif form == "sdpa":
        seen_h = ops.reshape(ops.broadcast(ops.unsqueeze(seen, const([2])), const([1, 1, group, 1]),
                                           broadcast_spec="BIDIRECTIONAL"), const([0, heads, 1, -1]), special_zero=True)
        out = ops.scaled_dot_product_attention(q, repeat(k), repeat(v), ops.logical_and(seen_h, causal),
                                               ops.constant(scale), causal=False)
    else:
        raise ValueError(f"form {form!r} is not one of {', '.join(FORMS)}")
    out = ops.reshape(ops.transpose(out, const([0, 2, 1, 3])), const([0, 0, heads * head_dim]), special_zero=True)
    return ov.Model([out], [q, k, v, seen, causal], form)


def chunk_inputs(past: int, n: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random q, k, v of a chunk of n tokens over ``past`` held ones; the first KV head holds 7 entries fewer (a head
    of its own length, as the selection leaves them)."""
    rng = np.random.default_rng(seed)
    keys = past + n
    seen = np.ones((1, kv_heads, keys), bool)
    if past > 7:
        seen[:, 0, past - 7:past] = False
    positions = np.arange(keys)
    return {"q": rng.standard_normal((1, heads, n, head_dim), np.float32),
            "k": rng.standard_normal((1, kv_heads, keys, head_dim), np.float32),
            "v": rng.standard_normal((1, kv_heads, keys, head_dim), np.float32),
            "seen": seen, "causal": positions[None, :] <= (past + np.arange(n))[:, None]}


def compare_forms(spec: dict, pasts: list[int], n: int, rounds: int, config: dict, forms=FORMS) -> list[dict]:
    """Per past length: each form's median time (ms), its ratio to the first form's, its largest |difference| from
    the first form's output."""
    import openvino as ov

    core = ov.Core()
    shape = (spec["num_heads"], spec["num_kv_heads"], spec["head_dim"])
    requests = {form: core.compile_model(attention_model(form, *shape), "CPU", config).create_infer_request()
                for form in forms}
    rows = []
    for past in pasts:
        feeds = chunk_inputs(past, n, *shape)
        outputs = {form: np.array(r.infer(feeds)[0]) for form, r in requests.items()}  # also the warm-up
        times = {form: [] for form in forms}
        for _ in range(rounds):
            for form, request in requests.items():
                start = time.perf_counter()
                request.infer(feeds)
                times[form].append((time.perf_counter() - start) * 1e3)
        base = forms[0]
        medians = {form: statistics.median(t) for form, t in times.items()}
        rows.append({"past": past, "n": n, "ms": medians, "ratio": {f: medians[f] / medians[base] for f in forms},
                     "max_diff": {f: float(np.abs(outputs[f] - outputs[base]).max()) for f in forms}})
    return rows


def gemm_rate(spec: dict, n: int, rounds: int, config: dict) -> dict:
    """The [n, hidden] x [hidden, intermediate] MatMul's median time and GFLOP/s."""
    import openvino as ov
    import openvino.opset13 as ops

    hidden, inner = spec["hidden_size"], spec["intermediate_size"]
    x = ops.parameter([-1, hidden], np.float32)
    w = ops.constant(np.random.default_rng(1).standard_normal((inner, hidden), np.float32) * 0.02)
    request = ov.Core().compile_model(ov.Model([ops.matmul(x, w, False, True)], [x]), "CPU", config).create_infer_request()
    a = np.random.default_rng(2).standard_normal((n, hidden), np.float32)
    for _ in range(3):
        request.infer([a])
    times = []
    for _ in range(max(rounds, 10)):
        start = time.perf_counter()
        request.infer([a])
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {"m": n, "k": hidden, "n": inner, "ms": median * 1e3, "gflops": 2 * n * hidden * inner / median / 1e9}


def render(results: dict) -> str:
    from criticalkv.bench import machine

    forms = results["forms"]
    lines = machine.header_lines(results) + [
        "",
        f"one chunk's attention, {results['spec']['num_heads']} query heads over {results['spec']['num_kv_heads']} KV "
        f"heads of {results['spec']['head_dim']}, precision {results['precision']}, medians of {results['rounds']} "
        "interleaved rounds (one layer; a prompt runs it once per layer and chunk)", "",
        "| P held | N new | " + " | ".join(f"{f} ms" for f in forms) + " | " +
        " | ".join(f"{f} / {forms[0]}" for f in forms[1:]) + " | " +
        " | ".join(f"{f} max diff" for f in forms[1:]) + " |",
        "|" + "---|" * (2 + len(forms) + 2 * (len(forms) - 1)),
    ]
    for row in results["attention"]:
        lines.append(f"| {row['past']} | {row['n']} | " + " | ".join(f"{row['ms'][f]:.3f}" for f in forms) + " | " +
                     " | ".join(f"{row['ratio'][f]:.2f}x" for f in forms[1:]) + " | " +
                     " | ".join(f"{row['max_diff'][f]:.3g}" for f in forms[1:]) + " |")
    g = results["gemm"]
    lines += ["", f"GEMM [{g['m']}, {g['k']}] x [{g['k']}, {g['n']}]: {g['ms']:.2f} ms, {g['gflops']:.0f} GFLOP/s"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=benchmarks.prog("openvino_attention"), description=benchmarks.plain(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine-dir", type=Path, required=True, help="the engine whose model's shapes are measured")
    parser.add_argument("--chunk", type=int, default=512, help="new tokens N (default: 512, serve's prefill chunk)")
    parser.add_argument("--pasts", default="0,512,1024,1536",
                        help="comma-separated held lengths P (default: a 2k prompt's chunks, 0,512,1024,1536)")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default: 15)")
    parser.add_argument("--precision", choices=("default", "f32"), default="default",
                        help="the plugin's default (bf16 where the CPU has it) or f32 (default: default)")
    parser.add_argument("--threads", type=int, default=0, help="the plugin's threads (default: 0, its own choice)")
    parser.add_argument("--out", type=Path, help="also write STEM.json and STEM.txt")
    args = parser.parse_args(argv)
    try:
        pasts = [int(p) for p in args.pasts.split(",")]
    except ValueError:
        parser.error(f"--pasts: {args.pasts!r} is not a comma-separated list of integers")
    if args.chunk < 1 or args.rounds < 1 or any(p < 0 for p in pasts) or args.threads < 0:
        parser.error("--chunk and --rounds must be >= 1, --pasts and --threads >= 0")
    if not (args.engine_dir / "manifest.json").is_file():
        parser.error(f"{args.engine_dir}: not an engine directory (no manifest.json)")

    from criticalkv.bench import machine

    spec = json.loads((args.engine_dir / "manifest.json").read_text())["model"]["spec"]
    config = {"INFERENCE_PRECISION_HINT": "f32"} if args.precision == "f32" else {}
    if args.threads:
        config["INFERENCE_NUM_THREADS"] = args.threads
    results = machine.header(benchmarks.command_line("openvino_attention", argv))
    print("\n".join(machine.header_lines(results)), flush=True)
    results.update(spec={k: spec[k] for k in ("num_heads", "num_kv_heads", "head_dim", "hidden_size",
                                              "intermediate_size")},
                   precision=args.precision, rounds=args.rounds, forms=list(FORMS))
    results["attention"] = compare_forms(spec, pasts, args.chunk, args.rounds, config)
    results["gemm"] = gemm_rate(spec, args.chunk, args.rounds, config)
    machine.finish(results)
    text = render(results)
    print(text, end="")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
        args.out.with_suffix(".txt").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(benchmarks.run("openvino_attention", main))
