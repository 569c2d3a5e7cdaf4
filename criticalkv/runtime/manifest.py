"""``manifest.json`` of an engine directory: what was built, for which limits, and a checksum of every file.

Written last by ``scripts/build_engine.py`` (the directory is renamed into place only once it is
complete); read and checked by ``criticalkv.runtime.Engine.load``.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from criticalkv.errors import EngineError
from criticalkv.files import sha256_file
from criticalkv.policy import SCHEMA_VERSION, KVPolicy, policy_spec
from criticalkv.request import EngineLimits

MANIFEST_FILE = "manifest.json"
FORMAT = "criticalkv-engine"
#: Bumped whenever graph I/O, file layout or manifest fields change incompatibly. 2: extend.onnx and select.onnx
#: (+ TensorRT flavours) and ``build.extend_chunk``, which chunked prefill and the context cache need. 3: a method's
#: phases (``criticalkv.methods.phases``) by generic names: the re-read graphs ``reread.onnx`` / ``reread_ort.onnx``,
#: the streams ``present.{l}.stream.{name}`` of the extend graphs, the manifest's ``method_data`` and ``streams``
#: (each was named after the one method that used it); every graph name from ``criticalkv.graphs``.
FORMAT_VERSION = 3
#: The section of a torch engine directory's manifest (the checkpoint it runs), which has no ``onnx`` section.
TORCH_KEY = "torch"


def rebuild_command(manifest: dict[str, Any], folder: str | Path) -> str:
    """The command that builds ``folder``'s engine again with this criticalkv, from what its manifest recorded of its
    build (``request``: the model, the policy, the limits, the context policy, the backend), the bare command when it
    recorded nothing usable."""
    request = manifest.get("request") if isinstance(manifest, dict) else None
    words = ["python", "scripts/build_engine.py"]
    try:
        policy = KVPolicy.from_dict(request["policy"])
        build = request["build"]
        path = (request.get("model") or {}).get("path")
        if path:
            words += ["--model", str(path)]
        words += ["--kv-policy", policy_spec(policy), "--budget", str(policy.budget)]
        if policy.window != KVPolicy().window:
            words += ["--window", str(policy.window)]
        for key in ("max_input_len", "max_new_tokens", "max_batch_size", "max_question_len", "dtype", "kv_dtype",
                    "weights"):
            if key in build:
                words += ["--" + key.replace("_", "-"), str(build[key])]
        if request.get("context_policy"):
            words += ["--context-policy", policy_spec(KVPolicy.from_dict(request["context_policy"]))]
        if request.get("backend"):
            words += ["--backend", "torch" if request["backend"] == "torch" else "onnx"]
    except (KeyError, TypeError, ValueError):
        return " ".join(words + ["--output", shlex.quote(str(folder)), "--force"])
    return shlex.join(words + ["--output", str(folder), "--force"])


def default_backend(manifest: dict[str, Any]) -> str:
    """The backend an engine directory runs on when none is named: ``torch`` for a directory built for it (it has no
    ONNX graphs), else ``onnxruntime``."""
    return "torch" if "onnx" not in manifest and TORCH_KEY in manifest else "onnxruntime"


def openvino_cannot_run(manifest: dict[str, Any]) -> str | None:
    """Why the OpenVINO backend cannot run an engine, as its manifest says (None: it can): no ONNX graphs (a torch
    engine), no openvino graphs (a policy the CPU plugin cannot compute, or a build from before the flavour), KV
    buffers other than float32. The backend refuses the engine with it; ``criticalkv serve`` then defaults to
    ONNX Runtime (``runtime.registry.served_backend``)."""
    if "onnx" not in manifest:
        return ("no ONNX graphs in this engine directory (built with --backend torch): run it on the torch backend, or "
                "rebuild it without --backend torch")
    info = manifest["onnx"].get("openvino") or {}
    if not info.get("prefill"):
        reason = info.get("refused") or "the engine was built before the openvino flavour existed; rebuild it"
        return f"no OpenVINO graphs: {reason}; serve it on onnxruntime"
    kv_dtype = manifest["build"].get("kv_dtype", "float32")
    if kv_dtype != "float32":
        return (f"its KV buffers are {kv_dtype} (--kv-dtype): the OpenVINO backend decodes float32 buffers; rebuild "
                "with --kv-dtype float32")
    return None


def engine_limits(manifest: dict[str, Any], accepts_kv_budget: bool = True, has_extend: bool = True) -> EngineLimits:
    """What an engine serves (``Request.checked``'s limits) as its manifest says, given what its backend can do
    (a runtime budget input, an extend graph): ``Engine`` checks requests with them, and the command line checks its
    arguments with them before the engine loads."""
    build, policy = manifest["build"], KVPolicy.from_dict(manifest["policy"])
    return EngineLimits(
        max_input_len=int(build["max_input_len"]), max_new_tokens=int(build["max_new_tokens"]),
        vocab_size=int(manifest["model"]["spec"]["vocab_size"]), policy=policy, accepts_kv_budget=accepts_kv_budget,
        eos_token_ids=tuple(manifest.get("generation", {}).get("eos_token_ids", [])),
        max_question_len=int(build.get("max_question_len", 0)) if has_extend else 0)


def load_tokenizer(folder: str | Path):
    """The tokenizer saved with an engine (``FOLDER/tokenizer``): its fast (Rust) tokenizer when the folder has
    ``tokenizer.json`` (chat template and special tokens included; this loads no torch), else transformers'
    ``AutoTokenizer``. EngineError when the engine has none."""
    path = Path(folder) / "tokenizer"
    if not path.is_dir():
        raise EngineError(f"{folder}: no tokenizer folder (the engine was built without one)")
    # imported when asked for: transformers is heavy, and its AutoTokenizer imports torch, which a serving
    # process never needs when the fast tokenizer is there
    if (path / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def file_table(folder: Path) -> dict[str, dict[str, Any]]:
    """{relative path: {"bytes", "sha256"}} of every file under ``folder`` except the manifest."""
    table = {}
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel == MANIFEST_FILE:
            continue
        table[rel] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    return table


def write_manifest(folder: Path, content: dict[str, Any]) -> Path:
    """Write ``manifest.json`` (format, version and the file table are added here)."""
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **content, "files": file_table(folder)}
    path = Path(folder) / MANIFEST_FILE
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return path


def read_manifest(folder: str | Path, verify: bool = True) -> dict[str, Any]:
    """Load and check an engine directory's manifest.

    Checks the format and its version, the policy, and that every listed file exists with its size
    (and, when ``verify``, its sha256). Raises ``FileNotFoundError`` or ``EngineError`` naming the problem.
    """
    folder = Path(folder)
    hint = "build it with: python scripts/build_engine.py --output " + str(folder)
    if folder.exists() and not folder.is_dir():
        raise EngineError(f"{folder} is a file, not an engine directory (a folder holding {MANIFEST_FILE}, built by "
                          "scripts/build_engine.py --output)")
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such engine directory; {hint}")
    path = folder / MANIFEST_FILE
    if not path.is_file():
        raise EngineError(f"{folder} is not an engine directory (no {MANIFEST_FILE}; an interrupted build?); {hint}")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise EngineError(f"{path}: corrupt manifest ({err}); rebuild the engine") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise EngineError(f"{path}: not a criticalkv engine manifest (format {manifest.get('format') if isinstance(manifest, dict) else None!r})")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        built_by = manifest.get("versions", {}).get("criticalkv", "an unknown version")
        raise EngineError(
            f"{path}: engine format_version {version!r} (built by criticalkv {built_by}) is not supported; this "
            f"criticalkv reads format_version {FORMAT_VERSION}. Rebuild it: {rebuild_command(manifest, folder)}"
        )
    # an engine for the torch backend (build_engine --backend torch) names its checkpoint instead of ONNX graphs
    graphs = "torch" if TORCH_KEY in manifest else "onnx"
    for key in ("policy", "model", "build", "shapes", graphs, "files"):
        if key not in manifest:
            raise EngineError(f"{path}: corrupt manifest, missing {key!r}; rebuild the engine")
    if manifest.get("policy_schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:
        raise EngineError(f"{path}: KVPolicy schema_version {manifest['policy_schema_version']} is not supported")
    try:
        KVPolicy.from_dict(manifest["policy"])
    except (TypeError, ValueError) as err:
        raise EngineError(f"{path}: invalid policy: {err}") from None
    for rel, info in manifest["files"].items():
        file = folder / rel
        if not file.is_file():
            raise EngineError(f"{folder}: missing file {rel}; the engine directory is incomplete, rebuild it")
        if file.stat().st_size != info["bytes"]:
            raise EngineError(f"{folder}: {rel} has {file.stat().st_size} bytes, the manifest says {info['bytes']}: corrupt")
        if verify and sha256_file(file) != info["sha256"]:
            raise EngineError(f"{folder}: {rel} does not match its sha256 in the manifest: corrupt, rebuild the engine")
    return manifest
