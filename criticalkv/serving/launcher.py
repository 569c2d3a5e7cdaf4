"""Set up and run the ``tritonserver`` bundled in the ``nvidia-pytriton`` wheel (CPU machines; GPU boxes use the
official Triton container, see the README).

``setup()`` makes, inside the checkout (``.triton/``, git-ignored):

* ``.triton/server/``: ``bin/tritonserver``, ``backends/python/`` with the Python-backend stub for this
  interpreter's version copied in, and the wheel's bundled libraries (``nvidia_pytriton.libs``), taken out
  of the wheel (``pip download --no-deps nvidia-pytriton==0.7.0`` into ``$CRITICALKV_CACHE/wheels``);
* ``.triton/model-env/``: the virtual environment the model runs in (``EXECUTION_ENV_PATH``): the stub
  imports that environment's numpy and needs ``numpy<2`` (with numpy 2 it crashes on the first BYTES
  input), while the project keeps its own numpy. Everything else (criticalkv, ONNX Runtime, transformers)
  comes from the project's environment, appended to the model's ``sys.path`` by ``model.py``.

``TritonServer`` starts the server on 127.0.0.1, waits until it is ready, and stops it by its PID
(SIGTERM, then SIGKILL after a timeout: a server whose stub crashed ignores SIGTERM for ~30 s).
"""

from __future__ import annotations

import os
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

PYTRITON_VERSION = "0.7.0"
MODEL_ENV_NUMPY = "numpy==1.26.4"
#: the checkout's root (``criticalkv/serving/launcher.py`` -> the repository)
ROOT = Path(__file__).resolve().parents[2]


def triton_home() -> Path:
    """Where the server and the model environment live (``$CRITICALKV_TRITON_HOME``, default ``ROOT/.triton``)."""
    return Path(os.environ.get("CRITICALKV_TRITON_HOME", ROOT / ".triton"))


def cache_dir() -> Path:
    return Path(os.environ.get("CRITICALKV_CACHE", Path.home() / ".cache" / "criticalkv"))


def server_dir() -> Path:
    return triton_home() / "server"


def model_env() -> Path:
    return triton_home() / "model-env"


def python_tag() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def is_set_up() -> bool:
    return (server_dir() / "bin" / "tritonserver").is_file() and \
        (server_dir() / "backends" / "python" / "triton_python_backend_stub").is_file() and \
        (model_env() / "bin" / "python").is_file()


def _pip(python: str, *args: str) -> None:
    subprocess.run([python, "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True)


def setup(force: bool = False, log=print) -> Path:
    """Download the wheel (once, into the cache), unpack the server, create the model environment."""
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TritonServer:
    """One ``tritonserver`` process on 127.0.0.1 serving ``repo``.

    ``start()`` returns once ``/v2/health/ready`` answers 200 (or raises with the server's last log lines);
    ``stop()`` sends SIGTERM to its PID, waits ``grace_s``, then SIGKILLs it.
    """

    def __init__(self, repo: Path, http_port: int | None = None, grpc_port: int | None = None,
                 metrics_port: int | None = None, log_file: Path | None = None, verbose: bool = False):
        self.repo = Path(repo).resolve()
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.log_file = Path(log_file) if log_file else self.repo / "tritonserver.log"
        self.verbose = verbose
        self.process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        server = server_dir()
        return [
            str(server / "bin" / "tritonserver"), f"--model-repository={self.repo}",
            f"--backend-directory={server / 'backends'}",
            "--http-address=127.0.0.1", f"--http-port={self.http_port}",
            "--grpc-address=127.0.0.1", f"--grpc-port={self.grpc_port}",
            "--metrics-address=127.0.0.1", f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true", "--allow-gpu-metrics=false", "--allow-cpu-metrics=false",
            "--exit-timeout-secs=10", f"--log-verbose={1 if self.verbose else 0}",
        ]

    def start(self, timeout_s: float = 300.0) -> "TritonServer":
        if not is_set_up():
            raise FileNotFoundError("tritonserver is not set up: run `criticalkv serve --setup` "
                                    "(or bash scripts/install.sh)")
        log = open(self.log_file, "ab")
        self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                        env=server_environment(), start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode} before it was ready:\n"
                                   f"{self.log_tail()}")
            if self.ready():
                return self
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"tritonserver was not ready within {timeout_s:.0f} s:\n{self.log_tail()}")

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

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM the server's PID, wait up to ``grace_s``, then SIGKILL it; returns its exit code."""
        process = self.process
        if process is None or process.poll() is not None:
            return None if process is None else process.returncode
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait(10)

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
