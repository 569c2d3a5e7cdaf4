"""Text requests over the scheduler: parse the Triton inputs (vllm_backend's names), validate, detokenize
incrementally, stop strings. Pure Python (no Triton imports), so it is unit-tested without a server.

Inputs (Triton model ``config.pbtxt``): ``text_input`` (STRING, required), ``stream`` (BOOL),
``sampling_parameters`` (STRING, JSON object: ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``,
``ignore_eos``), ``exclude_input_in_output`` (BOOL), ``kv_budget`` (INT32), ``return_num_input_tokens`` /
``return_num_output_tokens`` / ``return_kv_bytes`` (BOOL), ``apply_chat_template`` (BOOL: ``text_input`` is
one user message, wrapped by the tokenizer's chat template as ``criticalkv generate --chat`` does), ``context``
(STRING: a document compressed once without the question and cached; ``text_input`` is the question after it),
``input_ids`` / ``context_ids`` (INT32 [-1]: the prompt and the context as token ids, instead of text),
``context_threshold`` (FP32: the context keeps what its policy's score ranks at or above it, at most the budget). Without
``sampling_parameters`` the same keys are read from the request's parameters (Triton's generate endpoint puts
unknown JSON fields there).
As in vllm_backend: a streamed response carries the new text only; a non-streamed one the whole text,
after the prompt unless ``exclude_input_in_output`` is true; streaming with ``exclude_input_in_output``
false is an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from criticalkv.chat import chat_input_ids, encode_context_question, encode_text
from criticalkv.errors import RequestError
from criticalkv.request import SamplingParams, TextBound

BOOL_INPUTS = ("stream", "exclude_input_in_output", "return_num_input_tokens", "return_num_output_tokens",
               "return_kv_bytes", "apply_chat_template")


@dataclass
class TextRequest:
    """A parsed Triton request: the prompt text, its ``SamplingParams`` (``max_tokens`` None = the engine's
    default; ``stop`` strings cut the text) and the response flags."""

    prompt: str
    stream: bool = False
    prepend_input: bool = True
    sampling: SamplingParams = field(default_factory=SamplingParams)
    kv_budget: int | None = None
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_kv_bytes: bool = False
    apply_chat_template: bool = False
    context: str | None = None
    input_ids: list[int] | None = None
    context_ids: list[int] | None = None
    context_threshold: float | None = None

    @property
    def max_tokens(self) -> int | None:
        return self.sampling.max_tokens

    @property
    def stop(self) -> list[str]:
        return list(self.sampling.stop)


def _scalar(name: str, array: Any):
    array = np.asarray(array)
    if array.size != 1:
        raise RequestError(f"{name}: expected one element, got shape {list(array.shape)}")
    return array.reshape(-1)[0]


def _text(name: str, array: Any) -> str:
    value = _scalar(name, array)
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(f"{name}: not valid UTF-8") from None
    if isinstance(value, str):
        return value
    raise RequestError(f"{name}: expected a string (BYTES), got {type(value).__name__}")


def parse_request(inputs: dict[str, Any], parameters: str | dict | None = None) -> TextRequest:
    """A ``TextRequest`` from the request's input arrays (name -> NumPy array) and its parameters (JSON).

    Raises RequestError naming the problem (missing ``text_input``, malformed JSON, a bad value).
    """
    token_inputs = {name: _ids(name, inputs[name]) for name in ("input_ids", "context_ids")
                    if inputs.get(name) is not None}
    if inputs.get("text_input") is None and "input_ids" not in token_inputs:
        raise RequestError("missing required input 'text_input'")
    prompt = "" if inputs.get("text_input") is None else _text("text_input", inputs["text_input"])
    context = None if inputs.get("context") is None else _text("context", inputs["context"])
    if context is not None and "context_ids" in token_inputs:
        raise RequestError("context and context_ids exclude each other (text or token ids)")
    flags = {}
    for name in BOOL_INPUTS:
        if inputs.get(name) is not None:
            value = _scalar(name, inputs[name])
            if not isinstance(value, (bool, np.bool_)):
                raise RequestError(f"{name}: expected a BOOL, got {np.asarray(inputs[name]).dtype}")
            flags[name] = bool(value)
    stream = flags.get("stream", False)
    if "exclude_input_in_output" in flags:
        prepend = not flags["exclude_input_in_output"]
        if prepend and stream:
            raise RequestError("exclude_input_in_output=false is not allowed when streaming")
    else:
        prepend = not stream
    if inputs.get("sampling_parameters") is not None:
        raw = _text("sampling_parameters", inputs["sampling_parameters"])
        try:
            values = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as err:
            raise RequestError(f"sampling_parameters: malformed JSON ({err.msg} at character {err.pos})") from None
        sampling = SamplingParams.from_dict(values, strict=True, source="sampling_parameters")
    else:
        if isinstance(parameters, str):
            try:
                parameters = json.loads(parameters) if parameters.strip() else {}
            except json.JSONDecodeError:
                parameters = {}
        sampling = SamplingParams.from_dict(dict(parameters or {}), strict=False, source="request parameters")
    kv_budget = None
    if inputs.get("kv_budget") is not None:
        value = _scalar("kv_budget", inputs["kv_budget"])
        if not np.issubdtype(np.asarray(value).dtype, np.integer):
            raise RequestError(f"kv_budget: expected an integer, got {np.asarray(inputs['kv_budget']).dtype}")
        kv_budget = int(value)
    threshold = None
    if inputs.get("context_threshold") is not None:
        value = _scalar("context_threshold", inputs["context_threshold"])
        if not np.issubdtype(np.asarray(value).dtype, np.number) or np.issubdtype(np.asarray(value).dtype, np.bool_):
            raise RequestError(f"context_threshold: expected a number, got {np.asarray(inputs['context_threshold']).dtype}")
        threshold = float(value)
    return TextRequest(
        prompt=prompt, stream=stream, prepend_input=prepend, kv_budget=kv_budget,
        return_num_input_tokens=flags.get("return_num_input_tokens", False),
        return_num_output_tokens=flags.get("return_num_output_tokens", False),
        return_kv_bytes=flags.get("return_kv_bytes", False), sampling=sampling,
        apply_chat_template=flags.get("apply_chat_template", False), context=context,
        input_ids=token_inputs.get("input_ids"), context_ids=token_inputs.get("context_ids"),
        context_threshold=threshold,
    )


def _ids(name: str, array: Any) -> list[int]:
    array = np.asarray(array)
    if not np.issubdtype(array.dtype, np.integer):
        raise RequestError(f"{name}: expected token ids (INT32), got {array.dtype}")
    return [int(t) for t in array.reshape(-1)]


def encode_inputs(parsed: TextRequest, tokenizer, bound: TextBound | None = None) -> tuple[list[int], list[int]]:
    """(prompt ids, context ids) of a parsed request: ``input_ids`` / ``context_ids`` as given, else the texts
    tokenised as ``criticalkv generate`` does (``criticalkv.chat``): with ``apply_chat_template`` the prompt is one
    user message (and a ``context`` comes first in that message, the question after it); without it a ``context``
    is the text before ``text_input`` (tokenised on its own, with the tokenizer's BOS; the prompt without).
    ``bound``: the engine's ``TextBound``, checked before any text is rendered or tokenised (RequestError)."""
    if bound is not None:
        bound.check(None if parsed.input_ids is not None else parsed.prompt, parsed.context,
                    what="text_input and context" if parsed.context is not None else "text_input")
    context_ids = parsed.context_ids or []
    if parsed.input_ids is not None:
        ids = parsed.input_ids
        if parsed.context is not None:
            context_ids = encode_text(tokenizer, parsed.context)
        return ids, context_ids
    try:
        if parsed.apply_chat_template:
            if parsed.context is not None:  # encode_context_question gives (context, question): swap to (prompt, context)
                context_ids, question_ids = encode_context_question(tokenizer, parsed.context, parsed.prompt, chat=True)
                return question_ids, context_ids
            return chat_input_ids(tokenizer, [{"role": "user", "content": parsed.prompt}]), context_ids
    except ValueError as err:
        raise RequestError(f"apply_chat_template: {err}") from None
    if parsed.context is not None:
        return encode_text(tokenizer, parsed.prompt, special=False), encode_text(tokenizer, parsed.context)
    return encode_text(tokenizer, parsed.prompt, special=not context_ids), context_ids


class TextStream:
    """Incremental detokenization of one request's tokens, with stop strings.

    ``add(token_ids, final)`` returns ``(new_text, stopped)``: the text that became certain since the last
    call (a trailing incomplete UTF-8 sequence is held back until a later token completes it; a stream that
    ends inside a character drops those bytes: no U+FFFD is ever sent for them) and whether a stop string
    was reached (the text is then cut before it and the request should be cancelled).
    """

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = list(stop or [])
        self.token_ids: list[int] = []
        self.text = ""  # text sent so far
        self.stopped = False

    def add(self, token_ids: list[int], final: bool = False) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        self.token_ids.extend(token_ids)
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if self.stop:
            start = max(0, len(self.text) - max(len(s) for s in self.stop))
            hits = [i for i in (full.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                full = full[: min(hits)]
                self.stopped = True
        if full.endswith("\ufffd"):  # the tokens so far end inside a multi-byte UTF-8 character
            if not (final or self.stopped):
                return "", False  # wait for the next token to complete it
            # the stream ends there (max_tokens, a stop): the held bytes never complete; drop them rather than
            # send U+FFFD (a genuine U+FFFD as the very last character looks the same and is dropped too)
            full = full[: len(self.text)] + full[len(self.text):].rstrip("\ufffd")
        if self.stop and not (final or self.stopped):  # hold back a suffix that may start a stop string
            hold = max((k for s in self.stop for k in range(1, len(s)) if full.endswith(s[:k])), default=0)
            full = full[: len(full) - hold] if hold else full
        new = full[len(self.text):]  # byte-level BPE and word tokenizers decode prefixes to prefixes
        self.text = max(full, self.text, key=len)
        return new, self.stopped
