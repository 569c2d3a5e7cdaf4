"""``build_engine``: export, validate, smoke-test on ONNX Runtime, (TensorRT when present), manifest.

Everything is written into a temporary directory next to the output (named with the builder's process
id) and renamed into place at the end, so a failed or interrupted build never leaves a half-written
engine directory behind; what a killed build left is removed by the next build of the same output,
which holds a lock on it (``build_lock``) so that two builds never write one output at once.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import shutil
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

import criticalkv.tensorrt as trt_engine
from criticalkv.export.exporter import (
    DECODE_FILE,
    TOKENIZER_DIR,
    EXTEND_TENSORRT_FILE,
    PREFILL_TENSORRT_FILE,
    SELECT_TENSORRT_FILE,
    BuildConfig,
    ExportResult,
    export_model,
    DEFAULT_CONTEXT_POLICY,
    onnx_info,
)
from criticalkv.export.model_select import tensorrt_refusal
from criticalkv.export.validate import validate_export
from criticalkv.files import remove_stale_temporaries, temporary_dir
from criticalkv.hf import generate, load_model, resolve_model
from criticalkv.hf.loading import stop_token_ids
from criticalkv.methods import SURROGATE_FALLBACK
from criticalkv.policy import SCHEMA_VERSION, KVPolicy, parse_policy_spec, policy_spec
from criticalkv.runtime import Engine, create_backend
from criticalkv.runtime.manifest import FORMAT as MANIFEST_FORMAT
from criticalkv.runtime.manifest import FORMAT_VERSION, MANIFEST_FILE, EngineError, write_manifest

SMOKE_TEXT = (
    "The lighthouse keeper wrote in his log every evening: the wind, the colour of the sea, the ships that "
    "passed and the birds that rested on the rail. Years later his grandson read the pages aloud. "
)


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "platform": platform.platform()}
    for dist in ("criticalkv", "torch", "transformers", "onnx", "onnxruntime", "numpy", "polygraphy", "tensorrt"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return versions


#: What ``build_engine`` writes: ``onnx`` (the ONNX graphs for ONNX Runtime, and TensorRT engines where TensorRT runs)
#: or ``torch`` (a manifest naming the checkpoint, for the torch backend: no export)
BUILD_BACKENDS = ("onnx", "torch")


def context_policy_for(policy: KVPolicy, name: str | None = DEFAULT_CONTEXT_POLICY) -> KVPolicy | None:
    """The context policy of an engine built with ``policy``: ``name`` (or ``name:knob=value...``) at the engine's budget
    and window (other knobs at their defaults), or None (contexts selected by ``policy`` itself) for ``name`` None or "engine", or when
    ``policy`` keeps every entry (``full``: the lossless context cache)."""
    if name in (None, "engine") or not policy.method.base.evicts:
        return None
    try:  # a name, or a spec with knobs (``kvzip:kvzip_reread=chunk:kvzip_chunk=512``)
        context = parse_policy_spec(name, KVPolicy(budget=policy.budget, window=policy.window), "--context-policy")
    except ValueError as err:
        raise ValueError(err if str(err).startswith("--context-policy") else f"--context-policy {name}: {err}") from None
    return None if context == policy else context


def build_request(model_name: str, model_path: str, policy: KVPolicy, config: BuildConfig,
                  backend: str = "onnx", context_policy: KVPolicy | None = None) -> dict[str, Any]:
    """What identifies a build: an existing engine with the same request is up to date."""
    request = {"model": {"name": model_name, "path": model_path}, "policy": policy.to_dict(), "build": config.to_dict(),
               "format_version": FORMAT_VERSION, "criticalkv": package_versions().get("criticalkv")}
    if backend != "onnx":  # the ONNX builds' requests stay what they were (their engines are up to date)
        request["backend"] = backend
    if context_policy is not None:
        request["context_policy"] = context_policy.to_dict()
    return request


def existing_manifest(output: Path) -> dict[str, Any] | None:
    """The criticalkv manifest in ``output`` (None when there is none, or it is not one of ours)."""
    try:
        manifest = json.loads((output / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == MANIFEST_FORMAT else None


def _describe(entries: list[str], most: int = 5) -> str:
    shown = ", ".join(sorted(entries)[:most])
    return shown + (f" and {len(entries) - most} more" if len(entries) > most else "")


def check_replaceable(output: Path, request: dict[str, Any], force: bool) -> bool:
    """Whether to build into ``output``: False when it already holds this request's engine.

    Only an empty directory or one holding a criticalkv engine manifest is ever replaced (the latter
    only with ``force`` when it was built differently); anything else (a file, a directory of other
    things, a directory whose manifest is not an engine's) is refused, ``force`` or not.
    """
    if not output.exists() and not output.is_symlink():
        return True
    if output.is_symlink() or not output.is_dir():
        kind = "a symbolic link" if output.is_symlink() else "a file"
        raise EngineError(f"{output} is {kind}, not an engine directory; refusing to replace it "
                          "(choose another --output, or remove it yourself)")
    entries = [p.name for p in output.iterdir()]
    if not entries:
        return True
    manifest = existing_manifest(output)
    if manifest is None:
        raise EngineError(f"{output} is not an engine directory (no criticalkv {MANIFEST_FILE}; it holds "
                          f"{_describe(entries)}); refusing to replace it, even with --force "
                          "(choose another --output, or remove it yourself)")
    if not force and manifest.get("request") == request:
        return False
    if not force:
        raise EngineError(f"{output} holds an engine built differently (another model, policy or limits); "
                          "pass --force to replace it")
    return True


def check_compresses(policy: KVPolicy, config: BuildConfig) -> None:
    """Refuse an engine that would never evict anything: with ``budget >= max_input_len`` every prompt it
    accepts fits in the budget and is kept whole, so it is a full-cache engine that carries the selection."""
    if policy.name != "full" and policy.budget >= config.max_input_len:
        raise ValueError(
            f"budget {policy.budget} >= --max-input-len {config.max_input_len}: every prompt this engine accepts "
            f"would be kept whole, nothing ever evicted; use a budget below {config.max_input_len}, a larger "
            "--max-input-len, or --kv-policy full for a full-cache engine"
        )


def smoke_test(
    folder: Path, manifest: dict[str, Any], model, tokenizer, policy: KVPolicy, config: BuildConfig,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Generate a few greedy tokens on ONNX Runtime from a prompt long enough to be compressed, and the
    same with the PyTorch path; record whether tokens and kept indices agree."""
    n = min(config.max_input_len, policy.budget + 64 if policy.name != "full" else 96)
    ids = list(tokenizer(SMOKE_TEXT * (n // 20 + 2))["input_ids"][:n])
    vocab = manifest["model"]["spec"]["vocab_size"]
    ids += [(7919 * i + 11) % vocab for i in range(n - len(ids))]  # a tokenizer that drops unknown text
    new = min(8, config.max_new_tokens)
    engine = Engine(folder, manifest, create_backend("onnxruntime", folder, manifest))  # the manifest is written last
    try:
        got = engine.generate([ids], max_new_tokens=new, stop_token_ids=[])
    finally:
        engine.close()
    ref = generate(model, torch.tensor([ids]), policy, max_new_tokens=new)
    same_indices = all(
        got.kept(layer, 0, h) == [i for i in sel.indices[0, h].tolist() if i >= 0]
        for layer, sel in enumerate(ref.prefill.selections)
        for h in range(sel.indices.shape[1])
    )
    result = {
        "prompt_tokens": len(ids),
        "new_tokens": len(got.tokens[0]),
        "token_ids": got.tokens[0],
        "pytorch_token_ids": ref.tokens[0],
        "tokens_match_pytorch": got.tokens[0] == ref.tokens[0],
        "kept_indices_match_pytorch": same_indices,
        "prefill_s": round(got.prefill_s, 4),
        "decode_s_per_token": round(got.decode_s_per_token, 5),
        "kv_kept_fraction": got.kv_bytes_kept / got.kv_bytes_full,
    }
    status = "matches" if result["tokens_match_pytorch"] and same_indices else "DIFFERS FROM"
    log(f"smoke test: {len(ids)}-token prompt, {result['new_tokens']} tokens on ONNX Runtime; {status} the PyTorch path "
        f"(tokens {result['tokens_match_pytorch']}, kept indices {same_indices})")
    return result


def tensorrt_step(folder: Path, result: ExportResult, log: Callable[[str], None]) -> dict[str, Any]:
    """Build the TensorRT engines when criticalkv.tensorrt, TensorRT, a GPU and the plugin are all present.

    Never fails the build: a missing part is recorded as ``skipped_reason``; a TensorRT failure (the parser
    rejecting a graph, the builder failing, the plugin not loading) is printed and recorded as ``failed`` with
    its ``error``, ``tensorrt/`` is removed, and the ONNX Runtime engine directory is still written.
    ``scripts/build_engine.py`` then exits 3 (the rule is in its ``--help``).
    """
    if not (folder / PREFILL_TENSORRT_FILE).exists():  # the export refused the TensorRT flavour: it says why
        return _skipped(tensorrt_refusal(result.policy, result.spec.num_layers) or "the export wrote no TensorRT "
                        "flavour", log)
    reason = trt_engine.tensorrt_unavailable_reason()
    if reason:  # without TensorRT installed (a CPU machine) one line: nothing there to act on
        return _skipped(reason, log, detail=trt_engine.tensorrt_installed())
    plugin = trt_engine.find_plugin_library(required=False)
    if plugin is None:
        return _skipped("the CriticalKVSelect plugin library is not built (run `bash scripts/build_plugin.sh`)", log)
    config = result.config
    # extend and select (chunked prefill, the context cache) when the export wrote their TensorRT flavours
    chunked = (folder / EXTEND_TENSORRT_FILE).exists() and (folder / SELECT_TENSORRT_FILE).exists()
    log(f"building TensorRT engines ({config.dtype}) with {plugin} ...")
    try:
        built = trt_engine.build_tensorrt_engines(
            folder / PREFILL_TENSORRT_FILE, folder / DECODE_FILE, folder / "tensorrt", plugin_library=plugin,
            max_batch=config.max_batch_size, max_input_len=config.max_input_len,
            max_capacity=max(result.prefill_capacities), dtype=config.dtype,
            strongly_typed=config.dtype == "float32",  # the graphs are fp32: fp16/bf16 are builder precision flags
            onnx_extend_path=folder / EXTEND_TENSORRT_FILE if chunked else None,
            onnx_select_path=folder / SELECT_TENSORRT_FILE if chunked else None,
            extend_chunk=config.extend_chunk, window=result.policy.window,
            # an extend runs over a slot's decode buffers or over a prompt's prefill buffer (at most max_input_len)
            extend_capacities=[max(c, config.max_input_len) for c in result.decode_capacities],
        )
    except Exception as err:  # noqa: BLE001: any TensorRT failure leaves the ONNX Runtime engine intact
        shutil.rmtree(folder / "tensorrt", ignore_errors=True)
        error = f"{type(err).__name__}: {err}"
        log(f"TensorRT engines: FAILED ({error}). The ONNX Runtime engine is complete; the error is recorded in "
            f"{MANIFEST_FILE} (tensorrt.error)")
        return {"built": False, "failed": True, "error": error}
    return built.manifest_entry(folder)  # paths relative to the engine directory: they move with it


def _skipped(reason: str, log: Callable[[str], None], detail: bool = True) -> dict[str, Any]:
    """``detail``: say which graphs a GPU machine's TensorRT build takes (for a user who has TensorRT; a CPU build
    without it gets the one line)."""
    if not detail:
        log(f"TensorRT engines: SKIPPED because {reason}; the ONNX Runtime engine is complete (GPU: docs/gpu.md)")
    else:
        log(f"TensorRT engines: SKIPPED because {reason}. The ONNX Runtime engine is complete; "
            f"{PREFILL_TENSORRT_FILE}, {EXTEND_TENSORRT_FILE}, {SELECT_TENSORRT_FILE} (when written) and {DECODE_FILE} are "
            "the inputs of criticalkv.tensorrt.build_tensorrt_engines on a GPU machine.")
    return {"built": False, "skipped_reason": reason}


def export_engine(
    model, policy: KVPolicy, folder: Path, config: BuildConfig, tokenizer=None, model_name: str = "custom",
    model_path: str = "", validate: bool = True, context_policy: KVPolicy | None = None,
) -> tuple[ExportResult, dict[str, Any]]:
    """Export ``model`` into ``folder`` and validate it; returns the export and the manifest content
    (``write_manifest(folder, content)`` completes an engine directory). ``context_policy``: the policy contexts are
    compressed with (``export_model``); the manifest records it, and what the policies' methods need beyond their
    layers (``criticalkv.methods.phases``): their data (``method_data``, e.g. kvzip's repeat prompt in the tokenizer's
    ids) and the streams the extend graphs return (``streams``: name -> where it came from)."""
    result = export_model(model, policy, folder, config, tokenizer, context_policy)
    validation = validate_export(result) if validate else None
    content = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": {"name": model_name, "path": model_path, "model_type": result.spec.model_type,
                  "spec": result.spec.to_dict()},
        "policy": policy.to_dict(),
        "policy_schema_version": SCHEMA_VERSION,
        "build": config.to_dict(),
        "shapes": result.shapes(),
        "onnx": {**_onnx_files(folder), "validation": validation, "fused_decode": result.fused_decode,
                 "fused_prompt": result.fused_prompt, "weights": result.weights, "openvino": result.openvino},
        "generation": {"eos_token_ids": stop_token_ids(tokenizer, model) if tokenizer is not None else [],
                       "chat_template": bool(getattr(tokenizer, "chat_template", None))},
        "versions": package_versions(),
    }
    if result.context_policy is not None:
        content["context_policy"] = result.context_policy.to_dict()
    content.update(phases_content(result.phases))
    return result, content


def phases_content(phases) -> dict[str, Any]:
    """The manifest's record of an engine's method phases (``criticalkv.methods.phases.BuildPhases``): the methods'
    data by key and the streams (their weights are in the engine: ``weights.bin``), when there are any."""
    content: dict[str, Any] = {}
    if phases.data_key:
        content["method_data"] = {phases.data_key: phases.data}
    if phases.streams:
        content["streams"] = {s.name: s.info for s in phases.streams}
    return content


def _onnx_files(folder: Path) -> dict[str, Any]:
    """``onnx_info()`` with only the graphs written (a model-level policy has no TensorRT flavour)."""
    info = onnx_info()
    info["files"] = {k: v for k, v in info["files"].items() if (Path(folder) / v).exists()}
    return info


@contextmanager
def build_lock(output: Path) -> Iterator[None]:
    """Hold an exclusive lock on building ``output`` (``fcntl.flock`` on ``.NAME.lock`` beside it); a second
    build of the same output fails at once, naming the process that holds it. The lock file is removed on
    release (one left by a killed process is simply locked again: flock dies with its holder)."""
    path = output.parent / f".{output.name}.lock"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise EngineError(f"{output} is being built by another process (pid {holder}, lock {path}); wait for it "
                              "to finish, or choose another --output") from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:  # the previous holder removed it after we opened it: lock the new one
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


def build_engine(
    output: str | Path,
    policy: KVPolicy,
    config: BuildConfig | None = None,
    model: str | None = None,
    force: bool = False,
    smoke: bool = True,
    tensorrt: bool = True,
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True),
    backend: str = "onnx",
    context_policy: str | None = DEFAULT_CONTEXT_POLICY,
) -> Path:
    """Build an engine directory for ``model`` (default: the bundled SmolLM2-135M-Instruct) and ``policy``.

    ``backend``: ``onnx`` exports the graphs (ONNX Runtime, TensorRT); ``torch`` writes a manifest that names the
    checkpoint, for the torch backend (``build_torch_engine``: no export, no TensorRT).
    ``context_policy``: the name of the policy the serving context cache compresses contexts with (at the engine's
    budget: ``context_policy_for``; None or "engine": ``policy`` itself; a ``full`` engine keeps contexts whole). The
    torch backend has no separate context policy: its contexts are selected with ``policy``.

    An existing engine built from the same request is left as it is (``force`` rebuilds); one built
    from a different request is an error unless ``force``. Anything at ``output`` that is not an engine
    directory (or an empty one) is never replaced: see ``check_replaceable``.
    """
    config = config or BuildConfig()
    if backend not in BUILD_BACKENDS:
        raise ValueError(f"backend: {backend!r} is not one of {', '.join(BUILD_BACKENDS)}")
    check_compresses(policy, config)
    output = Path(output)
    model_name = model or "smollm2-135m"
    model_path = str(resolve_model(model))
    check_exportable_model(model_path)
    context = context_policy_for(policy, context_policy)
    # the default context policy may need a stand-in (a model without a KVzip surrogate); a policy that keeps every
    # entry (``full``) has no context policy to stand in for
    default_context = context is not None and context_policy == DEFAULT_CONTEXT_POLICY
    request = build_request(model_name, model_path, policy, config, backend, context)
    output.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(output):
        for kind in ("building", "old"):
            remove_stale_temporaries(output.parent, f".{output.name}.{kind}-", log)
        if not check_replaceable(output, request, force):
            log(f"{output} is already built for this model, policy and limits (use --force to rebuild)")
            return output
        if backend == "torch":
            return _build_torch(output, policy, config, model_name, model_path, request, smoke, log, context,
                                default_context=default_context)
        return _build(output, policy, config, model, model_name, model_path, request, smoke, tensorrt, log, context,
                      default_context=default_context)


def check_exportable_model(model_path: str) -> None:
    """Refuse a model the export cannot write graphs for from its config alone, before loading its weights."""
    from transformers import AutoConfig

    from criticalkv.hf.loading import check_supported

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    check_supported(AutoConfig.from_pretrained(model_path))


def _swap_in(tmp: Path, output: Path) -> None:
    """Rename the finished ``tmp`` into ``output`` (``--force``: the old directory is dropped after the swap)."""
    if output.exists():
        old = temporary_dir(output.parent, f".{output.name}.old-")
        output.rename(old / "engine")
        tmp.rename(output)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(output)


def _build(output: Path, policy: KVPolicy, config: BuildConfig, model: str | None, model_name: str, model_path: str,
           request: dict[str, Any], smoke: bool, tensorrt: bool, log: Callable[[str], None],
           context_policy: KVPolicy | None = None, default_context: bool = False) -> Path:
    tmp = temporary_dir(output.parent, f".{output.name}.building-")
    try:
        start = time.perf_counter()
        log(f"loading {model_name} ...")
        hf_model, tokenizer = load_model(model)
        if default_context:
            context_policy = _default_context_for(hf_model, policy, context_policy, model_name, model_path, log)
        log(f"exporting {hf_model.config.model_type} ({hf_model.config.num_hidden_layers} layers) with policy "
            f"{policy.name} (budget {policy.budget}) to ONNX, then validating (onnx.checker full check, strict "
            "shape inference, node attributes) ...")
        if context_policy is not None:
            base = context_policy.method.base
            scored = context_policy.method.scored_apart
            streams = base.streams(context_policy, hf_model) if scored else ()
            log(f"contexts (the serving context cache) are compressed with {policy_spec(context_policy)}: its select graph"
                + (" and the re-read graph (it re-reads each context once)" if scored and base.rereads(context_policy) else "")
                + "".join(f" and {s.description or 'the stream ' + s.name} (no re-read)" for s in streams))
        result, content = export_engine(hf_model, policy, tmp, config, tokenizer, model_name, model_path,
                                        context_policy=context_policy)
        content["request"] = request
        log(f"exported and validated in {time.perf_counter() - start:.1f} s" + ("; smoke test on ONNX Runtime ..." if smoke else ""))
        content["smoke_test"] = smoke_test(tmp, content, hf_model, tokenizer, policy, config, log) if smoke else None
        content["tensorrt"] = (tensorrt_step(tmp, result, log) if tensorrt else
                                  _skipped("--skip-tensorrt was given", log, detail=False))
        content["build_seconds"] = round(time.perf_counter() - start, 1)
        write_manifest(tmp, content)
        _swap_in(tmp, output)
        log(f"engine written to {output} ({result.weights_bytes / 2**20:.0f} MiB of weights, "
            f"KV buffers {result.shapes()['kv_buffer_bytes'] / 2**20:.1f} MiB for batch {config.max_batch_size})")
        return output
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)



