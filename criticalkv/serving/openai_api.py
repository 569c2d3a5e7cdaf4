"""OpenAI-compatible API (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``) in front of the
criticalkv Triton model: a small ASGI app (FastAPI, served by uvicorn) that forwards each request to the
model over gRPC streaming (``ModelStreamInfer``, the decoupled model's protocol), so the OpenAI API and
Triton's own endpoints share one engine and one scheduler per model instance.

Why not Triton's own OpenAI frontend (``triton-inference-server/server``, ``python/openai``): it drives an
in-process server through the ``tritonserver`` Python bindings, which the ``nvidia-pytriton`` wheel does not
ship (only the ``tritonserver`` binary), and the PyPI package of that name is a placeholder that refuses to
install (checked 2026-11).

The request is turned into the model's inputs (vllm_backend's names): ``text_input`` (the prompt; for chat,
the messages rendered by the engine's chat template, ``criticalkv.chat``), ``stream``,
``sampling_parameters`` (``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ``ignore_eos``),
``exclude_input_in_output``, ``kv_budget`` and the token counts. criticalkv's own fields ride in the body
(the ``openai`` client's ``extra_body``): ``kv_budget`` (tokens kept per KV head for this request),
``ignore_eos`` (as vLLM), ``context`` (the compressed context cache, forwarded only to a model that has a
``context`` input). The model checks the values (ranges, lengths); its errors come back on the gRPC stream and
become 400 with its message; this layer checks the shapes and types (pydantic, strict) and what only it
knows (the model name, ``n``, fields the server does not implement). Every error is OpenAI's error object
``{"error": {"message", "type", "param", "code"}}``.

No request can stall the others: a body is JSON (else 415) of at most ``max_body_bytes`` (else 413, decided from its
``Content-Length`` before it is read, or as soon as a body sent without one passes the limit; the rest is read and
dropped up to a bound so that a client still writing it reads the 413), and arrives without a 10 s gap (else 400); its
texts are held to the engine's ``TextBound`` (more characters than its max input length can hold: 400, before the chat
template runs);
parsing, the chat template and the tokenizer run on a small thread pool, never on the event loop, so ``/health`` and
the other requests' tokens flow while one request is prepared. And no request waits for ever: each has a deadline
(``request_timeout``, ``criticalkv serve --request-timeout``), past which its work is cancelled and it is answered with
OpenAI's error object, status 504.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Literal, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request  # module level: FastAPI reads the handlers' (string) annotations


from criticalkv.chat import chat_context_ids, chat_prompt_text
from criticalkv.errors import RequestError
from criticalkv.request import DEFAULT_MAX_TOKENS, TextBound

#: max_tokens of /v1/completions when the request gives none (OpenAI's and vLLM's default); a chat completion
#: without one may use the engine's whole built maximum (``chat_max_tokens``), as vLLM fills the context
COMPLETIONS_DEFAULT_MAX_TOKENS = DEFAULT_MAX_TOKENS
INT32_MAX = 2**31 - 1
INTERNAL_PREFIX = "internal error: "
#: what a request still running when the server stops gets (503, as OpenAI's service_unavailable)
SHUTTING_DOWN = "the server is shutting down"
#: what a request gets when it ran past the server's request timeout (504): its work is cancelled
TIMED_OUT = "no answer within the server's request timeout"
#: the default of ``criticalkv serve --request-timeout``: half of the ``openai`` client's own default (600 s), so that a
#: default client reads the server's error rather than giving up first
DEFAULT_REQUEST_TIMEOUT_S = 300.0
#: a request body that stops arriving for this long before its Content-Length is complete gets a 400
BODY_IDLE_TIMEOUT_S = 10.0
#: a body refused with 413 is read and dropped up to this many bytes (and seconds) before the 413 is sent, so that a
#: client still writing it reads the answer instead of a reset connection; beyond, the 413 goes at once
DRAIN_MAX_BYTES = 64 * 2**20
DRAIN_MAX_S = 5.0


class APIError(Exception):
    """An error answered with OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type_ or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                              405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
                              503: "service_unavailable",
                              504: "timeout"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


