"""One request type: ``SamplingParams`` (how to generate) and ``Request`` (what to generate from), named and
shaped as vLLM and TensorRT-LLM users know them.

Every rule about a request lives here, once, with one set of messages:

* ``SamplingParams.__post_init__`` checks what a request says on its own (types, ``temperature >= 0``,
  ``0 < top_p <= 1``, ...); ``SamplingParams.from_dict`` reads the JSON form the frontends receive;
* ``Request.checked(limits)`` checks what depends on the engine (prompt length, token ids, ``max_tokens`` within
  the built maximum, ``kv_budget`` within the policy's range: ``KVPolicy.request_budget``) and fills the defaults:
  it returns a ``CheckedRequest``, whose ``budget`` is the int the selection runs with.

The command line, ``Engine``, the serving scheduler, the Triton model and the OpenAI frontend all build a
``Request`` and call ``Engine.check`` (= ``Request.checked`` with the engine's limits) once, at the edge; ``Engine``
takes a ``CheckedRequest`` of its own limits as it is and hands the backends its int ``budget``, which they trust
(no backend checks a budget again). A violated rule raises ``RequestError`` naming the field.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

from criticalkv.errors import RequestError
from criticalkv.policy import KVPolicy

#: new tokens of a request that does not say (vLLM's default)
DEFAULT_MAX_TOKENS = 16

#: the keys of the JSON form (``sampling_parameters`` of the Triton model, the OpenAI request's fields)
SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "seed", "stop", "stop_token_ids", "ignore_eos")

#: the error when a per-request budget reaches an engine whose prefill graph fixes the budget
NO_BUDGET_INPUT = "this engine was built without a runtime budget input; rebuild it"


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How a request generates. Checked on construction (``RequestError`` naming the field).

    max_tokens : new tokens at most (>= 1; None = ``DEFAULT_MAX_TOKENS`` or the engine's maximum if lower)
    temperature : 0 is greedy (argmax, ties to the lower token id); > 0 samples
    top_p : nucleus mass in (0, 1]
    seed : the sampler's seed (>= 0) for repeatable sampling; None draws a fresh one
    stop : strings that end the output (cut before them; the frontends apply them to the text)
    stop_token_ids : token ids that end the output besides the model's end-of-sequence ids (kept in the output)
    ignore_eos : do not stop at the model's end-of-sequence ids
    """

    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        m = self.max_tokens
        if m is not None:
            if not _is_number(m) or (isinstance(m, float) and not m.is_integer()) or not math.isfinite(m):
                raise RequestError(f"max_tokens must be an integer, got {m!r}")
            if m <= 0:
                raise RequestError(f"max_tokens must be >= 1, got {int(m)}")
            object.__setattr__(self, "max_tokens", int(m))
        for key in ("temperature", "top_p"):
            if not _is_number(getattr(self, key)):
                raise RequestError(f"{key} must be a number, got {getattr(self, key)!r}")
            object.__setattr__(self, key, float(getattr(self, key)))
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise RequestError(f"temperature: must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p: must lie in (0, 1], got {self.top_p}")
        if self.seed is not None and not (_is_int(self.seed) and self.seed >= 0):
            raise RequestError(f"seed must be an integer >= 0, got {self.seed!r}")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise RequestError(f"stop_token_ids must be a list of token ids (integers >= 0), got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def stop_ids(self, eos_token_ids: Iterable[int]) -> frozenset[int]:
        """The token ids that end this request: the model's ``eos_token_ids`` (unless ``ignore_eos``) and
        ``stop_token_ids``."""
        return frozenset(() if self.ignore_eos else map(int, eos_token_ids)) | frozenset(self.stop_token_ids)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], strict: bool = True, source: str = "sampling_parameters",
                  **overrides: Any) -> "SamplingParams":
        """From the JSON form (keys ``SAMPLING_KEYS``; null = the default). ``strict``: an unknown key is an
        error (a typo must not pass silently); otherwise other keys are ignored (Triton's generate endpoint puts
        every extra JSON field of the request among its parameters). Errors are prefixed with ``source``."""
        if not isinstance(values, Mapping):
            raise RequestError(f"{source}: expected a JSON object, got {type(values).__name__}")
        unknown = sorted(set(values) - set(SAMPLING_KEYS))
        if unknown and strict:
            raise RequestError(f"{source}: unknown key(s) {', '.join(unknown)} (known: {', '.join(SAMPLING_KEYS)})")
        kwargs = {k: values[k] for k in SAMPLING_KEYS if values.get(k) is not None}
        kwargs.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**kwargs)
        except RequestError as err:
            raise RequestError(f"{source}: {err}") from None


