"""Text requests over the scheduler: parse the Triton inputs (vllm_backend's names), validate, detokenize
incrementally, stop strings. Pure Python (no Triton imports), so it is unit-tested without a server.

Inputs (Triton model ``config.pbtxt``): ``text_input`` (STRING, required), ``stream`` (BOOL),
``sampling_parameters`` (STRING, JSON object: ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``,
``ignore_eos``), ``exclude_input_in_output`` (BOOL), ``kv_budget`` (INT32), ``return_num_input_tokens`` /
``return_num_output_tokens`` / ``return_kv_bytes`` (BOOL). Without ``sampling_parameters`` the same keys
are read from the request's parameters (Triton's generate endpoint puts unknown JSON fields there).
As in vllm_backend: a streamed response carries the new text only; a non-streamed one the whole text,
after the prompt unless ``exclude_input_in_output`` is true; streaming with ``exclude_input_in_output``
false is an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from criticalkv.errors import RequestError
from criticalkv.request import SamplingParams
BOOL_INPUTS = ("stream", "exclude_input_in_output", "return_num_input_tokens", "return_num_output_tokens",
               "return_kv_bytes")


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
    if inputs.get("text_input") is None:
        raise RequestError("missing required input 'text_input'")
    prompt = _text("text_input", inputs["text_input"])
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
    return TextRequest(
        prompt=prompt, stream=stream, prepend_input=prepend, kv_budget=kv_budget,
        return_num_input_tokens=flags.get("return_num_input_tokens", False),
        return_num_output_tokens=flags.get("return_num_output_tokens", False),
        return_kv_bytes=flags.get("return_kv_bytes", False), sampling=sampling,
    )


class TextStream:
    """Incremental detokenization of one request's tokens, with stop strings.

    ``add(token_ids, final)`` returns ``(new_text, stopped)``: the text that became certain since the last
    call (a trailing incomplete UTF-8 sequence is held back until the next token or the end) and whether a
    stop string was reached (the text is then cut before it and the request should be cancelled).
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
        if not (final or self.stopped) and full.endswith("\ufffd"):
            return "", False  # an incomplete multi-byte character: wait for the next token
        if self.stop and not (final or self.stopped):  # hold back a suffix that may start a stop string
            hold = max((k for s in self.stop for k in range(1, len(s)) if full.endswith(s[:k])), default=0)
            full = full[: len(full) - hold] if hold else full
        new = full[len(self.text):]  # byte-level BPE and word tokenizers decode prefixes to prefixes
        self.text = max(full, self.text, key=len)
        return new, self.stopped
