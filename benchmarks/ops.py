"""The selection's primitives alone: ``torch.ops.criticalkv.top_k``, ``value_norms`` and ``window_scores`` against what
torch computes the same with (``torch.topk``, a torch matmul, a softmax), and the model-level selection
(``layer_ranking`` + ``select_model``) against the PyTorch reference's ``select_model``, interleaved in one run.

    python -m benchmarks.ops                       # on the CPU: the ops' host version (the kernels' logic in scalar fp32)
    python -m benchmarks.ops --device cuda         # on a GPU: the CUDA kernels (bf16 where the op takes it)
    python -m benchmarks.ops --output results/benchmarks/ops/cpu.json

Medians of ``--repeats`` timed calls after one warm-up (CUDA: synchronised, events), the machine header (load average
included) and the exact outputs' agreement (the same entries; the norms' largest relative difference). On the CPU the
host version is a check of the kernels' logic, not a fast path: the ratios say how far it is from torch's vectorised
code, not what a GPU does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import benchmarks
from criticalkv.bench.machine import finish, header, load_average


def timed(torch, fn, repeats: int, device: str) -> float:
    """Median seconds of ``repeats`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def shapes(device: str) -> dict:
    """The sizes per device: a GPU gets a Llama-3-8B layer at 32k tokens, the CPU a small one (its host version is
    scalar C++)."""
    if device == "cuda":
        return {"topk": (256, 32768, 2016), "norms": (1, 8, 32768, 128, 32, 4096), "window": (1, 32, 8, 32768, 128, 32),
                "model": (32, 8, 8192, 128, 32, 4096, 2048)}
    return {"topk": (64, 8192, 1024), "norms": (1, 2, 1024, 64, 8, 512), "window": (1, 8, 2, 2048, 64, 32),
            "model": (4, 2, 512, 32, 8, 256, 64)}


def run(device: str = "cpu", repeats: int = 5, dtype: str | None = None, log=print) -> dict:
    import torch

    from criticalkv import KVPolicy
    from criticalkv.selection.op import KernelsUnavailable, load_torch_ops, select_model_kv, top_k, value_norms, window_scores
    from criticalkv.selection.scores import window_attention

    missing = load_torch_ops()
    if missing is not None:
        raise KernelsUnavailable(missing)
    dev = torch.device(device)
    dt = getattr(torch, dtype) if dtype else (torch.bfloat16 if device == "cuda" else torch.float32)
    g = torch.Generator().manual_seed(0)
    size = shapes(device)
    results = {**header(f"python -m benchmarks.ops --device {device}"), "device": device, "dtype": str(dt), "rows": []}

    def row(name: str, ours, theirs, against: str, agree: str):
        mine = timed(torch, ours, repeats, device)
        other = timed(torch, theirs, repeats, device)
        results["rows"].append({"op": name, "ops_s": mine, "torch_s": other, "against": against, "agree": agree,
                                "ratio": mine / other})
        log(f"| {name} | {mine * 1e3:.3f} | {against} | {other * 1e3:.3f} | {mine / other:.2f} | {agree} |")

    log(f"# torch.ops.criticalkv primitives vs torch on {device} ({dt}), medians of {repeats}, load {load_average()}")
    log("| op | ops ms | torch | torch ms | ratio | outputs |")
    log("|---|---|---|---|---|---|")
    rows, length, k = size["topk"]
    scores = torch.randn(rows, length, generator=g).to(dev)
    counts = torch.full((rows,), k, dtype=torch.int64, device=dev)
    mask = top_k(scores, counts)
    want = torch.zeros_like(mask).scatter_(-1, torch.topk(scores, k).indices, True)
    row(f"top_k {rows}x{length}, k {k}", lambda: top_k(scores, counts), lambda: torch.topk(scores, k),
        "torch.topk", "same entries" if torch.equal(mask, want) else "DIFFERENT entries")

    b, hkv, n, d, h, hidden = size["norms"]
    values = torch.randn(b, hkv, n, d, generator=g).to(dev, dt)
    o_proj = (torch.randn(hidden, h * d, generator=g) / 16).to(dev, dt)
    w_heads = torch.stack([o_proj[:, i * d:(i + 1) * d].float().t() for i in range(h)])  # [H, d, hidden]

    def matmul():
        v = values.float().repeat_interleave(h // hkv, dim=1)  # [B, H, n, d]
        return (v @ w_heads[None]).abs().sum(-1)

    got, ref = value_norms(values, o_proj, h, "l1"), matmul()
    diff = float(((got - ref).abs() / ref.abs().clamp_min(1e-6)).max())
    row(f"value_norms l1 [{b},{hkv},{n},{d}] x {hidden}", lambda: value_norms(values, o_proj, h, "l1"), matmul,
        "matmul + abs + sum", f"max rel. diff {diff:.1e}")

    b, h, hkv, n, d, w = size["window"]
    queries = torch.randn(b, h, w, d, generator=g).to(dev, dt)
    keys = torch.randn(b, hkv, n, d, generator=g).to(dev, dt)

    def softmax():
        expanded = keys.float().repeat_interleave(h // hkv, dim=1)
        return window_attention(queries.float(), expanded).mean(dim=2)[..., :n - w]

    got, ref = window_scores(queries, keys, w), softmax()
    row(f"window_scores [{b},{h},{w}] x {n}", lambda: window_scores(queries, keys, w), softmax, "softmax(QK^T) mean",
        f"max abs. diff {float((got - ref).abs().max()):.1e}")

    layers, hkv, n, d, h, hidden, budget = size["model"]
    policy = KVPolicy("layer-defensivekv", budget=budget, window=32, head_cap_ratio=6.0)
    model = [(torch.randn(1, h, 32, d, generator=g).to(dev, dt), torch.randn(1, hkv, n, d, generator=g).to(dev, dt),
              torch.randn(1, hkv, n, d, generator=g).to(dev, dt), (torch.randn(hidden, h * d, generator=g) / 16).to(dev, dt))
             for _ in range(layers)]
    ours = select_model_kv(policy, model)
    theirs = select_model_kv(policy, model, implementation="reference")
    same = all(torch.equal(a[3], b[3]) for a, b in zip(ours, theirs))
    row(f"select_model layer-defensivekv cap 6, {layers} layers x [{hkv},{n}]", lambda: select_model_kv(policy, model),
        lambda: select_model_kv(policy, model, implementation="reference"), "PyTorch reference",
        "same entries" if same else "DIFFERENT entries")
    return finish(results)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ops", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the ops run (default: cpu)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per op and side (default: 5)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="the inputs' dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--output", type=Path, default=None, help="write the results as JSON there")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats: must be >= 1")
    results = run(args.device, args.repeats, args.dtype)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(benchmarks.run("ops", main))
