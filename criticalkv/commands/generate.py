"""``criticalkv generate``: generate from a long prompt with a compressed KV cache."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from criticalkv.chat import encode_context_question, encode_prompt
from criticalkv.commands.arguments import check_request, positive_int
from criticalkv.files import read_text_interruptibly
from criticalkv.methods import same_selection
from criticalkv.policy import KVPolicy, parse_policy_spec, policy_spec
from criticalkv.request import SamplingParams
from criticalkv.runtime import Engine
from criticalkv.runtime.manifest import default_backend, engine_limits, load_tokenizer, read_manifest
from criticalkv.runtime.registry import BACKENDS

DTYPES = ("float32", "bfloat16", "float16")

#: --max-tokens when not given (an engine's built maximum when that is smaller)
MAX_TOKENS = 64


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text after compressing the prompt's KV cache",
        description="Prefill the prompt, keep only the KV entries the policy selects, then decode. "
        "Runs the transformers model (PyTorch) by default, or a built engine directory with --engine-dir on ONNX "
        "Runtime, TensorRT or the torch backend (its policy and limits come from the engine's manifest).",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-file", type=Path, help="text file with the prompt")
    src.add_argument("--prompt", help="the prompt itself")
    src.add_argument("--context-file", type=Path,
                     help="text file with a context (a document) to compress without the question, then ask "
                          "--question about it (what the server's context cache does)")
    src.add_argument("--context", help="the context itself (see --context-file)")
    p.add_argument("--question", help="with --context-file/--context: the question asked after the compressed context")
    p.add_argument("--model", help="HF folder or .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--engine-dir", type=Path,
                   help="run an engine built by scripts/build_engine.py (ONNX Runtime or TensorRT) instead of PyTorch")
    p.add_argument("--backend", choices=tuple(BACKENDS), default=None,
                   help="with --engine-dir only: ONNX Runtime (CPU; the default for an exported engine), the TensorRT "
                        "engines (GPU, CUDA graphs), torch (the checkpoint's own layers with the selection op: CUDA "
                        "graphs on a GPU, else the CPU; the default for an engine built with --backend torch), or "
                        "openvino (CPU, the engine's openvino graphs at the CPU's default precision: bf16 where it has "
                        "it; pip install 'criticalkv[openvino]')")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as the user turn of the model's chat template")
    p.add_argument("--max-tokens", "--max-new-tokens", dest="max_new_tokens", type=positive_int, default=None,
                   help=f"tokens to generate at most (default: {MAX_TOKENS}, or an engine's built maximum when that "
                        "is smaller)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="model dtype of the PyTorch path (default: float32; not with --engine-dir, whose dtype is "
                        "fixed when it is built)")
    p.add_argument("--device", default=None,
                   help="torch device of the PyTorch path, e.g. cpu, cuda, cuda:1 "
                        "(default: cpu; not with --engine-dir)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    KVPolicy.add_arguments(p, optional=True)
    p.set_defaults(func=run)


def read_text(text: str | None, path: Path | None, what: str) -> str:
    flag = f"--{what}-file"
    if text is None:
        if path.is_dir():
            raise ValueError(f"{flag} {path}: is a directory, not a text file")
        if not path.exists():
            raise FileNotFoundError(f"{flag} {path}: no such {what} file")
        try:
            text = read_text_interruptibly(path)  # a FIFO or a terminal: Ctrl-C ends the wait at any moment
        except UnicodeDecodeError as err:
            raise ValueError(f"{flag} {path}: not UTF-8 text (byte {err.start}: {err.reason}); "
                             "give a text file") from None
    if not text.strip():
        raise ValueError(f"the {what} is empty")
    return text


def read_prompt(args) -> str:
    return read_text(args.prompt, args.prompt_file, "prompt")


def read_inputs(args) -> tuple[str, str | None]:
    """(prompt, None), or (context, question) with --context/--context-file and --question: read before the model
    loads, so a missing file fails at once."""
    has_context = args.context is not None or args.context_file is not None
    if has_context != (args.question is not None):
        raise ValueError("--question goes with --context or --context-file (and they need a --question)")
    if not has_context:
        return read_prompt(args), None
    if not args.question.strip():
        raise ValueError("the question is empty")
    return read_text(args.context, args.context_file, "context"), args.question


def encode_inputs(tokenizer, inputs: tuple[str, str | None], chat: bool) -> tuple[list[int], list[int] | None]:
    """(prompt ids, None) or (context ids, question ids)."""
    text, question = inputs
    if question is None:
        return encode_prompt(tokenizer, text, chat), None
    return encode_context_question(tokenizer, text, question, chat)


def kept_whole(policy: KVPolicy, prompt_len: int) -> bool:
    """Whether a prompt of ``prompt_len`` tokens keeps its whole KV cache: under ``full``, or when it fits
    in the budget (``select_layer`` keeps such a sequence whole; shorter than the window included)."""
    return policy.name == "full" or prompt_len <= policy.budget


def report(args, policy: KVPolicy, tokenizer, prompt_len: int, tokens: list[int], timings: dict, kv_full: int, kv_kept: int,
           backend: str, question_len: int | None = None) -> None:
    """Print the answer (or one JSON object). ``prompt_len``: the tokens compressed (the context when a question
    follows it); ``question_len``: the question's tokens asked after the compressed context."""
    stops = set(args.stop_ids)
    text = tokenizer.decode([t for t in tokens if t not in stops], skip_special_tokens=True)
    if policy.name != "full" and kept_whole(policy, prompt_len):
        print(f"[criticalkv] the prompt ({prompt_len} tokens) fits in the budget ({policy.budget}): "
              "its KV cache is kept whole, nothing is evicted", file=sys.stderr)
    if args.json:
        print(json.dumps({
            "text": text,
            "token_ids": tokens,
            "prompt_tokens": prompt_len,
            **({} if question_len is None else {"question_tokens": question_len}),
            "new_tokens": len(tokens),
            "backend": backend,
            "model": args.model or "smollm2-135m",
            "policy": policy.to_dict(),
            "timings": timings,
            "kv_bytes": {"full": kv_full, "kept": kv_kept, "kept_fraction": kv_kept / kv_full if kv_full else 1.0},
            "kept_whole": kept_whole(policy, prompt_len),
        }))
    else:
        print(f"\n[criticalkv] {backend} | prompt {prompt_len} tokens | KV kept {kv_kept / 2**20:.2f} of "
              f"{kv_full / 2**20:.2f} MiB | prefill {timings['prefill_s']:.2f} s ({_selection(timings['selection_s'])})"
              f" | decode {1000 * timings['decode_s_per_token']:.1f} ms/token", file=sys.stderr)


