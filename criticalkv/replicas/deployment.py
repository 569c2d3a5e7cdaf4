"""The Ray Serve application: engine replicas behind the OpenAI-compatible API.

``Replica`` (deployment ``Replica``, N of them): one ``Engine`` and its serving ``Scheduler`` (continuous batching,
chunked prefill, the context cache, one KV memory budget), exactly what one Triton model instance runs. Its
``generate`` takes a request already parsed and tokenised by the frontend and streams the outputs the OpenAI layer
reads from the Triton model (``text_output``, ``finish_reason``, ``num_input_tokens``, ``num_output_tokens``,
``context_cache_hit``; ``error`` for a failure, worded as the Triton model words it). With the shared store
(``criticalkv.replicas.store``) a context it does not hold is looked up there before it is compressed, and every
context it compresses is published there. It reports the contexts it holds to the router
(``record_routing_stats``) and its state to the store every second.

The OpenAI-compatible API is not a deployment: ``criticalkv serve --replicas`` runs the app of
``criticalkv.serving.openai_api`` in its own process (``OpenAIFrontend``, as ``criticalkv serve`` does in front of
Triton: the same uvicorn server, routes, request checks, error objects, deadlines and streaming) over
``ReplicaModel``, which parses and tokenises each request as the Triton model does (``criticalkv.serving.requests``),
names its context's digest as the request's ``route`` for ``ContextAffinityRouter`` (which runs in that process, the
handle's) and calls the replicas through a Ray Serve handle. A request whose replica dies before it sent anything is
sent again (to another replica, or the restarted one); one whose replica dies after it streamed tokens ends with
OpenAI's error object (503): no request waits for a dead replica. ``GET /replicas`` (``add_replica_routes``) shows
the replicas' last reports, the store's counts, the router's decisions and every request in flight with the stage it
reached (``InFlight``), on the frontend and on its replica.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path
from typing import Any, AsyncIterator

import ray
from ray import serve
from starlette.requests import Request as HTTPRequest  # module level: FastAPI reads the annotations

from criticalkv.errors import RequestError
from criticalkv.replicas.router import ROUTERS, ContextAffinityRouter
from criticalkv.replicas.store import (NAMESPACE, REPORT_PERIOD_S, engine_fingerprint, from_host, model_name,
                                       route_digest, store_key, store_name, to_host)
from criticalkv.request import Request, TextBound
from criticalkv.runtime.manifest import read_manifest
from criticalkv.serving.context_cache import context_key
from criticalkv.serving.openai_api import INTERNAL_PREFIX, SHUTTING_DOWN, APIError, _until, model_error, model_inputs
from criticalkv.serving.requests import TextStream, encode_inputs, parse_request

#: the inputs the OpenAI layer may send (it sends ``context`` only to a model that has it)
MODEL_INPUTS = frozenset({"text_input", "stream", "sampling_parameters", "exclude_input_in_output", "kv_budget",
                          "return_num_input_tokens", "return_num_output_tokens", "return_kv_bytes",
                          "apply_chat_template", "context", "input_ids", "context_ids", "context_threshold"})
#: ONNX Runtime options of a replica that does not prepack (``lean_options``): every session maps the one copy of the
#: weights (shared with the other replicas of the machine through the page cache), and no session keeps its arena
LEAN_ORT_OPTIONS = {"prepack": False, "prefill_prepack": False, "arena": False}
#: glibc's allocator in a replica process: large blocks always mapped (and unmapped when freed, not kept by its heap
#: after a long prompt), two arenas instead of one per thread and core
REPLICA_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_ARENA_MAX": "2"}
#: the longest a replica waits for the shared store's copy of a context before it compresses the context itself
STORE_LOAD_TIMEOUT_S = 10.0
#: the replica failures after which a request that received nothing yet is sent again
REPLICA_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


def load_tokenizer(engine_dir: str | Path):
    """The engine's tokenizer as ``Engine.tokenizer`` loads it (the fast one when there is a ``tokenizer.json``)."""
    folder = Path(engine_dir) / "tokenizer"
    if (folder / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def process_memory() -> dict:
    """This process's memory in MiB (Linux ``/proc/self/smaps_rollup``): ``rss`` (resident), ``anonymous`` (its own
    heap: arenas, buffers, prepacked weights), ``file`` (mapped files resident: the engine's weights, libraries; shared
    with every process mapping them) and ``pss`` (resident with shared pages divided among their processes)."""
    fields = {}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if rest.strip().endswith("kB"):
                    fields[name] = int(rest.split()[0]) / 1024
    except OSError:
        return {}
    rss = fields.get("Rss", 0.0)
    anonymous = fields.get("Anonymous", 0.0)
    return {"rss": round(rss, 1), "anonymous": round(anonymous, 1), "file": round(rss - anonymous, 1),
            "pss": round(fields.get("Pss", 0.0), 1)}


def keep_serve_grpc_on_loopback() -> None:
    """(In a replica, before Serve finishes starting it.) Ray Serve 2.60 opens in every replica an inter-deployment gRPC
    server (what handles call with ``RAY_SERVE_USE_GRPC_BY_DEFAULT=1``; unused otherwise) bound to every interface,
    ``[::]:0`` written in ``ray/serve/_private/replica.py``. On a node whose address is loopback (``criticalkv serve
    --replicas`` with a loopback ``--host``), bind it to 127.0.0.1 like the rest of Ray."""
    if ray.util.get_node_ip_address() != "127.0.0.1":
        return
    from ray.serve._private import replica as serve_replica

    original = serve_replica.add_port_to_grpc_server
    if getattr(original, "criticalkv_loopback", False):
        return

    def on_loopback(server, address: str):
        if address.startswith("[::]:"):
            address = "127.0.0.1:" + address.removeprefix("[::]:")
        return original(server, address)

    on_loopback.criticalkv_loopback = True
    serve_replica.add_port_to_grpc_server = on_loopback


# ----------------------------------------------------------------------------------------------- in flight
class InFlight:
    """The requests a process is serving now, each with the stage it reached and when (``GET /replicas`` shows them):
    where a slow or lost request waits, in the process's own words."""

    def __init__(self, shown: int = 32):
        self.records: dict[int, dict] = {}
        self.shown = shown

    def add(self, request_id: str | None, stage: str, **fields) -> dict:
        now = time.monotonic()
        record = {"request_id": request_id, "stage": stage, "since": now, "started": now, "outputs": 0, **fields}
        self.records[id(record)] = record
        return record

    def stage(self, record: dict, stage: str, **fields) -> None:
        record.update(stage=stage, since=time.monotonic(), **fields)

    def remove(self, record: dict) -> None:
        self.records.pop(id(record), None)

    def report(self, where=None) -> list[dict]:
        """The oldest requests first: request id, stage, seconds in that stage and in all (``where(record)``: more
        fields, e.g. the scheduler's own state of the request)."""
        now = time.monotonic()
        out = []
        for r in sorted(self.records.values(), key=lambda r: r["started"])[:self.shown]:
            row = {k: v for k, v in r.items() if k not in ("since", "started")}
            row.update(stage_s=round(now - r["since"], 3), age_s=round(now - r["started"], 3))
            if where is not None:
                row.update(where(r))
            out.append(row)
        return out


# ----------------------------------------------------------------------------------------------- replica
class Replica:
    """One engine and its scheduler (a Ray Serve replica). ``scheduler``: ``SchedulerConfig`` fields; ``store``:
    whether contexts are shared through the application's ``ContextStore``; ``prepack``: ONNX Runtime's sessions as
    ``criticalkv serve`` runs them (their own prepacked copies of the weights: prefill 1.11x and decode 1.2x faster,
    docs/performance.md, for about 1.9 GB more per replica of the bundled model); False (default): ``LEAN_ORT_OPTIONS``,
    a replica that fits (docs/serving.md, "Memory")."""

    async def __init__(self, engine_dir: str, backend: str | None = None, threads: int = 0,
                       scheduler: dict | None = None, app_name: str = "criticalkv", store: bool = True,
                       device: str | None = None, prepack: bool = False):
        from criticalkv.runtime import Engine
        from criticalkv.runtime.manifest import default_backend
        from criticalkv.serving import Scheduler

        keep_serve_grpc_on_loopback()
        options: dict[str, Any] = {}
        if threads:
            options["threads"] = int(threads)
        if device is not None:
            options["device"] = device
        if not prepack and (backend or default_backend(read_manifest(engine_dir, verify=False))) == "onnxruntime":
            options.update(LEAN_ORT_OPTIONS)
        self.engine = Engine.load(engine_dir, backend=backend, verify=False, **options)
        self.tokenizer = self.engine.tokenizer
        self.scheduler = Scheduler(self.engine, **(scheduler or {}))
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside Serve (a test calling the class directly)
            self.replica_id = f"pid{os.getpid()}"
        self.store = ray.get_actor(store_name(app_name), namespace=NAMESPACE)
        self.share = bool(store)
        self.key_prefix = (model_name(engine_dir), engine_fingerprint(engine_dir), type(self.engine.backend).__name__)
        self.counts = {"requests": 0, "store_loads": 0, "store_misses": 0, "store_errors": 0, "published": 0}
        self.in_flight = InFlight()
        self.loop = asyncio.get_running_loop()
        if self.share:
            self.scheduler.on_context_compressed = self._publish
        self._reporter = self.loop.create_task(self._report_loop())

    # ------------------------------------------------------------------ the shared store
    def _store_key(self, key: tuple) -> str:
        return store_key(*self.key_prefix, key)

    def _publish(self, key: tuple, snapshot) -> None:
        """(Scheduler thread.) A context compressed here goes to the store; the call is sent from the event loop."""
        host = to_host(snapshot)
        self.counts["published"] += 1
        self.loop.call_soon_threadsafe(lambda: self.store.put.remote(self._store_key(key), host))

    async def _load(self, key: tuple):
        """The context under ``key`` from the store (a ``SlotSnapshot`` for this engine), or None (also when the store
        does not answer within ``STORE_LOAD_TIMEOUT_S``: the request never waits on it for longer)."""

        async def fetch():
            found = await self.store.get.remote(self._store_key(key))
            return None if found is None else await found[0]

        try:
            host = await asyncio.wait_for(fetch(), STORE_LOAD_TIMEOUT_S)
            if host is None:
                self.counts["store_misses"] += 1
                return None
            snapshot = from_host(host, self.engine)
        except Exception:  # the store restarted empty, the object was lost, no answer in time: compress it here
            self.counts["store_errors"] += 1
            return None
        self.counts["store_loads"] += 1
        return snapshot

    # ------------------------------------------------------------------ requests
    async def generate(self, payload: dict) -> AsyncIterator[dict]:
        """Serve one request: ``payload`` = {prompt_ids, context_ids, sampling (SamplingParams), kv_budget, stream,
        stop (strings), route}; yields the Triton model's outputs (one per token when streaming, else one)."""
        self.counts["requests"] += 1
        record = self.in_flight.add(payload.get("request_id"), "received")
        steps = self._generate(payload, record)
        try:
            async for out in steps:
                yield out
        finally:
            await steps.aclose()  # its own finally frees the slot now, not when the generator is collected
            self.in_flight.remove(record)

    async def _generate(self, payload: dict, record: dict) -> AsyncIterator[dict]:
        request = Request(payload["prompt_ids"], payload["sampling"], payload.get("kv_budget"),
                          context_token_ids=payload.get("context_ids") or (),
                          context_threshold=payload.get("context_threshold"))
        from_store = False
        try:
            if request.context_token_ids and self.share:
                key = self.scheduler.context_key(request)
                if not self.scheduler.holds_context(key):
                    self.in_flight.stage(record, "store lookup")
                    snapshot = await self._load(key)
                    if snapshot is not None:
                        self.scheduler.offer_context(key, snapshot)
                        from_store = True
            outputs: asyncio.Queue = asyncio.Queue()
            loop = self.loop
            handle = self.scheduler.submit(
                request, on_output=lambda out: loop.call_soon_threadsafe(outputs.put_nowait, out))
            self.in_flight.stage(record, "submitted", scheduler_id=handle.request_id)
        except RequestError as err:
            yield {"error": str(err)}
            return
        except Exception as err:
            yield {"error": f"{INTERNAL_PREFIX}{type(err).__name__}: {err}"}
            return
        text = TextStream(self.tokenizer, payload.get("stop") or [])
        stream, sent, done = bool(payload.get("stream")), 0, False
        try:
            while True:
                out = await outputs.get()
                record["outputs"] += 1
                if record["outputs"] == 1:
                    self.in_flight.stage(record, "generating")
                new_text, stopped = text.add(out.new_token_ids, final=out.finished)
                final = out.finished or stopped
                if stopped and not out.finished:
                    handle.cancel("stop")  # a stop string: the slot is freed before the next decode step
                if out.error is not None:
                    done = True
                    yield {"error": f"{INTERNAL_PREFIX}{out.error}"}
                    return
                if out.finish_reason == "cancelled":
                    done = True
                    yield {"error": "request cancelled"}
                    return
                if stream or final:
                    fields = {"text_output": new_text if stream else text.text,
                              "num_output_tokens": len(out.token_ids) - sent if stream else len(out.token_ids)}
                    sent = len(out.token_ids)
                    if final:
                        fields["finish_reason"] = "stop" if text.stopped else out.finish_reason
                        fields["num_input_tokens"] = out.num_input_tokens
                        if out.context_cache_hit is not None:
                            fields["context_cache_hit"] = out.context_cache_hit
                            fields["context_store_hit"] = bool(from_store and out.context_cache_hit)
                        fields["replica"] = self.replica_id
                    if final:
                        done = True
                    yield fields
                if final:
                    return
        finally:
            if not done:  # the caller went away (its stream was cancelled): free the slot
                handle.cancel()

    # ------------------------------------------------------------------ state
    def contexts(self) -> list[str]:
        """The digests (``route_digest``) of the contexts cached or being compressed here."""
        return sorted({route_digest(k[0]) for k in self.scheduler.cached_context_keys(compressing=True)})

    def record_routing_stats(self) -> dict:
        """Ray Serve asks for this every ``request_routing_stats_period_s``: the router reads ``contexts``."""
        return {"contexts": self.contexts(), "running": self.scheduler.num_running,
                "waiting": self.scheduler.num_waiting}

    def info(self) -> dict:
        s = self.scheduler
        return {"pid": os.getpid(), "host": socket.gethostname(), "node": ray.get_runtime_context().get_node_id(),
                "running": s.num_running, "prefilling": s.num_prefilling, "waiting": s.num_waiting,
                "kv_bytes_reserved": s.kv_bytes_reserved, "context_cache": s.context_cache.stats.as_dict(),
                "contexts": self.contexts(), "in_flight": self.in_flight.report(self._scheduler_state),
                "memory_mib": process_memory(), **self.counts}

    def _scheduler_state(self, record: dict) -> dict:
        sid = record.get("scheduler_id")
        return {} if sid is None else {"scheduler": self.scheduler.state_of(sid)}

    async def _report_loop(self) -> None:
        while True:
            try:
                self.store.report.remote(self.replica_id, self.info())
            except Exception:
                pass
            await asyncio.sleep(REPORT_PERIOD_S)

    async def ready(self) -> bool:
        return self.scheduler.alive

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose scheduler thread died is replaced."""
        if not self.scheduler.alive:
            raise RuntimeError("the scheduler thread is not running")

    def __del__(self):
        reporter = getattr(self, "_reporter", None)
        if reporter is not None:
            reporter.cancel()
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            scheduler.close(timeout=10)
            self.engine.close()


# ----------------------------------------------------------------------------------------------- the frontend's side
class ReplicaModel:
    """``TritonModel``'s interface over the replicas' Ray Serve handle: what ``create_app`` serves requests with."""

    def __init__(self, replicas, name: str, tokenizer, retries: int = 2):
        self.replicas, self.name, self.tokenizer, self.retries = replicas, name, tokenizer, retries
        self.inputs = set(MODEL_INPUTS)
        self.draining: asyncio.Event | None = None
        self.counts = {"requests": 0, "retried": 0, "replica_lost": 0}
        self.in_flight = InFlight()

    async def connect(self) -> None:
        self.draining = asyncio.Event()

    async def close(self) -> None:
        pass

    async def ready(self) -> bool:
        try:
            return bool(await asyncio.wait_for(self.replicas.ready.remote(), 10))
        except Exception:
            return False

    def payload(self, values: dict[str, Any]) -> dict:
        """The replica's payload of the OpenAI layer's model inputs: parsed and tokenised as the Triton model does
        (``RequestError`` for a bad request)."""
        parsed = parse_request({name: array for name, (array, _) in model_inputs(values).items()})
        ids, context_ids = encode_inputs(parsed, self.tokenizer)
        route = route_digest(context_key(context_ids, "", None)[0]) if context_ids else None
        return {"prompt_ids": ids, "context_ids": context_ids, "sampling": parsed.sampling,
                "kv_budget": parsed.kv_budget, "stream": parsed.stream, "stop": parsed.stop, "route": route,
                "context_threshold": parsed.context_threshold}

    async def generate(self, values: dict[str, Any], request_id: str) -> AsyncIterator[dict[str, Any]]:
        """The replica's outputs for one request (``TritonModel.generate``'s contract): APIError for an error output;
        leaving the iteration early cancels the request on its replica."""
        if self.draining is not None and self.draining.is_set():
            raise APIError(503, SHUTTING_DOWN)
        self.counts["requests"] += 1
        record = self.in_flight.add(request_id, "tokenizing")
        steps = self._generate(values, request_id, record)
        try:
            async for out in steps:
                yield out
        finally:
            await steps.aclose()  # cancels the replica's call now, not when the generator is collected
            self.in_flight.remove(record)

    async def _generate(self, values: dict[str, Any], request_id: str, record: dict) -> AsyncIterator[dict[str, Any]]:
        try:
            payload = await asyncio.to_thread(self.payload, values)
        except RequestError as err:
            raise model_error(str(err)) from None
        payload["request_id"] = request_id
        attempt = 0
        while True:
            self.in_flight.stage(record, "sent to a replica", attempt=attempt)
            call = self.replicas.options(stream=True).generate.remote(payload)
            received, finished = False, False
            try:
                async for out in _until(call, self.draining):
                    if "error" in out:
                        finished = True
                        raise model_error(out["error"])
                    if not received:
                        self.in_flight.stage(record, "streaming")
                    received = True
                    record["outputs"] += 1
                    yield out
                    if "finish_reason" in out:
                        finished = True
                        return
                raise APIError(500, f"{INTERNAL_PREFIX}the replica closed the stream without a final response")
            except (APIError, asyncio.CancelledError, GeneratorExit):
                raise
            except REPLICA_GONE as err:
                self.counts["replica_lost"] += 1
                if not received and attempt < self.retries:
                    attempt += 1
                    self.counts["retried"] += 1
                    continue  # nothing reached the client: the request starts again elsewhere
                raise APIError(503, f"the replica serving this request stopped ({type(err).__name__}): "
                                    "send the request again") from None
            except ray.exceptions.RayTaskError as err:
                raise APIError(500, f"{INTERNAL_PREFIX}{err}") from None
            except Exception as err:  # Serve's own failures (no replica available, backpressure, ...)
                raise APIError(503, f"the replicas are unavailable: {type(err).__name__}: {err}") from None
            finally:
                if not finished:
                    call.cancel()


def add_replica_routes(app, model: ReplicaModel, store, api_key: str | None) -> None:
    """``GET /replicas`` on the OpenAI app ``app``: the replicas' last reports (each one's requests in flight with the
    stage each reached), the store's counts, the router's decisions and the frontend's own (requests, retries,
    replicas lost, its requests in flight)."""
    from fastapi.responses import JSONResponse

    expected = f"Bearer {api_key}" if api_key else None

    @app.get("/replicas")
    async def replicas(request: HTTPRequest):
        if expected is not None and request.headers.get("authorization") != expected:
            return JSONResponse(APIError(401, "missing or wrong API key").body(), status_code=401)
        summary = await store.summary.remote()
        routers = [dict(r.stats) for r in list(ROUTERS)]
        return {"store": {k: v for k, v in summary.items() if k != "replicas"}, "replicas": summary["replicas"],
                "router": routers[0] if len(routers) == 1 else routers,
                "ingress": {**model.counts, "in_flight": model.in_flight.report()}}


# ----------------------------------------------------------------------------------------------- the application
def application(engine_dir: str | Path, replicas: int, *, backend: str | None = None, threads: int = 0,
                scheduler: dict | None = None, app_name: str = "criticalkv", router: str = "affinity",
                imbalance_threshold: int = 4, store: bool = True, replica_cpus: float = 1.0, replica_gpus: float = 0.0,
                max_ongoing_requests: int = 64, stats_period_s: float = 1.0, device: str | None = None,
                prepack: bool = False):
    """The bound Serve application: ``replicas`` engine replicas (``router`` "affinity": ``ContextAffinityRouter``;
    "pow2": Ray Serve's default power-of-two-choices router), reached through a handle (no HTTP route: the OpenAI API
    is served by the launcher's own frontend, ``criticalkv.replicas.launch``)."""
    from ray.serve.config import RequestRouterConfig

    if router not in ("affinity", "pow2"):
        raise ValueError(f"router must be 'affinity' or 'pow2', got {router!r}")
    routing = RequestRouterConfig(request_routing_stats_period_s=stats_period_s,
                                  request_routing_stats_timeout_s=max(10.0, 5 * stats_period_s))
    if router == "affinity":
        routing = RequestRouterConfig(request_router_class=ContextAffinityRouter,
                                      request_router_kwargs={"imbalance_threshold": int(imbalance_threshold)},
                                      request_routing_stats_period_s=stats_period_s,
                                      request_routing_stats_timeout_s=max(10.0, 5 * stats_period_s))
    quiet = {"log_level": "WARNING", "enable_access_log": False}
    replica = serve.deployment(
        Replica, name="Replica", num_replicas=int(replicas), max_ongoing_requests=int(max_ongoing_requests),
        ray_actor_options={"num_cpus": replica_cpus, "num_gpus": replica_gpus,
                           "runtime_env": {"env_vars": dict(REPLICA_MALLOC_ENV)}}, request_router_config=routing,
        health_check_period_s=2.0, health_check_timeout_s=30.0, graceful_shutdown_timeout_s=10.0,
        graceful_shutdown_wait_loop_s=0.5, max_constructor_retry_count=3, logging_config=quiet)
    return replica.bind(str(engine_dir), backend, threads, scheduler or {}, app_name, store, device, prepack)


__all__ = ["InFlight", "Replica", "ReplicaModel", "add_replica_routes", "application", "load_tokenizer"]
