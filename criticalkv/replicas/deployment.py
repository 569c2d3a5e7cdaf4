"""The Ray Serve application: engine replicas behind the OpenAI-compatible API.

``Replica`` (deployment ``Replica``, N of them): one ``Engine`` and its serving ``Scheduler`` (continuous batching,
chunked prefill, the context cache, one KV memory budget), exactly what one Triton model instance runs. Its
``generate`` takes a request already parsed and tokenised by the ingress and streams the outputs the OpenAI layer
reads from the Triton model (``text_output``, ``finish_reason``, ``num_input_tokens``, ``num_output_tokens``,
``context_cache_hit``; ``error`` for a failure, worded as the Triton model words it). With the shared store
(``criticalkv.replicas.store``) a context it does not hold is looked up there before it is compressed, and every
context it compresses is published there. It reports the contexts it holds to the router
(``record_routing_stats``) and its state to the store every second.

``Ingress`` (deployment ``Ingress``): the app of ``criticalkv.serving.openai_api.create_app`` (the same routes,
request checks, error objects and streaming as ``criticalkv serve``) over ``ReplicaModel``, which parses and
tokenises each request as the Triton model does (``criticalkv.serving.requests``), names its context's digest as
the request's ``route`` for ``ContextAffinityRouter`` and calls the replicas through a Ray Serve handle. A request
whose replica dies before it sent anything is sent again (to another replica, or the restarted one); one whose
replica dies after it streamed tokens ends with OpenAI's error object (503): no request waits for a dead replica.
``GET /replicas`` shows the replicas' last reports, the store's counts and the router's decisions.
"""

from __future__ import annotations

import asyncio
import os
import socket
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
from criticalkv.serving.openai_api import (INTERNAL_PREFIX, SHUTTING_DOWN, APIError, _until, create_app, model_error,
                                           model_inputs)
from criticalkv.serving.requests import TextStream, encode_inputs, parse_request

#: the inputs the OpenAI layer may send (it sends ``context`` only to a model that has it)
MODEL_INPUTS = frozenset({"text_input", "stream", "sampling_parameters", "exclude_input_in_output", "kv_budget",
                          "return_num_input_tokens", "return_num_output_tokens", "return_kv_bytes",
                          "apply_chat_template", "context", "input_ids", "context_ids", "context_threshold"})
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


# ----------------------------------------------------------------------------------------------- replica
class Replica:
    """One engine and its scheduler (a Ray Serve replica). ``scheduler``: ``SchedulerConfig`` fields; ``store``:
    whether contexts are shared through the application's ``ContextStore``."""

    async def __init__(self, engine_dir: str, backend: str | None = None, threads: int = 0,
                       scheduler: dict | None = None, app_name: str = "criticalkv", store: bool = True,
                       device: str | None = None):
        from criticalkv.runtime import Engine
        from criticalkv.serving import Scheduler

        options: dict[str, Any] = {}
        if threads:
            options["threads"] = int(threads)
        if device is not None:
            options["device"] = device
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
        self.loop = asyncio.get_running_loop()
        if self.share:
            self.scheduler.on_context_compressed = self._publish
        self._draining = False
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
        """The context under ``key`` from the store (a ``SlotSnapshot`` for this engine), or None."""
        try:
            found = await self.store.get.remote(self._store_key(key))
            if found is None:
                self.counts["store_misses"] += 1
                return None
            snapshot = from_host(await found[0], self.engine)
        except Exception:  # the store restarted empty, the object was lost, ...: compress it here
            self.counts["store_errors"] += 1
            return None
        self.counts["store_loads"] += 1
        return snapshot

    # ------------------------------------------------------------------ requests
    async def generate(self, payload: dict) -> AsyncIterator[dict]:
        """Serve one request: ``payload`` = {prompt_ids, context_ids, sampling (SamplingParams), kv_budget, stream,
        stop (strings), route}; yields the Triton model's outputs (one per token when streaming, else one)."""
        self.counts["requests"] += 1
        if self._draining:
            yield {"error": SHUTTING_DOWN}
            return
        request = Request(payload["prompt_ids"], payload["sampling"], payload.get("kv_budget"),
                          context_token_ids=payload.get("context_ids") or (),
                          context_threshold=payload.get("context_threshold"))
        from_store = False
        try:
            if request.context_token_ids and self.share:
                key = self.scheduler.context_key(request)
                if not self.scheduler.holds_context(key):
                    snapshot = await self._load(key)
                    if snapshot is not None:
                        self.scheduler.offer_context(key, snapshot)
                        from_store = True
            outputs: asyncio.Queue = asyncio.Queue()
            loop = self.loop
            handle = self.scheduler.submit(
                request, on_output=lambda out: loop.call_soon_threadsafe(outputs.put_nowait, out))
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
                    yield {"error": SHUTTING_DOWN if self._draining else "request cancelled"}
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
                "contexts": self.contexts(), **self.counts}

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

    def drain(self) -> None:
        """End every request at once with "the server is shutting down" (the service stops)."""
        self._draining = True
        self.scheduler.close(timeout=10)

    def __del__(self):
        reporter = getattr(self, "_reporter", None)
        if reporter is not None:
            reporter.cancel()
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            scheduler.close(timeout=10)
            self.engine.close()