# --------------------------------------------------------------------------------------------------- requests
class _Strict(BaseModel):
    # strict: "0.5" is not a number and 2.0 not an integer (a client mistake gets a 400, not a guess)
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk


class _Common(_Strict):
    """Fields shared by both endpoints. Fields the server does not implement are accepted only at their
    neutral value (``UNSUPPORTED``), so a request that asks for them gets a 400 instead of being ignored."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # criticalkv's own fields (extra_body)
    kv_budget: int | None = None
    ignore_eos: bool | None = None
    context: str | bool | None = None
    context_threshold: float | None = None
    # OpenAI fields not implemented here (accepted at their neutral value only)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: Union[bool, int, None] = None
    top_logprobs: int | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = None


class CompletionRequest(_Common):
    # token ids are parsed so that they get a clear refusal (``prepare_completion``), not a union's type errors
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


#: field -> the values that mean "not used"
UNSUPPORTED = {
    "frequency_penalty": (None, 0), "presence_penalty": (None, 0), "logit_bias": (None, {}),
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "store": (None, False), "service_tier": (None, "auto"),
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]), "reasoning_effort": (None,), "suffix": (None, ""), "best_of": (None, 1),
}


def parse_body(raw: bytes, model_type: type[_Common]) -> _Common:
    """The request model of ``raw`` (JSON), or APIError 400 naming every problem."""
    try:
        return model_type.model_validate_json(raw)
    except ValidationError as err:
        problems, param = [], None
        for e in err.errors():
            loc = ".".join(str(part) for part in e["loc"])
            param = param or (str(e["loc"][0]) if e["loc"] else None)
            if e["type"] == "json_invalid":
                message = f"the request body is not valid JSON ({e.get('ctx', {}).get('error', e['msg'])})"
            elif e["type"] == "model_type" and not e["loc"]:
                message = "the request body must be a JSON object"
            elif e["type"] == "extra_forbidden":
                message = f"{loc}: unknown field (not an OpenAI or criticalkv request field)"
            elif e["type"] == "missing":
                message = f"{loc}: required"
            else:
                message = f"{loc}: {e['msg']}"
            if message not in problems:
                problems.append(message)
        # pydantic reports every member of a union; the first problems say it
        raise APIError(400, "; ".join(problems[:4]), param) from None


def check_common(request: _Common, served_model: str, model_inputs: set[str]) -> None:
    if request.model is None:  # OpenAI's API requires it (its 400 "you must provide a model parameter")
        raise APIError(400, f"model: required (this server serves {served_model!r}: GET /v1/models)", "model")
    if request.model != served_model:
        raise APIError(400, f"model {request.model!r} does not exist: this server serves {served_model!r} "
                            "(GET /v1/models)", "model")
    if request.n is not None and request.n != 1:
        raise APIError(400, f"n: only n=1 is supported, got {request.n}", "n")
    if request.stream_options is not None and not request.stream:
        raise APIError(400, "stream_options: only allowed when stream is true", "stream_options")
    for name, neutral in UNSUPPORTED.items():
        value = getattr(request, name, None)
        if not any(_same(value, v) for v in neutral):
            raise APIError(400, f"{name}: not supported by this server (got {value!r})", name)
    # the model checks kv_budget against the engine's range (and names it); here only what the INT32 input cannot carry
    if request.kv_budget is not None and not -INT32_MAX - 1 <= request.kv_budget <= INT32_MAX:
        raise APIError(400, f"kv_budget must lie in the engine's range (a token count per KV head, at most its built "
                            f"budget), got {request.kv_budget}", "kv_budget")
    if request.context is False:
        request.context = None
    if request.context is not None and "context" not in model_inputs:
        raise APIError(400, "context: not supported by this server (its model has no compressed-context input)",
                       "context")
    if request.context_threshold is not None and (request.context is None or "context_threshold" not in model_inputs):
        raise APIError(400, "context_threshold: adapts the budget of a context: give a context" if request.context is None
                       else "context_threshold: not supported by this server's model (rebuild its Triton repository)",
                       "context_threshold")


def _same(value, neutral) -> bool:
    if neutral is None or isinstance(neutral, bool) or isinstance(value, bool):
        return value is neutral  # False is neutral, 0 for a bool field is not given as False, 1 is not True
    return value == neutral


def sampling_parameters(request: _Common, max_tokens: int | None) -> dict[str, Any]:
    values = {"max_tokens": max_tokens, "temperature": request.temperature, "top_p": request.top_p,
              "seed": request.seed, "stop": request.stop, "ignore_eos": request.ignore_eos}
    return {k: v for k, v in values.items() if v is not None}


# --------------------------------------------------------------------------------------------------- Triton
class TritonModel:
    """The criticalkv model on a Triton server, reached over gRPC (``tritonclient.grpc.aio``)."""

    def __init__(self, grpc_url: str, name: str):
        self.grpc_url, self.name = grpc_url, name
        self.client = None
        self.inputs: set[str] = set()
        self.draining: asyncio.Event | None = None  # set when the server stops: requests end with SHUTTING_DOWN

    async def connect(self) -> None:
        import tritonclient.grpc.aio as grpcclient

        self.draining = asyncio.Event()
        self.client = grpcclient.InferenceServerClient(self.grpc_url)
        config = await self.client.get_model_config(self.name, as_json=True)
        self.inputs = {i["name"] for i in config["config"]["input"]}

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def ready(self) -> bool:
        try:
            return bool(await self.client.is_model_ready(self.name))
        except Exception:
            return False

    def _inputs(self, values: dict[str, Any]):
        import tritonclient.grpc.aio as grpcclient

        tensors = []
        for name, (array, dtype) in model_inputs(values).items():
            tensor = grpcclient.InferInput(name, list(array.shape), dtype)
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        return tensors

    async def generate(self, values: dict[str, Any], request_id: str) -> AsyncIterator[dict[str, Any]]:
        """The model's responses to one request: dicts of its outputs (``text_output``, ``finish_reason``
        on the last one, ``num_input_tokens``, ``num_output_tokens``); APIError for an error response.
        Leaving the iteration early (a client that went away) cancels the request in Triton."""

        async def one_request():
            yield {"model_name": self.name, "inputs": self._inputs(values), "request_id": request_id}

        if self.draining is not None and self.draining.is_set():
            raise APIError(503, SHUTTING_DOWN)
        call = self.client.stream_infer(one_request())
        finished = False
        try:
            async for result, error in _until(call, self.draining):
                if error is not None:
                    raise model_error(str(error.message() if hasattr(error, "message") else error))
                out = {}
                for name in ("text_output", "finish_reason", "num_input_tokens", "num_output_tokens",
                             "context_cache_hit"):
                    array = result.as_numpy(name)
                    if array is None:
                        continue
                    if array.dtype == bool:
                        out[name] = bool(array.reshape(-1)[0])
                    elif array.dtype == np.object_:
                        out[name] = b"".join(array.reshape(-1)).decode("utf-8")
                    else:
                        out[name] = int(array.reshape(-1)[0])
                final = "finish_reason" in out  # the model sends finish_reason with its final response only
                yield out
                if final:
                    finished = True
                    return
        except APIError:
            raise
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the gRPC channel itself (tritonserver gone, ...)
            raise APIError(503, f"the inference server is unavailable: {err}") from None
        finally:
            if not finished:
                call.cancel()  # Triton cancels the request: the model frees its slot


def model_inputs(values: dict[str, Any]) -> dict[str, tuple[np.ndarray, str]]:
    """The model's input arrays and their Triton types for the values ``respond`` builds (token ids: INT32 [-1];
    flags: BOOL [1]; integers: INT32 [1]; the rest: BYTES [1]), as ``criticalkv.serving.requests.parse_request``
    reads them."""
    arrays = {}
    for name, value in values.items():
        if isinstance(value, list):  # token ids
            arrays[name] = np.array(value, dtype=np.int32), "INT32"
        elif isinstance(value, bool):
            arrays[name] = np.array([value], dtype=bool), "BOOL"
        elif isinstance(value, int):
            arrays[name] = np.array([value], dtype=np.int32), "INT32"
        elif isinstance(value, float):
            arrays[name] = np.array([value], dtype=np.float32), "FP32"
        else:
            arrays[name] = np.array([str(value).encode("utf-8")], dtype=np.object_), "BYTES"
    return arrays


async def _until(responses, draining: asyncio.Event | None):
    """The items of ``responses`` until ``draining`` is set: then APIError 503 (the server is shutting down)."""
    if draining is None:
        async for item in responses:
            yield item
        return
    iterator = responses.__aiter__()
    stop = asyncio.ensure_future(draining.wait())
    step = None
    try:
        while True:
            step = asyncio.ensure_future(iterator.__anext__())
            await asyncio.wait({step, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
                raise APIError(503, SHUTTING_DOWN)
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        stop.cancel()
        if step is not None and not step.done():  # left while waiting (cancelled): no orphan task, no lost exception
            step.cancel()
            step.add_done_callback(_retrieved)  # it may end with the handle's own error (RequestCancelledError)


def _retrieved(task: asyncio.Future) -> None:
    """A done callback: the task's exception is taken (asyncio's "Task exception was never retrieved" is not said)."""
    if not task.cancelled():
        task.exception()


async def _within(responses, seconds: float | None, renew: bool):
    """The items of ``responses`` while they come in time: within ``seconds`` of the start (``renew``: of the previous
    item, for a stream), else APIError 504 after closing ``responses`` (which cancels the request's work)."""
    if seconds is None:
        async for item in responses:
            yield item
        return
    deadline = time.monotonic() + seconds
    try:
        while True:
            try:
                item = await asyncio.wait_for(responses.__anext__(), max(0.0, deadline - time.monotonic()))
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                what = "between two tokens of the stream" if renew else "for the whole answer"
                raise APIError(504, f"{TIMED_OUT} ({seconds:g} s {what}, `criticalkv serve --request-timeout`): the "
                                    "request was cancelled") from None
            if renew:
                deadline = time.monotonic() + seconds
            yield item
    finally:
        await responses.aclose()


def model_error(message: str) -> APIError:
    """APIError for an error the model (or Triton) sent on the stream: the model's own checks of the
    request are the client's mistakes (400); what it marks as internal is the server's (500)."""
    if message.startswith(INTERNAL_PREFIX):
        return APIError(500, message)
    if message.startswith(SHUTTING_DOWN):  # the model was told to end its requests (the server stops)
        return APIError(503, message)
    if message.startswith(TIMED_OUT):  # the model's own deadline (Triton's endpoints share it)
        return APIError(504, message)
    if "request cancelled" in message:
        return APIError(499, message, type_="cancelled")
    # the OpenAI fields were put into the model's sampling_parameters input: name them as the client did
    message = message.removeprefix("sampling_parameters: ")
    return APIError(400, message, _param_of(message))


#: the request fields a model error may name first ("kv_budget must lie in ...", "max_tokens: ...")
_PARAMS = set(ChatRequest.model_fields) | set(CompletionRequest.model_fields)


def _param_of(message: str) -> str | None:
    """OpenAI's ``param`` of a model error: the request field its message starts with, if any."""
    match = re.match(r"([a-z_]+)(?::| must| is)", message)
    return match.group(1) if match and match.group(1) in _PARAMS else None


# --------------------------------------------------------------------------------------------------- app
#: threads that parse request bodies and run the chat template and the tokenizer (off the event loop)
PREPARE_THREADS = 4


def create_app(grpc_url: str | None, model_name: str, tokenizer, api_key: str | None = None,
               chat_max_tokens: int | None = None, text_bound: TextBound | None = None,
               max_body_bytes: int | None = None, model=None,
               request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT_S):
    """The ASGI app. ``tokenizer``: the engine's (its chat template renders the chat messages);
    ``chat_max_tokens``: max_tokens of a chat completion that gives none (None: the model's default);
    ``text_bound``: the engine's bound on a request's characters (None: none checked here, the model still counts
    tokens); ``max_body_bytes``: the largest request body (default: ``text_bound.max_body_bytes``; None without a
    bound: no limit). ``model``: what serves the requests, with ``TritonModel``'s interface (``inputs``,
    ``draining``, ``connect``, ``close``, ``ready``, ``generate``); default: the Triton model at ``grpc_url``
    (``criticalkv.replicas`` gives its Ray Serve replicas). ``request_timeout``: the server-side deadline of every
    request in seconds (the whole answer; a stream's first token and each next one), past which it is cancelled and
    answered with OpenAI's error object, status 504 (None: none)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    ClosingStreamingResponse = _closing_streaming_response()
    from starlette.exceptions import HTTPException as StarletteHTTPException

    model = TritonModel(grpc_url, model_name) if model is None else model
    created = int(time.time())
    if max_body_bytes is None and text_bound is not None:
        max_body_bytes = text_bound.max_body_bytes
    pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="openai-prepare")

    @asynccontextmanager
    async def lifespan(app):
        await model.connect()
        app.state.loop = asyncio.get_running_loop()
        try:
            yield
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            await model.close()

    app = FastAPI(title="criticalkv OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.model = model

    def error_response(err: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request, err: APIError):
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, err: StarletteHTTPException):  # unknown path, wrong method
        message = {404: f"no such endpoint: {request.method} {request.url.path}",
                   405: f"method {request.method} not allowed on {request.url.path}"}.get(err.status_code, err.detail)
        return error_response(APIError(err.status_code, message))

    @app.exception_handler(Exception)
    async def _unexpected(request, err: Exception):
        return error_response(APIError(500, f"{INTERNAL_PREFIX}{type(err).__name__}: {err}"))

    # the outermost middleware runs first: the key is checked before the body's type and size
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    async def off_loop(function, *args):
        """``function(*args)`` on the prepare pool: a slow request (a long template, a long text) holds a thread of
        its own, never the event loop that serves the other requests' tokens and /health."""
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(function, *args))

    def check_texts(what: str, param: str, *texts: str | None) -> None:
        if text_bound is not None:
            try:
                text_bound.check(*texts, what=what)
            except RequestError as err:
                raise APIError(400, str(err), param) from None

    def prepare_chat(raw: bytes):
        """(body, prompt text, (context ids, question ids) or None, max_tokens) of a chat request: parsed, checked,
        rendered by the chat template (and tokenised for a context)."""
        body = parse_body(raw, ChatRequest)
        check_common(body, model_name, model.inputs)
        for i, message in enumerate(body.messages):
            if message.content is None and message.role != "assistant":
                raise APIError(400, f"messages.{i}.content: required for role {message.role!r}", "messages")
        if text_bound is not None and len(body.messages) > text_bound.max_input_len:
            raise APIError(400, f"messages: {len(body.messages)} messages, more than the engine's max input length "
                                f"({text_bound.max_input_len} tokens)", "messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        context = body.context if isinstance(body.context, str) else None
        check_texts("the messages" + (" and the context" if context else ""), "messages",
                    *(m["content"] for m in messages), context)
        ids = None
        try:
            if body.context is not None:  # the context (a document, or the earlier turns) is compressed and cached
                ids = chat_context_ids(tokenizer, messages, body.context)
                prompt = ""
            else:
                prompt = chat_prompt_text(tokenizer, messages)
        except APIError:
            raise
        except ValueError as err:
            if str(err).startswith("context:"):
                raise APIError(400, str(err), "context") from None
            raise APIError(400, f"messages: the model's chat template refused them: {err}", "messages") from None
        except Exception as err:  # the template's own checks (e.g. roles that must alternate)
            raise APIError(400, f"messages: the model's chat template refused them: {err}", "messages") from None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = chat_max_tokens if max_tokens is None else max_tokens
        return body, prompt, ids, max_tokens

    def prepare_completion(raw: bytes):
        """(body, prompt, max_tokens) of a completion request, parsed and checked."""
        body = parse_body(raw, CompletionRequest)
        check_common(body, model_name, model.inputs)
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if prompts and not all(isinstance(p, str) for p in prompts):
            raise APIError(400, "prompt: token ids are not taken here: send the prompt as text (the server tokenises it "
                                "with the engine's tokenizer)", "prompt")
        if len(prompts) != 1:
            raise APIError(400, f"prompt: one prompt per request is supported, got {len(prompts)}", "prompt")
        if body.context is True:
            raise APIError(400, "context: true (the earlier messages) needs /v1/chat/completions; give the context's "
                                "text here", "context")
        check_texts("the prompt" + (" and the context" if body.context else ""), "prompt", prompts[0], body.context)
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        return body, prompts[0], max_tokens

    @app.get("/health")
    async def health():
        if await model.ready():
            return JSONResponse({})
        return error_response(APIError(503, f"model {model_name!r} is not ready"))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": model_name, "object": "model", "created": created, "owned_by": "criticalkv"}]}

    @app.get("/v1/models/{name}")
    async def one_model(name: str):
        if name != model_name:
            raise APIError(404, f"model {name!r} does not exist: this server serves {model_name!r}", "model")
        return {"id": model_name, "object": "model", "created": created, "owned_by": "criticalkv"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body, prompt, ids, max_tokens = await off_loop(prepare_chat, await request.body())
        return await respond(request, body, prompt, max_tokens, chat=True, ids=ids)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body, prompt, max_tokens = await off_loop(prepare_completion, await request.body())
        return await respond(request, body, prompt, max_tokens, chat=False)

    async def respond(request: Request, body: _Common, prompt: str, max_tokens: int | None, chat: bool,
                      ids: tuple[list[int], list[int]] | None = None):
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        values: dict[str, Any] = {
            "text_input": prompt, "stream": body.stream, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps(sampling_parameters(body, max_tokens)),
            "return_num_input_tokens": True, "return_num_output_tokens": True,
        }
        if body.kv_budget is not None:
            values["kv_budget"] = body.kv_budget
        if ids is not None:  # a chat cut into its context and its question, as token ids
            context_ids, question_ids = ids
            values.pop("text_input")
            values["input_ids"] = question_ids
            if context_ids:
                values["context_ids"] = context_ids
        elif body.context is not None:
            values["context"] = body.context
        if body.context_threshold is not None:
            values["context_threshold"] = body.context_threshold
        echo = prompt if (not chat and getattr(body, "echo", False)) else ""
        responses = _within(model.generate(values, request_id), request_timeout, renew=body.stream)
        if body.stream:
            try:  # the first response before the 200: a request the model refuses gets its 400
                first = await responses.__anext__()
            except StopAsyncIteration:
                raise APIError(500, f"{INTERNAL_PREFIX}the model closed the stream without a response") from None
            return ClosingStreamingResponse(stream_events(body, request_id, first, responses, chat, echo),
                                            media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        collect = asyncio.ensure_future(_last(responses))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # this handler cancelled too: neither task outlives it
            if not collect.done():  # the client went away: cancel the request (frees its slot)
                collect.cancel()
                await asyncio.gather(collect, return_exceptions=True)
            gone.cancel()
        if collect.cancelled():
            return JSONResponse({}, status_code=499)
        out = collect.result()
        text = echo + out.get("text_output", "")
        usage = _usage(out.get("num_input_tokens", 0), out.get("num_output_tokens", 0))
        reason = out.get("finish_reason")
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                   "finish_reason": reason} if chat else
                  {"index": 0, "text": text, "logprobs": None, "finish_reason": reason})
        response = {"id": request_id, "object": "chat.completion" if chat else "text_completion",
                    "created": int(time.time()), "model": model_name, "choices": [choice], "usage": usage}
        if "context_cache_hit" in out:  # criticalkv's own field: the context's compressed entries were cached
            response["context_cache_hit"] = out["context_cache_hit"]
        return response

    async def stream_events(body, request_id, first, responses, chat, echo) -> AsyncIterator[str]:
        created_at = int(time.time())
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
        kind = "chat.completion.chunk" if chat else "text_completion"
        prompt_tokens, completion_tokens = 0, 0

        def event(choices, usage=None, with_usage=include_usage, extra=None):
            chunk = {"id": request_id, "object": kind, "created": created_at, "model": model_name, "choices": choices}
            if with_usage:
                chunk["usage"] = usage
            chunk.update(extra or {})
            return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

        def choice(text, reason=None, role=False):
            if chat:
                delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}

        async def everything():
            yield first
            async for out in responses:
                yield out

        try:
            if chat:  # OpenAI's first chunk: the role, empty content
                yield event([choice("", role=True)])
            elif echo:
                yield event([choice(echo)])
            async for out in everything():
                prompt_tokens = out.get("num_input_tokens", prompt_tokens)
                completion_tokens += out.get("num_output_tokens", 0)
                reason = out.get("finish_reason")
                text = out.get("text_output", "")
                usage = _usage(prompt_tokens, completion_tokens) if continuous else None
                if text or reason:
                    extra = {"context_cache_hit": out["context_cache_hit"]} if "context_cache_hit" in out else None
                    yield event([choice(text, reason)], usage, extra=extra)
            if include_usage:
                yield event([], _usage(prompt_tokens, completion_tokens))
        except APIError as err:  # after the 200: the error goes in the stream, as vLLM does
            yield f"data: {json.dumps(err.body())}\n\n"
        finally:
            await responses.aclose()  # cancels the Triton request unless it finished
        yield "data: [DONE]\n\n"

    return app


