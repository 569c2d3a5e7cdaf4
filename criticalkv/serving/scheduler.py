"""Continuous batching over one ``Engine``: per-request prefill, one shared decode batch, slots.

A scheduler thread drives the engine through its slot API only (``check``, ``prefill``, ``decode``,
``release``). Each loop iteration it

1. drops the cancelled requests (waiting ones at once; running ones release their slot at once);
2. admits waiting requests in arrival order while ``max_num_seqs`` and the KV pool allow: each one is
   prefilled alone into a free slot (batch 1, no padding; its selection runs inside the prefill graph) and its
   first token is sampled from the prefill logits, so it joins the decode batch at the next step;
3. runs one decode step over every occupied slot and samples each with that request's own sampler;
4. releases the slots of finished sequences at once.

The decode graph computes every row from that row's cache only, and a request's sampler sees only its
own logits, so a greedy request yields the same tokens as ``Engine.generate`` on it alone, whatever else
shares the batch (tests/serving/test_scheduler.py checks it).

KV pool: a request is charged its kept entries plus its ``max_tokens`` growth (every head of every layer
grows by one entry per token), at the engine's bytes per entry. Before its prefill the kept entries are
bounded (``Engine.kv_bytes_bound``); after it the charge drops to the real count. Requests that do not fit
wait; one that could never fit in an empty pool is refused at submission. The backend's buffers themselves
are allocated once for ``max_batch_size`` rows of full slot capacity; the pool limits what the admitted
sequences may hold.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable


from criticalkv.errors import EngineError, RequestError
from criticalkv.request import DEFAULT_MAX_TOKENS, Request
from criticalkv.runtime.engine import Engine
from criticalkv.sampling import Sampler

#: finish reasons (vllm's names): a stop token, max_tokens reached, cancelled by the client, an error
FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED, FINISH_ERROR = "stop", "length", "cancelled", "error"

__all__ = ["DEFAULT_MAX_TOKENS", "RequestError", "RequestHandle", "RequestOutput", "Scheduler"]


@dataclass
class RequestOutput:
    """What a request has produced so far; one is delivered per generated token, the last with ``finished``.

    new_token_ids : the tokens generated since the previous output (empty in a cancellation or error output)
    token_ids : every generated token so far (a stop token included)
    finish_reason : None while running, else "stop", "length", "cancelled" or "error"
    kv_bytes_kept / kv_bytes_full : the request's prompt cache after the selection / without eviction (bytes)
    ttft_s : time from submission to the first token; queue_s : time waiting for admission
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
        import asyncio

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
    request: Request  # checked by the engine (max_tokens filled, kv_budget normalised)
    sampler: Sampler
    stop: frozenset[int]
    charge: int  # bytes reserved in the KV pool
    submitted: float
    slot: int | None = None
    admitted: float = 0.0
    first_token_at: float | None = None
    tokens: list[int] = field(default_factory=list)
    kv_bytes_kept: int = 0
    kv_bytes_full: int = 0

    @property
    def max_tokens(self) -> int:
        return self.request.sampling.max_tokens

    def output(self, new: list[int], finish_reason: str | None = None, error: str | None = None) -> RequestOutput:
        now = time.perf_counter()
        return RequestOutput(
            request_id=self.handle.request_id, new_token_ids=new, token_ids=list(self.tokens),
            num_input_tokens=self.request.num_prompt_tokens, finished=finish_reason is not None,
            finish_reason=finish_reason, error=error, kv_bytes_kept=self.kv_bytes_kept,
            kv_bytes_full=self.kv_bytes_full,
            ttft_s=None if self.first_token_at is None else self.first_token_at - self.submitted,
            queue_s=(self.admitted - self.submitted) if self.admitted else None, elapsed_s=now - self.submitted,
        )


