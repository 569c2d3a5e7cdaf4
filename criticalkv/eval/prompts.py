"""Prompts of an exact token length, built at the token level from fixed seeds.

Every task prompt is ``prefix + context + suffix`` in token ids:

* ``prefix``: the chat template's opening (system turn, start of the user turn) and the task's instruction;
* ``context``: haystack sentences (or list items, documents) with the task's needles inserted between
  sentences, cut to exactly the number of tokens that makes the whole prompt ``length`` tokens long;
* ``suffix``: the question, the end of the user turn, the assistant header (``--chat`` semantics of
  ``criticalkv generate``: the user message wrapped in the model's chat template, generation prompt
  added) and the task's answer prefix, as RULER does.

Units (sentences, needles, items) are tokenised one by one, each with its leading space, and
concatenated: the ids are what a byte-level BPE gives for the joined text up to merges across unit
boundaries, and the length is exact by construction. Every random choice comes from a
``random.Random`` seeded by a string (``prompt_seed``), so prompts are identical across runs and
machines (string seeds are hashed with SHA-512, independent of ``PYTHONHASHSEED``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Sequence

#: Stand-in for the context when the chat template is rendered (split out again afterwards).
_SENTINEL = "\u2063CONTEXT\u2063"


@dataclass(frozen=True)
class EvalPrompt:
    """One task instance.

    input_ids : the prompt, exactly ``length`` token ids
    answers : reference strings the scorer looks for
    metric : ``digits`` (needle), ``all`` (RULER string_match_all) or ``part`` (string_match_part)
    max_new_tokens : decoding budget for the answer
    key : unique id of the instance inside a run (task, length, sample, depth)
    meta : task details (requested and actual needle depths, seed string, ...)
    """

    task: str
    key: str
    length: int
    input_ids: tuple[int, ...]
    answers: tuple[str, ...]
    metric: str
    max_new_tokens: int
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PromptFrame:
    """Token ids around the context: ``prefix`` (chat opening + instruction), ``suffix`` (question,
    end of turn, assistant header, answer prefix)."""

    prefix: tuple[int, ...]
    suffix: tuple[int, ...]

    @property
    def overhead(self) -> int:
        return len(self.prefix) + len(self.suffix)


def prompt_seed(seed: int, *parts: Any) -> str:
    """The seed string of one prompt: the run's seed plus what identifies the instance."""
    return "/".join(str(p) for p in (seed, *parts))


def rng(seed: str) -> random.Random:
    return random.Random(seed)


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (BOS/EOS) added."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def frame(tokenizer, instruction: str, question: str, answer_prefix: str, chat: bool = True) -> PromptFrame:
    """Token ids before and after the context.

    With ``chat`` the user message ``instruction + "\\n\\n" + CONTEXT + "\\n\\n" + question`` is rendered
    with the tokenizer's chat template (generation prompt added) and split at the context; the answer
    prefix starts the assistant turn. Without it the same text is used bare (with the tokenizer's BOS
    if it adds one).
    """
    message = f"{instruction}\n\n{_SENTINEL}\n\n{question}"
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use --no-chat")
        text = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False)
        before, after = text.split(_SENTINEL)
        prefix = encode(tokenizer, before)
    else:
        before, after = message.split(_SENTINEL)
        prefix = list(tokenizer(before)["input_ids"])  # keeps a BOS the tokenizer adds by default
    suffix = encode(tokenizer, after + answer_prefix)
    return PromptFrame(tuple(prefix), tuple(suffix))


def context_budget(frame_: PromptFrame, length: int, minimum: int, task: str) -> int:
    """Tokens left for the context of a ``length``-token prompt; at least ``minimum``, else a clear error."""
    room = length - frame_.overhead
    if room < minimum:
        raise ValueError(
            f"{task}: a {length}-token prompt is too short: the instruction, question and chat template take "
            f"{frame_.overhead} tokens and the task needs at least {minimum} context tokens "
            f"(use a length of at least {frame_.overhead + minimum})"
        )
    return room


def take_units(units: Sequence[Sequence[int]], start: int, count: int) -> tuple[list[int], list[int]]:
    """Concatenate ``units`` cyclically from ``start`` until ``count`` tokens, cutting the last unit.

    Returns ``(ids, starts)``: exactly ``count`` ids and the offset of every unit start inside them
    (the sentence boundaries where needles may go), 0 included.
    """
    if not units:
        raise ValueError("no text units to build a context from")
    ids: list[int] = []
    starts: list[int] = []
    i = start
    while len(ids) < count:
        starts.append(len(ids))
        ids.extend(units[i % len(units)])
        i += 1
    return ids[:count], starts


def nearest_boundary(starts: Sequence[int], total: int, fraction: float) -> int:
    """The unit boundary (a unit start, or the very end ``total``) nearest to ``fraction * total``;
    ties go to the earlier boundary."""
    target = fraction * total
    candidates = sorted(set(starts) | {total})
    return min(candidates, key=lambda b: (abs(b - target), b))


def insert_units(haystack: list[int], insertions: Sequence[tuple[int, Sequence[int]]]) -> tuple[list[int], list[int]]:
    """Insert token runs at haystack offsets; returns the ids and each run's start in the result.

    ``insertions`` are ``(offset, ids)`` with offsets into ``haystack`` (equal offsets keep their order).
    """
    order = sorted(range(len(insertions)), key=lambda j: (insertions[j][0], j))
    out: list[int] = []
    positions = [0] * len(insertions)
    cursor = 0
    for j in order:
        offset, ids = insertions[j]
        out.extend(haystack[cursor:offset])
        cursor = offset
        positions[j] = len(out)
        out.extend(ids)
    out.extend(haystack[cursor:])
    return out, positions


def assemble(frame_: PromptFrame, context: Sequence[int], length: int) -> tuple[int, ...]:
    ids = (*frame_.prefix, *context, *frame_.suffix)
    if len(ids) != length:  # a bug in a builder, never the user's input
        raise AssertionError(f"built a {len(ids)}-token prompt instead of {length}")
    return ids