class APIKeyMiddleware:
    """As `vllm serve --api-key`: every /v1 request needs the header ``Authorization: Bearer KEY`` (else 401);
    /health stays open. Plain ASGI (not Starlette's BaseHTTPMiddleware, which wraps streaming responses and
    the client's disconnect)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                from fastapi.responses import JSONResponse

                err = APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' with "
                                    "the key the server was started with (--api-key)")
                response = JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _is_json(content_type: bytes) -> bool:
    kind = content_type.split(b";")[0].strip().lower()
    return kind == b"application/json" or (kind.startswith(b"application/") and kind.endswith(b"+json"))


class BodyLimitMiddleware:
    """Every POST body must be JSON and at most ``max_bytes`` (None: any size), decided before the body costs anything:
    another Content-Type (text/plain, form-encoded) gets 415 and a Content-Length over the limit 413, from the headers
    alone; a body sent without a length (chunked) gets 413 as soon as the bytes received pass the limit. A refused body
    the client is still sending is read and dropped first (up to ``DRAIN_MAX_BYTES`` and ``DRAIN_MAX_S``), so that a
    client that writes its whole body before it reads (Python's http.client, urllib, httpx) reads the answer instead of
    a connection reset; a larger one gets the answer at once and the connection is closed. A body that stops arriving
    before its Content-Length for ``idle_s`` seconds gets a 400 (the client is still connected: it reads it; one that
    closed its side has nobody left to answer). A body without a Content-Type is taken as JSON (as FastAPI does).
    Plain ASGI, like APIKeyMiddleware."""

    def __init__(self, app, max_bytes: int | None, idle_s: float = BODY_IDLE_TIMEOUT_S):
        self.app, self.max_bytes, self.idle_s = app, max_bytes, idle_s

    def too_large(self, size: int | None) -> APIError:
        what = f"is {size} bytes" if size is not None else f"passed {self.max_bytes} bytes"
        return APIError(413, f"the request body {what}, more than this server takes ({self.max_bytes} bytes: the "
                             "engine's max input length at most, or `criticalkv serve --max-body-bytes`)")

    @staticmethod
    async def drain(receive, expected: int | None) -> bool:
        """Read and drop the rest of a refused body (``expected`` bytes at most, None: unknown); whether it all came."""
        if expected is not None and expected > DRAIN_MAX_BYTES:
            return False
        deadline, seen = time.monotonic() + DRAIN_MAX_S, 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or seen > DRAIN_MAX_BYTES:
                return False
            try:
                message = await asyncio.wait_for(receive(), left)
            except asyncio.TimeoutError:
                return False
            if message["type"] != "http.request":
                return False
            seen += len(message.get("body", b""))
            if not message.get("more_body", False):
                return True

    @staticmethod
    async def answer(error: APIError, scope, receive, send, close: bool) -> None:
        from fastapi.responses import JSONResponse

        headers = {"Connection": "close"} if close else None
        await JSONResponse(error.body(), status_code=error.status, headers=headers)(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])  # ASGI gives the names in lower case
        error, size = None, None
        content_type = headers.get(b"content-type")
        if content_type is not None and not _is_json(content_type):
            error = APIError(415, "the request body must be JSON (Content-Type: application/json), got Content-Type "
                                  f"{content_type.decode('latin-1')!r}")
        if headers.get(b"content-length") is not None:
            try:
                size = int(headers[b"content-length"])
            except ValueError:
                error = error or APIError(400, "Content-Length is not a number")
            if error is None and size is not None and self.max_bytes is not None and size > self.max_bytes:
                error = self.too_large(size)
        if error is not None:
            drained = size == 0 or await self.drain(receive, size)
            await self.answer(error, scope, receive, send, close=not drained)
            return
        received, complete = 0, False

        async def limited_receive():
            nonlocal received, complete
            if complete:  # the body is in: what follows is the disconnect, whenever it comes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.idle_s)
            except asyncio.TimeoutError:
                due = f" of its Content-Length {size}" if size is not None else ""
                raise APIError(400, f"the request body stopped arriving: {received} bytes{due} came, then nothing for "
                                    f"{self.idle_s:g} s") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if self.max_bytes is not None and received > self.max_bytes:
                    if message.get("more_body", False):
                        await self.drain(receive, None)
                    raise self.too_large(None)  # the app's APIError handler answers it
            return message

        await self.app(scope, limited_receive, send)


def _closing_streaming_response():
    from fastapi.responses import StreamingResponse

    class ClosingStreamingResponse(StreamingResponse):
        """A StreamingResponse that closes its generator when the response ends in any way: a client that goes
        away leaves the generator suspended at a ``yield`` (the send was cancelled, not the generator), and its
        ``finally``, which cancels the Triton request, would otherwise wait for the garbage collector."""

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                await self.body_iterator.aclose()

    return ClosingStreamingResponse


async def _last(responses: AsyncIterator[dict]) -> dict:
    last = {}
    async for out in responses:
        last = out
    return last


async def _disconnected(request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# --------------------------------------------------------------------------------------------------- server
class OpenAIFrontend:
    """The app served by uvicorn in a thread of this process, on a socket bound beforehand (so a taken port
    is reported by the launcher before anything starts, and nobody can take it in between)."""

    def __init__(self, sock, grpc_url: str, model_name: str, tokenizer, api_key: str | None = None,
                 chat_max_tokens: int | None = None, text_bound: TextBound | None = None,
                 max_body_bytes: int | None = None, model=None,
                 request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT_S):
        import uvicorn

        self.sock = sock
        self.app = app = create_app(grpc_url, model_name, tokenizer, api_key, chat_max_tokens, text_bound,
                                    max_body_bytes, model=model, request_timeout=request_timeout)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                                    timeout_graceful_shutdown=2))
        self.thread = None

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def start(self, timeout_s: float = 60.0, cancelled=lambda: False) -> "OpenAIFrontend":
        import threading

        # uvicorn leaves signals alone outside the main thread: the launcher keeps handling them
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="openai-frontend")
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started and not cancelled():
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the OpenAI-compatible frontend did not start (see the messages above)")
            time.sleep(0.05)
        return self

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, end the requests in flight at once with OpenAI's error object (503, "the server is
        shutting down"; a stream gets it as its last event, then ``[DONE]``), and wait for uvicorn to finish."""
        if self.thread is not None:
            loop, model = getattr(self.app.state, "loop", None), self.app.state.model
            if loop is not None and model.draining is not None:
                try:
                    loop.call_soon_threadsafe(model.draining.set)
                except RuntimeError:  # the loop already closed: nothing is in flight
                    pass
            self.server.should_exit = True
            self.thread.join(timeout_s)
        self.sock.close()
