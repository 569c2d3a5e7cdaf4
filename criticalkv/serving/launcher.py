"""Set up and run the ``tritonserver`` bundled in the ``nvidia-pytriton`` wheel (a CUDA 12.6 build that also runs on
CPU), or an installed Triton named by ``$CRITICALKV_TRITONSERVER`` (the official container's, docs/gpu.md).

``setup()`` makes, inside the checkout (``.triton/``, git-ignored):

* ``.triton/server/``: ``bin/tritonserver``, ``backends/python/`` with the Python-backend stub for this
  interpreter's version copied in, and the wheel's bundled libraries (``nvidia_pytriton.libs``), taken out
  of the wheel (``pip download --no-deps nvidia-pytriton==0.7.0`` into ``wheels/`` of criticalkv's user cache:
  ``$CRITICALKV_CACHE``, else ``$XDG_CACHE_HOME/criticalkv``, else ``~/.cache/criticalkv``);
* ``.triton/model-env/``: the virtual environment the model runs in (``EXECUTION_ENV_PATH``): the stub
  imports that environment's numpy and needs ``numpy<2`` (with numpy 2 it crashes on the first BYTES
  input), while the project keeps its own numpy. Everything else (criticalkv, ONNX Runtime, transformers)
  comes from the project's environment, appended to the model's ``sys.path`` by ``model.py``.

``TritonServer`` starts the server (on 127.0.0.1 unless told otherwise), waits until it is ready, and stops
it by its PID (SIGTERM, then SIGKILL after a timeout: a server whose stub crashed ignores SIGTERM for ~30 s).
It never reports a server ready that is not its own: the ports are checked free first (``PortInUse`` names
the one taken), and ready means this process is alive, has logged that it listens on each of its ports,
and answers ``/v2/health/ready``. The server and its model processes die with the process that started it, however
that ends (SIGKILL and the OOM killer included): ``tritonserver`` gets SIGKILL as its parent-death signal (``prctl``),
and a watchdog (``criticalkv.serving.watchdog``) SIGKILLs its process group, which holds the Python-backend stubs it
forked: a stub whose server died while responses were streaming can block for ever on its way out (seen). The
shared-memory regions of the server are named after the process that started it (``shm_prefix``), so the watchdog,
and failing that the next start (``remove_stale_servers``), removes those of a process that no longer runs.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

from criticalkv.files import cache_root, process_alive
from criticalkv.serving.watchdog import SHM_DIR, Watchdog

PYTRITON_VERSION = "0.7.0"
MODEL_ENV_NUMPY = "numpy==1.26.4"
#: the checkout's root (``criticalkv/serving/launcher.py`` -> the repository)
ROOT = Path(__file__).resolve().parents[2]


def triton_home() -> Path:
    """Where the server and the model environment live (``$CRITICALKV_TRITON_HOME``, default ``ROOT/.triton``)."""
    return Path(os.environ.get("CRITICALKV_TRITON_HOME", ROOT / ".triton"))


def cache_dir() -> Path:
    """criticalkv's user cache (the one the converted models use): the downloaded wheel lives in ``wheels/``."""
    return cache_root()


#: a Triton installation to run instead of the one ``setup()`` unpacks (the official container's /opt/tritonserver):
#: its ``bin/tritonserver`` and ``backends/``; the model then runs in that server's own Python (no model environment)
TRITONSERVER_ENV = "CRITICALKV_TRITONSERVER"


def external_server() -> Path | None:
    """The Triton installation named by ``$CRITICALKV_TRITONSERVER`` (``serve --tritonserver``), or None."""
    value = os.environ.get(TRITONSERVER_ENV)
    return Path(value) if value else None


def server_dir() -> Path:
    return external_server() or triton_home() / "server"


def model_env() -> Path | None:
    """The virtual environment the model runs in (``EXECUTION_ENV_PATH``): None with an external server."""
    return None if external_server() is not None else triton_home() / "model-env"