def check_max_tokens(max_tokens: int, max_new_tokens: int) -> None:
    """RequestError unless ``max_tokens`` lies in [1, ``max_new_tokens``] (an engine's built maximum)."""
    if not 1 <= max_tokens <= max_new_tokens:
        raise RequestError(f"max_tokens must lie in [1, {max_new_tokens}] (the engine's built maximum), got {max_tokens}")


#: the most bytes one character of a text takes in a JSON body: a character beyond the BMP written as a surrogate pair
#: of escapes (``"\\ud83d\\ude00"``), as a client that escapes everything (``json.dumps`` by default) sends it
JSON_BYTES_PER_CHAR = 12
#: what a request body holds besides its texts: field names, sampling values, stop strings, the JSON around them
BODY_OVERHEAD_BYTES = 1 << 20
#: what a text may hold that a tokenizer may drop without a token: whitespace (not counted against ``TextBound``)
_WHITESPACE = (" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
               "\u2009\u200a\u2028\u2029\u202f\u205f\u3000")


@dataclass(frozen=True)
class TextBound:
    """The most characters the texts of one request to an engine can hold, known before any tokenizer runs.

    A token stands for at most ``max_token_chars`` characters (``criticalkv.chat.max_token_chars``: the longest entry
    of the vocabulary), so texts with more than ``max_chars = max_input_len * max_token_chars`` characters besides
    whitespace (which some tokenizers drop) are more than ``max_input_len`` tokens: ``check`` refuses them at the edge
    (the OpenAI frontend before the chat template renders them, the Triton model before it tokenises them), so an
    oversized request costs no more than reading it. A prompt within the bound is counted exactly afterwards
    (``Request.checked``). ``max_body_bytes``: the request body that can carry such texts (every character at its
    longest JSON form, ``JSON_BYTES_PER_CHAR``, plus ``BODY_OVERHEAD_BYTES``), the default body limit of the
    OpenAI frontend (``criticalkv serve --max-body-bytes``).

    The bound is exact for the vocabularies of the supported families (byte-level BPE, SentencePiece); a tokenizer
    whose normaliser deletes other characters, or whose unknown token covers any run of text, is held to it as well.
    """

    max_input_len: int
    max_token_chars: int

    @classmethod
    def of(cls, tokenizer, max_input_len: int) -> "TextBound":
        from criticalkv.chat import max_token_chars

        return cls(int(max_input_len), max_token_chars(tokenizer))

    @property
    def max_chars(self) -> int:
        return self.max_input_len * self.max_token_chars

    @property
    def max_body_bytes(self) -> int:
        return JSON_BYTES_PER_CHAR * self.max_chars + BODY_OVERHEAD_BYTES

    def check(self, *texts: str | None, what: str = "the prompt") -> None:
        """RequestError when ``texts`` (None ones skipped) hold more than ``max_chars`` characters besides whitespace
        (Python's ``str.isspace`` set). Texts within ``max_chars`` in all are not even scanned."""
        texts = [t for t in texts if t]
        total = sum(map(len, texts))
        if total <= self.max_chars:
            return
        total -= sum(t.count(space) for t in texts for space in _WHITESPACE)  # str.count: ~10 ms per MB each
        if total > self.max_chars:
            raise RequestError(
                f"{what}: {total} characters (whitespace apart), more than the engine takes: at most {self.max_chars} "
                f"(its max input length {self.max_input_len} tokens x {self.max_token_chars} characters, its "
                "vocabulary's longest token)")


@dataclass(frozen=True)
class EngineLimits:
    """What an engine serves, for ``Request.checked``: built limits, vocabulary, policy, stop ids."""

    max_input_len: int
    max_new_tokens: int
    vocab_size: int
    policy: KVPolicy
    accepts_kv_budget: bool = True
    eos_token_ids: tuple[int, ...] = ()
    #: most question tokens after a cached context (the extend graph's room in a slot); 0: no context requests
    max_question_len: int = 0


