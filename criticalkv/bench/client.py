"""A streaming load generator for Triton's ``generate_stream`` endpoint (standard library, threads).

Each request is one ``POST /v2/models/NAME/generate_stream`` whose JSON body names the model's inputs
(``text_input``, ``sampling_parameters`` as a JSON string, ``return_*`` flags, optional ``kv_budget``);
the server answers with server-sent events, ``data: {...}`` per streamed response. The arrival time of
every event is taken with ``time.perf_counter`` as soon as its line is read.

Two load modes, as AIPerf and ``trtllm-bench`` have them:

* closed loop (``concurrency``): ``c`` workers each send their next request as soon as the previous
  one finished, so ``c`` requests are always in flight;
* open loop (``request_rate``): requests start at Poisson arrival times (exponential gaps of mean
  1 / rate, from a seeded generator), optionally capped by ``max_concurrency`` in flight.

Warm-up requests (sent first, with the same load, then discarded) are never part of the records.
"""

from __future__ import annotations

import http.client
import json
import queue
import random
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Sequence

from tqdm import tqdm

from criticalkv.bench.metrics import RequestRecord

#: Seconds a single request may take before the client gives up on it (recorded as an error).
REQUEST_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class Endpoint:
    """A server's HTTP address and the model to call: Triton's ``generate_stream`` (``api`` "triton"), or an OpenAI
    server (``api`` "openai": vLLM), whose requests are the same bodies made OpenAI completions of the same token
    ids by ``tokenizer`` (``openai_completion``)."""

    url: str  # e.g. http://127.0.0.1:8000
    model: str
    api: str = "triton"
    tokenizer: object = field(default=None, compare=False, repr=False)

    @property
    def host_port(self) -> tuple[str, int]:
        parsed = urllib.parse.urlsplit(self.url)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"--url must look like http://HOST:PORT, got {self.url!r}")
        return parsed.hostname, parsed.port or 80

    @property
    def stream_path(self) -> str:
        return f"/v2/models/{urllib.parse.quote(self.model)}/generate_stream"


def request_body(text: str, max_tokens: int, ignore_eos: bool = True, kv_budget: int | None = None,
                 extra_sampling: dict | None = None, context: str | None = None, chat: bool | None = None) -> dict:
    """The JSON body of one generate request (Triton generate extension: keys are the model's inputs).

    Greedy decoding (temperature 0) and ``ignore_eos`` so that every request produces exactly
    ``max_tokens`` tokens; the server returns token counts and KV bytes with the final response.
    ``context``: a document sent apart from the question ``text`` (the server compresses it once and caches it;
    its response says ``context_cache_hit``); ``chat``: the model's ``apply_chat_template`` input (None: not sent).
    """
    sampling = {"max_tokens": int(max_tokens), "temperature": 0.0, "ignore_eos": bool(ignore_eos)}
    sampling.update(extra_sampling or {})
    body = {
        "text_input": text,
        "stream": True,
        "exclude_input_in_output": True,
        "sampling_parameters": json.dumps(sampling),
        "return_num_input_tokens": True,
        "return_num_output_tokens": True,
        "return_kv_bytes": True,
    }
    if kv_budget is not None:
        body["kv_budget"] = int(kv_budget)
    if context is not None:
        body["context"] = context
    if chat is not None:
        body["apply_chat_template"] = bool(chat)
    return body


def _as_int(value) -> int | None:
    if isinstance(value, list):  # a [1]-shaped output comes back as a one-element list
        value = value[0] if value else None
    return None if value is None else int(value)


def _as_bool(value) -> bool | None:
    if isinstance(value, list):
        value = value[0] if value else None
    if isinstance(value, str):  # a BOOL output may come back as "true" / "false"
        return value.strip().lower() in ("true", "1")
    return None if value is None else bool(value)


def _as_str(value) -> str | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return None if value is None else str(value)


def parse_event(record: RequestRecord, event: dict, arrived: float) -> None:
    """Fold one SSE event into ``record``.

    A streamed response's ``num_output_tokens`` counts the tokens *it* carries (criticalkv's model sends
    a response when new text is ready, so a token that completes no character travels with the next
    one); a response with ``text_output`` and no count carries one token. The final response adds the
    input count, KV bytes and finish reason (and, for a request with a context, ``context_cache_hit``).
    """
    if "error" in event:
        record.error = str(event["error"])
        return
    count = _as_int(event.get("num_output_tokens"))
    if count is None and "text_output" in event:
        count = 1
    if event.get("text_output"):
        record.text.append(_as_str(event["text_output"]) or "")
    if count:
        record.chunks.append((arrived, count))
    for key, attr in (("num_input_tokens", "input_tokens"), ("kv_bytes_kept", "kv_bytes_kept"),
                      ("kv_bytes_full", "kv_bytes_full")):
        if event.get(key) is not None:
            setattr(record, attr, _as_int(event[key]))
    if event.get("context_cache_hit") is not None:
        record.context_cache_hit = _as_bool(event["context_cache_hit"])
    if event.get("finish_reason") not in (None, "", [""], [None]):
        record.finish_reason = _as_str(event["finish_reason"])