def python_tag() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def is_set_up() -> bool:
    if external_server() is not None:
        return (server_dir() / "bin" / "tritonserver").is_file() and (server_dir() / "backends" / "python").is_dir()
    return (server_dir() / "bin" / "tritonserver").is_file() and \
        (server_dir() / "backends" / "python" / "triton_python_backend_stub").is_file() and \
        (model_env() / "bin" / "python").is_file()


def _pip(python: str, *args: str) -> None:
    subprocess.run([python, "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True)


def setup(force: bool = False, log=print) -> Path:
    """Download the wheel (once, into the cache), unpack the server, create the model environment. With an external
    server (``$CRITICALKV_TRITONSERVER``) only check that it has ``bin/tritonserver`` and the Python backend."""
    if external_server() is not None:
        if not is_set_up():
            raise FileNotFoundError(f"{server_dir()}: not a Triton installation (no bin/tritonserver or no "
                                    "backends/python); --tritonserver names the folder holding both, e.g. /opt/tritonserver")
        return server_dir()
    home = triton_home()
    if is_set_up() and not force:
        return home
    home.mkdir(parents=True, exist_ok=True)
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"nvidia_pytriton-{PYTRITON_VERSION}-*.whl"))
    if not found:
        log(f"downloading nvidia-pytriton=={PYTRITON_VERSION} (55 MB) into {wheels}")
        _pip(sys.executable, "download", "--no-deps", f"nvidia-pytriton=={PYTRITON_VERSION}", "-d", str(wheels))
        found = sorted(wheels.glob(f"nvidia_pytriton-{PYTRITON_VERSION}-*.whl"))
    if not found:
        raise FileNotFoundError(f"nvidia-pytriton {PYTRITON_VERSION} wheel not found in {wheels} after pip download")
    with tempfile.TemporaryDirectory(dir=home) as tmp:  # unpack aside, rename into place
        with zipfile.ZipFile(found[-1]) as wheel:
            members = [m for m in wheel.namelist() if m.startswith(("pytriton/tritonserver/", "nvidia_pytriton.libs/"))]
            wheel.extractall(tmp, members)
            for member in wheel.infolist():  # zip keeps the executable bits in the high bits of external_attr
                mode = member.external_attr >> 16
                if member.filename in members and mode:
                    os.chmod(Path(tmp) / member.filename, mode)
        staged = Path(tmp) / "server"
        shutil.move(Path(tmp) / "pytriton" / "tritonserver", staged)
        shutil.move(Path(tmp) / "nvidia_pytriton.libs", staged / "nvidia_pytriton.libs")
        stub = staged / "python_backend_stubs" / python_tag() / "triton_python_backend_stub"
        if not stub.is_file():
            raise FileNotFoundError(f"the wheel has no Python-backend stub for Python {python_tag()}")
        shutil.copy2(stub, staged / "backends" / "python" / "triton_python_backend_stub")
        for path in (staged / "bin" / "tritonserver", staged / "backends" / "python" / "triton_python_backend_stub"):
            path.chmod(0o755)
        if server_dir().exists():
            shutil.rmtree(server_dir())
        staged.rename(server_dir())
    env = model_env()
    if force and env.exists():
        shutil.rmtree(env)
    if not (env / "bin" / "python").is_file():
        log(f"creating the model environment {env} ({MODEL_ENV_NUMPY})")
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(env)], check=True)
        _pip(str(env / "bin" / "python"), "install", MODEL_ENV_NUMPY)
    return home


def project_paths() -> list[str]:
    """What the model's ``sys.path`` needs from the project: the checkout and this environment's packages."""
    paths = [str(ROOT)]
    for key in ("purelib", "platlib"):
        path = sysconfig.get_paths()[key]
        if path not in paths:
            paths.append(path)
    return paths


