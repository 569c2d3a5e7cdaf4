"""`criticalkv serve --replicas 2` as the scripts of this folder run it (hang.py, target.py, edges.py, memory.py).

The launcher in its own process group (``start_new_session``), its output kept line by line in ``lines``, ``ready``
set at its ``ready:`` line; ``command`` is what the records show (the interpreter relative to the checkout when it
lies inside it: no machine's paths). Imported by the scripts beside it (their folder is first on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
#: the interpreter, as the records name it (relative to the checkout when it lies inside it: no machine's paths)
PYTHON = os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT)) else sys.executable


class Server:
    """`criticalkv serve --engine-dir ENGINE --replicas 2 --threads THREADS [--host HOST] --openai-port PORT EXTRA`."""

    def __init__(self, engine_dir: str, port: int, extra: list[str] = (), threads: int = 1,
                 host: str | None = None):
        self.port, self.lines = port, []
        self.command = [PYTHON, "-m", "criticalkv.cli", "serve", "--engine-dir", engine_dir, "--replicas", "2",
                        "--threads", str(threads), *(["--host", host] if host else []), "--openai-port", str(port),
                        *extra]
        self.process = subprocess.Popen([sys.executable, *self.command[1:]], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("ready:"):
                self.ready.set()

    def wait_ready(self, timeout: float, tail: int = 40) -> None:
        """Until the ``ready:`` line; RuntimeError with the last ``tail`` lines if it exits or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.5):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start:\n" + "\n".join(self.lines[-tail:]))

    def state(self) -> dict:
        """``GET /replicas``: the frontend's and every replica's last report."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/replicas", timeout=30) as response:
            return json.loads(response.read())

    def family(self) -> list:
        """The launcher and its descendants (psutil), now."""
        import psutil

        try:
            return [psutil.Process(self.process.pid), *psutil.Process(self.process.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self, wait: float = 180) -> int | None:
        """Ctrl-C (SIGINT) and its exit status; past ``wait`` seconds, SIGKILL to its process group and every
        descendant listed before the SIGINT (then None)."""
        if self.process.poll() is not None:
            return self.process.returncode
        family = self.family()
        self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(wait)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            for p in family:
                try:
                    p.kill()
                except Exception:
                    pass
            return None