def _events(host: str, port: int, path: str, body: dict, timeout: float, record: RequestRecord, accept: str):
    """POST ``body`` (JSON) and yield ``(arrival time, event)`` for every ``data: {...}`` line of the answer (``data:
    [DONE]`` skipped); a non-200 answer, a malformed event or a connection failure sets ``record.error`` and ends."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", "Accept": accept})
        response = conn.getresponse()
        if response.status != 200:
            message = response.read().decode(errors="replace").strip()
            try:
                message = json.loads(message).get("error", message)
                message = message.get("message", message) if isinstance(message, dict) else message  # OpenAI's object
            except (ValueError, AttributeError):
                pass
            record.error = f"HTTP {response.status}: {message}"
            return
        while True:
            line = response.readline()
            if not line:
                break
            arrived = time.perf_counter()
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            try:
                event = json.loads(line[5:])
            except ValueError:
                record.error = f"malformed event: {line[:200]!r}"
                return
            yield arrived, event
    except (OSError, http.client.HTTPException) as err:
        record.error = f"{type(err).__name__}: {err}"
    finally:
        conn.close()


def send_request(endpoint: Endpoint, body: dict, timeout: float = REQUEST_TIMEOUT_S,
                 on_event: Callable[[RequestRecord], None] | None = None) -> RequestRecord:
    """POST ``body`` to ``generate_stream`` and read the event stream to its end (an OpenAI endpoint: the same
    request as a streamed completion of the same ids, ``openai_completion``).

    ``on_event``: called with the record after every event was folded in (from the reading thread),
    e.g. to start another request once this one streamed its first tokens."""
    if endpoint.api == "openai":
        return send_openai(endpoint.url, openai_completion(body, endpoint.tokenizer, endpoint.model), timeout, on_event)
    host, port = endpoint.host_port
    return _stream(host, port, endpoint.stream_path, body, timeout, on_event, parse_event)


def _stream(host: str, port: int, path: str, body: dict, timeout: float, on_event, fold) -> RequestRecord:
    """One streamed request: every event folded into its record by ``fold(record, event, arrival)``."""
    record = RequestRecord(start=time.perf_counter())
    for arrived, event in _events(host, port, path, body, timeout, record, "text/event-stream"):
        fold(record, event, arrived)
        if on_event is not None:
            on_event(record)
        if record.error:
            break
    if not record.chunks and record.error is None:
        record.error = "the stream ended without any output"
    return record


def prompt_ids(body: dict, tokenizer) -> list[int]:
    """The token ids criticalkv's server runs for a ``generate_stream`` body (``text_input``, ``apply_chat_template``,
    ``context``: ``criticalkv.serving.requests.encode_inputs``), the context's first."""
    from criticalkv.serving.requests import TextRequest, encode_inputs

    chat = _as_bool(body.get("apply_chat_template")) or False
    ids, context = encode_inputs(TextRequest(prompt=body["text_input"], apply_chat_template=chat,
                                             context=body.get("context")), tokenizer)
    return [*context, *ids]


