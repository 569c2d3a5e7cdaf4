"""Where the time goes: ONNX Runtime's per-op profile of one prefill and of decode steps, the Python side of a
decode step, and this CPU's floors (``criticalkv.bench.floors``), all measured in one run.

    python -m benchmarks.profile --engine-dir engines/full --engine-dir engines/ckv256 --isl 2025

For each engine (batch 1, the same chat-wrapped prompt of ``--isl`` tokens cut from the benchmark prose):

* prefill: one profiled run after a warm-up of the prefill graph the engine runs (the fused ``prefill_ort.onnx`` when
  it has one, ``CRITICALKV_ORT_PREFILL=portable`` profiles ``prefill.onnx``). Every top-level node of the optimised
  graph is put in an op class (a node nested in the attention ``Loop`` or in the selection's ``If`` counts in its
  parent's class): the four projections and the LM head by their weight's shape (fp32 MatMul / Gemm, or the int8 /
  int4 operators of ``--weights``), ``attention`` (the query-block Loop, or GroupQueryAttention),
  ``selection`` (the inlined CriticalKVSelect body), ``rms_norm``, ``activation``, ``embedding``, ``other``
  (RoPE, reshapes, residual adds, masks, ...). FLOPs of a MatMul / Gemm come from its input shapes in the
  profile (the attention Loop's from its nested MatMuls: what it computes, block-causal); achieved GFLOP/s =
  FLOPs / time;
* decode: ``--steps`` profiled steps after the prefill and two warm-up steps (per-node mean) of the decode graph the
  engine runs (the fused ``decode_ort.onnx`` when it has one, its GroupQueryAttention nodes in ``attention``;
  ``CRITICALKV_ORT_DECODE=portable`` profiles ``decode.onnx``); bytes of a projection = its weight, of an attention
  MatMul = the KV buffer it reads; achieved GB/s = bytes / time;
* the Python side of a decode step, unprofiled: ``run_with_iobinding`` (wall time of the ORT call), the rest
  of ``OnnxRuntimeBackend.decode`` (the KV writes or moves and the length updates), greedy sampling and the loop.

The floors: ``gemm_rate`` at the prefill's projection shapes, ``gemv_bandwidth`` of the decode step's weights.
Timings are only comparable within one run on an idle machine: the load average is recorded at start and end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

import benchmarks
from criticalkv.bench.report import add_out_argument, write_atomic

#: Op types whose node is an RMSNorm (ONNX Runtime fuses the Pow/ReduceMean/Add/Sqrt/Div/Mul pattern).
NORM_OPS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "RMSNormalization", "LayerNormalization",
            "SkipLayerNormalization")
ACTIVATION_OPS = ("QuickGelu", "Sigmoid", "Silu")
#: The quantized projections of ``--weights int8|int4`` (``criticalkv.export.quantize``).
QUANTIZED_MATMUL_OPS = ("MatMulNBits", "DynamicQuantizeMatMul", "MatMulIntegerToFloat")
#: Bytes per weight element of each ``--weights`` setting (codes; the block scales add 1/8 or 1/16 of that)
WEIGHT_ELEMENT_BYTES = {"fp32": 4.0, "int8": 1.0, "int4": 0.5}
MATMUL_OPS = ("MatMul", "FusedMatMul", "Gemm", *QUANTIZED_MATMUL_OPS)
#: Nodes that hold their own subgraph: nested node events are counted in the parent's class.
CONTAINER_OPS = ("Loop", "If", "Scan")
#: Op classes in the order of the tables.
CLASSES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head", "attention", "selection", "rms_norm",
           "activation", "embedding", "other")


# ---------------------------------------------------------------------------------------------- trace reading
def node_events(trace: list[dict]) -> tuple[list[dict], list[dict]]:
    """(runs, node kernel events) of an ONNX Runtime profile, both sorted by start time."""
    runs = sorted((e for e in trace if e.get("name") == "model_run"), key=lambda e: e["ts"])
    nodes = sorted((e for e in trace if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")),
                   key=lambda e: e["ts"])
    return runs, nodes


def _shapes(event: dict, key: str = "input_type_shape") -> list[list[int]]:
    return [list(next(iter(s.values()))) for s in event.get("args", {}).get(key, [])]


def matmul_flops(event: dict) -> float:
    """2 * K * (elements of the output) of a MatMul / FusedMatMul / Gemm event, K = the first input's last dimension.

    From the output shape, so that a transposed or a prepacked second operand (an initializer MLAS prepacked is not
    listed among the inputs) needs no special case; 0 when the profile lacks the shapes."""
    inputs, outputs = _shapes(event), _shapes(event, "output_type_shape")
    if not inputs or not inputs[0] or not outputs:
        return 0.0
    return 2.0 * inputs[0][-1] * float(np.prod(outputs[0]))


def prompt_attention_flops(event: dict) -> float:
    """Causal FLOPs of a GroupQueryAttention event over a prompt without past (the fused prefill): QK^T and PV over
    s(s+1)/2 query-key pairs per head, 2 * 2 * B * (H d_h) * s(s+1)/2; 0 for a node with a past (decode, extend)."""
    inputs = _shapes(event)
    if len(inputs) < 3 or len(inputs[0]) != 3 or (len(inputs) > 3 and len(inputs[3]) == 4):
        return 0.0
    batch, s, width = inputs[0]
    return 2.0 * 2 * batch * width * s * (s + 1) / 2


def weight_shape(event: dict) -> tuple[int, int] | None:
    """(K, N) of a MatMul / Gemm whose second operand is a weight (an initializer), else None.

    A weight appears either with its shape and ``parameter_size`` > 0 (prepacking off, as in the engines' shared
    weights) or not at all among the listed inputs (MLAS prepacked it): then K = the input's last dimension and
    N = the output's."""
    inputs, outputs = _shapes(event), _shapes(event, "output_type_shape")
    if event["args"].get("op_name") in QUANTIZED_MATMUL_OPS:  # the second operand is always a weight
        return (inputs[0][-1], outputs[0][-1]) if inputs and inputs[0] and outputs else None
    if len(inputs) >= 2 and int(event["args"].get("parameter_size", 0) or 0) > 0:
        k, n = inputs[1][-2:]
        return (n, k) if event["args"].get("op_name") == "Gemm" and inputs[0][-1] == n else (k, n)
    if len(inputs) == 1 and inputs[0] and outputs:
        return inputs[0][-1], outputs[0][-1]
    return None


