"""Continuous batching over one ``Engine``: chunked prefill, a compressed context cache, one decode batch,
one KV memory budget.

A scheduler thread drives the engine through its API only (``check``, ``prefill`` / ``begin_prefill`` +
``prefill_step`` + ``finish_prefill``, ``extend``, ``save`` / ``restore``, ``decode``, ``release``). Each loop
iteration it

1. drops the cancelled requests (waiting ones at once; prefilling and running ones free what they hold at once);
2. admits waiting requests in arrival order while ``max_num_seqs``, the prefill buffers and the KV memory allow (a
   request whose context is being compressed lets the later ones pass until the copy is made);
3. runs ONE prefill chunk (at most ``prefill_chunk`` tokens through the extend graph) of the prefilling request with
   the fewest tokens left, so a short request that arrives during a long prompt's prefill waits for one chunk, not
   for the whole prompt. The last chunk runs the selection over the whole prompt (the kept entries of one unchunked
   prefill), loads them into a slot, and the request joins the decode batch. A plain prompt's first token is sampled
   from the last chunk's logits and delivered before the selection runs (the selection only decides what the next
   tokens attend to), and a request that its first token ends (a stop token, ``max_tokens`` 1) skips the selection;
4. runs one decode step over every running request and samples each with its own sampler;
5. releases the slots of finished requests at once.

Context cache: a request with a ``context`` has its context compressed alone (question-agnostic) the first time,
with the context policy (``SchedulerConfig.context_policy``: by default the engine's, whose method may score the
context apart, e.g. by re-reading it),
a copy of the kept entries is kept in an LRU store (``ContextCache``) under (context ids, policy, budget), and this
and every later request with that context restores the copy into a slot and runs its question through the extend
graph: a hit skips the context's prefill. Requests waiting for a context that is being compressed wait for it
instead of compressing it again. The copy is stored as ``context_cache_dtype`` (float16 by default: the float32
entries rounded, half the bytes); the request that compressed the context is answered from that copy too, so a
context's answers do not depend on whether it was cached.

Prefix cache (``SchedulerConfig.prefix_cache_mib``): a plain prompt (no ``context``) prefilled through the extend graph
(every prompt with at least one whole block before its window, whatever its length) leaves the
uncompressed entries of its full blocks of ``prefix_block`` tokens in a ``PrefixCache`` (vLLM's automatic prefix
caching: blocks keyed by their chain's hash); a later prompt that begins with the same blocks starts its prefill after
them (at most all but its last ``window`` tokens: their queries score the prompt), then the policy selects over the
whole prompt, so its kept entries and tokens are those of a cold run. A `full` engine's prompts too.

KV memory (``kv_memory_mib``): one budget for what the requests hold: a running request its kept entries plus its
``max_tokens`` growth (bounded before its prefill by ``Engine.kv_bytes_bound``, the real count after it), a prompt
being prefilled its full K/V, the cached contexts their kept entries and the prefix cache its blocks. A request is
admitted when it fits, after evicting prefix blocks, then cached contexts, least recently used first; otherwise it
waits (first come, first served), and one that could never fit is refused at submission.

The decode graph computes every row from that row's cache only, and a request's sampler sees only its own logits,
so a greedy request yields the same tokens as ``Engine.generate`` on it alone, whatever else shares the batch
(tests/serving/test_scheduler.py).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

from criticalkv.errors import EngineError, RequestError
from criticalkv.policy import POLICIES
from criticalkv.request import DEFAULT_MAX_TOKENS, CheckedRequest, Request
from criticalkv.runtime.engine import Engine, PrefillJob, PrefillResult, SlotSnapshot
from criticalkv.sampling import Sampler
from criticalkv.serving.context_cache import (DEFAULT_CONTEXT_CACHE_DTYPE, ContextCache, check_cache_dtype, context_key,
                                              narrow)
from criticalkv.serving.prefix_cache import DEFAULT_BLOCK_SIZE, PrefixCache, off_reason

#: prompt tokens one loop iteration prefills at most (``SchedulerConfig.prefill_chunk``): one run of the extend graph
#: (``Engine.prefill_run``), so a short request that arrives during a 2k prompt's prefill waits for a quarter of it.
#: vLLM's CPU server takes 2,048 prompt tokens a step; on the bundled model 2,048-token chunks measured no faster here
#: (8 concurrent 2k chats in process on OpenVINO, medians of 3 interleaved rounds: 21.65 output tokens/s against 21.28;
#: docs/serving.md)
DEFAULT_PREFILL_CHUNK = 512

#: finish reasons (vllm's names): a stop token, max_tokens reached, cancelled by the client, an error
FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED, FINISH_ERROR = "stop", "length", "cancelled", "error"

__all__ = ["DEFAULT_MAX_TOKENS", "RequestError", "RequestHandle", "RequestOutput", "Scheduler", "SchedulerConfig"]


@dataclass
class RequestOutput:
    """What a request has produced so far; one is delivered per generated token, the last with ``finished``.

    new_token_ids : the tokens generated since the previous output (empty in a cancellation or error output)
    token_ids : every generated token so far (a stop token included)
    finish_reason : None while running, else "stop", "length", "cancelled" or "error"
    kv_bytes_kept / kv_bytes_full : the request's prompt cache after the selection / without eviction (bytes)
    ttft_s : time from submission to the first token; queue_s : time waiting for admission
    context_cache_hit : with a context: True when its compressed entries came from the cache (no prefill of it)
    num_cached_tokens : prompt tokens whose entries came from the prefix cache (their prefill skipped)
    """

    request_id: int
    new_token_ids: list[int]
    token_ids: list[int]
    num_input_tokens: int
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    kv_bytes_kept: int = 0
    kv_bytes_full: int = 0
    ttft_s: float | None = None
    queue_s: float | None = None
    elapsed_s: float = 0.0
    context_cache_hit: bool | None = None
    num_cached_tokens: int = 0

    @property
    def time_per_output_token_s(self) -> float | None:
        """Mean time between output tokens after the first (None with fewer than two tokens)."""
        if self.ttft_s is None or len(self.token_ids) < 2:
            return None
        return (self.elapsed_s - self.ttft_s) / (len(self.token_ids) - 1)


class RequestHandle:
    """The caller's side of a submitted request: iterate its outputs, wait for the result, cancel it.

    ``for out in handle`` yields every ``RequestOutput`` (blocking), ``async for out in handle.outputs_async()``
    awaits them; ``result()`` waits for the last one;
    ``cancel()`` may be called from any thread. An ``on_output`` callback given to ``submit`` is called on
    the scheduler thread instead of queueing (it must return quickly).
    """

    def __init__(self, request_id: int, on_output: Callable[[RequestOutput], None] | None):
        self.request_id = request_id
        self._on_output = on_output
        self._queue: queue.Queue[RequestOutput] = queue.Queue()
        self._done = threading.Event()
        self._last: RequestOutput | None = None
        self.cancel_requested = False
        self.cancel_reason = FINISH_CANCELLED

    def cancel(self, reason: str = FINISH_CANCELLED) -> None:
        """Ask the scheduler to stop this request; it frees its slot before the next decode step."""
        self.cancel_reason = reason
        self.cancel_requested = True

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def _deliver(self, output: RequestOutput) -> None:
        if output.finished:
            self._last = output
        if self._on_output is not None:
            try:
                self._on_output(output)
            except Exception:  # a consumer that cannot take outputs any more (a closed stream): stop the request
                self.cancel()
        else:
            self._queue.put(output)
        if output.finished:
            self._done.set()

    def __iter__(self):
        if self._on_output is not None:
            raise RuntimeError("this request delivers its outputs to its on_output callback")
        while True:
            output = self._queue.get()
            yield output
            if output.finished:
                return

    async def outputs_async(self):
        """``async for out in handle.outputs_async()``: the outputs, awaited without blocking the event loop."""
        if self._on_output is not None:
            raise RuntimeError("this request delivers its outputs to its on_output callback")
        while True:
            output = await asyncio.to_thread(self._queue.get)
            yield output
            if output.finished:
                return

    def result(self, timeout: float | None = None) -> RequestOutput:
        """The final output (raises TimeoutError after ``timeout`` seconds)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        return self._last


