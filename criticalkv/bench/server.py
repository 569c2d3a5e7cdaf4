"""Start and stop a ``criticalkv serve`` process for a benchmark, and sample its memory.

``ServerProcess`` runs ``python -m criticalkv.cli serve --engine-dir DIR --http-port P ...`` in its own
process group, waits for ``GET /v2/health/ready``, and stops it by its PID (SIGTERM, then SIGKILL after
a grace period), never by name. ``RssMonitor`` samples the resident memory of a process and all its
descendants (the launcher, ``tritonserver`` and the Python-backend stubs) with psutil and keeps the peak.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from criticalkv.bench.client import is_ready, ready_models

#: Seconds to wait for a started server to report ready (engine load included).
READY_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A ``criticalkv serve`` child process on 127.0.0.1 (context manager)."""

    def __init__(self, engine_dir: Path, extra_args: list[str] | None = None, log_path: Path | None = None,
                 openai: bool = False):
        self.engine_dir = Path(engine_dir)
        if not (self.engine_dir / "manifest.json").is_file():
            raise FileNotFoundError(f"{self.engine_dir}: not an engine directory (no manifest.json)")
        self.extra_args = list(extra_args or [])
        self.log_path = log_path
        self.http_port = free_port()
        self.metrics_port = free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        # the OpenAI API only when asked (its process holds a tokenizer: measured RSS stays comparable), and
        # never on the default 9000: servers side by side must not collide
        self.openai_port = free_port() if openai else 0
        self.openai_url = f"http://127.0.0.1:{self.openai_port}/v1" if openai else None
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self, timeout: float = READY_TIMEOUT_S) -> "ServerProcess":
        cmd = [sys.executable, "-m", "criticalkv.cli", "serve", "--engine-dir", str(self.engine_dir),
               "--http-port", str(self.http_port), "--grpc-port", str(free_port()),
               "--metrics-port", str(self.metrics_port), "--openai-port", str(self.openai_port), *self.extra_args]
        self._log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"criticalkv serve exited with {self.proc.returncode} before it was ready"
                                   + (f" (log: {self.log_path})" if self.log_path else ""))
            if is_ready(self.url) and ready_models(self.url):
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"criticalkv serve was not ready after {timeout:.0f} s")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def stop(self, grace: float = 60.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def pid_listening_on(port: int) -> int | None:
    """PID of the process listening on TCP ``port`` (for a server given by ``--url``), or None."""
    import psutil  # optional (the bench extra): needed only to sample a server's memory

    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                return conn.pid
    except (psutil.AccessDenied, PermissionError):
        return None
    return None


def tree_rss_bytes(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants right now (0 when it is gone)."""
    import psutil  # optional (the bench extra): needed only to sample a server's memory

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


class RssMonitor:
    """Samples ``tree_rss_bytes(pid)`` every ``interval`` s in a thread; ``peak_bytes`` after ``stop``."""

    def __init__(self, pid: int | None, interval: float = 0.1):
        self.pid = pid
        self.interval = interval
        self.peak_bytes = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _loop(self):
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, tree_rss_bytes(self.pid))
            self.samples += 1
            self._stop.wait(self.interval)

    def start(self) -> "RssMonitor":
        if self.pid is not None:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def stop(self) -> int | None:
        if self._thread is None:
            return None
        self._stop.set()
        self._thread.join()
        return self.peak_bytes

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


#: The scheduler's gauges (criticalkv/serving/templates/model.py) a ``MetricsMonitor`` follows; the context cache's
#: gauge has one series per ``stat`` label, named ``criticalkv_context_cache:STAT`` here.
GAUGES = ("criticalkv_requests_running", "criticalkv_requests_waiting", "criticalkv_kv_bytes_reserved",
          *(f"criticalkv_context_cache:{k}" for k in ("hits", "misses", "evictions", "bytes_held", "entries")))


def parse_gauges(text: str, names=GAUGES) -> dict[str, float]:
    """The value of each gauge in Prometheus text ``text``, summed over its label sets (model instances); a
    ``stat`` label is part of the name (``NAME:STAT``); a gauge the text lacks is left out."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        stat = re.search(r'[{,]stat="([^"]*)"', line.split("}", 1)[0]) if "{" in line else None
        if stat:
            name = f"{name}:{stat.group(1)}"
        if name in names:
            try:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return out


class MetricsMonitor:
    """Samples the server's scheduler gauges (requests running and waiting, KV bytes held) every ``interval`` s from
    its Prometheus endpoint while a workload runs; ``summary()`` gives each gauge's peak and time-weighted mean.

    The model sets the gauges when it sends a response, so they are exact at the sampled instants; a sequence that
    starts and ends between two samples is missed (the interval is far below a request's life)."""

    def __init__(self, metrics_url: str | None, interval: float = 0.1):
        self.metrics_url = metrics_url
        self.interval = interval
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        import urllib.request

        try:
            with urllib.request.urlopen(self.metrics_url, timeout=2.0) as response:
                values = parse_gauges(response.read().decode(errors="replace"))
        except OSError:
            self.errors += 1
            return
        if values:
            self.samples.append((time.perf_counter(), values))

    def _loop(self):
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def start(self) -> "MetricsMonitor":
        if self.metrics_url:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def stop(self) -> dict:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        return self.summary()

    def summary(self) -> dict:
        """{gauge: {"peak", "mean", "first", "last"}} (mean weighted by the time to the next sample; first and last
        samples: a count since the server started, e.g. the context cache's evictions, grew by last - first during
        the run), "samples", "errors"."""
        out: dict = {"samples": len(self.samples), "errors": self.errors}
        for name in GAUGES:
            points = [(t, v[name]) for t, v in self.samples if name in v]
            if not points:
                continue
            peak = max(v for _, v in points)
            span = points[-1][0] - points[0][0]
            mean = (sum(v * (t1 - t0) for (t0, v), (t1, _) in zip(points, points[1:])) / span) if span > 0 \
                else points[0][1]
            out[name] = {"peak": peak, "mean": mean, "first": points[0][1], "last": points[-1][1]}
        return out

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def kv_bytes_per_token(engine_dir: Path) -> int:
    """KV bytes one token of a sequence takes without eviction: every KV head of every layer (keys and values),
    from the manifest (``Engine.kv_bytes_full(1)``, without loading the engine)."""
    import json

    manifest = json.loads((Path(engine_dir) / "manifest.json").read_text())
    spec, shapes = manifest["model"]["spec"], manifest["shapes"]
    batch = manifest["build"]["max_batch_size"]
    entry = shapes["kv_buffer_bytes"] // (batch * spec["num_kv_heads"] * sum(shapes["decode_capacity"]))
    return entry * spec["num_kv_heads"] * spec["num_layers"]


def only_model(url: str) -> str:
    """The one model a running server reports ready (ValueError naming them when it is not one)."""
    from criticalkv.bench.client import ready_models

    models = ready_models(url)
    if len(models) != 1:
        raise ValueError(f"{url} serves {len(models)} ready models ({', '.join(models) or 'none'}): give --model-name")
    return models[0]


def served_engine(url: str, model: str) -> dict:
    """What a running server's model serves (``engine_label``'s fields), from its Triton model config's parameters
    (``criticalkv_policy``, ``criticalkv_budget``: every repository ``criticalkv serve`` renders has them); the model's
    name and "unknown" for a server that does not say."""
    from criticalkv.bench.client import get_json

    try:
        config = get_json(f"{url}/v2/models/{model}/config") or {}
    except (OSError, ValueError):
        config = {}
    parameters = {k: (v or {}).get("string_value", "") for k, v in (config.get("parameters") or {}).items()}
    spec = parameters.get("criticalkv_policy") or ""
    name = spec.split(":")[0] or "unknown"
    budget = int(parameters["criticalkv_budget"]) if parameters.get("criticalkv_budget", "").isdigit() else None
    label = name if name in ("full", "unknown") else f"{spec} b={budget}"
    return {"label": label if name != "unknown" else model, "policy": name, "budget": budget, "engine_dir": None,
            "server_policy": spec or None}


def engine_label(engine_dir: Path) -> dict:
    """Policy name, budget and build limits of an engine directory (from its manifest)."""
    manifest = json.loads((Path(engine_dir) / "manifest.json").read_text())
    policy = manifest.get("policy", {})
    build = manifest.get("build", {})
    name = policy.get("name", "?")
    label = name if name == "full" else f"{name} b={policy.get('budget')}"
    return {"label": label, "policy": name, "budget": None if name == "full" else policy.get("budget"),
            "engine_dir": os.path.relpath(engine_dir), "max_batch_size": build.get("max_batch_size"),
            "max_input_len": build.get("max_input_len"), "max_new_tokens": build.get("max_new_tokens")}


class PySpyProfile:
    """``py-spy record`` over a process tree (``--subprocesses``: the launcher, tritonserver's Python
    stubs) while a workload runs; ``stop`` returns the collapsed stacks (``--format raw``)."""

    def __init__(self, pid: int, out: Path, rate: int = 50):
        exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if not Path(exe).exists():
            raise FileNotFoundError("--profile needs py-spy (pip install py-spy)")
        self.out = Path(out)
        self.cmd = [exe, "record", "--pid", str(pid), "--subprocesses", "--format", "raw", "--rate", str(rate),
                    "--nonblocking", "--output", str(self.out)]
        self.proc: subprocess.Popen | None = None

    def start(self) -> "PySpyProfile":
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # py-spy attaches
        return self

    def stop(self) -> Path | None:
        if self.proc is None:
            return None
        self.proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        if not self.out.is_file():
            return None
        # "process PID:\"/path/to/exe args\"" frames name the executables with this machine's paths: keep the name
        text = re.sub(r'process \d+:"([^"]*)"', lambda m: "process " + Path(m.group(1).split(" ")[0]).name,
                      self.out.read_text())
        self.out.write_text(text)
        return self.out


def profile_breakdown(collapsed: Path) -> dict:
    """Share of py-spy samples (active threads) in prefill, decode and the rest, from ``--format raw``.

    A stack counts as ``prefill`` when one of its frames is a function whose name contains ``prefill``
    (the backend's prefill session run, selection inside), ``decode`` for the decode step, else ``other``
    (HTTP, scheduling, detokenisation, Python overhead)."""
    totals = {"prefill": 0, "decode": 0, "other": 0}
    for line in Path(collapsed).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        # frames are "Class.method (file.py:line)"; keep the method name
        names = [frame.split(" (", 1)[0].rsplit(".", 1)[-1] for frame in stack.split(";")]
        phase = "other"
        if any("prefill" in n for n in names):
            phase = "prefill"
        elif any(n in ("decode", "_decode_step") for n in names):
            phase = "decode"
        totals[phase] += int(count)
    total = sum(totals.values())
    return {"samples": total, **{f"{k}_fraction": (v / total if total else None) for k, v in totals.items()}}