def openai_completion(body: dict, tokenizer, model: str) -> dict:
    """A ``generate_stream`` body as an OpenAI ``/v1/completions`` body for another server (vLLM): the prompt as the
    same token ids (``prompt_ids``), the same sampling (``max_tokens``, ``temperature``, ``ignore_eos``, ...),
    streamed with the usage and each chunk's token ids (``return_token_ids``: a token that completes no character is
    counted when it arrives). A ``kv_budget`` has no counterpart there and is left out."""
    if tokenizer is None:
        raise ValueError("an OpenAI endpoint needs the tokenizer that makes the prompt's ids")
    sampling = json.loads(body.get("sampling_parameters") or "{}")
    return {"model": model, "prompt": prompt_ids(body, tokenizer), "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True, **sampling}


def parse_openai_event(record: RequestRecord, event: dict, arrived: float) -> None:
    """Fold one event of an OpenAI stream into ``record``: a chunk per event that carries text (of its ``token_ids``
    tokens where the server lists them, as vLLM's ``return_token_ids`` does, else one), the usage (the last
    event with ``stream_options.include_usage``) as the token counts, criticalkv's ``context_cache_hit``, and an error
    event (OpenAI's error object) as the error."""
    if "error" in event:
        error = event["error"]
        record.error = str(error.get("message", error) if isinstance(error, dict) else error)
        return
    for choice in event.get("choices") or []:
        text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
        ids = choice.get("token_ids")  # vLLM's return_token_ids: the chunk's tokens, text or not
        count = len(ids) if isinstance(ids, list) else (1 if text else 0)
        if count:
            record.chunks.append((arrived, count))
        if text:
            record.text.append(text)
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    if event.get("context_cache_hit") is not None:
        record.context_cache_hit = bool(event["context_cache_hit"])
    if event.get("usage"):
        record.input_tokens = event["usage"].get("prompt_tokens")
        record.output_tokens = event["usage"].get("completion_tokens")


def send_openai(url: str, body: dict, timeout: float = REQUEST_TIMEOUT_S,
                on_event: Callable[[RequestRecord], None] | None = None) -> RequestRecord:
    """``send_request`` for the OpenAI API at ``url`` (``http://HOST:PORT``): a streaming ``/v1/completions`` (or
    ``/v1/chat/completions`` when ``body`` has ``messages``), its events folded by ``parse_openai_event``."""
    parsed = urllib.parse.urlsplit(url)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    return _stream(parsed.hostname, parsed.port or 80, path, body, timeout, on_event, parse_openai_event)


def _run_closed_loop(endpoint: Endpoint, bodies: Sequence[dict], concurrency: int,
                     on_done: Callable[[RequestRecord], None], send=None) -> list[RequestRecord]:
    send = send or send_request
    todo: queue.Queue = queue.Queue()
    for i, body in enumerate(bodies):
        todo.put((i, body))
    records: list[RequestRecord | None] = [None] * len(bodies)

    def worker():
        while True:
            try:
                i, body = todo.get_nowait()
            except queue.Empty:
                return
            records[i] = send(endpoint, body)
            on_done(records[i])

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, concurrency))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in records if r is not None]


def poisson_offsets(count: int, rate: float, seed: int = 0) -> list[float]:
    """Start times (s after the first) of ``count`` Poisson arrivals at ``rate`` requests/s."""
    if rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {rate}")
    rng = random.Random(f"bench-arrivals/{seed}")
    t, out = 0.0, []
    for i in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _run_open_loop(endpoint: Endpoint, bodies: Sequence[dict], rate: float, max_concurrency: int | None, seed: int,
                   on_done: Callable[[RequestRecord], None], send=None) -> list[RequestRecord]:
    send = send or send_request
    offsets = poisson_offsets(len(bodies), rate, seed)
    slots = threading.BoundedSemaphore(max_concurrency) if max_concurrency else None
    records: list[RequestRecord | None] = [None] * len(bodies)

    def one(i: int):
        try:
            records[i] = send(endpoint, bodies[i])
            on_done(records[i])
        finally:
            if slots:
                slots.release()

    threads = []
    t0 = time.perf_counter()
    for i, offset in enumerate(offsets):
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        if slots:
            slots.acquire()
        thread = threading.Thread(target=one, args=(i,), daemon=True)
        thread.start()
        threads.append(thread)
    for t in threads:
        t.join()
    return [r for r in records if r is not None]


def run_load(endpoint: Endpoint, bodies: Sequence[dict], concurrency: int | None = None, request_rate: float | None = None,
             max_concurrency: int | None = None, seed: int = 0, progress: str | None = None,
             send: Callable[..., RequestRecord] | None = None) -> list[RequestRecord]:
    """Send ``bodies`` closed-loop at ``concurrency`` or open-loop at ``request_rate`` (Poisson);
    returns one record per request, in the order of ``bodies``. ``progress``: a tqdm bar's label; ``send``: how one
    request is sent (``send(endpoint, body)``; default ``send_request``, Triton's generate_stream; ``send_openai``
    streams an OpenAI completion)."""
    if (concurrency is None) == (request_rate is None):
        raise ValueError("give exactly one of concurrency and request_rate")
    bar = None
    lock = threading.Lock()
    if progress is not None:
        bar = tqdm(total=len(bodies), desc=progress, unit="req", leave=False, disable=None)  # on a terminal only

    def on_done(_record):
        if bar is not None:
            with lock:
                bar.update(1)

    try:
        if concurrency is not None:
            return _run_closed_loop(endpoint, bodies, concurrency, on_done, send)
        return _run_open_loop(endpoint, bodies, request_rate, max_concurrency, seed, on_done, send)
    finally:
        if bar is not None:
            bar.close()


# ---------------------------------------------------------------------- server queries
def get_json(url: str, timeout: float = 5.0, method: str = "GET", data: bytes | None = None):
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as response:
        raw = response.read()
        return json.loads(raw) if raw else None


def is_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=2.0) as response:
            return response.status == 200
    except OSError:
        return False


def ready_models(url: str) -> list[str]:
    """Names of the models the server reports READY (Triton's repository index)."""
    index = get_json(f"{url}/v2/repository/index", method="POST", data=b"{}") or []
    return sorted(m["name"] for m in index if m.get("state") == "READY")
