"""Small file helpers shared by the model cache, the engine builds and the manifests."""

from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True


def temporary_dir(parent: Path, prefix: str) -> Path:
    """A new directory ``parent/<prefix><pid>-<random>`` (named by this process, so that a later run can
    tell a leftover of a killed process from the work of a live one), with the usual umask permissions."""
    path = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)  # mkdtemp makes it private; what is renamed into place is an ordinary directory
    return path


def remove_stale_temporaries(parent: Path, prefix: str, log: Callable[[str], None]) -> list[Path]:
    """Remove ``parent/<prefix>*`` entries left by processes that no longer run (killed by SIGKILL or the
    OOM killer before they could clean up), saying so through ``log``; those of live processes stay.

    A name without a process id (written by an older criticalkv) counts as stale.
    """
    removed = []
    if not parent.is_dir():
        return removed
    for path in sorted(parent.glob(glob.escape(prefix) + "*")):
        match = re.match(r"(\d+)-", path.name[len(prefix):])
        pid = int(match.group(1)) if match else None
        if pid is not None and (pid == os.getpid() or process_alive(pid)):
            continue
        owner = f"process {pid}, which no longer runs" if pid is not None else "a process that no longer runs"
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        log(f"removed {path}: a temporary left by {owner} (killed before it could clean up)")
        removed.append(path)
    return removed
