"""The options of the model a server runs (``criticalkv serve``, Triton or the Ray replicas): its name, instances and
the scheduler's settings, checked against the engine's manifest before anything starts."""

from __future__ import annotations

import argparse

from criticalkv.commands.arguments import gpu_ids, nonnegative_float, nonnegative_int, positive_float, positive_int
from criticalkv.serving.context_cache import CONTEXT_CACHE_DTYPES, DEFAULT_CONTEXT_CACHE_DTYPE
from criticalkv.serving.repository import DEFAULT_MODEL_NAME, SERVED_BACKENDS
from criticalkv.serving.scheduler import DEFAULT_PREFILL_CHUNK, SchedulerConfig


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The model's arguments (what the repository's model runs with)."""
    p.add_argument("--model-name", default=DEFAULT_MODEL_NAME,
                   help=f"Triton model name (default: {DEFAULT_MODEL_NAME})")
    p.add_argument("--instances", type=positive_int, default=1,
                   help="model instances, each its own engine and scheduler (default: 1; "
                        "with --backend tensorrt: per GPU)")
    p.add_argument("--max-num-seqs", type=positive_int, default=None,
                   help="sequences decoding at once per instance (default and maximum: the engine's --max-batch-size)")
    p.add_argument("--kv-memory-mib", "--kv-pool-mib", dest="kv_memory_mib", type=positive_float, default=None,
                   help="one KV memory budget per instance, MiB: what running requests keep (+ their growth), prompts "
                        "under prefill (their full K/V), cached contexts and prefix blocks hold together (default: no "
                        "limit beyond --max-num-seqs); requests beyond it wait, prefix blocks then cached contexts are "
                        "evicted first")
    p.add_argument("--prefill-chunk", type=nonnegative_int, default=DEFAULT_PREFILL_CHUNK,
                   help="prefill prompts in chunks of at most this many tokens, one per step between the running "
                        f"requests' decode steps (default: {DEFAULT_PREFILL_CHUNK}, a multiple of the engine's "
                        "attention block: the same kept entries and tokens as one prefill; 0 = one prefill per prompt, "
                        "without the prefix cache)")
    p.add_argument("--context-cache-mib", type=nonnegative_float, default=256.0,
                   help="compressed contexts kept for reuse per instance, MiB (default: 256; 0 = none): a request's "
                        "`context` is compressed once and later questions about it skip its prefill")
    p.add_argument("--context-cache-dtype", choices=CONTEXT_CACHE_DTYPES, default=DEFAULT_CONTEXT_CACHE_DTYPE,
                   help=f"the element type cached contexts are stored in (default: {DEFAULT_CONTEXT_CACHE_DTYPE}): "
                        "float16 rounds the engine's float32 entries to float16 and widens them back when a question "
                        "reuses the context, so the cache (and --kv-memory-mib) holds twice the contexts; float32 "
                        "keeps them exact (docs/performance.md: parity and speed of both)")
    p.add_argument("--prefix-cache-mib", type=nonnegative_float, default=512.0,
                   help="plain prompts' uncompressed blocks kept for reuse per instance, MiB (default: 512; 0 = none): "
                        "a prompt that begins like an earlier one (the same document, a chat's earlier turns) prefills "
                        "only the rest, then selects over the whole prompt: the same answer as without the cache "
                        "(vLLM's automatic prefix caching)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache_mib", action="store_const", const=0.0,
                   help="serve without the prefix cache (= --prefix-cache-mib 0; vLLM's --no-enable-prefix-caching)")
    p.add_argument("--prefix-block", type=positive_int, default=16,
                   help="tokens per prefix-cache block (default: 16, vLLM's): a prompt reuses the longest run of whole "
                        "blocks an earlier prompt began with")
    p.add_argument("--context-policy", default=None, metavar="NAME",
                   help="the policy a request's `context` is compressed with, before any question is known (default: "
                        "the engine's context policy, built with scripts/build_engine.py --context-policy, which "
                        "defaults to layer-kvzip-criticalkv:kvzip_score=surrogate:head_cap_ratio=6; 'engine' = the engine's own "
                        "--kv-policy). "
                        "It must be one of the two the engine was built with (results/README.md, question-agnostic "
                        "quality, says why that one)")
    p.add_argument("--backend", choices=SERVED_BACKENDS, default=None,
                   help="onnxruntime (KIND_CPU, fp32: the parity path), openvino (KIND_CPU: the engine's openvino "
                        "graphs; the default of an exported engine where this CPU computes bf16 (AVX-512 BF16 or "
                        "AMX), where it serves fastest; else onnxruntime), tensorrt (KIND_GPU), or torch (the "
                        "checkpoint's own layers and the selection op; the default for an engine built with --backend "
                        "torch; needs torch and transformers in the model's Python: the bundled CPU server's model "
                        "environment reaches the project's, a Triton container needs them installed). "
                        "$CRITICALKV_SERVE_BACKEND sets the default; --write-repo and --replicas default to "
                        "onnxruntime for an exported engine")
    p.add_argument("--gpus", type=gpu_ids, default=None,
                   help="with --backend tensorrt (default: 0) or torch (default: none given, KIND_CPU, and torch picks "
                        "CUDA when it sees a GPU): comma-separated GPU ids, one instance per GPU")
    p.add_argument("--threads", type=nonnegative_int, default=0,
                   help="ONNX Runtime or OpenVINO (or, with --backend torch on the CPU, torch) threads per instance "
                        "(default: 0 = the library's choice)")


def prefix_cache_note(args: argparse.Namespace) -> str | None:
    """Why the engine of ``--engine-dir`` on ``--backend`` serves without the prefix cache asked for (None: it has one,
    or none was asked for): said before the server starts, so that no one expects a cached prefix's first token."""
    if getattr(args, "engine_dir", None) is None:
        return None
    from criticalkv.runtime.manifest import default_backend, read_manifest
    from criticalkv.serving.prefix_cache import off_reason

    manifest = read_manifest(args.engine_dir, verify=False)
    backend = getattr(args, "backend", None) or default_backend(manifest)
    extend = backend == "torch" or any(name.startswith("extend") for name in manifest.get("files", {}))
    chunked = args.prefill_chunk > 0 and int(manifest["build"].get("max_question_len", 0)) > 0 and extend
    return off_reason(backend, backend in ("onnxruntime", "openvino", "torch"), chunked, args.prefix_cache_mib)


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    """The scheduler options of ``add_model_arguments``, checked here against the engine's manifest (before any server
    starts: the model would refuse them only once loaded)."""
    if getattr(args, "engine_dir", None) is not None:
        from criticalkv.errors import EngineError
        from criticalkv.runtime.manifest import read_manifest
        from criticalkv.serving.scheduler import check_context_policy, check_max_num_seqs

        manifest = read_manifest(args.engine_dir, verify=False)
        try:
            check_max_num_seqs(args.max_num_seqs, int(manifest["build"]["max_batch_size"]))
        except EngineError as err:
            raise ValueError(f"--max-num-seqs: {err}") from None
        if args.context_policy is not None:
            built = (manifest.get("context_policy") or {}).get("name")
            try:
                check_context_policy(manifest["policy"]["name"], built, args.context_policy)
            except EngineError as err:  # a user error of this flag
                raise ValueError(f"--context-policy: {err}") from None
    return SchedulerConfig(max_num_seqs=args.max_num_seqs, kv_memory_mib=args.kv_memory_mib,
                           prefill_chunk=args.prefill_chunk, context_cache_mib=args.context_cache_mib,
                           context_policy=args.context_policy, prefix_cache_mib=args.prefix_cache_mib,
                           prefix_block=args.prefix_block, context_cache_dtype=args.context_cache_dtype)
