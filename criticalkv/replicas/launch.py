"""``criticalkv serve --replicas N``: start a local Ray (or join ``--ray-address``), deploy the engine replicas with Ray
Serve, serve the OpenAI-compatible API in this process over them, print ``ready:``, and on Ctrl-C / SIGTERM stop what
it started.

The API is ``criticalkv serve``'s own frontend (``criticalkv.serving.openai_api.OpenAIFrontend``: uvicorn on the socket
the command bound before anything started, the same routes, checks, error objects, deadlines and streaming) whose
model is ``ReplicaModel``: the replicas' Serve handle. Serve's HTTP proxy does not run (``proxy_location="Disabled"``):
no port of it, no process.

Where Ray listens: a local Ray for ``--host 127.0.0.1`` (the default) or any loopback address runs with its node
address on loopback: every port of Ray (GCS, raylets, object manager, workers and replicas, the dashboard and runtime-env
agents, the metrics agent) then listens on 127.0.0.1 only (Ray binds its gRPC servers to 127.0.0.1 when the node's
address is, else to every interface; ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is the switch that lets a Linux node take
127.0.0.1 as its address, the single-machine mode of Ray on macOS and Windows). With another ``--host`` the node's
address is that host (``0.0.0.0``: Ray's own choice) and Ray's gRPC servers listen on every interface: docs/serving.md.

What it starts and stops: on a local Ray (``address="local"``: always a new one, never another user's) everything,
Ray included (``ray.shutdown`` ends its processes; a watchdog process SIGKILLs them if this process dies without
stopping them); on an existing cluster, the Serve application it deployed, its context store actor and, when Serve was
not running there before, Serve itself. Stopping first ends the requests in flight at once with OpenAI's 503 "the
server is shutting down" (as ``criticalkv serve`` does), then deletes the application (its replicas stop), then the
store.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from criticalkv.replicas.store import NAMESPACE, ContextStore, store_name
from criticalkv.serving.openai_api import DEFAULT_REQUEST_TIMEOUT_S

#: how a local Ray is told that its node address may be loopback (read when ray is imported: ``ray_environment``)
LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
#: Ray's authentication mode (token / disabled), read from the environment only (``ray_environment``)
AUTH_MODE = "RAY_AUTH_MODE"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def ray_environment(host: str, local: bool) -> dict[str, str]:
    """The environment a local Ray for ``--host`` needs, set before ``ray`` is first imported (its constants read it
    then, and every process of the local Ray inherits it): loopback node addresses allowed for a loopback ``host``;
    token authentication named (``$RAY_AUTH_MODE=token``, unless the environment already names a mode): the mode a
    new local Ray takes anyway, said here so that Ray does not warn "Token authentication is enabled for this Ray
    cluster" at every start. Its errors (a token missing or refused) are raised as before; joining a cluster
    (``--ray-address``) leaves the mode to that cluster."""
    out = {LOOPBACK_SWITCH: "0"} if local and is_loopback(host) else {}
    if local and AUTH_MODE not in os.environ:
        out[AUTH_MODE] = "token"
    return out


def node_address(host: str) -> str | None:
    """The node address a local Ray is given for ``--host`` (None: Ray's own choice, for 0.0.0.0 / ::)."""
    if host in ("0.0.0.0", "::", ""):
        return None
    if is_loopback(host):
        return "127.0.0.1"
    return host


@dataclass
class ReplicaServeConfig:
    """What ``criticalkv serve --replicas`` deploys (its flags)."""

    engine_dir: Path
    replicas: int = 2
    ray_address: str | None = None
    host: str = "127.0.0.1"
    port: int = 9000
    api_key: str | None = None
    api_key_source: str | None = None
    model_name: str = "criticalkv"
    backend: str | None = None
    threads: int = 0
    scheduler: dict = field(default_factory=dict)
    router: str = "affinity"
    imbalance_threshold: int = 4
    store_mib: float = 1024.0
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    max_ongoing_requests: int = 64
    prepack: bool = False
    app_name: str = "criticalkv"
    ready_timeout: float = 600.0
    max_body_bytes: int | None = None
    request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT_S

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"--replicas must be an integer >= 1, got {self.replicas!r}")
        if self.router not in ("affinity", "pow2"):
            raise ValueError(f"--replica-options router must be affinity or pow2, got {self.router!r}")
        if self.imbalance_threshold < 0:
            raise ValueError(f"--replica-options imbalance_threshold must be >= 0, got {self.imbalance_threshold}")
        if self.store_mib < 0:
            raise ValueError(f"--replica-options context_store_mib must be >= 0, got {self.store_mib}")
        if self.replica_cpus < 0 or self.replica_gpus < 0:
            raise ValueError("--replica-options replica_cpus and replica_gpus must be >= 0")
        if not (Path(self.engine_dir) / "manifest.json").is_file():
            raise FileNotFoundError(f"{self.engine_dir}: not an engine directory (no manifest.json)")