@dataclass
class _Sequence:
    handle: RequestHandle
    request: CheckedRequest  # checked by the engine at submission (max_tokens filled, its int budget)
    sampler: Sampler
    stop: frozenset[int]
    charge: int  # bytes reserved in the KV memory
    submitted: float
    slot: int | None = None
    job: PrefillJob | None = None  # while its prompt (or context) is prefilled in chunks
    key: tuple | None = None  # its context's cache key
    context_cache_hit: bool | None = None
    block_hashes: list | None = None  # a plain prompt's block chain in the prefix cache (None: not looked up)
    num_cached_tokens: int = 0
    admitted: float = 0.0
    first_token_at: float | None = None
    tokens: list[int] = field(default_factory=list)
    kv_bytes_kept: int = 0
    kv_bytes_full: int = 0

    @property
    def max_tokens(self) -> int:
        return self.request.sampling.max_tokens

    @property
    def prefill_ids(self) -> tuple[int, ...]:
        """What the prefill runs: the context when there is one (compressed without the question), else the prompt."""
        return self.request.context_token_ids or self.request.prompt_token_ids

    def output(self, new: list[int], finish_reason: str | None = None, error: str | None = None) -> RequestOutput:
        now = time.perf_counter()
        return RequestOutput(
            request_id=self.handle.request_id, new_token_ids=new, token_ids=list(self.tokens),
            num_input_tokens=self.request.num_context_tokens + self.request.num_prompt_tokens,
            finished=finish_reason is not None, finish_reason=finish_reason, error=error,
            kv_bytes_kept=self.kv_bytes_kept, kv_bytes_full=self.kv_bytes_full,
            ttft_s=None if self.first_token_at is None else self.first_token_at - self.submitted,
            queue_s=(self.admitted - self.submitted) if self.admitted else None, elapsed_s=now - self.submitted,
            context_cache_hit=self.context_cache_hit, num_cached_tokens=self.num_cached_tokens,
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """How a scheduler serves an engine (``criticalkv serve`` flags, ``model.json`` of the Triton model).

    max_num_seqs : most requests holding a slot or a prefill buffer at once (default: the engine's max batch size)
    kv_memory_mib : one KV memory budget (MiB) for running requests, prompts under prefill and cached contexts
        (default: no limit beyond max_num_seqs)
    prefill_chunk : most prompt tokens one loop iteration prefills through the extend graph, between two decode steps
        (default: ``DEFAULT_PREFILL_CHUNK``); 0 prefills every prompt in one run of the prefill graph (engines without
        an extend graph always do). A multiple of the engine's attention block (256) keeps the prefill bitwise
        identical to one run
    context_cache_mib : most MiB of compressed contexts kept for reuse (0 = no cache: a context is compressed for
        each request); cached contexts also count in ``kv_memory_mib``
    max_prefills : prompts prefilled in chunks at once (each holds a full-length prefill buffer)
    context_policy : the policy that compresses contexts (question-agnostic): None (default) the engine's context
        policy (built with ``--context-policy``) when it has one, else the engine's own; "engine" the engine's own
        policy; or the name of one of those two (anything else: rebuild the engine with ``--context-policy NAME``)
    prefix_cache_mib : most MiB of plain prompts' uncompressed blocks kept for reuse (0 = none; only prompts prefilled
        through the extend graph, of at least one block beyond the selection's window, use it; the blocks also count in
        ``kv_memory_mib``)
    prefix_block : tokens per prefix-cache block: a prompt reuses its longest run of whole blocks an earlier prompt
        began with
    context_cache_dtype : the element type cached contexts are stored in: float16 (default: float32 entries rounded
        to float16, half the bytes, so twice the contexts; widened back on restore) or float32 (the engine's entries
        as they are, exact)
    """

    max_num_seqs: int | None = None
    kv_memory_mib: float | None = None
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    context_cache_mib: float = 256.0
    max_prefills: int = 2
    context_policy: str | None = None
    prefix_cache_mib: float = 512.0
    prefix_block: int = DEFAULT_BLOCK_SIZE
    context_cache_dtype: str = DEFAULT_CONTEXT_CACHE_DTYPE

    def __post_init__(self) -> None:
        def integer(name, low):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")

        if self.max_num_seqs is not None:
            integer("max_num_seqs", 1)
        integer("prefill_chunk", 0)
        integer("max_prefills", 1)
        integer("prefix_block", 1)
        if self.kv_memory_mib is not None and not (isinstance(self.kv_memory_mib, (int, float)) and self.kv_memory_mib > 0):
            raise ValueError(f"kv_memory_mib must be > 0, got {self.kv_memory_mib!r}")
        for name in ("context_cache_mib", "prefix_cache_mib"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"{name} must be >= 0, got {value!r}")
        try:
            check_cache_dtype(self.context_cache_dtype)
        except ValueError as err:
            raise ValueError(f"context_cache_dtype: {err}") from None
        if self.context_policy is not None and (not isinstance(self.context_policy, str) or not self.context_policy):
            raise ValueError(f"context_policy must be a policy name or 'engine', got {self.context_policy!r}")

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in ("max_num_seqs", "kv_memory_mib", "prefill_chunk", "context_cache_mib",
                                              "max_prefills", "context_policy", "prefix_cache_mib", "prefix_block",
                                              "context_cache_dtype")}


