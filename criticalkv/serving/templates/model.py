"""criticalkv Triton model (decoupled Python backend): a thin adapter over criticalkv.serving.Scheduler.

``execute`` hands each request to a small thread pool and returns at once: a pool thread parses and validates it
(its texts held to the engine's ``TextBound`` before the tokenizer runs), tokenises it and submits it to the
instance's scheduler, so a long request costs its own time, never the other requests' (``execute`` runs on the
stub's one thread) nor the scheduler's. The scheduler thread produces tokens, a response thread sends them through
the request's response sender (new text per token when streaming; the whole text at the end otherwise), closes with
TRITONSERVER_RESPONSE_COMPLETE_FINAL, and cancels the request when ``is_cancelled()`` turns true. A bad
request gets a TritonError naming the problem, on that request alone; a failure that is not the client's
(an unexpected exception, an engine error) is sent as "internal error: ..." (the OpenAI frontend answers it
with 500, the rest with 400). Engine arguments: ``model.json``.

Cancellation and shutdown: the response thread also polls, every ``POLL_S``, the requests that produced nothing for
that long (a long prefill), so a request its client cancelled frees its slot without waiting for its next token.
A server stopping with requests in flight would wait for them to finish, and one stopped while the model still sends
responses may not unload it at all: tritonserver 2.51 sometimes waited its whole exit timeout ("Found 1 live models",
then "Exit timeout expired", exit status 1; ``finalize`` was never called) when SIGTERM came while the model was still
ending its requests. ``criticalkv serve`` therefore drains first: it names a file in ``$CRITICALKV_DRAIN_FILE`` and
creates it before it stops the server; from then on every request is ended with the error "the server is shutting
down" (UNAVAILABLE) and new ones are refused with it; each model instance keeps a file ``<drain file>.<pid>.active``
from its start until it has answered every request after the drain began, and the launcher sends SIGTERM once no such
file is left (``TritonServer.stop``). ``finalize`` returns within seconds whatever the scheduler was doing.
"""

import json
import os
import queue
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils

TTFT_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64]
TPOT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2]
#: seconds between the response thread's looks at quiet requests (cancelled by their client?) and at the drain file
POLL_S = 0.1
#: threads that parse, check and tokenise requests (off the stub's thread that calls execute)
PREPARE_THREADS = 2
#: the longest finalize waits for the scheduler's thread and the response thread (Triton's exit timeout is 10 s)
FINALIZE_WAIT_S = 3.0
DRAIN_ENV = "CRITICALKV_DRAIN_FILE"
SHUTTING_DOWN = "the server is shutting down"
#: a request past its deadline (``model.json``'s request_timeout) ends with this error (criticalkv.serving.openai_api's
#: TIMED_OUT: its OpenAI frontend answers 504)
TIMED_OUT = "no answer within the server's request timeout"
TIMEOUT_REASON = "timeout"


