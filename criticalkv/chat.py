"""Prompts as token ids: plain text or the model's chat template, and a prompt split into a context (compressed
once, question-agnostically, and cached) and the question asked after it.

The same functions serve the command line, the Triton model and the OpenAI frontend, so a chat sent to the
server is tokenised exactly as ``criticalkv generate --chat`` tokenises it. ``tokenizer`` is a transformers
tokenizer (duck-typed: ``__call__``, ``apply_chat_template``, ``chat_template``).
"""

from __future__ import annotations

from typing import Any, Sequence

#: A string no prompt contains: the point where a rendered chat template is cut into context and question.
_SPLIT = "\u2063criticalkv-split\u2063"
#: Between the context and the question inside one user message.
CONTEXT_SEPARATOR = "\n\n"


def max_token_chars(tokenizer) -> int:
    """The most characters one token of ``tokenizer`` stands for: its longest vocabulary entry (added tokens
    included) as the vocabulary spells it. A byte-level BPE spells each byte as one character, a SentencePiece
    vocabulary a space as ``▁`` and a fallback byte as ``<0xNN>``, a WordPiece one a continuation with ``##``: a token
    never decodes to more characters than its entry has. So a text of more than ``max_input_len *
    max_token_chars(tokenizer)`` characters that are not whitespace is longer than ``max_input_len`` tokens, which
    is known without tokenising it (``criticalkv.request.TextBound``)."""
    vocab = tokenizer.get_vocab()
    return max(1, max(map(len, vocab), default=1))


def _ids(encoded: Any) -> list[int]:
    ids = encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded
    return [int(t) for t in ids]


def _check_chat(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template (send plain text instead)")


def render_chat(tokenizer, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    """The chat template applied to ``messages`` ([{"role", "content"}, ...]) as text."""
    _check_chat(tokenizer)
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=False)


def chat_input_ids(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Prompt ids of ``messages`` rendered by the chat template, the assistant turn opened: list[int]."""
    _check_chat(tokenizer)
    return _ids(tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True))


def chat_prompt_text(tokenizer, messages: Sequence[dict]) -> str:
    """The chat template's text for ``messages`` (assistant turn opened), written so that the plain
    ``tokenizer(text)`` (as a text prompt is tokenised: ``encode_text``) gives back ``chat_input_ids``: a
    tokenizer that adds its BOS itself would add it a second time to a template that already starts with it, so
    that leading BOS text is left out (the ids are checked; ValueError if they still differ). The OpenAI
    frontend sends a chat to the model as this text."""
    text = render_chat(tokenizer, messages)
    expected = chat_input_ids(tokenizer, messages)
    if encode_text(tokenizer, text) == expected:
        return text
    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos) and encode_text(tokenizer, text[len(bos):]) == expected:
        return text[len(bos):]
    raise ValueError("the chat template's text does not tokenize back to the template's ids with this tokenizer")


def encode_text(tokenizer, text: str, special: bool = True) -> list[int]:
    """``text`` as token ids; ``special``: with the tokens the tokenizer adds by default (a BOS)."""
    return _ids(tokenizer(text, add_special_tokens=special))


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """A prompt: plain text, or with ``chat`` the user turn of the model's chat template (generation prompt added)."""
    if chat:
        return chat_input_ids(tokenizer, [{"role": "user", "content": text}])
    return encode_text(tokenizer, text)


def encode_context_question(tokenizer, context: str, question: str, chat: bool) -> tuple[list[int], list[int]]:
    """A prompt whose context comes first and whose question follows it, as (context ids, question ids).

    With ``chat``: one user message ``context + "\\n\\n" + question`` in the chat template, cut right before the
    question (the template's opening and the context on one side; the question, the end of the turn and the
    assistant header on the other). Without it: the context as plain text (with the tokenizer's BOS) and
    ``"\\n\\n" + question`` after it.
    """
    if not context or not question:
        raise ValueError("the context and the question must both be non-empty")
    if chat:
        text = render_chat(tokenizer, [{"role": "user", "content": context + CONTEXT_SEPARATOR + _SPLIT + question}])
        before, after = text.split(_SPLIT)
        return encode_text(tokenizer, before, special=False), encode_text(tokenizer, after, special=False)
    return encode_text(tokenizer, context), encode_text(tokenizer, CONTEXT_SEPARATOR + question, special=False)


def split_chat(tokenizer, messages: Sequence[dict]) -> tuple[list[int], list[int]]:
    """A conversation as (context ids, question ids): every message but the last is the context (a follow-up turn
    reuses its compressed history), the last message and the generation prompt are the question. With a single
    message the context is empty."""
    if not messages:
        raise ValueError("messages: at least one message is needed")
    full = render_chat(tokenizer, messages)
    if len(messages) == 1:
        return [], encode_text(tokenizer, full, special=False)
    history = render_chat(tokenizer, messages[:-1], add_generation_prompt=False)
    if not full.startswith(history):  # a template that rewrites earlier turns (e.g. drops old reasoning)
        return [], encode_text(tokenizer, full, special=False)
    return encode_text(tokenizer, history, special=False), encode_text(tokenizer, full[len(history):], special=False)


def chat_context_ids(tokenizer, messages: Sequence[dict], context: str | bool) -> tuple[list[int], list[int]]:
    """A chat as (context ids, question ids) for the compressed context cache.

    ``context`` a string: a document placed at the start of the last (user) message, ``context + "\n\n" + its
    content``, and the chat cut right before that content (earlier turns, the template's opening and the document
    are the context; the last message and the generation prompt the question). ``context`` True: the
    conversation's earlier messages are the context (``split_chat``), so a follow-up turn reuses its compressed
    history.
    """
    if not messages or messages[-1].get("role") != "user":
        raise ValueError("context: the last message must be the user's (the question asked after the context)")
    if context is True:
        return split_chat(tokenizer, messages)
    if not isinstance(context, str) or not context:
        raise ValueError("context: a non-empty string (a document) or true (the earlier messages)")
    last = dict(messages[-1])
    last["content"] = context + CONTEXT_SEPARATOR + _SPLIT + str(last.get("content") or "")
    before, after = render_chat(tokenizer, [*messages[:-1], last]).split(_SPLIT)
    return encode_text(tokenizer, before, special=False), encode_text(tokenizer, after, special=False)