def context_selection(engine: Engine, context_policy: str | None) -> bool:
    """Whether contexts are selected with the engine's context policy (``Engine.policy_for(context=True)``) rather than
    its own, for ``SchedulerConfig.context_policy``; EngineError naming the policies the engine has otherwise."""
    return check_context_policy(engine.policy.name, None if engine.context_policy is None else engine.context_policy.name,
                                context_policy)


def check_max_num_seqs(max_num_seqs: int | None, max_batch_size: int) -> None:
    """EngineError when ``max_num_seqs`` exceeds the engine's max batch size (its slots)."""
    if max_num_seqs is not None and max_num_seqs > max_batch_size:
        raise EngineError(
            f"max_num_seqs {max_num_seqs} exceeds the engine's max batch size {max_batch_size}: rebuild the engine with "
            f"--max-batch-size {max_num_seqs} (or more), or lower max_num_seqs")


def check_context_policy(own: str, built: str | None, requested: str | None) -> bool:
    """``context_selection`` from the names of an engine's policy (``own``) and context policy (``built``, None if it has
    none): whether ``requested`` selects contexts with the context policy. EngineError when the engine has neither."""
    if requested is None:
        return built is not None
    if requested == "engine" or (requested == own and built != requested):
        return False
    if built is not None and requested == built:
        return True
    have = f"its own {own!r}" + (f" and the context policy {built!r}" if built is not None else "")
    if requested.split(":")[0] not in POLICIES:  # not a policy at all: no rebuild would serve it
        raise EngineError(f"context policy {requested!r}: no such policy; this engine serves {have} ('engine' = its "
                          f"own; other policies need a rebuild with scripts/build_engine.py --context-policy: "
                          f"{', '.join(POLICIES)})")
    raise EngineError(f"context policy {requested!r}: the engine was built with {have}; rebuild it with "
                      f"--context-policy {requested} (or serve --context-policy engine)")