class ReplicaService:
    """The running service: ``start`` (Ray, Serve, the store, the application, the API), ``stop`` (what ``start``
    started). ``sock``: the API's socket, bound by the caller on --host and --openai-port before anything started."""

    def __init__(self, config: ReplicaServeConfig, sock: socket.socket | None = None,
                 say=lambda m: print(m, file=sys.stderr, flush=True)):
        self.config, self.say = config, say
        self.sock = sock
        self.local = config.ray_address is None
        self.ray_started = self.serve_started = self.deployed = self.running = False
        self.store = self.frontend = self.model = self.watchdog = None
        self.address = None
        self._watched: set[int] = set()

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "::", "") else self.config.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.sock.getsockname()[1] if self.sock is not None else self.config.port}"

    def start(self, cancelled=lambda: False) -> None:
        import ray
        from ray import serve

        from criticalkv.replicas.deployment import ReplicaModel, add_replica_routes, application, load_tokenizer
        from criticalkv.request import TextBound
        from criticalkv.runtime.manifest import read_manifest
        from criticalkv.serving.openai_api import OpenAIFrontend

        c = self.config
        manifest = read_manifest(c.engine_dir, verify=False)
        if self.sock is None:
            from criticalkv.serving import launcher

            self.sock = launcher.bind_socket(c.host, c.port, "--openai-port")
        # Serve says "Connecting to existing Serve app ..." at INFO each time this process reaches its controller
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
        if self.local:
            cpus = max(os.cpu_count() or 1, int(c.replicas * c.replica_cpus + 0.999))
            address = node_address(c.host)
            self.say(f"starting a local Ray ({cpus} CPUs, listening on {address or 'every interface'}) ...")
            ray.init(address="local", namespace=NAMESPACE, include_dashboard=False, num_cpus=cpus,
                     log_to_driver=True, logging_level=logging.WARNING,
                     **({"_node_ip_address": address} if address else {}))
            self.ray_started = True
            self._watch_ray()
            if address is not None and ray.util.get_node_ip_address() != address:
                raise RuntimeError(f"Ray took {ray.util.get_node_ip_address()} as its node address, not {address} "
                                   f"(--host {c.host}): ${LOOPBACK_SWITCH} must be 0 before ray is imported")
        else:
            self.say(f"joining the Ray cluster at {c.ray_address} ...")
            ray.init(address=c.ray_address, namespace=NAMESPACE, log_to_driver=True, logging_level=logging.WARNING)
            self.ray_started = True
        self.address = ray.get_runtime_context().gcs_address
        running = serve.status().applications if self._serve_running() else {}
        if c.app_name in running:
            raise RuntimeError(f"a Serve application named {c.app_name!r} already runs on this cluster: stop it, or "
                               "give another --replica-options app_name=...")
        self.serve_started = not self._serve_running()
        if self.serve_started:  # the OpenAI API runs here: no HTTP proxy
            serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING", "enable_access_log": False})
        try:
            ray.get_actor(store_name(c.app_name), namespace=NAMESPACE)
            raise RuntimeError(f"a context store for {c.app_name!r} already exists on this cluster (another "
                               "`criticalkv serve --replicas` with this app_name?)")
        except ValueError:
            pass
        self.store = ray.remote(ContextStore).options(
            name=store_name(c.app_name), namespace=NAMESPACE, lifetime="detached", num_cpus=0, max_restarts=-1,
        ).remote(int(c.store_mib * 2**20))
        app = application(c.engine_dir, c.replicas, backend=c.backend, threads=c.threads, scheduler=c.scheduler,
                          app_name=c.app_name, router=c.router, imbalance_threshold=c.imbalance_threshold,
                          store=c.store_mib > 0, replica_cpus=c.replica_cpus, replica_gpus=c.replica_gpus,
                          max_ongoing_requests=c.max_ongoing_requests, prepack=c.prepack)
        self.say(f"deploying {c.replicas} replica{'s' if c.replicas > 1 else ''} of {c.engine_dir} "
                 f"(router {c.router}, context store {c.store_mib:g} MiB) ...")
        from ray.serve import RunTarget  # serve.run would wait for the replicas without seeing Ctrl-C

        serve.run_many([RunTarget(target=app, name=c.app_name, route_prefix=None)],
                       wait_for_applications_running=False, wait_for_ingress_deployment_creation=False)
        self.deployed = True
        tokenizer = load_tokenizer(c.engine_dir)  # while the replicas load
        self._wait_running(cancelled)
        if cancelled():
            return
        self.model = ReplicaModel(serve.get_deployment_handle("Replica", c.app_name), c.model_name, tokenizer)
        self.frontend = OpenAIFrontend(
            self.sock, None, c.model_name, tokenizer, c.api_key, chat_max_tokens=int(manifest["build"]["max_new_tokens"]),
            text_bound=TextBound.of(tokenizer, int(manifest["build"]["max_input_len"])),
            max_body_bytes=c.max_body_bytes, model=self.model, request_timeout=c.request_timeout)
        add_replica_routes(self.frontend.app, self.model, self.store, c.api_key)
        self.frontend.start(cancelled=cancelled)
        deadline = time.monotonic() + c.ready_timeout
        while not cancelled() and not self.healthy():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the replicas do not answer /health after {c.ready_timeout:g} s")
            time.sleep(0.5)
        self.running = True

    @staticmethod
    def _serve_running() -> bool:
        import ray
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        try:
            ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
            return True
        except ValueError:
            return False

    def _watch_ray(self) -> None:
        """(A local Ray.) Every process of it that runs now (this process's descendants: Ray's head processes, its
        agents, the workers and replicas) is SIGKILLed by the watchdog if this process dies without stopping it.
        Called again while serving: replicas Serve restarts are new processes."""
        import psutil  # Ray's dependency

        if self.watchdog is None:
            from criticalkv.serving.watchdog import Watchdog

            self.watchdog = Watchdog("criticalkv serve --replicas")
        for p in psutil.Process().children(recursive=True):
            if p.pid not in self._watched and p.pid != self.watchdog.process.pid:
                if self.watchdog.kill_process(p.pid):
                    self._watched.add(p.pid)

    def _wait_running(self, cancelled) -> None:
        from ray import serve

        deadline = time.monotonic() + self.config.ready_timeout
        while not cancelled():
            if self.local:
                self._watch_ray()
            app = serve.status().applications.get(self.config.app_name)
            status = str(getattr(app, "status", "")) if app is not None else ""
            if status.endswith("RUNNING"):
                return
            if status.endswith("DEPLOY_FAILED"):
                raise RuntimeError(f"the replicas did not start: {app.message}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the application is not running after {self.config.ready_timeout:g} s "
                                   f"(status {status or 'unknown'})")
            time.sleep(0.5)

    def healthy(self) -> bool:
        """Whether ``GET /health`` answers 200 (the API is up and a replica answers)."""
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=15) as response:
                return response.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def replicas(self) -> dict:
        """``GET /replicas``: the replicas' reports, the store's counts, the router's decisions."""
        request = urllib.request.Request(f"{self.base_url}/replicas", headers={
            "Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {})
        with urllib.request.urlopen(request, timeout=15) as response:
            return json.loads(response.read())

    def alive(self) -> bool:
        import ray

        if self.frontend is not None and not self.frontend.alive():
            return False
        try:
            return ray.is_initialized() and bool(ray.nodes())
        except Exception:
            return False

    def tick(self) -> None:
        """While serving (every few seconds): the watchdog learns the processes a local Ray started since."""
        if self.local and self.ray_started:
            try:
                self._watch_ray()
            except Exception:
                pass

    def stop(self) -> None:
        """End the requests in flight (503) and stop the API, delete the application, the store, Serve (if started
        here on a cluster), Ray (if local). Each step is tried even when an earlier one failed."""
        if self.frontend is not None:
            self.frontend.stop()  # OpenAI's 503 to everything in flight, at once; the socket is closed
            self.frontend = None
        elif self.sock is not None:
            self.sock.close()
        if not self.ray_started:
            self._close_watchdog()
            return
        import ray
        from ray import serve

        if self.deployed:
            try:
                serve.delete(self.config.app_name)
            except Exception as err:
                self.say(f"(deleting the application failed: {type(err).__name__}: {err})")
        if self.store is not None:
            try:
                ray.kill(self.store, no_restart=True)
            except Exception:
                pass
        # a local Ray goes whole (ray.shutdown): Serve's own shutdown there would only race it (its controller killed
        # during its graceful_shutdown: an error line from the raylet at every stop)
        if self.serve_started and not self.local:
            try:
                serve.shutdown()
            except Exception:
                pass
        ray.shutdown()
        self.ray_started = False
        self._close_watchdog()

    def _close_watchdog(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
            self.watchdog = None


def ready_message(service: ReplicaService) -> str:
    from criticalkv.serving.launcher import auth_header

    c = service.config
    base = f"{service.base_url}/v1"
    auth = auth_header(c.api_key, c.api_key_source)
    body = json.dumps({"model": c.model_name, "messages": [{"role": "user", "content": "..."}]})
    where = "a local Ray" if service.local else f"the Ray cluster at {c.ray_address}"
    lines = [f"ready: OpenAI API {base}  (model \"{c.model_name}\"{', API key required' if c.api_key else ''}; "
             f"{c.replicas} replica{'s' if c.replicas > 1 else ''} on {where}, router {c.router}, context store "
             f"{c.store_mib:g} MiB)",
             f"  curl {base}/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'",
             f"  replicas, their contexts and the store: curl {service.base_url}/replicas{auth}"]
    if c.host in ("0.0.0.0", "::", ""):
        lines.append(f"  listening on every network interface (--host {c.host})")
    lines.append("Ctrl-C stops the replicas" + (" and the local Ray." if service.local else "."))
    return "\n".join(lines)


def serve_replicas(config: ReplicaServeConfig, stop: threading.Event, sock: socket.socket | None = None) -> int:
    """Start, print ``ready:``, wait for ``stop`` (Ctrl-C / SIGTERM), stop; the status ``criticalkv serve`` exits
    with. ``sock``: the API's socket, bound by the caller (default: bound here)."""
    service = ReplicaService(config, sock)
    try:
        try:
            service.start(cancelled=stop.is_set)
        except (RuntimeError, TimeoutError) as err:
            print(f"criticalkv serve: error: {err}", file=sys.stderr)
            return 1
        if stop.is_set():
            return 0
        print(ready_message(service), flush=True)
        while not stop.wait(2.0):
            if not service.alive():
                print("criticalkv serve: the Ray cluster or the API is gone", file=sys.stderr)
                return 1
            service.tick()
        return 0
    finally:
        if stop.is_set():
            service.say("criticalkv serve: stopping: ending the requests in flight")
        service.stop()
        service.say("criticalkv serve: stopped")