def server_environment() -> dict[str, str]:
    """The server's environment: libpython of this interpreter and the wheel's libraries on the loader path."""
    env = dict(os.environ)
    libs = [sysconfig.get_config_var("LIBDIR") or "", str(server_dir() / "nvidia_pytriton.libs")]
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(p for p in libs if p)
    return env


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(_family(host)) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def connect_host(host: str) -> str:
    """The address a client on this machine uses to reach a server bound to ``host`` (a wildcard address
    is reached through loopback)."""
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)


def url_host(host: str) -> str:
    host = connect_host(host)
    return f"[{host}]" if ":" in host else host


class PortInUse(OSError):
    """A port the server needs is taken (another server, or any other program)."""


def auth_header(api_key: str | None, source: str | None) -> str:
    """The ready banner's curl option for the API key as it was given: the variable's name, or a placeholder for the
    flag's value (never the key itself)."""
    if not api_key:
        return ""
    if source == "$CRITICALKV_API_KEY":
        return ' -H "Authorization: Bearer $CRITICALKV_API_KEY"'
    return " -H 'Authorization: Bearer <the --api-key value>'"


def bind_socket(host: str, port: int, flag: str) -> socket.socket:
    """A TCP socket bound to (host, port) (not listening yet), or PortInUse naming the port and its flag.

    SO_REUSEADDR as servers set it (a port in TIME_WAIT is free), never SO_REUSEPORT: a port another
    socket listens on, with or without SO_REUSEPORT, is refused."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise PortInUse(f"port {port} ({flag}) on {host} is already in use (another server?): stop it or "
                            f"choose another port with {flag}") from None
        raise OSError(f"cannot bind {host}:{port} ({flag}): {err.strerror}") from None
    return sock


def check_ports_free(host: str, ports: dict[str, int]) -> None:
    """PortInUse for the first of ``ports`` (flag -> port) that cannot be bound on ``host``."""
    seen: dict[int, str] = {}
    for flag, port in ports.items():
        if port in seen:
            raise ValueError(f"{flag} and {seen[port]} are both {port}: give each its own port")
        seen[port] = flag
        bind_socket(host, port, flag).close()


#: the Python backend's shared-memory regions: /dev/shm/<SHM_PREFIX><pid of the process that started the server>_
#: <the server's number in that process>_<uuid>
SHM_PREFIX = "criticalkv_triton_"
_SERVER_PROGRAMS = ("tritonserver", "triton_python_backend_stub")
_servers_started = itertools.count()


def shm_prefix(owner_pid: int, serial: int) -> str:
    """The prefix of the shared-memory regions of the ``serial``-th server started by ``owner_pid``."""
    return f"{SHM_PREFIX}{owner_pid}_{serial}_"


def remove_shm(prefix: str) -> list[str]:
    """Remove /dev/shm/<prefix>*; the names removed."""
    removed = []
    for path in glob.glob(os.path.join(SHM_DIR, glob.escape(prefix) + "*")):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def _owner_of(name: str) -> int | None:
    match = re.match(rf"{SHM_PREFIX}(\d+)_", name)
    return int(match.group(1)) if match else None


def remove_stale_servers(log) -> None:
    """What a process that started a server left when it was killed before its watchdog could clean up (both
    killed at once): SIGKILL its ``tritonserver`` and Python-backend stubs (found by the shared-memory prefix on
    their command line) and remove its shared-memory regions. Only those of processes that no longer run."""
    me = os.getuid()
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != me:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if not argv or os.path.basename(argv[0]) not in _SERVER_PROGRAMS:
            continue
        owners = {_owner_of(m.group(0)) for arg in argv for m in [re.search(rf"{SHM_PREFIX}\d+_", arg)] if m}
        owner = next(iter(owners), None)
        if owner is None or process_alive(owner):
            continue
        try:
            os.kill(int(entry), signal.SIGKILL)
            log(f"killed {os.path.basename(argv[0])} (pid {entry}), left running by process {owner}, which no longer "
                "runs")
        except OSError:
            pass
    if not os.path.isdir(SHM_DIR):
        return
    for name in sorted(os.listdir(SHM_DIR)):
        owner = _owner_of(name)
        if owner is None or owner == os.getpid() or process_alive(owner):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except OSError:
            continue
        log(f"removed {SHM_DIR}/{name}: a shared-memory region left by process {owner}, which no longer runs")


def _kill_group(pgid: int, wait_s: float = 10.0) -> bool:
    """SIGKILL what is left of process group ``pgid`` and wait (up to ``wait_s``) until it is gone; whether any
    process was left."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            break
        time.sleep(0.05)
    return True