def classify(event: dict, spec: dict, selection_marks: tuple[str, ...]) -> str:
    """The op class of a top-level node event (see ``CLASSES``)."""
    from criticalkv.bench.floors import LayerShapes

    name, op = event["name"], event["args"].get("op_name", "")
    if any(mark in name for mark in selection_marks):
        return "selection"
    if op in ("Loop", "GroupQueryAttention"):  # the prefill's query-block Loop; the fused decode's attention node
        return "attention"
    if op in NORM_OPS:
        return "rms_norm"
    if op in ACTIVATION_OPS:
        return "activation"
    if op == "Gather" and int(event["args"].get("parameter_size", 0) or 0) > 0:
        return "embedding"
    if op in MATMUL_OPS:
        weight = weight_shape(event)
        if weight is not None:
            if weight == (spec["hidden_size"], spec["vocab_size"]):
                return "lm_head"
            for cls, shape in LayerShapes.from_spec(spec).projections().items():
                if weight == shape:
                    return cls
            return "other"
        return "attention"  # activations x activations: QK^T and PV of the decode step
    if op == "Softmax":
        return "attention"
    return "other"


def breakdown(trace: list[dict], spec: dict, first: int = 0, quantized_element_bytes: float = 1.0) -> dict:
    """Per op class: seconds, node count, FLOPs and weight/KV bytes of the runs of a profile, averaged over the
    ``model_run`` events from index ``first`` on (-1: the last run only; warm-up runs come first).
    ``quantized_element_bytes``: bytes per weight of the quantized projections (``WEIGHT_ELEMENT_BYTES``).
    Returns {"run_s", "runs", "classes": {cls: {"seconds", "nodes", "flops", "bytes"}}, "unaccounted_s"}."""
    from criticalkv.runtime.profiling import SELECTION_MARKS

    runs, nodes = node_events(trace)
    if not runs:
        raise ValueError("the profile holds no model_run event")
    chosen = runs[first:]
    classes = {c: {"seconds": 0.0, "nodes": 0, "flops": 0.0, "bytes": 0} for c in CLASSES}
    for run in chosen:
        begin, end = run["ts"], run["ts"] + run["dur"]
        inside = [e for e in nodes if begin <= e["ts"] <= end]
        parent_end, parent_cls = -1, None
        for e in inside:
            if e["ts"] < parent_end:  # nested in a Loop / If body: its FLOPs count in the parent's class
                if e["args"].get("op_name") in MATMUL_OPS:
                    classes[parent_cls]["flops"] += matmul_flops(e)
                continue
            cls = classify(e, spec, SELECTION_MARKS)
            entry = classes[cls]
            entry["seconds"] += e["dur"] / 1e6
            entry["nodes"] += 1
            op = e["args"].get("op_name")
            if op == "GroupQueryAttention":
                entry["flops"] += prompt_attention_flops(e)
            if op in MATMUL_OPS:
                entry["flops"] += matmul_flops(e)
                weight, shapes = weight_shape(e), _shapes(e)
                if weight is not None:  # the weight read
                    element = quantized_element_bytes if op in QUANTIZED_MATMUL_OPS else 4.0
                    entry["bytes"] += element * weight[0] * weight[1]
                elif len(shapes) > 1:  # the second activation read (the KV buffer of a decode step)
                    entry["bytes"] += 4 * int(np.prod(shapes[1]))
            if op in CONTAINER_OPS:
                parent_end, parent_cls = e["ts"] + e["dur"], cls
    count = len(chosen)
    for entry in classes.values():
        for key in entry:
            entry[key] = entry[key] / count if count > 1 else entry[key]
    run_s = sum(r["dur"] for r in chosen) / 1e6 / count
    return {"run_s": run_s, "runs": count, "classes": classes,
            "unaccounted_s": run_s - sum(c["seconds"] for c in classes.values())}