class Scheduler:
    """Continuous batching over ``engine`` (any backend: ONNX Runtime, OpenVINO, TensorRT, torch) on a background
    thread.

    ``engine``: a loaded ``Engine`` built with ``--max-batch-size`` >= max_num_seqs; the scheduler owns it while it
    runs (nothing else may prefill, decode or release its slots). The other arguments are ``SchedulerConfig``'s.
    """

    def __init__(self, engine: Engine, max_num_seqs: int | None = None, kv_memory_mib: float | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, context_cache_mib: float = 256.0, max_prefills: int = 2,
                 context_policy: str | None = None, prefix_cache_mib: float = 512.0,
                 prefix_block: int = DEFAULT_BLOCK_SIZE, context_cache_dtype: str = DEFAULT_CONTEXT_CACHE_DTYPE):
        config = SchedulerConfig(max_num_seqs, kv_memory_mib, prefill_chunk, context_cache_mib, max_prefills,
                                 context_policy, prefix_cache_mib, prefix_block, context_cache_dtype)
        self.config = config
        self.engine = engine
        check_max_num_seqs(max_num_seqs, engine.num_slots)
        self.max_num_seqs = engine.num_slots if max_num_seqs is None else max_num_seqs
        self.kv_memory_bytes = None if kv_memory_mib is None else int(kv_memory_mib * 2**20)
        self.chunked = prefill_chunk > 0 and engine.limits.max_question_len > 0  # the engine has extend + select
        self.prefill_chunk = prefill_chunk
        self.max_prefills = max_prefills
        self.context_cache = ContextCache(int(context_cache_mib * 2**20))
        self.context_cache_dtype = context_cache_dtype
        self.prefix_cache = PrefixCache(int(prefix_cache_mib * 2**20), prefix_block)
        #: plain prompts prefilled in chunks reuse the blocks of earlier ones (the engine copies a prefill buffer's
        #: entries out and in: ``Engine.caches_prompts``)
        self.prefix_caching = self.chunked and prefix_cache_mib > 0 and engine.caches_prompts
        #: why a prefix cache asked for is off (None: on, or none asked for)
        self.prefix_cache_off = off_reason(engine.backend.name, engine.caches_prompts, self.chunked, prefix_cache_mib)
        #: contexts are compressed with the engine's context policy (else with its own, as prompts)
        self.context_selection = context_selection(engine, context_policy)
        self.context_policy = engine.policy_for(self.context_selection)
        self._policy_json = self.context_policy.to_json()
        self._ids = itertools.count(1)
        self._lock = threading.Condition()
        self._waiting: deque[_Sequence] = deque()
        self._prefilling: list[_Sequence] = []
        self._running: list[_Sequence] = []
        self._compressing: dict[tuple, _Sequence] = {}  # context key -> the request compressing it now
        self._reserved = 0  # bytes held by prefilling and running requests (cached contexts apart)
        self._offers: list[tuple[tuple, SlotSnapshot]] = []  # compressed contexts made elsewhere (``offer_context``)
        #: called on the scheduler thread with (key, snapshot) each time a context has been compressed here (a
        #: shared store publishes it; it must return quickly and must not keep the thread)
        self.on_context_compressed: Callable[[tuple, SlotSnapshot], None] | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="criticalkv-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ submission
    def submit(self, request: Request, on_output: Callable[[RequestOutput], None] | None = None) -> RequestHandle:
        """Queue one request; returns at once. Raises ``RequestError`` naming the problem for a bad request
        (``Engine.check``: prompt and context lengths and ids, ``max_tokens`` within the built maximum (default
        ``DEFAULT_MAX_TOKENS`` or the engine's maximum if lower), ``kv_budget`` within the policy's range), or one
        that could never fit in the KV memory."""
        engine = self.engine
        request = engine.check(request)
        charge = self._bound(request)
        if self.kv_memory_bytes is not None and charge > self.kv_memory_bytes:
            raise RequestError(f"the request needs up to {charge / 2**20:.2f} MiB of KV cache, more than the whole "
                               f"KV memory ({self.kv_memory_bytes / 2**20:.2f} MiB)")
        request_id = next(self._ids) if request.request_id is None else request.request_id
        handle = RequestHandle(request_id, on_output)
        seq = _Sequence(handle, request, Sampler(request.sampling), engine.stop_ids(request), charge,
                        time.perf_counter())
        if request.context_token_ids:
            seq.key = context_key(request.context_token_ids, self._policy_json, request.kv_budget,
                                  request.context_threshold)
        elif self.prefix_caching and self._prefix_cacheable(request.num_prompt_tokens):  # hashed here, off the loop
            seq.block_hashes = self.prefix_cache.hashes(request.prompt_token_ids)
        with self._lock:
            if self._stopping:
                raise RequestError("the scheduler is shutting down")
            self._waiting.append(seq)
            self._lock.notify()
        return handle

    def _prefix_cacheable(self, num_tokens: int) -> bool:
        """Whether a plain prompt of ``num_tokens`` tokens goes through the prefix cache: at least one whole block
        before the tokens that always run (the selection's window), whatever ``prefill_chunk`` is."""
        return self.engine.prefix_limit(num_tokens) >= self.prefix_cache.block_size

    def context_key(self, request: Request) -> tuple:
        """The context cache's key of ``request``'s context (``RequestError`` for a bad request or one without a
        context): what ``offer_context`` and ``on_context_compressed`` name a compressed context by."""
        request = self.engine.check(request)
        if not request.context_token_ids:
            raise RequestError("the request has no context")
        return context_key(request.context_token_ids, self._policy_json, request.kv_budget, request.context_threshold)

    def holds_context(self, key: tuple) -> bool:
        """Whether the context under ``key`` is cached here or being compressed here now (any thread)."""
        return key in self.context_cache or key in self._compressing

    def cached_context_keys(self, compressing: bool = False) -> list[tuple]:
        """The keys of the cached contexts, least recently used first, then (``compressing``) those being compressed
        now (any thread: a copy)."""
        for _ in range(100):  # the scheduler thread may change them meanwhile (outside the lock): look again
            try:
                return self.context_cache.keys() + (list(self._compressing) if compressing else [])
            except RuntimeError:
                continue
        return []

    def offer_context(self, key: tuple, snapshot: SlotSnapshot) -> None:
        """A compressed context made elsewhere (another replica's, from a shared store): it joins the context cache
        before the next admission, as one compressed here would (when it fits the cache and the KV memory; otherwise
        it is dropped and the context is compressed here). Any thread; a request submitted after this call sees it."""
        with self._lock:
            self._offers.append((key, snapshot))
            self._lock.notify()

    def _take_offers(self) -> None:
        """Cache the offered contexts (scheduler thread, under the lock)."""
        offers, self._offers = self._offers, []
        for key, snapshot in offers:
            if key not in self.context_cache:
                self._cache_copy(key, snapshot)

    def _cache_copy(self, key: tuple, snapshot: SlotSnapshot) -> bool:
        """Put ``snapshot`` in the context cache if it fits the cache and the KV memory (evicting least recently used
        contexts), stored as ``context_cache_dtype`` (``narrow``: the bytes counted are the stored ones)."""
        snapshot = narrow(snapshot, self.context_cache_dtype)
        room = self.context_cache.capacity_bytes
        if self.kv_memory_bytes is not None:  # the copy must fit the KV memory too (prefix blocks, other contexts go)
            room = min(room, self.kv_memory_bytes - self._reserved)
            if snapshot.nbytes > room:
                return False
            prefix = self.prefix_cache.stats
            over = self._reserved + self.context_cache.stats.bytes_held + prefix.bytes_held + snapshot.nbytes - \
                self.kv_memory_bytes
            if over > 0:
                self.prefix_cache.shrink(max(prefix.bytes_held - over, 0))
            room = min(room, self.kv_memory_bytes - self._reserved - prefix.bytes_held)
        if snapshot.nbytes > room:
            return False
        self.context_cache.shrink(room - snapshot.nbytes)
        return self.context_cache.put(key, snapshot)

    def _bound(self, request: Request) -> int:
        """Most KV bytes ``request`` holds at once: its full prompt (or context) while prefilled, or its kept
        entries + question + growth while it runs."""
        engine, n = self.engine, len(request.context_token_ids or request.prompt_token_ids)
        question = request.num_prompt_tokens if request.context_token_ids else 0
        context = bool(request.context_token_ids) and self.context_selection
        running = engine.kv_bytes_bound(n, request.sampling.max_tokens + question, context=context)
        return max(running, engine.kv_bytes_full(n))

    # ------------------------------------------------------------------ state
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_prefilling(self) -> int:
        return len(self._prefilling)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def state_of(self, request_id: int) -> str | None:
        """Where request ``request_id`` is now: "waiting" (for its context's compression when that runs), "prefilling",
        "running", or None (finished, or never submitted here). Any thread: a diagnostic, racy by nature."""
        for state, seqs in (("waiting", list(self._waiting)), ("prefilling", list(self._prefilling)),
                            ("running", list(self._running))):
            for seq in seqs:
                if seq.handle.request_id == request_id:
                    if state == "waiting" and seq.key is not None and seq.key in self._compressing:
                        return "waiting for its context's compression"
                    return state
        return None

    @property
    def alive(self) -> bool:
        """Whether the scheduler thread runs (it stops only on ``close``)."""
        return self._thread.is_alive()

    @property
    def kv_bytes_reserved(self) -> int:
        """KV bytes held now: running requests, prompts under prefill, cached contexts and the prefix cache's blocks."""
        return self._reserved + self.context_cache.stats.bytes_held + self.prefix_cache.stats.bytes_held

    def close(self, timeout: float = 30.0) -> None:
        """Stop the scheduler thread; requests still waiting or running end with finish reason "cancelled"."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._waiting or self._prefilling or self._running or self._stopping):
                    self._lock.wait()
                if self._stopping:
                    break
            try:
                self._drop_cancelled()
                self._admit()
                self._prefill_step()
                if self._running:
                    self._decode_step()
            except Exception as err:  # an engine failure ends the running requests, not the server
                self._fail_running(f"{type(err).__name__}: {err}")
        for seq in list(self._running) + list(self._prefilling):
            self._finish(seq, FINISH_CANCELLED)
        with self._lock:
            waiting, self._waiting = list(self._waiting), deque()
        for seq in waiting:
            seq.handle._deliver(seq.output([], FINISH_CANCELLED))

    def _drop_cancelled(self) -> None:
        with self._lock:
            cancelled = [s for s in self._waiting if s.handle.cancel_requested]
            for seq in cancelled:
                self._waiting.remove(seq)
        for seq in cancelled:
            seq.handle._deliver(seq.output([], seq.handle.cancel_reason))
        for seq in [s for s in self._running + self._prefilling if s.handle.cancel_requested]:
            self._finish(seq, seq.handle.cancel_reason)

    def _fits(self, charge: int, keep: tuple | None = None, blocks: list | None = None) -> bool:
        """Whether ``charge`` more bytes fit the KV memory, evicting what the caches hold if that makes room, least
        recently used first: prefix blocks (``blocks``, the chain this request is about to read, last), then cached
        contexts (never ``keep``: the context this request is about to read)."""
        if self.kv_memory_bytes is None:
            return True
        room = self.kv_memory_bytes - self._reserved
        kept = self.context_cache.peek(keep).nbytes if keep is not None else 0
        if charge + kept > room:
            return False
        contexts, prefix = self.context_cache.stats, self.prefix_cache.stats
        over = lambda: charge + contexts.bytes_held + prefix.bytes_held - room  # noqa: E731
        if over() > 0:
            self.prefix_cache.shrink(max(prefix.bytes_held - over(), 0), keep=frozenset(blocks or ()))
        if over() > 0:
            self.context_cache.shrink(max(contexts.bytes_held - over(), 0), keep=keep)
        if over() > 0:
            self.prefix_cache.shrink(max(prefix.bytes_held - over(), 0))
        return True

    def _admit(self) -> None:
        while True:
            with self._lock:
                if self._offers:
                    self._take_offers()
                if not self._waiting or len(self._running) + len(self._prefilling) >= self.max_num_seqs:
                    return
                # a request whose context is being compressed waits for the copy, and lets the ones behind it pass
                # meanwhile (a hit, or another prompt, needs nothing of that compression); so does one that needs a
                # prefill slot while every slot is taken: a hit behind it needs none. The first of the others is
                # admitted first come, first served; memory stops the queue
                picked = self._next_admissible()
                if picked is None:
                    return
                index, seq, cached = picked
                if seq.block_hashes:  # the blocks it would reuse: the last ones evicted to make room
                    self.prefix_cache.touch(seq.block_hashes)
                if not self._fits(seq.charge, keep=seq.key if cached is not None else None, blocks=seq.block_hashes):
                    return  # first come, first served: later requests wait behind it
                del self._waiting[index]
                self._reserved += seq.charge
            # out of the queue and in no list until it prefills or runs: a failure on the way (the engine, its
            # sampler) must end it here, or it would never be answered and keep its slot and its context's claim
            self._guard(seq, lambda: self._start(seq))

    def _next_admissible(self):
        """The first waiting request that can start now, as (its index in the queue, it, its cached context or None),
        or None: one waiting for its context's compression is passed, and so is one that needs a prefill slot when
        ``max_prefills`` prompts are already prefilling (a hit, which needs no prefill, is taken behind it). A hit's
        charge is set here: its cached entries, its question and its growth."""
        slots_full = self.chunked and len(self._prefilling) >= self.max_prefills
        if slots_full and not len(self.context_cache):  # only a hit could start: no scan of the queue per step
            return None
        for index, seq in enumerate(self._waiting):
            if seq.key is not None and seq.key in self._compressing:
                continue
            cached = self.context_cache.peek(seq.key) if seq.key is not None else None
            if cached is None:
                if slots_full:
                    continue
                return index, seq, None
            seq.charge = cached.kept_entries * self.engine.entry_bytes + self.engine.growth_bytes(
                seq.max_tokens + seq.request.num_prompt_tokens)
            return index, seq, cached
        return None

    def _start(self, seq: _Sequence) -> None:
        """Admit ``seq``: a cached context goes straight to its question; otherwise its prompt (or context) is
        prefilled, in chunks when it is longer than one."""
        seq.admitted = time.perf_counter()
        if seq.key is not None:
            snapshot = self.context_cache.get(seq.key, packed=self.engine.restores_packed)
            if snapshot is not None:
                seq.context_cache_hit = True
                slot = self.engine.free_slots()[0]
                if self._guard(seq, lambda: self.engine.restore(slot, snapshot) or True):
                    seq.slot = slot
                    self._ask(seq, snapshot.kept_entries, self.engine.kv_bytes_full(seq.request.num_context_tokens))
                return
            seq.context_cache_hit = False
            self._compressing[seq.key] = seq
        ids = seq.prefill_ids
        # the request was checked at submission (a CheckedRequest of this engine, taken as it is); a context is
        # prefilled alone as the prompt of the same checked request (it passed the checks with its question after it)
        prefill_request = seq.request if not seq.request.context_token_ids else \
            replace(seq.request, prompt_token_ids=ids, context_token_ids=())
        context = seq.key is not None and self.context_selection  # selected with the engine's context policy
        if self.chunked and (len(ids) > self.prefill_chunk or seq.block_hashes is not None):  # a cacheable prompt too
            prefix = self._cached_prefix(seq)
            job = self._guard(seq, lambda: self.engine.begin_prefill(prefill_request, context=context, prefix=prefix))
            if job is not None:
                seq.job = job
                self._prefilling.append(seq)
            return
        slot = self.engine.free_slots()[0]
        result = self._guard(seq, lambda: self.engine.prefill(slot, prefill_request, context=context))
        if result is not None:
            seq.slot = slot
            self._prefilled(seq, result)

    def _guard(self, seq: _Sequence, step):
        """Run ``step`` for ``seq``; a failure ends that request alone (its reservation returned)."""
        try:
            return step()
        except Exception as err:
            self._abort(seq, f"{type(err).__name__}: {err}")
            return None

    def _abort(self, seq: _Sequence, message: str) -> None:
        """End ``seq`` with an error wherever it stands (admitted, prefilling, running): its slot, prefill buffer,
        reservation and claim on its context's compression are given back, so that the next decode step and the
        requests waiting for that context go on (an error already delivered is not delivered twice)."""
        if seq in self._running:
            self._running.remove(seq)
        if seq in self._prefilling:
            self._prefilling.remove(seq)
        if seq.slot is not None:
            try:
                self.engine.release(seq.slot)
            except EngineError:  # the failure may have come from the slot itself
                pass
            seq.slot = None
        seq.job = None
        self._forget_compression(seq)
        self._release(seq)
        if not seq.handle.finished:
            seq.handle._deliver(seq.output([], FINISH_ERROR, message))

    def _forget_compression(self, seq: _Sequence) -> None:
        if seq.key is not None and self._compressing.get(seq.key) is seq:
            del self._compressing[seq.key]

    def _cached_prefix(self, seq: _Sequence) -> list:
        """The prefix cache's blocks a plain prompt begins with (at most ``Engine.prefix_limit`` tokens), counted."""
        if seq.block_hashes is None:
            return []
        n = seq.request.num_prompt_tokens
        blocks = self.prefix_cache.lookup(seq.block_hashes, self.engine.prefix_limit(n) // self.prefix_cache.block_size)
        seq.num_cached_tokens = len(blocks) * self.prefix_cache.block_size
        self.prefix_cache.record(n, seq.num_cached_tokens)
        return blocks

    def _cache_prefix(self, seq: _Sequence, job: PrefillJob) -> None:
        """Keep the full blocks of ``seq``'s prompt that the prefix cache does not hold yet, from its prefill buffer
        (after its first token: the copies do not delay it), within the cache's capacity and the KV memory."""
        hashes, size = seq.block_hashes, self.prefix_cache.block_size
        limit = None
        if self.kv_memory_bytes is not None:  # never at the cost of cached contexts or requests
            limit = self.kv_memory_bytes - self._reserved - self.context_cache.stats.bytes_held
        for j in range(self.prefix_cache.cached(hashes), len(hashes)):
            entries = self.engine.prompt_entries(job, j * size, (j + 1) * size)
            if not self.prefix_cache.add(hashes, j, [entries], capacity_bytes=limit):
                break
        self.prefix_cache.touch(hashes)

    def _prefill_step(self) -> None:
        """One chunk of the prefilling request with the fewest tokens left."""
        if not self._prefilling:
            return
        seq = min(self._prefilling, key=lambda s: (s.job.remaining, s.submitted))
        done = self._guard(seq, lambda: self.engine.prefill_step(seq.job, self.prefill_chunk))
        if not done:
            return
        self._prefilling.remove(seq)
        job, keep = seq.job, seq.block_hashes is not None  # keep its buffer: its blocks go to the prefix cache
        if seq.key is None:  # a plain prompt: its first token comes from the prefill's logits, before the selection
            seq.kv_bytes_full = self.engine.kv_bytes_full(seq.request.num_prompt_tokens)
            if not self._guard(seq, lambda: self._first_token(seq, job.logits)):
                # ended by its first token (a stop token, max_tokens 1) or failed: nothing to select, no slot taken
                if keep and seq.tokens:
                    self._guard_cache(lambda: self._cache_prefix(seq, job))
                job.buffer = None
                return
        slot = self._guard(seq, lambda: self.engine.free_slots()[0])
        result = None if slot is None else \
            self._guard(seq, lambda: self.engine.finish_prefill(job, slot, keep_buffer=keep))
        seq.job = None
        if result is not None:
            seq.slot = slot
            self._guard(seq, lambda: self._prefilled(seq, result))  # a failure there ends this request alone
            if keep:
                self._guard_cache(lambda: self._cache_prefix(seq, job))
        job.buffer = None

    def _guard_cache(self, step) -> None:
        """Run a cache's bookkeeping ``step``; a failure there costs the cache's gain only, never a request."""
        try:
            step()
        except Exception:
            pass

    def _prefilled(self, seq: _Sequence, result: PrefillResult) -> None:
        """``seq``'s prompt (or context) is compressed into its slot: cache a context, ask a question, or sample
        the first token."""
        if seq.key is None:
            seq.kv_bytes_kept, seq.kv_bytes_full = result.kv_bytes_kept, result.kv_bytes_full
            self._recharge(seq, result.kv_bytes_kept + self.engine.growth_bytes(seq.max_tokens))
            # a chunked prompt's first token went out before the selection (_prefill_step)
            if seq.tokens or self._first_token(seq, result.logits):
                self._running.append(seq)
            return
        # stored as the cache stores it (float16: half the bytes), also what a replica publishes to the shared store
        saved = self.engine.save(seq.slot)
        # no cache (capacity 0): nothing is stored, so nothing is rounded
        snapshot = narrow(saved, self.context_cache_dtype) if self.context_cache.capacity_bytes else saved
        if snapshot is not saved:  # this question too is answered from the stored copy: a hit's tokens, not a miss's
            self.engine.release(seq.slot)
            self.engine.restore(seq.slot, snapshot)
        self._forget_compression(seq)
        # the request now holds its kept entries (+ question and growth), no longer its whole prompt: charge that first,
        # so that the room left for the copy is what is really free
        self._recharge(seq, result.kv_bytes_kept + self.engine.growth_bytes(seq.max_tokens + seq.request.num_prompt_tokens))
        with self._lock:
            self._cache_copy(seq.key, snapshot)
        if self.on_context_compressed is not None:
            try:
                self.on_context_compressed(seq.key, snapshot)
            except Exception:  # a store that cannot take it: the context stays served from this cache
                pass
        self._ask(seq, result.kept_entries, result.kv_bytes_full)

    def _ask(self, seq: _Sequence, kept_entries: int, kv_bytes_full: int) -> None:
        """The question after a compressed context in ``seq``'s slot: through the extend graph, then the first token."""
        seq.kv_bytes_kept = kept_entries * self.engine.entry_bytes
        seq.kv_bytes_full = kv_bytes_full
        self._recharge(seq, seq.kv_bytes_kept + self.engine.growth_bytes(seq.max_tokens + seq.request.num_prompt_tokens))
        logits = self._guard(seq, lambda: self.engine.extend(seq.slot, seq.request.prompt_token_ids))
        if logits is not None and self._first_token(seq, logits):
            self._running.append(seq)

    def _recharge(self, seq: _Sequence, actual: int) -> None:
        with self._lock:  # the bound charged at admission -> what it really holds
            self._reserved += actual - seq.charge
            seq.charge = actual

    def _first_token(self, seq: _Sequence, logits) -> bool:
        """Sample ``seq``'s first token from its prompt's last logits and deliver it; True when the request goes on
        (the caller puts it in the decode batch once its slot holds its entries), False when that token ended it."""
        token = int(seq.sampler(logits[None, :])[0])
        seq.tokens.append(token)
        seq.first_token_at = time.perf_counter()
        reason = self._finish_reason(seq, token)
        if reason is not None:
            self._remove(seq)
            seq.handle._deliver(seq.output([token], reason))
            return False
        seq.handle._deliver(seq.output([token]))
        return True

    def _finish_reason(self, seq: _Sequence, token: int) -> str | None:
        if token in seq.stop:
            return FINISH_STOP
        if len(seq.tokens) >= seq.max_tokens:
            return FINISH_LENGTH
        return None

    def _decode_step(self) -> None:
        running = self._running
        tokens = [s.tokens[-1] for s in running]
        slots = [s.slot for s in running]
        if all(s.sampler.config.greedy for s in running):  # the same argmax, taken where the backend can (its device)
            chosen = self.engine.decode_greedy(slots, tokens)
            sample = lambda row, seq: int(chosen[row])  # noqa: E731
        else:
            logits = self.engine.decode(slots, tokens)
            sample = lambda row, seq: int(seq.sampler(logits[row:row + 1])[0])  # noqa: E731
        finished = []
        for row, seq in enumerate(running):
            token = sample(row, seq)
            seq.tokens.append(token)
            reason = self._finish_reason(seq, token)
            if reason is None:
                seq.handle._deliver(seq.output([token]))
            else:
                finished.append((seq, token, reason))
        for seq, token, reason in finished:
            self._remove(seq)
            seq.handle._deliver(seq.output([token], reason))

    # ------------------------------------------------------------------ slots
    def _release(self, seq: _Sequence) -> None:
        with self._lock:
            self._reserved -= seq.charge
            seq.charge = 0

    def _remove(self, seq: _Sequence) -> None:
        """Release what ``seq`` holds: its slot or its prefill buffer, and its share of the KV memory."""
        if seq in self._running:
            self._running.remove(seq)
        if seq in self._prefilling:
            self._prefilling.remove(seq)
        if seq.slot is not None:
            self.engine.release(seq.slot)
            seq.slot = None
        seq.job = None
        self._forget_compression(seq)
        self._release(seq)

    def _finish(self, seq: _Sequence, reason: str, error: str | None = None) -> None:
        self._remove(seq)
        seq.handle._deliver(seq.output([], reason, error))

    def _fail_running(self, message: str) -> None:
        for seq in list(self._running):
            self._running.remove(seq)
            try:
                self.engine.release(seq.slot)
            except EngineError:  # the failure may have come from the slot itself
                pass
            seq.slot = None
            self._release(seq)
            seq.handle._deliver(seq.output([], FINISH_ERROR, message))
