"""Result files: atomic writes (temp file + rename), run metadata, output folder checks."""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import transformers

import criticalkv


def prepare_out_dir(path: Path) -> Path:
    """Create ``path`` if needed and make sure files can be written into it (clear error otherwise)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ValueError(f"--out {path}: cannot write results there ({err.strerror or err})") from None
    return path


def _default(obj: Any):
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (np.floating, np.integer)):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it over ``path``: a reader
    (or an interrupted run) never sees a half-written file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files; results are ordinary files
        os.replace(tmp, path)
    except BaseException:
        with_suppressed_unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def with_suppressed_unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


#: A JSON list holding no list or object: printed on one line.
_FLAT_LIST = re.compile(r"\[[^\[\]{}]*\]")


def to_json(data: Any) -> str:
    """Indented JSON with lists of numbers or strings kept on one line (compact, still diffable)."""
    text = json.dumps(data, indent=1, default=_default, ensure_ascii=False)
    return _FLAT_LIST.sub(_join_lines, text)


def _join_lines(match: re.Match) -> str:
    # JSON strings hold no raw newline, so whitespace spanning a newline is layout, never content
    s = re.sub(r"\[\s*\n\s*", "[", match.group(0))
    s = re.sub(r"\s*\n\s*\]", "]", s)
    return re.sub(r",\s*\n\s*", ", ", s)


def write_json(path: Path, data: Any) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(to_json(data) + "\n", encoding="utf-8"))


def write_text(path: Path, text: str) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def save_figure(fig, path: Path) -> None:
    """Save a matplotlib figure as PNG atomically and close it."""
    import matplotlib.pyplot as plt  # optional (the eval extra): needed only for figures

    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))
    plt.close(fig)


def environment() -> dict:
    """Machine and versions, for the results files."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return {
        "criticalkv": criticalkv.__version__,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
    }