# ---------------------------------------------------------------------------------------------- measurements
class _TimedSession:
    """Wraps an InferenceSession: records the wall time of every ``run_with_iobinding`` call."""

    def __init__(self, session):
        self._session = session
        self.seconds: list[float] = []

    def run_with_iobinding(self, binding, *args):
        start = time.perf_counter()
        self._session.run_with_iobinding(binding, *args)
        self.seconds.append(time.perf_counter() - start)

    def __getattr__(self, name):
        return getattr(self._session, name)


def _trace(session) -> list[dict]:
    path = session.end_profiling()
    try:
        return json.loads(Path(path).read_text())
    finally:
        os.remove(path)


def profile_engine(engine_dir: Path, ids: list[int], steps: int = 16, threads: int | None = None) -> dict:
    """Profile one prefill (after a warm-up) and ``steps`` decode steps of an engine, then time the Python
    side of ``steps`` unprofiled decode steps. ``ids``: the prompt's token ids (batch 1)."""
    from criticalkv.runtime.manifest import read_manifest
    from criticalkv.runtime.onnxruntime_backend import OnnxRuntimeBackend
    from criticalkv.sampling import Sampler

    manifest = read_manifest(Path(engine_dir), verify=False)
    spec = manifest["model"]["spec"]
    n = len(ids)
    x = np.asarray([ids], np.int64)
    mask, positions = np.ones_like(x), np.arange(n, dtype=np.int64)[None]
    backend = OnnxRuntimeBackend(Path(engine_dir), manifest, threads=threads, profile=True)
    try:
        warm = backend.prefill(x, mask, positions)  # warm-up run: also profiled, not counted
        pre = backend.prefill(x, mask, positions)
        prefill_wall = pre.seconds
        element = WEIGHT_ELEMENT_BYTES[(manifest["onnx"].get("weights") or {}).get("format", "fp32")]
        prefill = breakdown(_trace(backend.prefill_session), spec, first=-1, quantized_element_bytes=element)
        del warm
        backend.profile = False

        # decode, profiled: a session of the graph the backend runs (the fused decode_ort.onnx with its prepacked
        # weights, or the portable decode.onnx) with profiling on, bound like the backend's own
        plain_session = backend.decode_session
        backend.profile_decode()
        sampler = Sampler()
        backend.begin_decode(pre)
        token = sampler(pre.logits)
        for t in range(steps + 2):
            token = sampler(backend.decode(token, np.array([n + t])))
        decode = breakdown(_trace(backend.decode_session), spec, first=2, quantized_element_bytes=element)

        # decode, unprofiled: the Python side of a step
        backend.use_decode_session(_TimedSession(plain_session))
        backend.begin_decode(pre)
        token = sampler(pre.logits)
        split = defaultdict(list)
        for t in range(steps + 2):
            start = time.perf_counter()
            logits = backend.decode(token, np.array([n + t]))
            middle = time.perf_counter()
            token = sampler(logits)
            end = time.perf_counter()
            split["decode_call"].append(middle - start)
            split["sampling"].append(end - middle)
            split["step"].append(end - start)
        runs = backend.decode_session.seconds[2:]
        python = {
            "step_ms": 1e3 * statistics.median(split["step"][2:]),
            "ort_run_ms": 1e3 * statistics.median(runs),
            "kv_writes_and_binding_ms": 1e3 * statistics.median(c - r for c, r in zip(split["decode_call"][2:], runs)),
            "sampling_ms": 1e3 * statistics.median(split["sampling"][2:]),
        }
        python["ort_profiled_run_ms"] = 1e3 * decode["run_s"]
        kept = [int(length.max()) for length in pre.lengths]
    finally:
        backend.close()
    return {"engine_dir": str(engine_dir), "policy": manifest["policy"]["name"], "budget": manifest["policy"].get("budget"),
            "prompt_tokens": n, "decode_steps": steps, "kept_per_layer_max": kept, "decode_form": backend.decode_form,
            "prefill_form": backend.prefill_form, "weights": manifest["onnx"].get("weights") or {"format": "fp32"},
            "decode_capacity": manifest["shapes"]["decode_capacity"], "threads": backend.threads or "default",
            "prefill_wall_s": prefill_wall, "prefill": prefill, "decode": decode, "python": python, "spec": spec}