def _default_context_for(model, policy: KVPolicy, context_policy: KVPolicy, model_name: str, model_path: str,
                         log: Callable[[str], None]) -> KVPolicy:
    """The default context policy, or its stand-in for a model its streams cannot serve (no KVzip surrogate)."""
    try:  # the default's streams: the model's KVzip surrogate
        context_policy.method.base.streams(context_policy, model)
        return context_policy
    except ValueError:  # the model has none: the re-read's policy instead
        log(f"no KVzip surrogate for {model_name}: contexts are compressed with {SURROGATE_FALLBACK} (KVzip's "
            f"re-read) instead of the default's surrogate; `criticalkv train-surrogate --model {model_path}` "
            "trains one (about 25 s per training context for a 135M model on 2 CPU cores)")
        return context_policy_for(policy, SURROGATE_FALLBACK)


# ---------------------------------------------------------------------- the torch backend
def torch_engine_content(model, policy: KVPolicy, config: BuildConfig, tokenizer=None, model_name: str = "custom",
                         model_path: str = "", context_policy: KVPolicy | None = None) -> dict[str, Any]:
    """The manifest content of a torch engine directory for ``model`` (a transformers model: real weights, or the
    structure alone on the meta device): the limits, shapes and policy the other backends record, the context policy
    and what the policies' methods keep (``method_data``; their streams are found for the model when the backend
    loads it), and the ``torch`` section naming the checkpoint ``model_path`` (with its fingerprint; empty for an
    in-memory model, which must then be handed to the backend). No ``onnx`` section: no graph is exported."""
    from criticalkv.export.exporter import check_model_limits
    from criticalkv.export.decoder import layer_capacities, model_spec
    from criticalkv.methods.phases import BuildPhases
    from criticalkv.runtime.torch_backend import DTYPES, torch_manifest_section

    if context_policy is not None and context_policy == policy:
        context_policy = None
    spec = model_spec(model)
    check_model_limits(model, spec, config)
    capacities = layer_capacities(policy, spec, config.max_input_len)
    context_capacities = None if context_policy is None else layer_capacities(context_policy, spec, config.max_input_len)
    held = capacities if context_capacities is None else [max(a, b) for a, b in zip(capacities, context_capacities)]
    decode = [c + config.max_question_len + config.max_new_tokens for c in held]
    element = DTYPES[config.dtype].itemsize
    phases = BuildPhases()
    for one in (policy, context_policy):
        if one is not None and one.method.scored_apart:
            base = one.method.base
            phases = phases.merged(BuildPhases((), base.rereads(one), base.data_key, base.engine_data(one, model, tokenizer)))
    extra = phases_content(phases)
    if context_policy is not None:
        extra["context_policy"] = context_policy.to_dict()
    shapes = {"prefill_capacity": capacities, "decode_capacity": decode,
              "kv_buffer_bytes": 2 * config.max_batch_size * spec.num_kv_heads * spec.head_dim * element * sum(decode)}
    if context_capacities is not None:
        shapes["context_capacity"] = context_capacities
    return {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": {"name": model_name, "path": model_path, "model_type": spec.model_type, "spec": spec.to_dict()},
        "policy": policy.to_dict(),
        "policy_schema_version": SCHEMA_VERSION,
        "build": config.to_dict(),
        "shapes": shapes,
        **extra,
        "torch": {**(torch_manifest_section(model_path) if model_path else {"checkpoint": None}),
                  "dtype_on_cuda": config.dtype, "dtype_on_cpu": "float32"},
        "generation": {"eos_token_ids": stop_token_ids(tokenizer, model) if tokenizer is not None else [],
                       "chat_template": bool(getattr(tokenizer, "chat_template", None))},
        "versions": package_versions(),
    }