def _selection(seconds: float | None) -> str:
    """The selection's time, or why there is none (TensorRT runs the plugin inside the engine, timed as prefill)."""
    return "selection not timed apart" if seconds is None else f"selection {seconds:.3f} s"


def engine_policy(args, built: KVPolicy) -> tuple[KVPolicy, int | None]:
    """The engine's policy and the request's budget. ``--kv-policy`` and ``--window``, when given, must name the built
    policy; ``--budget`` is this request's ``kv_budget``, in the engine's per-request range [min_budget, built budget]
    (the selection inside the prefill takes it as an input)."""
    if args.kv_policy is not None:
        asked = parse_policy_spec(args.kv_policy, built, "--kv-policy")
        if not same_selection(asked.replace(budget=built.budget, window=built.window), built):
            raise ValueError(f"--kv-policy {args.kv_policy} differs from the engine's policy ({policy_spec(built)}); the "
                             "policy is built into the engine: rebuild it with scripts/build_engine.py to change it")
    if args.window is not None and args.window != built.window:
        raise ValueError(f"--window {args.window} differs from the engine's policy (window = {built.window}); the "
                         "window is built into the engine: rebuild it with scripts/build_engine.py to change it")
    kv_budget = None
    if args.budget is not None and args.budget != built.budget:
        if not built.method.base.evicts:
            raise ValueError(f"--budget {args.budget}: the engine's policy {built.name} keeps every entry (no budget)")
        try:
            kv_budget = built.request_budget(args.budget)
        except ValueError:
            raise ValueError(
                f"--budget {args.budget} differs from the engine's policy (budget = {built.budget}), and this engine "
                f"serves per-request budgets in [{built.min_budget}, {built.budget}] only (--budget must lie there); "
                "to keep more, rebuild it with scripts/build_engine.py --budget") from None
    return (built if kv_budget is None else built.with_budget(kv_budget)), kv_budget