#: the environment variable naming the drain file of the criticalkv model (templates/model.py)
DRAIN_ENV = "CRITICALKV_DRAIN_FILE"
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL):
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when its parent dies (Linux
    ``prctl(PR_SET_PDEATHSIG)``; elsewhere a no-op). The kernel sends it when the *thread* that forked the
    child ends, so start children from the main thread. A parent that died before the ``prctl`` took
    effect is caught by comparing the parent id afterwards."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork: nothing to load in the child
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), sig)

    return preexec


class TritonServer:
    """One ``tritonserver`` process serving ``repo`` on ``host`` (default 127.0.0.1, loopback only).

    ``start()`` checks that the ports are free (PortInUse names the one taken), starts the server and
    returns once it is ready (or raises with the server's last log lines); ``stop()`` sends SIGTERM to its
    PID, waits ``grace_s``, then SIGKILLs it and whatever of its process group is left. The server and its model
    processes get SIGKILL when the process that started it dies (``watchdog``: the caller's, which then also
    removes what the caller gave it, or one of the server's own).
    """

    def __init__(self, repo: Path, http_port: int | None = None, grpc_port: int | None = None,
                 metrics_port: int | None = None, log_file: Path | None = None, verbose: bool = False,
                 host: str = "127.0.0.1", watchdog: Watchdog | None = None, drain_file: Path | None = None):
        self.repo = Path(repo).resolve()
        self.host = host
        self.http_port = http_port or free_port(host)
        self.grpc_port = grpc_port or free_port(host)
        self.metrics_port = metrics_port or free_port(host)
        self.log_file = Path(log_file) if log_file else self.repo / "tritonserver.log"
        self.verbose = verbose
        self.process: subprocess.Popen | None = None
        self.watchdog = watchdog
        self._own_watchdog = False
        self.shm_prefix = shm_prefix(os.getpid(), next(_servers_started))
        # created by stop(): the criticalkv model then ends its requests at once (templates/model.py says why)
        self.drain_file = Path(drain_file) if drain_file is not None else None

    @property
    def http_url(self) -> str:
        return f"http://{url_host(self.host)}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{url_host(self.host)}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{url_host(self.host)}:{self.metrics_port}/metrics"

    @property
    def ports(self) -> dict[str, int]:
        return {"--http-port": self.http_port, "--grpc-port": self.grpc_port, "--metrics-port": self.metrics_port}

    def command(self) -> list[str]:
        server = server_dir()
        return [
            str(server / "bin" / "tritonserver"), f"--model-repository={self.repo}",
            f"--backend-directory={server / 'backends'}",
            f"--http-address={self.host}", f"--http-port={self.http_port}",
            f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true", "--allow-gpu-metrics=false", "--allow-cpu-metrics=false",
            "--exit-timeout-secs=10", f"--log-verbose={1 if self.verbose else 0}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
        ]

    def start(self, timeout_s: float = 300.0) -> "TritonServer":
        return self.launch().wait_ready(timeout_s)

    def launch(self) -> "TritonServer":
        """Check the ports and start the process (call it from the main thread: the server dies with the
        thread that starts it); ``wait_ready`` then waits for it."""
        if not is_set_up():
            raise FileNotFoundError("tritonserver is not set up: run `criticalkv serve --setup` "
                                    "(or bash scripts/install.sh)")
        check_ports_free(self.host, self.ports)
        self._log_start = self.log_file.stat().st_size if self.log_file.exists() else 0
        if self.watchdog is None:
            self.watchdog, self._own_watchdog = Watchdog("criticalkv"), True
        log = open(self.log_file, "ab")
        # its own session: its process group (the server and the stubs it forks) is killed as one
        env = server_environment()
        if self.drain_file is not None:
            self.drain_file.unlink(missing_ok=True)
            for stale in self.active_instances():
                stale.unlink(missing_ok=True)
            env[DRAIN_ENV] = str(self.drain_file)
        self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                        env=env, start_new_session=True,
                                        preexec_fn=die_with_parent(os.getpid()))
        log.close()
        self.watchdog.kill_group(self.process.pid)
        self.watchdog.remove_shm(self.shm_prefix)
        return self

    def wait_ready(self, timeout_s: float = 300.0, cancelled=lambda: False) -> "TritonServer":
        """Return once ready (or at once when ``cancelled()`` turns true); RuntimeError if the process
        exits first, TimeoutError (the server stopped) after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not cancelled():
            if self.process.poll() is not None:
                self.stop()  # whatever of its group is left, and its watchdog
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode} before it was ready:\n"
                                   f"{self.log_tail()}")
            # its own log says it listens on every port before any health answer counts: another server
            # on a port this one failed to take must not make it look ready
            if self.listening() and self.ready() and self.process.poll() is None:
                return self
            time.sleep(0.2)
        if cancelled():
            return self
        self.stop()
        raise TimeoutError(f"tritonserver was not ready within {timeout_s:.0f} s:\n{self.log_tail()}")

    def listening(self) -> bool:
        """Whether this server's log (since its start) says it listens on its HTTP, gRPC and metrics ports."""
        try:
            with open(self.log_file, "rb") as f:
                f.seek(self._log_start)
                text = f.read().decode(errors="replace")
        except OSError:
            return False
        return all(re.search(rf"Started {service} at \S*:{port}\b", text) for service, port in (
            ("GRPCInferenceService", self.grpc_port), ("HTTPService", self.http_port),
            ("Metrics Service", self.metrics_port)))

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def active_instances(self) -> list[Path]:
        """The criticalkv model instances that have not answered every request since the drain began (each keeps
        ``<drain file>.<pid>.active`` until then: templates/model.py)."""
        if self.drain_file is None:
            return []
        return [Path(p) for p in glob.glob(glob.escape(str(self.drain_file)) + ".*.active")]

    def wait_drained(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until every model instance has ended its requests; whether they all did."""
        deadline = time.monotonic() + timeout_s
        while self.active_instances():
            if time.monotonic() > deadline or self.process.poll() is not None:
                return False
            time.sleep(0.02)
        return True

    def stop(self, grace_s: float = 20.0, drain_s: float = 5.0) -> int | None:
        """SIGTERM the server's PID, wait up to ``grace_s``, then SIGKILL it; returns its exit code. With a
        ``drain_file``, the criticalkv model first ends the requests in flight (Triton waits for them otherwise), and
        SIGTERM waits (at most ``drain_s``) until every model instance has answered all of them: tritonserver stopped
        while the model still sent responses sometimes never unloaded it ("Found 1 live models" until its exit timeout,
        exit status 1). Any process of its group still there then (a model process that outlived it) gets SIGKILL
        too."""
        process = self.process
        if process is None:
            return None
        code = process.poll()
        if code is None:
            if self.drain_file is not None:
                self.drain_file.touch()
                self.wait_drained(drain_s)
            process.send_signal(signal.SIGTERM)
            try:
                code = process.wait(grace_s)
            except subprocess.TimeoutExpired:
                process.kill()
                code = process.wait(10)
        if _kill_group(process.pid):  # the group outlives its leader only through a model process stuck on its way out
            remove_shm(self.shm_prefix)  # which leaves its shared memory behind
        if self._own_watchdog and self.watchdog is not None:
            self.watchdog.close()
            self.watchdog, self._own_watchdog = None, False
        return code

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
