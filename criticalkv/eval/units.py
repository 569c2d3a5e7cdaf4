"""Tokenised text units shared by the task builders (cached per tokenizer and domain)."""

from __future__ import annotations

from criticalkv.eval.domains import get_domain

_CACHE: dict[tuple[int, str], tuple[object, list[list[int]]]] = {}


def sentence_units(tokenizer, domain: str | None = None) -> list[list[int]]:
    """Token ids of every haystack unit of ``domain`` (default: shakespeare), each tokenised with its joiner in
    front (a leading space for prose, a line break for code)."""
    d = get_domain(domain)
    hit = _CACHE.get((id(tokenizer), d.name))
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    ids = tokenizer([d.unit_text(s) for s in d.sentences()], add_special_tokens=False)["input_ids"]
    units = [list(x) for x in ids]
    _CACHE[(id(tokenizer), d.name)] = (tokenizer, units)
    return units


def spaced(tokenizer, text: str, domain: str | None = None) -> list[int]:
    """Token ids of ``text`` inserted into ``domain``'s running text (a leading space in prose; a comment line in
    code)."""
    return list(tokenizer(get_domain(domain).needle_text(text), add_special_tokens=False)["input_ids"])