def model_flops(spec: dict, n: int) -> dict:
    """FLOPs of a batch-1 prefill of ``n`` tokens by class, the causal attention counted as useful work (n(n+1)/2
    query-key pairs): what any implementation must compute, the yardstick of the floors."""
    from criticalkv.bench.floors import LayerShapes

    shapes = LayerShapes.from_spec(spec)
    out = {name: 2.0 * n * k * m * shapes.layers for name, (k, m) in shapes.projections().items()}
    out["lm_head"] = 2.0 * shapes.hidden * shapes.vocab
    out["attention"] = 2.0 * 2 * spec["num_heads"] * spec["head_dim"] * n * (n + 1) / 2 * shapes.layers
    return out


def decode_bytes(spec: dict, capacity: list[int], kept: list[int], weights: dict | None = None) -> dict:
    """Bytes a batch-1 decode step reads: the weights (fp32, or the integer codes and scales of ``--weights int8|int4``:
    the manifest's ``onnx.weights``), the KV the graph reads (its whole fixed capacity per head) and the KV actually
    held (``kept`` entries per head and layer)."""
    from criticalkv.bench.floors import LayerShapes

    per_entry = 2 * spec["num_kv_heads"] * spec["head_dim"] * 4  # K and V, every KV head, fp32
    weight_bytes = (weights or {}).get("bytes") or LayerShapes.from_spec(spec).weight_bytes()
    return {"weights": weight_bytes, "kv_read_by_graph": per_entry * sum(capacity), "kv_held": per_entry * sum(kept)}