def run_engine(args) -> int:
    """``--engine-dir``: the engine runtime (criticalkv.runtime) on ONNX Runtime or TensorRT."""
    for flag, value, why in (
        ("--model", args.model, "the engine directory holds its model"),
        ("--dtype", args.dtype, "the engine's dtype is fixed when it is built (build_engine.py --dtype)"),
        ("--device", args.device, "the backend chooses the device (--backend)"),
    ):
        if value is not None:
            raise ValueError(f"{flag} and --engine-dir exclude each other: {why}")
    manifest = read_manifest(args.engine_dir, verify=False)
    if args.backend == "tensorrt":  # an engine directory without TensorRT engines says so before anything is read
        from criticalkv.runtime.tensorrt_backend import engine_files
        engine_files(args.engine_dir, manifest)
    if args.max_new_tokens is None:  # the default, within what the engine was built for
        args.max_new_tokens = min(MAX_TOKENS, engine_limits(manifest).max_new_tokens)
    sampling = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                              seed=args.seed)
    # everything is checked before the engine loads (its weights and sessions: seconds and gigabytes): the policy
    # flags and --max-tokens against the manifest (read in milliseconds), the prompt's length with the engine's
    # tokenizer (a fraction of a second)
    _, kv_budget = engine_policy(args, KVPolicy.from_dict(manifest["policy"]))
    check_request(manifest, sampling)  # --max-tokens before the tokenizer's import
    inputs = read_inputs(args)
    tokenizer = load_tokenizer(args.engine_dir)
    ids, question = encode_inputs(tokenizer, inputs, args.chat)
    check_request(manifest, sampling, question if question is not None else ids,
                  ids if question is not None else None, kv_budget)
    # profile=True: ONNX Runtime profiles the prefill run, which gives the selection nodes' time
    # (TensorRT reports selection_s as null: the plugin runs inside the engine, timed as part of prefill)
    args.backend = args.backend or default_backend(manifest)
    options = {"profile": True} if args.backend == "onnxruntime" else {}
    engine = Engine.load(args.engine_dir, backend=args.backend, **options)
    try:
        policy, kv_budget = engine_policy(args, engine.policy)
        args.stop_ids = engine.eos_token_ids
        args.model = engine.manifest["model"]["name"]
        stream = None if args.json else _streamer(tokenizer, args.stop_ids)
        out = engine.generate([ids], args.max_new_tokens, sampling=sampling, stop_token_ids=args.stop_ids,
                              on_tokens=stream, kv_budget=kv_budget, questions=None if question is None else [question])
        if question is not None and engine.context_policy is not None:  # the context went to the context policy
            policy = engine.context_policy.replace(budget=max(policy.budget, engine.context_policy.min_budget))
    finally:
        engine.close()
    report(args, policy, tokenizer, len(ids), out.tokens[0], out.timings(), out.kv_bytes_full, out.kv_bytes_kept,
           engine.backend.name, None if question is None else len(question))
    if not args.json:
        print()
    return 0


def _streamer(tokenizer, stop_ids):
    """A streaming callback printing the first sequence's new text as tokens arrive."""
    printed = ""
    generated: list[int] = []

    def stream(step_tokens):
        nonlocal printed
        generated.append(int(step_tokens[0]))
        now = tokenizer.decode([t for t in generated if t not in stop_ids], skip_special_tokens=True)
        sys.stdout.write(now[len(printed):])
        sys.stdout.flush()
        printed = now

    return stream


def torch_device(name: str):
    """``torch.device(name)`` after checking that this torch can use it (one-line error otherwise)."""
    import torch  # the PyTorch path only (see run)

    try:
        device = torch.device(name)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"--device {name}: not usable with this torch {torch.__version__} ({reason})") from None
    return device


def run(args) -> int:
    if args.engine_dir is not None:
        return run_engine(args)
    if args.backend is not None:
        raise ValueError(f"--backend {args.backend}: only with --engine-dir (without it generate runs the PyTorch "
                         "model; build an engine with scripts/build_engine.py)")
    policy = KVPolicy.from_args(args)
    if args.max_new_tokens is None:
        args.max_new_tokens = MAX_TOKENS
    sampling = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                              seed=args.seed)
    inputs = read_inputs(args)  # before torch's seconds of imports: a prompt from a pipe is read at once
    # the PyTorch path's imports load torch (seconds): only this path pays them, after the prompt is read, so the
    # command line starts (and takes Ctrl-C) at once and --engine-dir never loads torch
    import torch

    from criticalkv.hf import generate, load_model
    from criticalkv.hf.loading import stop_token_ids

    args.dtype = args.dtype or "float32"
    args.device = torch_device(args.device or "cpu")
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype))
    model.to(args.device)
    ids, question = encode_inputs(tokenizer, inputs, args.chat)
    args.stop_ids = stop_token_ids(tokenizer, model)
    out = generate(
        model, torch.tensor([ids], device=args.device), policy, args.max_new_tokens,
        stop_token_ids=args.stop_ids, sampling=sampling, on_tokens=None if args.json else _streamer(tokenizer, args.stop_ids),
        question_ids=None if question is None else torch.tensor([question], device=args.device),
    )
    report(args, policy, tokenizer, len(ids), out.tokens[0], out.timings(), out.kv_bytes_full, out.kv_bytes_kept, "pytorch",
           None if question is None else len(question))
    if not args.json:
        print()
    return 0
