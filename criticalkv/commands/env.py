"""``criticalkv env``: what this machine can run (``criticalkv.bench.environment``): torch and CUDA versions, the GPUs,
nvcc, whether the selection ops and the TensorRT plugin load, whether TensorRT builds engines, ONNX Runtime's
providers, and for every policy where its selection runs (the CUDA kernels, their host version on the CPU, or the
PyTorch reference, with the reason). Paste it into a bug report, like ``python -m torch.utils.collect_env``."""

from __future__ import annotations

import argparse
import json


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "env", help="report what this machine can run: torch, CUDA, GPUs, the selection ops, TensorRT, per policy",
        description=__doc__.replace("``", ""), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the report as JSON (for tools) instead of text")
    p.set_defaults(func=run)


def run(args) -> int:
    from criticalkv.bench.environment import collect, render

    report = collect()
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0