@dataclass(frozen=True)
class Request:
    """One generation request.

    prompt_token_ids : the prompt's token ids (1 <= n <= the engine's max input length)
    sampling : how to generate (``SamplingParams``)
    kv_budget : tokens per KV head the selection keeps for this request, in [min_budget, the built budget]
        (``KVPolicy.request_budget``); None = the engine's built budget
    request_id : the caller's name for it (logs, outputs); the scheduler numbers requests that have none
    context_token_ids : a context (a document, a conversation's earlier turns) that comes before the prompt and is
        compressed alone, question-agnostically, and cached: later requests with the same context skip its prefill
        (the serving context cache). The prompt is then the question asked after it. Empty: no context.
    context_threshold : an input-adaptive budget for the context (``criticalkv.methods.budget.adaptive_budget``): keep
        what the context policy's own score (KVzip's, an attention probability) ranks at or above this threshold, at
        most the request's budget; in (0, 1]. None: the budget itself.
    """

    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    kv_budget: int | None = None
    request_id: Any = None
    context_token_ids: tuple[int, ...] = ()
    context_threshold: float | None = None

    def __post_init__(self) -> None:
        for name in ("prompt_token_ids", "context_token_ids"):
            ids = getattr(self, name)
            if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
                raise RequestError(f"{name}: expected a list of token ids, got {type(ids).__name__}")
            ids = tuple(ids)
            if not all(_is_int(t) for t in ids):
                raise RequestError(f"{name}: every token id must be an integer")
            object.__setattr__(self, name, tuple(int(t) for t in ids))
        if not isinstance(self.sampling, SamplingParams):
            raise RequestError(f"sampling: expected SamplingParams, got {type(self.sampling).__name__}")
        t = self.context_threshold
        if t is not None:
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 1:
                raise RequestError(f"context_threshold: a score in (0, 1] (an attention probability), got {t!r}")
            object.__setattr__(self, "context_threshold", float(t))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_context_tokens(self) -> int:
        return len(self.context_token_ids)

    def checked(self, limits: EngineLimits) -> "Request":
        """This request checked against an engine's ``limits``, defaults filled: ``max_tokens`` set, ``kv_budget``
        None for the built budget. Raises ``RequestError`` naming the field."""
        ids, context = self.prompt_token_ids, self.context_token_ids
        if not ids:
            raise RequestError("the prompt is empty")
        if self.context_threshold is not None and not context:
            raise RequestError("context_threshold: adapts the budget of a context; this request has no context")
        if context:
            if not limits.max_question_len:
                raise RequestError("context: this engine cannot keep a compressed context (it has no extend graph); "
                                   "rebuild it with scripts/build_engine.py")
            if len(context) + len(ids) > limits.max_input_len:
                raise RequestError(f"the context and the prompt after it have {len(context)} + {len(ids)} tokens, more "
                                   f"than the engine's max input length {limits.max_input_len}")
            if len(ids) > limits.max_question_len:
                raise RequestError(f"the prompt after the context has {len(ids)} tokens, more than the engine's max "
                                   f"question length {limits.max_question_len} (rebuild with a larger "
                                   "--max-question-len, or send it without a context)")
        elif len(ids) > limits.max_input_len:
            raise RequestError(f"the prompt has {len(ids)} tokens, more than the engine's max input length "
                               f"{limits.max_input_len}")
        if min(ids + context) < 0 or max(ids + context) >= limits.vocab_size:
            raise RequestError(f"prompt token ids must lie in [0, {limits.vocab_size})")
        sampling = self.sampling
        if sampling.max_tokens is None:
            sampling = replace(sampling, max_tokens=min(DEFAULT_MAX_TOKENS, limits.max_new_tokens))
        else:
            check_max_tokens(sampling.max_tokens, limits.max_new_tokens)
        try:
            budget = limits.policy.request_budget(self.kv_budget)
        except ValueError as err:
            raise RequestError(str(err)) from None
        if budget is not None and not limits.accepts_kv_budget:
            raise RequestError(NO_BUDGET_INPUT)
        return CheckedRequest(self.prompt_token_ids, sampling, budget, self.request_id, context,
                              self.context_threshold, limits=limits,
                              budget=limits.policy.budget if budget is None else budget)


@dataclass(frozen=True)
class CheckedRequest(Request):
    """A ``Request`` that ``Request.checked`` passed against one engine's ``limits``: ``max_tokens`` set, ``kv_budget``
    None for the built budget (as given, normalised), and ``budget``: the int budget (tokens per KV head) its selection
    runs with, in [min_budget, the built budget], what the backends receive. ``Engine.check`` returns one of its own
    limits unchanged (checked once)."""

    budget: int = 0
    limits: EngineLimits | None = field(default=None, compare=False, repr=False)

    def checked(self, limits: EngineLimits) -> "CheckedRequest":
        if limits is self.limits:
            return self
        return Request(self.prompt_token_ids, self.sampling, self.kv_budget, self.request_id,
                       self.context_token_ids, self.context_threshold).checked(limits)