def structure_of(model_path: str):
    """The checkpoint's model without its weights (the meta device): enough for its spec and limits, in a second
    whatever its size; its generation config is the checkpoint's (the stop ids)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if (Path(model_path) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(model_path)
    return model


def torch_smoke_test(folder: Path, manifest: dict[str, Any], tokenizer, policy: KVPolicy, config: BuildConfig,
                     log: Callable[[str], None]) -> dict[str, Any]:
    """Generate a few greedy tokens on the torch backend (its device and dtype) from a prompt long enough to be
    compressed, and the same with the PyTorch path on the backend's model; record whether they agree."""
    n = min(config.max_input_len, policy.budget + 64 if policy.name != "full" else 96)
    ids = list(tokenizer(SMOKE_TEXT * (n // 20 + 2))["input_ids"][:n])
    vocab = manifest["model"]["spec"]["vocab_size"]
    ids += [(7919 * i + 11) % vocab for i in range(n - len(ids))]
    new = min(8, config.max_new_tokens)
    engine = Engine(folder, manifest, create_backend("torch", folder, manifest))  # the manifest is written last
    try:
        got = engine.generate([ids], max_new_tokens=new, stop_token_ids=[])
        model = engine.backend.model
        ref = generate(model, torch.tensor([ids], device=engine.backend.device), policy, max_new_tokens=new)
        device, dtype = str(engine.backend.device), str(engine.backend.dtype).removeprefix("torch.")
    finally:
        engine.close()
    same_indices = all(
        got.kept(layer, 0, h) == [i for i in sel.indices[0, h].tolist() if i >= 0]
        for layer, sel in enumerate(ref.prefill.selections)
        for h in range(sel.indices.shape[1])
    )
    result = {"prompt_tokens": len(ids), "new_tokens": len(got.tokens[0]), "token_ids": got.tokens[0],
              "pytorch_token_ids": ref.tokens[0], "tokens_match_pytorch": got.tokens[0] == ref.tokens[0],
              "kept_indices_match_pytorch": same_indices, "device": device, "dtype": dtype,
              "prefill_s": round(got.prefill_s, 4), "decode_s_per_token": round(got.decode_s_per_token, 5)}
    status = "matches" if result["tokens_match_pytorch"] and same_indices else "DIFFERS FROM"
    log(f"smoke test: {len(ids)}-token prompt, {result['new_tokens']} tokens on the torch backend ({device}, {dtype}); "
        f"{status} the PyTorch path (tokens {result['tokens_match_pytorch']}, kept indices {same_indices})")
    return result


def _build_torch(output: Path, policy: KVPolicy, config: BuildConfig, model_name: str, model_path: str,
                 request: dict[str, Any], smoke: bool, log: Callable[[str], None],
                 context_policy: KVPolicy | None = None, default_context: bool = False) -> Path:
    from transformers import AutoTokenizer

    tmp = temporary_dir(output.parent, f".{output.name}.building-")
    try:
        start = time.perf_counter()
        model = structure_of(model_path)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        if default_context:
            context_policy = _default_context_for(model, policy, context_policy, model_name, model_path, log)
        content = torch_engine_content(model, policy, config, tokenizer, model_name, model_path, context_policy)
        tokenizer.save_pretrained(tmp / TOKENIZER_DIR)
        content["request"] = request
        log(f"torch engine for {model.config.model_type} ({model.config.num_hidden_layers} layers), policy {policy.name} "
            f"(budget {policy.budget}): no export, the manifest names {model_path}"
            + (f"; contexts compressed with {policy_spec(context_policy)} (a method stream it reads, such as a KVzip "
               "surrogate, is found for the checkpoint when the engine loads)" if context_policy is not None else ""))
        if smoke:
            content["smoke_test"] = torch_smoke_test(tmp, content, tokenizer, policy, config, log)
        content["build_seconds"] = round(time.perf_counter() - start, 1)
        write_manifest(tmp, content)
        _swap_in(tmp, output)
        log(f"engine written to {output} (torch backend; KV buffers {content['shapes']['kv_buffer_bytes'] / 2**20:.1f} "
            f"MiB for batch {config.max_batch_size} in {config.dtype} on CUDA)")
        return output
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
