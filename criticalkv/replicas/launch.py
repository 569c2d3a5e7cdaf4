"""``criticalkv serve --replicas N``: start a local Ray (or join ``--ray-address``), deploy the replicas and the
OpenAI-compatible ingress with Ray Serve, print ``ready:``, and on Ctrl-C / SIGTERM stop what it started.

What it starts and stops: on a local Ray (``address="local"``: always a new one, never another user's) everything,
Ray included (``ray.shutdown`` ends its processes); on an existing cluster, the Serve application it deployed, its
context store actor and, when Serve was not running there before, Serve itself. Stopping first ends the requests in
flight at once with OpenAI's 503 "the server is shutting down" (as ``criticalkv serve`` does), then deletes the
application (its replicas stop), then the store.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from criticalkv.replicas.store import NAMESPACE, ContextStore, store_name


@dataclass
class ReplicaServeConfig:
    """What ``criticalkv serve --replicas`` deploys (its flags)."""

    engine_dir: Path
    replicas: int = 2
    ray_address: str | None = None
    host: str = "127.0.0.1"
    port: int = 9000
    api_key: str | None = None
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
    app_name: str = "criticalkv"
    ready_timeout: float = 600.0
    max_body_bytes: int | None = None

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
    """The running service: ``start`` (Ray, Serve, the store, the application), ``stop`` (what ``start`` started)."""

    def __init__(self, config: ReplicaServeConfig, say=lambda m: print(m, file=sys.stderr, flush=True)):
        self.config, self.say = config, say
        self.local = config.ray_address is None
        self.ray_started = self.serve_started = self.deployed = self.running = False
        self.store = None
        self.address = None

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "::", "") else self.config.host
        return f"http://{host}:{self.config.port}"

    def start(self, cancelled=lambda: False) -> None:
        import ray
        from ray import serve

        from criticalkv.replicas.deployment import application
        from criticalkv.runtime.manifest import read_manifest

        c = self.config
        manifest = read_manifest(c.engine_dir, verify=False)
        if self.local:
            cpus = max(os.cpu_count() or 1, int(c.replicas * c.replica_cpus + 0.999))
            self.say(f"starting a local Ray ({cpus} CPUs) ...")
            ray.init(address="local", namespace=NAMESPACE, include_dashboard=False, num_cpus=cpus,
                     log_to_driver=True, logging_level=logging.WARNING)
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
        serve.start(http_options={"host": c.host, "port": c.port},
                    proxy_location="HeadOnly" if self.local else "EveryNode",
                    logging_config={"log_level": "WARNING", "enable_access_log": False})
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
                          model_name=c.model_name, api_key=c.api_key,
                          chat_max_tokens=int(manifest["build"]["max_new_tokens"]), app_name=c.app_name,
                          router=c.router, imbalance_threshold=c.imbalance_threshold, store=c.store_mib > 0,
                          replica_cpus=c.replica_cpus, replica_gpus=c.replica_gpus,
                          max_ongoing_requests=c.max_ongoing_requests, max_body_bytes=c.max_body_bytes)
        self.say(f"deploying {c.replicas} replica{'s' if c.replicas > 1 else ''} of {c.engine_dir} "
                 f"(router {c.router}, context store {c.store_mib:g} MiB) ...")
        from ray.serve import RunTarget  # serve.run would wait for the replicas without seeing Ctrl-C

        serve.run_many([RunTarget(target=app, name=c.app_name, route_prefix="/")], wait_for_applications_running=False,
                       wait_for_ingress_deployment_creation=False)
        self.deployed = True
        self._wait_running(cancelled)
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

    def _wait_running(self, cancelled) -> None:
        from ray import serve

        deadline = time.monotonic() + self.config.ready_timeout
        while not cancelled():
            app = serve.status().applications.get(self.config.app_name)
            status = str(getattr(app, "status", "")) if app is not None else ""
            if status.endswith("RUNNING") and self.healthy():
                return
            if status.endswith("DEPLOY_FAILED"):
                raise RuntimeError(f"the replicas did not start: {app.message}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the application is not running after {self.config.ready_timeout:g} s "
                                   f"(status {status or 'unknown'})")
            time.sleep(0.5)

    def healthy(self) -> bool:
        """Whether ``GET /health`` answers 200 (the ingress is up and a replica answers)."""
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

        try:
            return ray.is_initialized() and bool(ray.nodes())
        except Exception:
            return False

    def stop(self) -> None:
        """End the requests in flight (503), delete the application, the store, Serve (if started here), Ray (if
        local). Each step is tried even when an earlier one failed."""
        import ray
        from ray import serve

        if not self.ray_started:
            return
        if self.running:
            try:  # OpenAI's 503 to everything in flight, at once
                serve.get_deployment_handle("Ingress", self.config.app_name).drain.remote().result(timeout_s=10)
            except Exception as err:
                self.say(f"(the ingress did not drain: {type(err).__name__}: {err})")
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
        if self.serve_started:
            try:
                serve.shutdown()
            except Exception:
                pass
        ray.shutdown()
        self.ray_started = False


def ready_message(service: ReplicaService) -> str:
    c = service.config
    base = f"{service.base_url}/v1"
    auth = ' -H "Authorization: Bearer $CRITICALKV_API_KEY"' if c.api_key else ""
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


def serve_replicas(config: ReplicaServeConfig, stop: threading.Event) -> int:
    """Start, print ``ready:``, wait for ``stop`` (Ctrl-C / SIGTERM), stop; the status ``criticalkv serve`` exits
    with."""
    service = ReplicaService(config)
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
                print("criticalkv serve: the Ray cluster is gone", file=sys.stderr)
                return 1
        return 0
    finally:
        if stop.is_set():
            service.say("criticalkv serve: stopping: ending the requests in flight")
        service.stop()
        service.say("criticalkv serve: stopped")
