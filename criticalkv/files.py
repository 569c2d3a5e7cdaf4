"""Small file helpers shared by the model cache, the engine builds and the manifests."""

from __future__ import annotations

import glob
import hashlib
import os
import re
import select
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable

from criticalkv.interrupts import raise_pending


def cache_root() -> Path:
    """Root of criticalkv's user cache (converted models, downloaded wheels): ``$CRITICALKV_CACHE``, else
    ``$XDG_CACHE_HOME/criticalkv``, else ``~/.cache/criticalkv``."""
    if os.environ.get("CRITICALKV_CACHE"):
        return Path(os.environ["CRITICALKV_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "criticalkv"


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


def read_text_interruptibly(path: Path, poll_s: float = 0.1) -> str:
    """The UTF-8 text of ``path`` (universal newlines, as ``Path.read_text``), read so that Ctrl-C and
    SIGTERM end the wait at any moment when ``path`` is a FIFO, a terminal or another file a read can block on.

    Why: Python runs a signal's handler between bytecodes; a signal that lands after the last check and
    before a blocking ``read()`` starts is noted but never acted on, since the read does not return (it
    was not interrupted: the signal came before it) and the command hangs until a writer closes the file.
    Here such files are opened without blocking and read after ``poll()`` with a timeout of ``poll_s``:
    a signal that lands anywhere is acted on within ``poll_s`` (and one whose exception was dropped is
    raised again: ``criticalkv.interrupts.raise_pending``). Regular files cannot block and are read at once.
    UnicodeDecodeError as ``read_text`` raises it.
    """
    path = Path(path)
    if stat.S_ISREG(os.stat(path).st_mode):
        return path.read_text(encoding="utf-8")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once, before any writer
    try:
        fifo = stat.S_ISFIFO(os.fstat(fd).st_mode)
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLPRI)
        chunks = []
        while True:
            events = poller.poll(int(poll_s * 1000))  # the loop itself is where a pending signal is acted on
            raise_pending()  # one whose exception was dropped (see criticalkv.interrupts)
            if not events:
                continue
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            if data:
                chunks.append(data)
            # end of file: a FIFO reads empty before its first writer too, but only then polls without POLLHUP
            elif not fifo or any(mask & select.POLLHUP for _, mask in events):
                break
    finally:
        os.close(fd)
    text = b"".join(chunks).decode("utf-8")
    return text.replace("\r\n", "\n").replace("\r", "\n")