# ---------------------------------------------------------------------------------------------- the report
def render(results: dict) -> str:
    """The breakdown as Markdown tables (one set per engine), with the floors and the header."""
    from criticalkv.bench.machine import header_lines

    f = results["floors"]
    gemm, gemv = f["gemm"]["gflops"], f["gemv"]["gbps"]
    lines = header_lines(results) + [
        "",
        f"floors (ONNX Runtime, same run): fp32 GEMM {gemm:.1f} GFLOP/s at the prefill's projection shapes "
        f"({f['gemm']['tokens']} tokens); decode-weight GEMV read {gemv:.1f} GB/s; NumPy copy {f['copy']['gbps']:.1f} GB/s"
        + (f"; torch {f['torch']['version']}: GEMM {f['torch']['gemm_gflops']:.1f} GFLOP/s, GEMV {f['torch']['gemv_gbps']:.1f} GB/s"
           if f.get("torch") else ""),
    ]
    for e in results["engines"]:
        label = e["policy"] + (f" b={e['budget']}" if e["policy"] != "full" else "")
        if "prefill_form" in e:  # results written before the fused prompt graphs have neither
            label += f", {e['weights']['format']} weights, {e['prefill_form']} prefill"
        p, d, py = e["prefill"], e["decode"], e["python"]
        useful = model_flops(e["spec"], e["prompt_tokens"])
        floor_s = sum(useful.values()) / (gemm * 1e9)
        lines += ["", f"## {label} ({e['engine_dir']}): prefill of {e['prompt_tokens']} tokens",
                  f"profiled run {p['run_s']:.3f} s (wall time of that call {e['prefill_wall_s']:.3f} s); useful FLOPs "
                  f"{sum(useful.values()) / 1e9:.0f} G (causal attention), floor at the GEMM rate {floor_s:.2f} s "
                  f"({100 * floor_s / e['prefill_wall_s']:.0f} % of the wall time)",
                  "| op class | ms | % | nodes | GFLOP computed | GFLOP useful | GFLOP/s | % of GEMM rate |",
                  "|---|---|---|---|---|---|---|---|"]
        for cls in CLASSES:
            c = p["classes"][cls]
            if not c["nodes"]:
                continue
            rate = c["flops"] / c["seconds"] / 1e9 if c["flops"] and c["seconds"] else None
            lines.append(f"| {cls} | {1e3 * c['seconds']:.1f} | {100 * c['seconds'] / p['run_s']:.1f} | {c['nodes']:.0f} | "
                         f"{c['flops'] / 1e9:.1f} | {useful.get(cls, 0) / 1e9:.1f} | "
                         + (f"{rate:.1f} | {100 * rate / gemm:.0f} |" if rate else "| |"))
        bytes_ = decode_bytes(e["spec"], e["decode_capacity"], e["kept_per_layer_max"], e.get("weights"))
        floor_ms = (bytes_["weights"] + bytes_["kv_held"]) / (gemv * 1e9) * 1e3
        if e.get("decode_form", "portable") == "fused":
            kv_read = (f"{bytes_['kv_held'] / 1e6:.1f} MB of KV (the fused decode_ort.onnx reads each row's held entries, "
                       "up to its longest head)")
        else:
            kv_read = (f"{bytes_['kv_read_by_graph'] / 1e6:.1f} MB of KV buffers (the portable decode.onnx reads each "
                       f"head's whole capacity; {bytes_['kv_held'] / 1e6:.1f} MB held)")
        lines += ["", f"## {label}: one decode step after the prompt (median of {e['decode_steps']} profiled steps, "
                  f"{e.get('decode_form', 'portable')} decode graph)",
                  f"profiled run {1e3 * d['run_s']:.2f} ms; reads {bytes_['weights'] / 1e6:.0f} MB of weights + {kv_read}; "
                  f"floor at the GEMV bandwidth (weights + held KV) {floor_ms:.1f} ms",
                  "| op class | ms | % | nodes | MB read | GB/s | % of GEMV bandwidth |", "|---|---|---|---|---|---|---|"]
        for cls in CLASSES:
            c = d["classes"][cls]
            if not c["nodes"]:
                continue
            rate = c["bytes"] / c["seconds"] / 1e9 if c["bytes"] and c["seconds"] else None
            lines.append(f"| {cls} | {1e3 * c['seconds']:.2f} | {100 * c['seconds'] / d['run_s']:.1f} | {c['nodes']:.0f} | "
                         f"{c['bytes'] / 1e6:.1f} | " + (f"{rate:.1f} | {100 * rate / gemv:.0f} |" if rate else "| |"))
        lines += ["", f"Python side of a decode step (unprofiled, median): step {py['step_ms']:.2f} ms = ORT "
                  f"run_with_iobinding {py['ort_run_ms']:.2f} ms + KV writes / length updates / binding "
                  f"{py['kv_writes_and_binding_ms']:.2f} ms + greedy sampling {py['sampling_ms']:.2f} ms"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- command line
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=benchmarks.prog("profile"), description=benchmarks.plain(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-dir", action="append", type=Path, required=True, help="an engine directory (repeat)")
    p.add_argument("--isl", type=int, default=2025, help="prompt tokens, chat template included (default: 2025)")
    p.add_argument("--steps", type=int, default=16, help="decode steps profiled and timed (default: 16)")
    p.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads of the engines and the floors "
                   "(default: $CRITICALKV_ORT_THREADS, else ONNX Runtime's default, one per core)")
    p.add_argument("--seed", type=int, default=0, help="prompt offset (default: 0)")
    add_out_argument(p, "results/benchmarks/profile/profile")
    args = p.parse_args(argv)
    args.command_line = benchmarks.command_line("profile", argv)
    return args


def main(argv=None) -> int:
    """Profile every ``--engine-dir`` on one prompt, the floors measured in the same run; writes OUT.json / OUT.txt."""
    args = parse_args(argv)
    for d in args.engine_dir:
        if not (Path(d) / "manifest.json").is_file():
            raise FileNotFoundError(f"{d}: not an engine directory (no manifest.json)")
    if args.isl < 64 or args.steps < 1 or (args.threads is not None and args.threads < 0):
        raise ValueError("--isl must be >= 64, --steps >= 1 and --threads >= 0")
    from transformers import AutoTokenizer  # torch: not for --help and argument errors

    from criticalkv.bench import floors, machine
    from criticalkv.bench.prompts import chat_ids, text_for_chat_length
    from criticalkv.runtime.manifest import read_manifest
    from criticalkv.runtime.onnxruntime_backend import THREADS_ENV

    results = machine.header(args.command_line)
    print("\n".join(machine.header_lines(results)), flush=True)
    tokenizer = AutoTokenizer.from_pretrained(Path(args.engine_dir[0]) / "tokenizer")
    ids = chat_ids(tokenizer, text_for_chat_length(tokenizer, args.isl, args.seed))
    spec = read_manifest(Path(args.engine_dir[0]), verify=False)["model"]["spec"]
    threads = args.threads if args.threads is not None else int(os.environ.get(THREADS_ENV, "0"))
    results["floors"] = floors.measure(spec, len(ids), threads)
    results["engines"] = [profile_engine(Path(d), ids, args.steps, threads) for d in args.engine_dir]
    machine.finish(results)
    text = render(results)
    write_atomic(args.out.with_suffix(".json"), json.dumps(results, indent=1) + "\n")
    write_atomic(args.out.with_suffix(".txt"), text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(benchmarks.run("profile", main))