class Scheduler:
    """Continuous batching over ``engine`` (ONNX Runtime or TensorRT backend) on a background thread.

    Parameters
    ----------
    engine : a loaded ``Engine`` built with ``--max-batch-size`` >= max_num_seqs; the scheduler owns it while
        it runs (nothing else may prefill, decode or release its slots)
    max_num_seqs : most sequences decoding at once (default: the engine's max batch size)
    kv_pool_mib : most KV memory the running sequences may hold, MiB (default: no limit beyond max_num_seqs)
    """

    def __init__(self, engine: Engine, max_num_seqs: int | None = None, kv_pool_mib: float | None = None):
        self.engine = engine
        self.max_num_seqs = engine.num_slots if max_num_seqs is None else int(max_num_seqs)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_seqs > engine.num_slots:
            raise EngineError(
                f"max_num_seqs {self.max_num_seqs} exceeds the engine's max batch size {engine.num_slots}: "
                f"rebuild the engine with --max-batch-size {self.max_num_seqs} (or more), or lower max_num_seqs")
        if kv_pool_mib is not None and not kv_pool_mib > 0:
            raise ValueError(f"kv_pool_mib must be > 0, got {kv_pool_mib}")
        self.kv_pool_bytes = None if kv_pool_mib is None else int(kv_pool_mib * 2**20)
        self._ids = itertools.count(1)
        self._lock = threading.Condition()
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._reserved = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="criticalkv-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ submission
    def submit(self, request: Request, on_output: Callable[[RequestOutput], None] | None = None) -> RequestHandle:
        """Queue one request; returns at once. Raises ``RequestError`` naming the problem for a bad request
        (``Engine.check``: prompt length and ids, ``max_tokens`` within the built maximum (default
        ``DEFAULT_MAX_TOKENS`` or the engine's maximum if lower), ``kv_budget`` within the policy's range), or one
        that could never fit in the KV pool."""
        engine = self.engine
        request = engine.check(request)
        charge = engine.kv_bytes_bound(request.num_prompt_tokens, request.sampling.max_tokens)
        if self.kv_pool_bytes is not None and charge > self.kv_pool_bytes:
            raise RequestError(f"the request needs up to {charge / 2**20:.2f} MiB of KV cache, more than the whole "
                               f"KV pool ({self.kv_pool_bytes / 2**20:.2f} MiB)")
        request_id = next(self._ids) if request.request_id is None else request.request_id
        handle = RequestHandle(request_id, on_output)
        seq = _Sequence(handle, request, Sampler(request.sampling), engine.stop_ids(request), charge,
                        time.perf_counter())
        with self._lock:
            if self._stopping:
                raise RequestError("the scheduler is shutting down")
            self._waiting.append(seq)
            self._lock.notify()
        return handle

    # ------------------------------------------------------------------ state
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_bytes_reserved(self) -> int:
        return self._reserved

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
                while not (self._waiting or self._running or self._stopping):
                    self._lock.wait()
                if self._stopping:
                    break
            try:
                self._drop_cancelled()
                self._admit()
                if self._running:
                    self._decode_step()
            except Exception as err:  # an engine failure ends the running requests, not the server
                self._fail_running(f"{type(err).__name__}: {err}")
        for seq in list(self._running):
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
        for seq in [s for s in self._running if s.handle.cancel_requested]:
            self._finish(seq, seq.handle.cancel_reason)

    def _admit(self) -> None:
        while True:
            with self._lock:
                if not self._waiting or len(self._running) >= self.max_num_seqs:
                    return
                seq = self._waiting[0]
                if self.kv_pool_bytes is not None and self._reserved + seq.charge > self.kv_pool_bytes:
                    return  # first come, first served: later requests wait behind it
                self._waiting.popleft()
                self._reserved += seq.charge
            self._start(seq)

    def _start(self, seq: _Sequence) -> None:
        """Prefill ``seq`` alone into a free slot and sample its first token."""
        seq.admitted = time.perf_counter()
        slot = self.engine.free_slots()[0]
        try:
            result = self.engine.prefill(slot, seq.request)
        except Exception as err:
            with self._lock:
                self._reserved -= seq.charge
            seq.handle._deliver(seq.output([], FINISH_ERROR, f"prefill failed: {type(err).__name__}: {err}"))
            return
        seq.slot = slot
        seq.kv_bytes_kept, seq.kv_bytes_full = result.kv_bytes_kept, result.kv_bytes_full
        actual = result.kv_bytes_kept + self.engine.growth_bytes(seq.max_tokens)
        with self._lock:  # the bound charged at admission -> the real kept entries
            self._reserved += actual - seq.charge
            seq.charge = actual
        token = int(seq.sampler(result.logits[None, :])[0])
        seq.tokens.append(token)
        seq.first_token_at = time.perf_counter()
        self._running.append(seq)
        reason = self._finish_reason(seq, token)
        if reason is not None:
            self._remove(seq)
            seq.handle._deliver(seq.output([token], reason))
            return
        seq.handle._deliver(seq.output([token]))

    def _finish_reason(self, seq: _Sequence, token: int) -> str | None:
        if token in seq.stop:
            return FINISH_STOP
        if len(seq.tokens) >= seq.max_tokens:
            return FINISH_LENGTH
        return None

    def _decode_step(self) -> None:
        running = self._running
        tokens = [s.tokens[-1] for s in running]
        logits = self.engine.decode([s.slot for s in running], tokens)
        finished = []
        for row, seq in enumerate(running):
            token = int(seq.sampler(logits[row:row + 1])[0])
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
        """Release ``seq``'s slot and its share of the KV pool."""
        self._running.remove(seq)
        self.engine.release(seq.slot)
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
            self._release(seq)
            seq.handle._deliver(seq.output([], FINISH_ERROR, message))
