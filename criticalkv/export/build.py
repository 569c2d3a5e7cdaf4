"""``build_engine``: export, validate, smoke-test on ONNX Runtime, (TensorRT when present), manifest.

Everything is written into a temporary directory next to the output and renamed into place at the
end, so an interrupted or failed build never leaves a half-written engine directory behind.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from criticalkv.export.exporter import DECODE_FILE, PREFILL_TENSORRT_FILE, BuildConfig, ExportResult, export_model, onnx_info
from criticalkv.export.validate import validate_export
from criticalkv.policy import SCHEMA_VERSION, KVPolicy
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


def build_request(model_name: str, model_path: str, policy: KVPolicy, config: BuildConfig) -> dict[str, Any]:
    """What identifies a build: an existing engine with the same request is up to date."""
    return {"model": {"name": model_name, "path": model_path}, "policy": policy.to_dict(), "build": config.to_dict(),
            "format_version": FORMAT_VERSION, "criticalkv": package_versions().get("criticalkv")}


def existing_request(output: Path) -> dict[str, Any] | None:
    import json

    try:
        manifest = json.loads((output / MANIFEST_FILE).read_text())
        return manifest.get("request")
    except (OSError, ValueError):
        return None


def smoke_test(
    folder: Path, manifest: dict[str, Any], model, tokenizer, policy: KVPolicy, config: BuildConfig,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Generate a few greedy tokens on ONNX Runtime from a prompt long enough to be compressed, and the
    same with the PyTorch path; record whether tokens and kept indices agree."""
    import torch

    from criticalkv.hf import generate
    from criticalkv.runtime import Engine, create_backend

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
    """Build the TensorRT engines when criticalkv.engine, TensorRT, a GPU and the plugin are all present."""
    try:
        import criticalkv.engine as trt_engine
    except ImportError as err:
        reason = f"the criticalkv.engine package (TensorRT plugin and engine build) is not available: {err}"
        return _skipped(reason, log)
    reason = trt_engine.tensorrt_unavailable_reason()
    if reason:
        return _skipped(reason, log)
    plugin = trt_engine.find_plugin_library(required=False)
    if plugin is None:
        return _skipped("the CriticalKVSelect plugin library is not built (run `bash scripts/build_plugin.sh`)", log)
    config = result.config
    log(f"building TensorRT engines ({config.dtype}) with {plugin} ...")
    built = trt_engine.build_tensorrt_engines(
        folder / PREFILL_TENSORRT_FILE, folder / DECODE_FILE, folder / "tensorrt", plugin_library=plugin,
        max_batch=config.max_batch_size, max_input_len=config.max_input_len,
        max_capacity=max(result.prefill_capacities), dtype=config.dtype,
        strongly_typed=config.dtype == "float32",  # the graphs are fp32: fp16 is a builder precision flag
    )
    return {"built": True, "tensorrt_version": built.tensorrt_version, "dtype": built.dtype,
            "plugin_layers": built.plugin_layers, "plugin_library": str(built.plugin_library)}


def _skipped(reason: str, log: Callable[[str], None]) -> dict[str, Any]:
    log(f"TensorRT engines: SKIPPED because {reason}. The ONNX Runtime engine is complete; "
        f"{PREFILL_TENSORRT_FILE} and {DECODE_FILE} are the inputs of criticalkv.engine.build_tensorrt_engines on a GPU machine.")
    return {"built": False, "skipped_reason": reason}


def export_engine(
    model, policy: KVPolicy, folder: Path, config: BuildConfig, tokenizer=None, model_name: str = "custom",
    model_path: str = "", validate: bool = True,
) -> tuple[ExportResult, dict[str, Any]]:
    """Export ``model`` into ``folder`` and validate it; returns the export and the manifest content
    (``write_manifest(folder, content)`` completes an engine directory)."""
    from criticalkv.commands.generate import stop_token_ids

    result = export_model(model, policy, folder, config, tokenizer)
    validation = validate_export(result) if validate else None
    content = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": {"name": model_name, "path": model_path, "model_type": result.spec.model_type,
                  "spec": result.spec.to_dict()},
        "policy": policy.to_dict(),
        "policy_schema_version": SCHEMA_VERSION,
        "build": config.to_dict(),
        "shapes": result.shapes(),
        "onnx": {**onnx_info(), "validation": validation},
        "generation": {"eos_token_ids": stop_token_ids(tokenizer, model) if tokenizer is not None else [],
                       "chat_template": bool(getattr(tokenizer, "chat_template", None))},
        "versions": package_versions(),
    }
    return result, content


def build_engine(
    output: str | Path,
    policy: KVPolicy,
    config: BuildConfig | None = None,
    model: str | None = None,
    force: bool = False,
    smoke: bool = True,
    tensorrt: bool = True,
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True),
) -> Path:
    """Build an engine directory for ``model`` (default: the bundled SmolLM2-135M-Instruct) and ``policy``.

    An existing directory built from the same request is left as it is (``force`` rebuilds); one built
    from a different request is an error unless ``force``.
    """
    from criticalkv.hf import load_model, resolve_model

    config = config or BuildConfig()
    output = Path(output)
    model_name = model or "smollm2-135m"
    model_path = str(resolve_model(model))
    request = build_request(model_name, model_path, policy, config)
    if output.exists():
        if not force and existing_request(output) == request:
            log(f"{output} is already built for this model, policy and limits (use --force to rebuild)")
            return output
        if not force:
            raise EngineError(f"{output} already exists and was built differently (or is not an engine); "
                              "pass --force to replace it")
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.building-", dir=output.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the engine directory is an ordinary one
    try:
        start = time.perf_counter()
        log(f"loading {model_name} ...")
        hf_model, tokenizer = load_model(model)
        log(f"exporting {hf_model.config.model_type} ({hf_model.config.num_hidden_layers} layers) with policy "
            f"{policy.name} (budget {policy.budget}) to ONNX, then validating (onnx.checker full check, strict "
            "shape inference, node attributes) ...")
        result, content = export_engine(hf_model, policy, tmp, config, tokenizer, model_name, model_path)
        content["request"] = request
        log(f"exported and validated in {time.perf_counter() - start:.1f} s" + ("; smoke test on ONNX Runtime ..." if smoke else ""))
        content["smoke_test"] = smoke_test(tmp, content, hf_model, tokenizer, policy, config, log) if smoke else None
        content["tensorrt"] = tensorrt_step(tmp, result, log) if tensorrt else _skipped("--skip-tensorrt was given", log)
        content["build_seconds"] = round(time.perf_counter() - start, 1)
        write_manifest(tmp, content)
        if output.exists():  # --force: swap the new directory in, then drop the old one
            old = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
            output.rename(old / "engine")
            tmp.rename(output)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(output)
        log(f"engine written to {output} ({result.weights_bytes / 2**20:.0f} MiB of weights, "
            f"KV buffers {result.shapes()['kv_buffer_bytes'] / 2**20:.1f} MiB for batch {config.max_batch_size})")
        return output
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)

