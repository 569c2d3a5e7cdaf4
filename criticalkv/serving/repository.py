"""Render a Triton model repository for an engine directory from ``criticalkv/serving/templates/``:

    REPO/NAME/config.pbtxt     decoupled Python-backend model, inputs/outputs of vllm_backend (+ kv_budget, KV bytes)
    REPO/NAME/1/model.py       the adapter over criticalkv.serving.Scheduler (copied as is)
    REPO/NAME/1/model.json     the engine arguments (engine_dir, backend, threads) and the scheduler's (SchedulerConfig)

``render`` is ``string.Template`` with a check that every ``${key}`` of the template was given (and no
unknown key), so a template and its caller cannot drift apart silently. The repository is written into a
temporary folder and renamed into place.
"""

from __future__ import annotations

import json
import re
import shutil
import string
import tempfile
from pathlib import Path
from typing import Any

from criticalkv.policy import KVPolicy, policy_spec
from criticalkv.runtime.manifest import default_backend, read_manifest
from criticalkv.runtime.registry import BACKENDS
from criticalkv.serving.scheduler import SchedulerConfig

TEMPLATES = Path(__file__).parent / "templates"
DEFAULT_MODEL_NAME = "criticalkv"
#: The backends the Triton model runs an engine on (torch: wherever the model's Python imports torch and transformers;
#: the bundled CPU server's model environment reaches the project's packages, torch included).
SERVED_BACKENDS = tuple(BACKENDS)


def template_keys(text: str) -> set[str]:
    """The ``$key`` / ``${key}`` placeholders of a template."""
    keys = set()
    for match in string.Template.pattern.finditer(text):
        name = match.group("named") or match.group("braced")
        if name:
            keys.add(name)
    return keys


def render(text: str, values: dict[str, Any]) -> str:
    """``text`` with every placeholder filled from ``values``; KeyError naming missing or unknown keys."""
    keys = template_keys(text)
    missing, unknown = sorted(keys - set(values)), sorted(set(values) - keys)
    if missing:
        raise KeyError(f"template keys not filled: {', '.join(missing)}")
    if unknown:
        raise KeyError(f"values given for keys the template does not have: {', '.join(unknown)}")
    out = string.Template(text).safe_substitute({k: str(v) for k, v in values.items()})
    left = template_keys(out) & keys
    assert not left, f"placeholders left after rendering: {left}"
    return out


def _model_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"model name {name!r}: use letters, digits, '_', '-' or '.'")
    return name


def make_repository(
    engine_dir: str | Path,
    out: str | Path,
    model_name: str = DEFAULT_MODEL_NAME,
    instances: int = 1,
    scheduler: SchedulerConfig | None = None,
    backend: str | None = None,
    gpus: list[int] | None = None,
    threads: int = 0,
    execution_env: str | None = None,
    python_paths: list[str] | None = None,
    force: bool = False,
    request_timeout: float | None = None,
) -> Path:
    """Write the model repository ``out`` for ``engine_dir``; returns ``out/model_name``.

    scheduler : how each instance's scheduler serves (``SchedulerConfig``; max_num_seqs defaults to the engine's max
        batch size and may not exceed it)
    backend : "onnxruntime" or "openvino" (KIND_CPU), "tensorrt" (KIND_GPU, one instance per GPU in ``gpus`` times
        ``instances``) or "torch" (KIND_GPU on ``gpus`` when given; else KIND_CPU, and the backend picks its device:
        CUDA when the model's Python sees a GPU, the CPU otherwise); None: the engine directory's default
        (``default_backend``: torch for a directory built with ``--backend torch``, else onnxruntime)
    execution_env : a virtual environment the model runs in (``EXECUTION_ENV_PATH``; the bundled CPU server
        needs one with numpy<2); python_paths : the project's packages for the model's ``sys.path``: the first (the
        checkout) put before everything, even the server's working directory, the others appended
    request_timeout : the model's deadline of every request in seconds (the whole answer; a stream's first response
        and each next one): past it the request is cancelled and answered with the error "no answer within the
        server's request timeout ..." (None: none)
    """
    engine_dir = Path(engine_dir).resolve()
    manifest = read_manifest(engine_dir, verify=False)
    max_batch = manifest["build"]["max_batch_size"]
    scheduler = scheduler or SchedulerConfig()
    max_num_seqs = max_batch if scheduler.max_num_seqs is None else scheduler.max_num_seqs
    if not 1 <= max_num_seqs <= max_batch:
        raise ValueError(f"max_num_seqs {max_num_seqs} must lie in [1, {max_batch}] (the engine's max batch size); "
                         f"rebuild the engine with --max-batch-size {max_num_seqs} to serve more sequences at once")
    if instances < 1:
        raise ValueError(f"instances must be >= 1, got {instances}")
    backend = backend or default_backend(manifest)
    if backend not in SERVED_BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(SERVED_BACKENDS)}")
    name = _model_name(model_name)
    on_gpu = backend == "tensorrt" or (backend == "torch" and gpus is not None)
    gpu_list = f", gpus: [ {', '.join(str(g) for g in (gpus or [0]))} ]" if on_gpu else ""
    env_line = "" if not execution_env else \
        f'parameters: {{ key: "EXECUTION_ENV_PATH", value: {{ string_value: "{Path(execution_env).resolve()}" }} }}'
    policy = KVPolicy.from_dict(manifest["policy"])
    config = render((TEMPLATES / "config.pbtxt").read_text(), {
        "model_name": name, "instances": instances, "policy": policy_spec(policy),
        "budget": policy.budget if policy.method.base.evicts else "",
        "tokenizer": str(engine_dir / "tokenizer"), "backend": backend,
        "instance_kind": "KIND_GPU" if on_gpu else "KIND_CPU",
        "gpus": gpu_list, "execution_env_parameter": env_line,
    })
    arguments = {"engine_dir": str(engine_dir), "backend": backend, "threads": threads,
                 "scheduler": {**scheduler.to_dict(), "max_num_seqs": max_num_seqs},
                 "python_paths": list(python_paths or [])}
    if request_timeout is not None:
        if not request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {request_timeout!r}")
        arguments["request_timeout"] = float(request_timeout)
    out = Path(out)
    target = out / name
    if target.exists() and not force:
        raise ValueError(f"{target} exists (pass force=True / --force to replace it)")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=f".{name}.building-") as tmp:
        staged = Path(tmp) / name
        (staged / "1").mkdir(parents=True)
        (staged / "config.pbtxt").write_text(config)
        shutil.copy2(TEMPLATES / "model.py", staged / "1" / "model.py")
        (staged / "1" / "model.json").write_text(json.dumps(arguments, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        staged.rename(target)
    return target
