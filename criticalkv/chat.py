"""Chat prompts from the model's own chat template (the tokenizer's ``chat_template``), shared by
``criticalkv generate --chat``, the Triton model's ``apply_chat_template`` input and the OpenAI-compatible
``/v1/chat/completions``, so that the three give the same prompt ids for the same messages.

Messages are dicts ``{"role": str, "content": str}`` (OpenAI's chat format).
"""

from __future__ import annotations

from typing import Any


def check_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")


def chat_input_ids(tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """Prompt ids of ``messages`` rendered by the chat template, with the assistant turn opened
    (``add_generation_prompt=True``): list[int] of the prompt's length."""
    check_chat_template(tokenizer)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return [int(i) for i in (ids["input_ids"] if hasattr(ids, "keys") else ids)]


def chat_prompt_text(tokenizer, messages: list[dict[str, Any]]) -> str:
    """The chat template's text for ``messages`` (assistant turn opened), written so that the plain
    ``tokenizer(text)`` gives back ``chat_input_ids(tokenizer, messages)``: a tokenizer that adds its BOS
    token itself would add it a second time to a template that already starts with it, so that leading
    BOS text is left out (the ids are checked; ValueError if they still differ)."""
    check_chat_template(tokenizer)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = chat_input_ids(tokenizer, messages)
    if tokenizer(text)["input_ids"] == expected:
        return text
    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos) and tokenizer(text[len(bos):])["input_ids"] == expected:
        return text[len(bos):]
    raise ValueError("the chat template's text does not tokenize back to the template's ids with this tokenizer")
