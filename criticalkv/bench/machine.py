"""The header every benchmark result carries: machine, load average, versions, commit, command."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

#: Distributions whose versions the results record (those installed).
VERSIONED = ("criticalkv", "torch", "transformers", "onnx", "onnxruntime", "numpy", "tritonclient",
             "nvidia-pytriton", "kvpress", "aiperf", "psutil")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> list[float]:
    """1, 5 and 15-minute load averages (empty where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in VERSIONED:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def git_commit(root: Path | None = None) -> str | None:
    """HEAD of the checkout this package runs from, with ``-dirty`` when tracked files changed."""
    root = root or Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                               text=True, check=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def header(command: str) -> dict:
    """Machine, versions and commit at the start of a run; ``finish`` adds the end load average."""
    return {
        "command": command,
        "machine": {"cpu": cpu_model(), "logical_cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_average_start": load_average()},
        "versions": versions(),
        "commit": git_commit(),
    }


def finish(info: dict) -> dict:
    info["machine"]["load_average_end"] = load_average()
    return info


def header_lines(info: dict) -> list[str]:
    """The header as ``# ...`` lines for the text table (what a run that stopped early did not record shows as ?)."""
    m = info.get("machine") or {}
    load = f"load average {m.get('load_average_start', '?')} (start)"
    if "load_average_end" in m:
        load += f" / {m['load_average_end']} (end)"
    return [
        f"# {info.get('command', '?')}",
        f"# machine: {m.get('cpu', '?')}, {m.get('logical_cpus', '?')} logical CPUs, {load}",
        "# versions: " + ", ".join(f"{k} {v}" for k, v in (info.get("versions") or {}).items()),
        f"# commit: {info.get('commit')}",
    ]
