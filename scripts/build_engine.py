#!/usr/bin/env python3
"""Build an engine directory: export to ONNX (selection inside the graph), validate, smoke-test on
ONNX Runtime, build TensorRT engines when TensorRT and a GPU are present, write manifest.json.
With --backend torch: no export, a manifest naming the checkpoint for the torch backend, smoke-tested on it.

    python scripts/build_engine.py --kv-policy criticalkv --budget 256 --output engines/smollm2-criticalkv
    python scripts/build_engine.py --backend torch --model PATH --dtype bfloat16 --output engines/model-torch

Exit status: 0 when the engine directory is written and the TensorRT engines were built or skipped
(TensorRT, a GPU or the plugin is missing here: it says which); 3 when the engine directory is written
(the ONNX Runtime engine is complete) but the TensorRT build failed (the error is printed and recorded
as tensorrt.error in manifest.json); 2 on bad input; 130 when interrupted (nothing is written).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from criticalkv.cli import EXIT_INTERRUPTED, EXIT_TERMINATED, Terminated, sigterm_raises  # noqa: E402
from criticalkv.export.exporter import DEFAULT_CONTEXT_POLICY, EXPORT_DTYPES, WEIGHT_FORMATS, BuildConfig  # noqa: E402
from criticalkv.policy import KVPolicy  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = BuildConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF folder or .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--output", required=True, type=Path, help="engine directory to write (created atomically)")
    p.add_argument("--max-input-len", type=int, default=defaults.max_input_len,
                   help=f"longest prompt in tokens (default: {defaults.max_input_len})")
    p.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens,
                   help=f"most tokens generated per prompt (default: {defaults.max_new_tokens})")
    p.add_argument("--max-batch-size", type=int, default=defaults.max_batch_size,
                   help=f"largest batch (default: {defaults.max_batch_size})")
    p.add_argument("--dtype", choices=EXPORT_DTYPES, default=defaults.dtype,
                   help="precision of the TensorRT engines, and of the torch backend on a GPU: float16 (default), "
                        "bfloat16, or float32 (TF32 off: matches ONNX Runtime token for token). The ONNX graphs and "
                        "ONNX Runtime are always fp32, and so is the torch backend on the CPU")
    p.add_argument("--attention-chunk", type=int, default=defaults.attention_chunk,
                   help=f"query block size of the prompt attention (default: {defaults.attention_chunk})")
    p.add_argument("--extend-chunk", type=int, default=defaults.extend_chunk,
                   help="most new tokens per sequence in one run of extend.onnx: a chunk of a chunked prefill, or a "
                        "question after a cached context (default: %(default)s). Chunks that are multiples of "
                        "--attention-chunk reproduce the one-shot prefill bitwise on ONNX Runtime")
    p.add_argument("--max-question-len", type=int, default=defaults.max_question_len,
                   help="most tokens of a question asked after a cached context (the serving context cache); every "
                        "slot's KV buffers keep room for them (default: %(default)s)")
    p.add_argument("--kv-dtype", choices=("float32", "float16"), default=defaults.kv_dtype,
                   help="element type of the ONNX Runtime decode KV buffers: float32 (default: the parity setting) or "
                        "float16 (half the KV memory: twice the sequences and cached contexts in one KV budget; logits "
                        "move by ~1e-2, docs/performance.md). Only the fused decode graph decode_ort.onnx reads them; "
                        "the TensorRT engines keep --dtype")
    p.add_argument("--weights", choices=WEIGHT_FORMATS, default=defaults.weights,
                   help="projection weights of the fused ONNX Runtime graphs (prefill_ort, extend_ort, decode_ort): fp32 "
                        "(default: the parity setting), int8 (DynamicQuantizeMatMul: int8 weights per output column, "
                        "activations quantized per tensor at run time; MLAS's VNNI/AMX int8 GEMMs) or int4 (MatMulNBits: "
                        "4-bit weights in blocks of 32, int8 compute, onnxruntime-genai's CPU default). The selection, "
                        "the KV cache, the embedding and the portable graphs stay float32; quality in "
                        "docs/performance.md section 5")
    p.add_argument("--force", action="store_true",
                   help="rebuild, replacing the engine at --output; anything there that is not an engine directory "
                   "(a file, other folders) is never replaced")
    p.add_argument("--backend", choices=("onnx", "torch"), default="onnx",
                   help="onnx (default): export the ONNX graphs (ONNX Runtime, and TensorRT engines where TensorRT runs); "
                        "torch: no export, a manifest naming the checkpoint for the torch backend (the model's own "
                        "layers with the selection op; CUDA graphs on a GPU, in --dtype there, float32 on the CPU). The "
                        "checkpoint must stay where it is: the engine loads it from there")
    p.add_argument("--skip-smoke-test", action="store_true",
                   help="do not run the smoke generation (ONNX Runtime, or the torch backend, against the PyTorch path)")
    p.add_argument("--skip-tensorrt", action="store_true", help="do not try to build TensorRT engines")
    p.add_argument("--context-policy", default=DEFAULT_CONTEXT_POLICY, metavar="NAME[:KNOB=VALUE...]",
                   help="the policy the serving context cache compresses a request's `context` with, before its "
                        f"question is known, at this engine's budget (default: {DEFAULT_CONTEXT_POLICY}: KVzip's score "
                        "predicted from the prefill by the model's surrogate, no re-read, CriticalKV's two stages in one "
                        "model-wide allocation, a head keeping at most 6x the budget; the bundled model's surrogate "
                        "ships, another model's comes from criticalkv train-surrogate; kvzip_score=reread re-reads the "
                        "context instead: results/README.md; 'engine' = --kv-policy itself). Its select graph is added, "
                        "and the re-read graph for a policy that re-reads contexts")
    KVPolicy.add_arguments(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from criticalkv.build import build_engine

    try:
        with sigterm_raises():
            policy = KVPolicy.from_args(args)
            config = BuildConfig(args.max_input_len, args.max_new_tokens, args.max_batch_size, args.dtype,
                                 args.attention_chunk, args.extend_chunk, args.max_question_len, args.kv_dtype,
                                 weights=args.weights)
            folder = build_engine(args.output, policy, config, model=args.model, force=args.force,
                                  smoke=not args.skip_smoke_test, tensorrt=not args.skip_tensorrt,
                                  backend=args.backend, context_policy=args.context_policy)
    except (ValueError, OSError) as err:
        print(f"build_engine: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("build_engine: interrupted; nothing was written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print("build_engine: terminated (SIGTERM); nothing was written", file=sys.stderr)
        return EXIT_TERMINATED
    from criticalkv.runtime.manifest import read_manifest

    return 3 if (read_manifest(folder, verify=False).get("tensorrt") or {}).get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