# ----------------------------------------------------------------------------------------------- ingress side
class ReplicaModel:
    """``TritonModel``'s interface over the replicas' Ray Serve handle: what ``create_app`` serves requests with."""

    def __init__(self, replicas, name: str, tokenizer, retries: int = 2):
        self.replicas, self.name, self.tokenizer, self.retries = replicas, name, tokenizer, retries
        self.inputs = set(MODEL_INPUTS)
        self.draining: asyncio.Event | None = None
        self.counts = {"requests": 0, "retried": 0, "replica_lost": 0}

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
        try:
            payload = await asyncio.to_thread(self.payload, values)
        except RequestError as err:
            raise model_error(str(err)) from None
        payload["request_id"] = request_id
        attempt = 0
        while True:
            call = self.replicas.options(stream=True).generate.remote(payload)
            received, finished = False, False
            try:
                async for out in _until(call, self.draining):
                    if "error" in out:
                        finished = True
                        raise model_error(out["error"])
                    received = True
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


@serve.ingress()
class Ingress:
    """The OpenAI-compatible API over the replicas (a Ray Serve ingress deployment)."""

    def __init__(self, replicas, engine_dir: str, model_name: str = "criticalkv", api_key: str | None = None,
                 chat_max_tokens: int | None = None, app_name: str = "criticalkv", retries: int = 2,
                 max_body_bytes: int | None = None):
        self.replicas, self.engine_dir, self.model_name, self.api_key = replicas, engine_dir, model_name, api_key
        self.chat_max_tokens, self.app_name, self.retries = chat_max_tokens, app_name, retries
        self.max_body_bytes = max_body_bytes
        self.api = self.model = None

    def __serve_build_asgi_app__(self):
        from fastapi.responses import JSONResponse

        self.model = ReplicaModel(self.replicas, self.model_name, load_tokenizer(self.engine_dir), self.retries)
        # the same edge bounds as `criticalkv serve`: a request's characters before the chat template, its body size
        max_input_len = int(read_manifest(self.engine_dir, verify=False)["build"]["max_input_len"])
        self.api = create_app(None, self.model_name, self.model.tokenizer, self.api_key, self.chat_max_tokens,
                              text_bound=TextBound.of(self.model.tokenizer, max_input_len),
                              max_body_bytes=self.max_body_bytes, model=self.model)
        store = ray.get_actor(store_name(self.app_name), namespace=NAMESPACE)
        expected = f"Bearer {self.api_key}" if self.api_key else None

        @self.api.get("/replicas")
        async def replicas(request: HTTPRequest):
            if expected is not None and request.headers.get("authorization") != expected:
                return JSONResponse(APIError(401, "missing or wrong API key").body(), status_code=401)
            summary = await store.summary.remote()
            routers = [dict(r.stats) for r in list(ROUTERS)]
            return {"store": {k: v for k, v in summary.items() if k != "replicas"}, "replicas": summary["replicas"],
                    "router": routers[0] if len(routers) == 1 else routers, "ingress": dict(self.model.counts)}

        return self.api

    async def drain(self) -> None:
        """End the requests in flight at once with OpenAI's 503 "the server is shutting down" (the service stops)."""
        loop = getattr(self.api.state, "loop", None) if self.api is not None else None
        if loop is not None and self.model.draining is not None:
            loop.call_soon_threadsafe(self.model.draining.set)


# ----------------------------------------------------------------------------------------------- the application
def application(engine_dir: str | Path, replicas: int, *, backend: str | None = None, threads: int = 0,
                scheduler: dict | None = None, model_name: str = "criticalkv", api_key: str | None = None,
                chat_max_tokens: int | None = None, app_name: str = "criticalkv", router: str = "affinity",
                imbalance_threshold: int = 4, store: bool = True, replica_cpus: float = 1.0, replica_gpus: float = 0.0,
                max_ongoing_requests: int = 64, stats_period_s: float = 1.0, retries: int = 2,
                device: str | None = None, max_body_bytes: int | None = None):
    """The bound Serve application: ``replicas`` engine replicas (``router`` "affinity": ``ContextAffinityRouter``;
    "pow2": Ray Serve's default power-of-two-choices router) behind the ``Ingress``."""
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
        ray_actor_options={"num_cpus": replica_cpus, "num_gpus": replica_gpus}, request_router_config=routing,
        health_check_period_s=2.0, health_check_timeout_s=30.0, graceful_shutdown_timeout_s=10.0,
        graceful_shutdown_wait_loop_s=0.5, max_constructor_retry_count=3, logging_config=quiet)
    ingress = serve.deployment(Ingress, name="Ingress", num_replicas=1, max_ongoing_requests=10_000,
                               ray_actor_options={"num_cpus": 0}, logging_config=quiet,
                               graceful_shutdown_timeout_s=10.0, graceful_shutdown_wait_loop_s=0.5)
    bound = replica.bind(str(engine_dir), backend, threads, scheduler or {}, app_name, store, device)
    return ingress.bind(bound, str(engine_dir), model_name, api_key, chat_max_tokens, app_name, retries, max_body_bytes)


__all__ = ["Ingress", "Replica", "ReplicaModel", "application", "load_tokenizer"]
