"""``criticalkv triton-repo``: render a Triton model repository for a built engine directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from criticalkv.serving import launcher
from criticalkv.serving.repository import DEFAULT_MODEL_NAME, make_repository
from criticalkv.serving.scheduler import SchedulerConfig


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The model's arguments, shared by ``triton-repo`` and ``serve``."""
    p.add_argument("--model-name", default=DEFAULT_MODEL_NAME,
                   help=f"Triton model name (default: {DEFAULT_MODEL_NAME})")
    p.add_argument("--instances", type=int, default=1,
                   help="model instances, each its own engine and scheduler (default: 1; "
                        "with --backend tensorrt: per GPU)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="sequences decoding at once per instance (default and maximum: the engine's --max-batch-size)")
    p.add_argument("--kv-memory-mib", "--kv-pool-mib", dest="kv_memory_mib", type=float, default=None,
                   help="one KV memory budget per instance, MiB: what running requests keep (+ their growth), prompts "
                        "under prefill (their full K/V) and cached contexts hold together (default: no limit beyond "
                        "--max-num-seqs); requests beyond it wait, cached contexts are evicted first")
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="prefill long prompts in chunks of this many tokens, interleaved with the running requests' "
                        "decode steps (default: 512, a multiple of the engine's attention block: the same kept entries "
                        "and tokens as one prefill; 0 = one prefill per prompt)")
    p.add_argument("--context-cache-mib", type=float, default=256.0,
                   help="compressed contexts kept for reuse per instance, MiB (default: 256; 0 = none): a request's "
                        "`context` is compressed once and later questions about it skip its prefill")
    p.add_argument("--context-policy", default=None, metavar="NAME",
                   help="the policy a request's `context` is compressed with, before any question is known (default: "
                        "the engine's context policy, built with scripts/build_engine.py --context-policy, which "
                        "defaults to layer-kvzip-criticalkv:kvzip_score=surrogate:head_cap_ratio=6; 'engine' = the engine's own "
                        "--kv-policy). "
                        "It must be one of the two the engine was built with (results/README.md, question-agnostic "
                        "quality, says why that one)")
    p.add_argument("--backend", choices=("onnxruntime", "tensorrt", "torch", "openvino"), default=None,
                   help="onnxruntime (KIND_CPU; the default for an exported engine), openvino (KIND_CPU: the engine's "
                        "openvino graphs), tensorrt (KIND_GPU), or torch (the "
                        "checkpoint's own layers and the selection op; the default for an engine built with --backend "
                        "torch; needs torch and transformers in the model's Python: the bundled CPU server's model "
                        "environment reaches the project's, a Triton container needs them installed)")
    p.add_argument("--gpus", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="with --backend tensorrt (default: 0) or torch (default: none given, KIND_CPU, and torch picks "
                        "CUDA when it sees a GPU): comma-separated GPU ids, one instance per GPU")
    p.add_argument("--threads", type=int, default=0,
                   help="ONNX Runtime (or, with --backend torch on the CPU, torch) threads per instance "
                        "(default: 0 = the library's choice)")


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    """The scheduler options of ``add_model_arguments`` (checked here, before any server starts)."""
    if args.context_policy is not None and getattr(args, "engine_dir", None) is not None:
        from criticalkv.runtime.manifest import read_manifest
        from criticalkv.serving.scheduler import check_context_policy

        manifest = read_manifest(args.engine_dir, verify=False)
        built = (manifest.get("context_policy") or {}).get("name")
        try:
            check_context_policy(manifest["policy"]["name"], built, args.context_policy)
        except Exception as err:  # EngineError: a user error of this flag
            raise ValueError(f"--context-policy: {err}") from None
    return SchedulerConfig(max_num_seqs=args.max_num_seqs, kv_memory_mib=args.kv_memory_mib,
                           prefill_chunk=args.prefill_chunk, context_cache_mib=args.context_cache_mib,
                           context_policy=args.context_policy)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "triton-repo",
        help="render a Triton model repository for an engine directory",
        description="Write REPO/NAME/config.pbtxt (decoupled Python-backend model, vllm_backend's inputs and outputs "
        "+ kv_budget and KV bytes), REPO/NAME/1/model.py (the adapter over the continuous-batching scheduler) and "
        "REPO/NAME/1/model.json (the engine arguments). `criticalkv serve` does this itself when given no --repo.",
    )
    p.add_argument("--engine-dir", type=Path, required=True, help="engine directory built by scripts/build_engine.py")
    p.add_argument("--out", type=Path, required=True, help="model repository folder to write into")
    add_model_arguments(p)
    p.add_argument("--execution-env", default="auto",
                   help="virtual environment the model runs in (EXECUTION_ENV_PATH): 'auto' = the one "
                        "`criticalkv serve --setup` made for the bundled CPU server, 'none' = the server's own Python")
    p.add_argument("--force", action="store_true", help="replace REPO/NAME if it exists")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    auto = launcher.model_env()  # None with an external server ($CRITICALKV_TRITONSERVER): its own Python
    env = {"auto": str(auto) if auto else None, "none": None}.get(args.execution_env, args.execution_env)
    paths = launcher.project_paths() if args.execution_env != "none" else []
    target = make_repository(args.engine_dir, args.out, model_name=args.model_name, instances=args.instances,
                             scheduler=scheduler_config(args), backend=args.backend,
                             gpus=args.gpus, threads=args.threads, execution_env=env, python_paths=paths,
                             force=args.force)
    print(f"model repository written: {target}")
    return 0
