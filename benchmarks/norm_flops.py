"""FLOPs of CriticalKV's stage-2 value norms per prefill, unpruned and pruned (criticalkv/methods/pruned.py).

    python -m benchmarks.norm_flops            # SmolLM2-135M and Llama-3-8B shapes, 1k/4k/8k tokens, budget 256

Counts 2 FLOPs per multiply-add, summed over the layers; the pruned count assumes the first candidate round (2k
per KV head) is accepted (on the bundled model's needle prompt it was in most layers: docs/operator.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import benchmarks

#: (name, layers, query heads, KV heads, head dim, hidden)
SHAPES = [("SmolLM2-135M", 30, 9, 3, 64, 576), ("Llama-3-8B", 32, 32, 8, 128, 4096)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.norm_flops", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-lens", default="1024,4096,8192", help="comma-separated prompt lengths (default: 1024,4096,8192)")
    p.add_argument("--budget", type=int, default=256, help="KV budget per head (default: 256)")
    p.add_argument("--window", type=int, default=32, help="observation window (default: 32)")
    p.add_argument("--alpha", type=float, default=0.25, help="stage-1 fraction (default: 0.25)")
    args = p.parse_args(argv)
    from criticalkv.methods.pruned import norm_flops  # torch: not for --help

    print(f"# stage-2 value-norm GFLOPs per prefill, budget {args.budget}, window {args.window}, alpha {args.alpha}")
    print("| model | prompt | unpruned | bound (group + per-head Gram) | exact (candidates) | pruned | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, layers, heads, kv_heads, head_dim, hidden in SHAPES:
        for n in (int(x) for x in args.prompt_lens.split(",")):
            f = norm_flops(n, args.budget, args.window, args.alpha, heads, head_dim, hidden, kv_heads=kv_heads)
            g = {k: layers * v / 1e9 for k, v in f.items() if k in ("unpruned", "bound", "exact", "pruned")}
            print(f"| {name} | {n} | {g['unpruned']:.2f} | {g['bound']:.2f} | {g['exact']:.2f} | {g['pruned']:.2f} | "
                  f"{f['ratio']:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(benchmarks.run("norm_flops", main))