class TritonPythonModel:
    def initialize(self, args):
        folder = os.path.join(args["model_repository"], args["model_version"])
        with open(os.path.join(folder, "model.json")) as f:
            self.config = json.load(f)
        # the stub ignores PYTHONPATH. The project's checkout goes first, ahead of sys.path's "" (the directory the
        # server was started in, which may hold another checkout's criticalkv); the environment's packages go last,
        # after this model environment's own numpy
        for i, path in enumerate(self.config.get("python_paths", [])):
            if i == 0:
                if path in sys.path:
                    sys.path.remove(path)
                sys.path.insert(0, path)
            elif path not in sys.path:
                sys.path.append(path)
        from criticalkv.request import TextBound
        from criticalkv.runtime import Engine, Request, RequestError
        from criticalkv.serving import Scheduler
        from criticalkv.serving.requests import TextStream, encode_inputs, parse_request

        self.parse_request, self.TextStream, self.RequestError = parse_request, TextStream, RequestError
        self.encode_inputs = encode_inputs
        self.Request = Request
        options = {}
        backend = self.config.get("backend", "onnxruntime")
        if backend == "tensorrt":
            options["device"] = int(args.get("model_instance_device_id", 0))
        elif backend == "torch" and args.get("model_instance_kind") == "GPU":
            options["device"] = f"cuda:{int(args.get('model_instance_device_id', 0))}"
        elif self.config.get("threads"):
            options["threads"] = int(self.config["threads"])
        self.engine = Engine.load(self.config["engine_dir"], backend=self.config.get("backend", "onnxruntime"),
                                  verify=False, **options)
        self.tokenizer = self.engine.tokenizer
        self.text_bound = TextBound.of(self.tokenizer, self.engine.max_input_len)
        self.scheduler = Scheduler(self.engine, **self.config.get("scheduler", {}))
        self.request_timeout = self.config.get("request_timeout")  # seconds, or None: no deadline
        self._setup_metrics(args)
        self._drain_file = os.environ.get(DRAIN_ENV) or None
        self._draining = False
        # removed once this instance has answered every request after the drain began (the launcher waits for it)
        self._active_file = f"{self._drain_file}.{os.getpid()}.active" if self._drain_file else None
        if self._active_file is not None:
            open(self._active_file, "w").close()
        self._preparing = 0  # requests handed to the prepare pool and not yet submitted or answered
        self._open = {}  # id -> state of every request not closed yet (the response thread polls them)
        self._open_lock = threading.Lock()
        self._responses = queue.Queue()
        self._response_thread = threading.Thread(target=self._response_loop, daemon=True)
        self._response_thread.start()
        self._prepare_pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="criticalkv-prepare")

    def _setup_metrics(self, args):
        labels = {"model": args["model_name"], "version": args["model_version"],
                  "instance": args.get("model_instance_name", "")}
        family = pb_utils.MetricFamily
        self._metric_families = [
            family("criticalkv_time_to_first_token_seconds", "Time from arrival to the first token", family.HISTOGRAM),
            family("criticalkv_time_per_output_token_seconds", "Mean time per output token after the first",
                   family.HISTOGRAM),
            family("criticalkv_kv_bytes_kept_total", "KV cache bytes kept by the selection, summed over requests",
                   family.COUNTER),
            family("criticalkv_kv_bytes_full_total", "KV cache bytes of the full prompt cache, summed over requests",
                   family.COUNTER),
            family("criticalkv_requests_running", "Requests decoding", family.GAUGE),
            family("criticalkv_requests_waiting", "Requests waiting for a slot", family.GAUGE),
            family("criticalkv_kv_bytes_reserved", "KV bytes held: running requests, prompts under prefill, cached contexts", family.GAUGE),
            family("criticalkv_context_cache", "Compressed context cache: hits, misses, evictions (counts since start), "
                   "bytes_held, entries (now)", family.GAUGE),
            family("criticalkv_prefix_cache", "Prefix cache of plain prompts: queries and hits (prompt tokens looked up "
                   "and found), requests and hit_requests, evictions (blocks) (counts since start), bytes_held, "
                   "blocks (now)", family.GAUGE),
        ]
        ttft, tpot, kept, full, running, waiting, reserved, cache, prefix = self._metric_families
        self.m_cache = {key: cache.Metric(labels={**labels, "stat": key})
                        for key in ("hits", "misses", "evictions", "bytes_held", "entries")}
        self._cache_stats = {}
        self.m_prefix = {key: prefix.Metric(labels={**labels, "stat": key})
                         for key in self.scheduler.prefix_cache.stats.as_dict()}
        self._prefix_stats = {}
        self.m_ttft = ttft.Metric(labels=labels, buckets=TTFT_BUCKETS)
        self.m_tpot = tpot.Metric(labels=labels, buckets=TPOT_BUCKETS)
        self.m_kept, self.m_full = kept.Metric(labels=labels), full.Metric(labels=labels)
        self.m_running, self.m_waiting = running.Metric(labels=labels), waiting.Metric(labels=labels)
        self.m_reserved = reserved.Metric(labels=labels)
        self._gauges = (None, None, None)

    # ------------------------------------------------------------------ requests
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            if self._draining:
                self._send_error(sender, SHUTTING_DOWN, pb_utils.TritonError.UNAVAILABLE)
                continue
            with self._open_lock:
                self._preparing += 1
            try:
                self._prepare_pool.submit(self._prepare, request, sender)
            except RuntimeError:  # the pool is shut down: finalize has begun
                with self._open_lock:
                    self._preparing -= 1
                self._send_error(sender, SHUTTING_DOWN, pb_utils.TritonError.UNAVAILABLE)
        return None

    def _prepare(self, request, sender):
        """On a pool thread: parse, check, tokenise and submit one request; an error answers it alone."""
        try:
            if self._draining:
                self._send_error(sender, SHUTTING_DOWN, pb_utils.TritonError.UNAVAILABLE)
                return
            self._submit(request, sender)
        except self.RequestError as err:
            self._send_error(sender, str(err))
        except Exception as err:  # an unexpected failure still answers this request alone
            self._send_error(sender, f"internal error: {type(err).__name__}: {err}")
            pb_utils.Logger.log_error(traceback.format_exc())
        finally:
            with self._open_lock:
                self._preparing -= 1

    def _submit(self, request, sender):
        names = ("text_input", "stream", "sampling_parameters", "exclude_input_in_output", "kv_budget",
                 "return_num_input_tokens", "return_num_output_tokens", "return_kv_bytes", "apply_chat_template",
                 "context", "input_ids", "context_ids", "context_threshold")
        inputs = {}
        for name in names:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            inputs[name] = None if tensor is None else tensor.as_numpy()
        parsed = self.parse_request(inputs, request.parameters())
        ids, context_ids = self.encode_inputs(parsed, self.tokenizer, self.text_bound)
        # the Triton request stays referenced until its final response: its sender needs it alive (``_close`` drops it)
        state = {"request": parsed, "triton_request": request, "sender": sender, "num_sent": 0, "handle": None,
                 "text": self.TextStream(self.tokenizer, parsed.stop), "checked": time.monotonic(),
                 "deadline": None if self.request_timeout is None else time.monotonic() + self.request_timeout}
        request = self.Request(ids, parsed.sampling, parsed.kv_budget, context_token_ids=context_ids,
                               context_threshold=parsed.context_threshold)
        with self._open_lock:
            state["handle"] = self.scheduler.submit(request, on_output=lambda out: self._responses.put((state, out)))
            self._open[id(state)] = state

    @staticmethod
    def _close(state):
        """``state``'s request is answered (its final response sent, or being sent by the caller): drop the Triton
        request, its response sender and the scheduler's handle, whose callback refers back to ``state`` (a reference
        cycle that held them, and the request's inputs, until the cyclic garbage collector ran)."""
        state["closed"] = True
        for key in ("triton_request", "sender", "handle"):
            state.pop(key, None)

    def _send_error(self, sender, message, code=None):
        error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
        sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    # ------------------------------------------------------------------ responses
    def _response_loop(self):
        next_poll = time.monotonic() + POLL_S
        while True:
            try:
                item = self._responses.get(timeout=POLL_S)
            except queue.Empty:
                item = ()
            if time.monotonic() >= next_poll:
                try:
                    self._poll()
                except Exception:
                    pb_utils.Logger.log_error(traceback.format_exc())
                next_poll = time.monotonic() + POLL_S
            if item is None:
                return
            if not item:
                continue
            state, out = item
            try:
                self._respond(state, out)
            except Exception:
                pb_utils.Logger.log_error(traceback.format_exc())
                if state.get("handle") is not None:
                    state["handle"].cancel()
            if state.get("closed"):
                with self._open_lock:
                    self._open.pop(id(state), None)

    def _poll(self):
        """Cancel the requests whose client cancelled them (those quiet for POLL_S: the others are checked at each
        output), or every request once the drain file exists."""
        if self._drain_file is not None and not self._draining and os.path.exists(self._drain_file):
            self._draining = True
            pb_utils.Logger.log_info(f"criticalkv: {SHUTTING_DOWN}: ending the requests in flight")
        with self._open_lock:
            states = list(self._open.values())
            preparing = self._preparing
        if self._draining and not states and not preparing and self._responses.empty():
            self._drained()
        now = time.monotonic()
        for state in states:
            if state.get("closed") or state["handle"].cancel_requested:
                continue
            if self._draining:
                state["handle"].cancel()
            elif state["deadline"] is not None and now > state["deadline"]:
                state["handle"].cancel(TIMEOUT_REASON)
            elif now - state["checked"] >= POLL_S:
                state["checked"] = now
                if state["sender"].is_cancelled():
                    state["handle"].cancel()

    def _drained(self):
        """Every request is answered since the drain began: tell the launcher (it stops the server then)."""
        if self._active_file is not None:
            try:
                os.unlink(self._active_file)
            except FileNotFoundError:
                pass
            self._active_file = None

    def _respond(self, state, out):
        gauges = (self.scheduler.num_running, self.scheduler.num_waiting, self.scheduler.kv_bytes_reserved)
        if gauges != self._gauges:  # each update is a message to the server: only on change
            for metric, value, last in zip((self.m_running, self.m_waiting, self.m_reserved), gauges, self._gauges):
                if value != last:
                    metric.set(value)
            self._gauges = gauges
        for metrics, cache, last in ((self.m_cache, self.scheduler.context_cache, "_cache_stats"),
                                     (self.m_prefix, self.scheduler.prefix_cache, "_prefix_stats")):
            stats, before = cache.stats.as_dict(), getattr(self, last)
            if stats != before:
                for key, value in stats.items():
                    if value != before.get(key):
                        metrics[key].set(value)
                setattr(self, last, stats)
        if state.get("closed"):
            return
        parsed, sender, handle = state["request"], state["sender"], state["handle"]
        new_text, stopped = state["text"].add(out.new_token_ids, final=out.finished)
        final = out.finished or stopped
        if stopped and not out.finished:
            handle.cancel("stop")  # a stop string: the slot is freed before the next decode step
        if out.ttft_s is not None and len(out.token_ids) == len(out.new_token_ids) and out.new_token_ids:
            self.m_ttft.observe(out.ttft_s)
        if out.finished:
            if out.time_per_output_token_s is not None:
                self.m_tpot.observe(out.time_per_output_token_s)
            self.m_kept.increment(out.kv_bytes_kept)
            self.m_full.increment(out.kv_bytes_full)
        if out.error is not None:
            self._close(state)
            self._send_error(sender, f"internal error: {out.error}")
            return
        if out.finish_reason == TIMEOUT_REASON:
            self._close(state)
            what = "between two responses of the stream" if parsed.stream else "for the whole answer"
            self._send_error(sender, f"{TIMED_OUT} ({self.request_timeout:g} s {what}, `criticalkv serve "
                                     "--request-timeout`): the request was cancelled")
            return
        if out.finish_reason == "cancelled":
            self._close(state)
            error = (pb_utils.TritonError(SHUTTING_DOWN, pb_utils.TritonError.UNAVAILABLE) if self._draining else
                     pb_utils.TritonError("request cancelled", pb_utils.TritonError.CANCELLED))
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        if parsed.stream:  # one response per token (its text may be empty: a special token, a partial character)
            count = len(out.token_ids) - state["num_sent"]
            state["num_sent"] = len(out.token_ids)
            self._send(state, out, new_text, count, final)
        elif final:
            text = (parsed.prompt if parsed.prepend_input else "") + state["text"].text
            self._send(state, out, text, len(out.token_ids), True)
        if final:
            self._close(state)
        else:
            state["checked"] = time.monotonic()
            if parsed.stream and state["deadline"] is not None:  # a stream's deadline runs from its last response
                state["deadline"] = state["checked"] + self.request_timeout
            if sender.is_cancelled():
                handle.cancel()

    def _send(self, state, out, text, num_tokens, final):
        parsed = state["request"]
        tensors = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))]
        if final:
            reason = "stop" if state["text"].stopped else out.finish_reason
            tensors.append(pb_utils.Tensor("finish_reason", np.array([reason.encode()], dtype=np.object_)))
            if parsed.return_num_input_tokens:
                tensors.append(pb_utils.Tensor("num_input_tokens", np.array([out.num_input_tokens], np.uint32)))
            if parsed.return_kv_bytes:
                tensors.append(pb_utils.Tensor("kv_bytes_kept", np.array([out.kv_bytes_kept], np.uint64)))
                tensors.append(pb_utils.Tensor("kv_bytes_full", np.array([out.kv_bytes_full], np.uint64)))
            if out.context_cache_hit is not None:  # a request with a context: were its entries cached?
                tensors.append(pb_utils.Tensor("context_cache_hit", np.array([out.context_cache_hit], bool)))
        if parsed.return_num_output_tokens:
            tensors.append(pb_utils.Tensor("num_output_tokens", np.array([num_tokens], np.uint32)))
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        state["sender"].send(pb_utils.InferenceResponse(output_tensors=tensors), flags=flags)

    def finalize(self):
        """Called by Triton once every request is released; returns within seconds (Triton's exit timeout is 10 s):
        what the scheduler still runs ends as cancelled, the response thread stops, the engine closes."""
        started = time.monotonic()
        pb_utils.Logger.log_info("criticalkv: finalize: stopping the scheduler and closing the engine")
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)
        self.scheduler.close(timeout=FINALIZE_WAIT_S)
        self._responses.put(None)
        self._response_thread.join(FINALIZE_WAIT_S)
        self.engine.close()
        self._drained()
        # Triton ends this stub process right after finalize (one process per model instance, ended on unload): the
        # engine's ONNX Runtime sessions and weights are left for the OS to reclaim with the process instead of being
        # freed allocation by allocation as the interpreter exits (py-spy: 1.4 s of the unload in libc's free under
        # ONNX Runtime's destructors, tritonserver waiting for the process all along)
        import ctypes
        import gc

        ctypes.pythonapi.Py_IncRef(ctypes.py_object(self.engine))
        gc.freeze()
        pb_utils.Logger.log_info(f"criticalkv: finalize: done in {time.monotonic() - started:.2f} s")
