"""Tokenised text units shared by the task builders (cached per tokenizer)."""

from __future__ import annotations

from criticalkv.eval.haystack import haystack_sentences

_CACHE: dict[int, tuple[object, list[list[int]]]] = {}


def sentence_units(tokenizer) -> list[list[int]]:
    """Token ids of every haystack sentence, each tokenised with its leading space."""
    hit = _CACHE.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    sentences = haystack_sentences()
    ids = tokenizer([" " + s for s in sentences], add_special_tokens=False)["input_ids"]
    units = [list(x) for x in ids]
    _CACHE[id(tokenizer)] = (tokenizer, units)
    return units


def spaced(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as a unit inside running text (with its leading space)."""
    return list(tokenizer(" " + text, add_special_tokens=False)["input_ids"])
