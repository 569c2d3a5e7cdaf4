"""Continuous batching over one ``Engine``: per-request prefill, one shared decode batch, slots.

A scheduler thread owns the engine's backend. Each loop iteration it

1. drops the cancelled requests (waiting ones at once; running ones free their slot at once);
2. admits waiting requests in arrival order while ``max_num_seqs`` and the KV pool allow: each one is
   prefilled alone (batch 1, no padding; its selection runs inside the prefill graph), its first token
   is sampled from the prefill logits, and its kept K/V are copied into buffer row B (the next free
   slot), so it joins the decode batch at the next step;
3. runs one decode step over the first B rows (one row per running sequence, each at its own
   position) and samples every row with that request's own sampler;
4. frees the rows of finished sequences at once, moving the last running row into each freed one so the
   decode batch always stays the first B rows.

The decode graph computes every row from that row's cache only, and a request's sampler sees only its
own logits, so a greedy request yields the same tokens as ``Engine.generate`` on it alone, whatever else
shares the batch (tests/serving/test_scheduler.py checks it).

KV pool: a request is charged its kept entries plus its ``max_tokens`` growth (every head of every layer
grows by one entry per token), at the backend's bytes per entry. Before its prefill the kept entries are
bounded by min(prompt length, the layer's selection capacity); after it the charge drops to the real
count. Requests that do not fit wait; one that could never fit in an empty pool is refused at submission.
The backend's buffers themselves are allocated once for ``max_batch_size`` rows of full slot capacity;
the pool limits what the admitted sequences may hold.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from criticalkv.runtime.backend import NO_BUDGET_INPUT
from criticalkv.runtime.engine import Engine
from criticalkv.runtime.manifest import EngineError
from criticalkv.sampling import Sampler, SamplingConfig

#: finish reasons (vllm's names): a stop token, max_tokens reached, cancelled by the client, an error
FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED, FINISH_ERROR = "stop", "length", "cancelled", "error"


#: new tokens of a request that does not say (vllm's default)
DEFAULT_MAX_TOKENS = 16


class RequestError(ValueError):
    """A request the engine cannot serve (the message names the problem)."""


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
    prompt: np.ndarray  # [n] int64
    max_tokens: int
    sampler: Sampler
    stop: set[int]
    kv_budget: int | None
    charge: int  # bytes reserved in the KV pool
    submitted: float
    admitted: float = 0.0
    first_token_at: float | None = None
    tokens: list[int] = field(default_factory=list)
    kv_bytes_kept: int = 0
    kv_bytes_full: int = 0

    def output(self, new: list[int], finish_reason: str | None = None, error: str | None = None) -> RequestOutput:
        now = time.perf_counter()
        return RequestOutput(
            request_id=self.handle.request_id, new_token_ids=new, token_ids=list(self.tokens),
            num_input_tokens=len(self.prompt), finished=finish_reason is not None, finish_reason=finish_reason,
            error=error, kv_bytes_kept=self.kv_bytes_kept, kv_bytes_full=self.kv_bytes_full,
            ttft_s=None if self.first_token_at is None else self.first_token_at - self.submitted,
            queue_s=(self.admitted - self.submitted) if self.admitted else None, elapsed_s=now - self.submitted,
        )


class Scheduler:
    """Continuous batching over ``engine`` (ONNX Runtime or TensorRT backend) on a background thread.

    Parameters
    ----------
    engine : a loaded ``Engine``; its backend must implement ``load_slot`` / ``move_slot`` and decode over
        the first B rows (both bundled backends do). It was built with ``--max-batch-size`` >= max_num_seqs.
    max_num_seqs : most sequences decoding at once (default: the engine's max batch size)
    kv_pool_mib : most KV memory the running sequences may hold, MiB (default: no limit beyond max_num_seqs)
    """

    def __init__(self, engine: Engine, max_num_seqs: int | None = None, kv_pool_mib: float | None = None):
        backend = engine.backend
        for method in ("load_slot", "move_slot"):
            if not hasattr(backend, method):
                raise EngineError(f"backend {backend.name} has no {method}: it cannot serve continuous batches")
        self.engine = engine
        self.backend = backend
        self.max_num_seqs = engine.max_batch_size if max_num_seqs is None else int(max_num_seqs)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_seqs > engine.max_batch_size:
            raise EngineError(
                f"max_num_seqs {self.max_num_seqs} exceeds the engine's max batch size {engine.max_batch_size}: "
                f"rebuild the engine with --max-batch-size {self.max_num_seqs} (or more), or lower max_num_seqs")
        if kv_pool_mib is not None and not kv_pool_mib > 0:
            raise ValueError(f"kv_pool_mib must be > 0, got {kv_pool_mib}")
        self.kv_pool_bytes = None if kv_pool_mib is None else int(kv_pool_mib * 2**20)
        spec = engine.spec
        self.num_layers, self.kv_heads = spec["num_layers"], spec["num_kv_heads"]
        capacities = engine.manifest["shapes"]["decode_capacity"]
        # K + V bytes of one entry of one head, from the backend's own buffers (fp32 on ONNX Runtime)
        self.entry_bytes = backend.kv_buffer_bytes() // (engine.max_batch_size * self.kv_heads * sum(capacities))
        self.selection_capacities = [c - engine.max_new_tokens for c in capacities]
        self.policy = engine.policy
        self._ids = itertools.count(1)
        self._lock = threading.Condition()
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []  # row r of the decode buffers holds _running[r]
        self._reserved = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="criticalkv-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ submission
    def validate_budget(self, kv_budget: int | None) -> int | None:
        """The budget to pass to the prefill (None = the built one); RequestError when out of range."""
        if kv_budget is None:
            return None
        policy = self.policy
        if isinstance(kv_budget, bool) or int(kv_budget) != kv_budget:
            raise RequestError(f"kv_budget must be an integer, got {kv_budget!r}")
        kv_budget = int(kv_budget)
        if policy.name == "full":
            raise RequestError("kv_budget: this engine's policy 'full' keeps every entry (no budget to lower)")
        if not policy.window <= kv_budget <= policy.budget:
            raise RequestError(f"kv_budget must lie in [{policy.window}, {policy.budget}] (the window and the "
                               f"engine's built budget), got {kv_budget}")
        if kv_budget == policy.budget:
            return None
        if not getattr(self.backend, "accepts_kv_budget", False):
            raise RequestError(NO_BUDGET_INPUT)
        return kv_budget

    def submit(
        self,
        prompt_ids: Sequence[int],
        max_tokens: int | None = None,
        sampling: SamplingConfig | None = None,
        stop_token_ids: Sequence[int] | None = None,
        kv_budget: int | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> RequestHandle:
        """Queue one request; returns at once. Raises RequestError naming the problem for a bad request.

        prompt_ids : the prompt's token ids (1 <= n <= the engine's max input length)
        max_tokens : new tokens at most (1 <= max_tokens <= the engine's max new tokens; default
            ``DEFAULT_MAX_TOKENS`` or the engine's maximum if lower)
        stop_token_ids : default the model's EOS ids; the stop token is part of the output
        kv_budget : tokens per KV head kept by the selection (window <= kv_budget <= the built budget)
        """
        engine = self.engine
        if max_tokens is None:
            max_tokens = min(DEFAULT_MAX_TOKENS, engine.max_new_tokens)
        prompt = np.asarray(list(prompt_ids), dtype=np.int64)
        if prompt.size == 0:
            raise RequestError("the prompt is empty")
        if prompt.size > engine.max_input_len:
            raise RequestError(f"the prompt has {prompt.size} tokens, more than the engine's max input length "
                               f"{engine.max_input_len}")
        vocab = engine.spec["vocab_size"]
        if prompt.min() < 0 or prompt.max() >= vocab:
            raise RequestError(f"prompt token ids must lie in [0, {vocab})")
        if isinstance(max_tokens, bool) or int(max_tokens) != max_tokens:
            raise RequestError(f"max_tokens must be an integer, got {max_tokens!r}")
        if not 1 <= max_tokens <= engine.max_new_tokens:
            raise RequestError(f"max_tokens must lie in [1, {engine.max_new_tokens}] (the engine's built maximum), "
                               f"got {max_tokens}")
        kv_budget = self.validate_budget(kv_budget)
        charge = self._charge_bound(prompt.size, int(max_tokens))
        if self.kv_pool_bytes is not None and charge > self.kv_pool_bytes:
            raise RequestError(f"the request needs up to {charge / 2**20:.2f} MiB of KV cache, more than the whole "
                               f"KV pool ({self.kv_pool_bytes / 2**20:.2f} MiB)")
        stop = engine.eos_token_ids if stop_token_ids is None else stop_token_ids
        handle = RequestHandle(next(self._ids), on_output)
        seq = _Sequence(handle, prompt, int(max_tokens), Sampler(sampling), {int(t) for t in stop}, kv_budget,
                        charge, time.perf_counter())
        with self._lock:
            if self._stopping:
                raise RequestError("the scheduler is shutting down")
            self._waiting.append(seq)
            self._lock.notify()
        return handle

    def _charge_bound(self, prompt_len: int, max_tokens: int) -> int:
        kept = sum(min(prompt_len, cap) for cap in self.selection_capacities)
        return (kept + self.num_layers * max_tokens) * self.kv_heads * self.entry_bytes

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
        """Stop the thread; requests still waiting or running end with finish reason "cancelled"."""
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
        """Prefill ``seq`` alone, sample its first token, load its kept K/V into the next free row."""
        seq.admitted = time.perf_counter()
        n = len(seq.prompt)
        ids = seq.prompt[None, :]
        try:
            pre = self.backend.prefill(ids, np.ones_like(ids), np.arange(n, dtype=np.int64)[None, :],
                                       kv_budget=seq.kv_budget)
        except Exception as err:
            with self._lock:
                self._reserved -= seq.charge
            seq.handle._deliver(seq.output([], FINISH_ERROR, f"prefill failed: {type(err).__name__}: {err}"))
            return
        kept = sum(int(x.sum()) for x in pre.lengths)
        seq.kv_bytes_kept = kept * self.entry_bytes
        seq.kv_bytes_full = n * self.kv_heads * self.num_layers * self.entry_bytes
        actual = (kept + self.num_layers * self.kv_heads * seq.max_tokens) * self.entry_bytes
        with self._lock:  # the bound charged at admission -> the real kept entries
            self._reserved += actual - seq.charge
            seq.charge = actual
        token = int(seq.sampler(pre.logits)[0])
        seq.tokens.append(token)
        seq.first_token_at = time.perf_counter()
        reason = self._finish_reason(seq, token)
        if reason is not None:
            self._release(seq)
            seq.handle._deliver(seq.output([token], reason))
            return
        row = len(self._running)
        self.backend.load_slot(row, pre, 0)
        self._running.append(seq)
        seq.handle._deliver(seq.output([token]))

    def _finish_reason(self, seq: _Sequence, token: int) -> str | None:
        if token in seq.stop:
            return FINISH_STOP
        if len(seq.tokens) >= seq.max_tokens:
            return FINISH_LENGTH
        return None

    def _decode_step(self) -> None:
        running = self._running
        tokens = np.array([s.tokens[-1] for s in running], dtype=np.int64)
        # the token generated t-th (t from 0) after a prompt of n tokens sits at position n + t
        positions = np.array([len(s.prompt) + len(s.tokens) - 1 for s in running], dtype=np.int64)
        logits = self.backend.decode(tokens, positions)
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
        """Free ``seq``'s row: the last running row moves into it, so the batch stays the first B rows."""
        row = self._running.index(seq)
        last = len(self._running) - 1
        if row != last:
            self.backend.move_slot(last, row)
            self._running[row] = self._running[last]
        self._running.pop()
        self._release(seq)

    def _finish(self, seq: _Sequence, reason: str, error: str | None = None) -> None:
        self._remove(seq)
        seq.handle._deliver(seq.output([], reason, error))

    def _fail_running(self, message: str) -> None:
        for seq in list(self._running):
            self._running.remove(seq)
            self._release(seq)
            seq.handle._deliver(seq.output([], FINISH_ERROR, message))
