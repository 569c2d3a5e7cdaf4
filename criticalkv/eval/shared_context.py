"""Shared-context documents: one document, many questions (SCBench's compress-once, answer-many, for small models).

Each document is a stretch of a domain's text (``criticalkv.eval.domains``: its evaluation documents, or with
``split="train"`` its training documents, which share none of them) of an exact token length, wrapped in the model's
chat template with an instruction, with facts inserted between its sentences (lines, in code: as comment lines) at
random depths. Every question of a document shares the same context ids; a question is what follows the context
(``\\n\\n`` + the question, the end of the user turn, the assistant header and the answer prefix), so the context can be
compressed once, before any question is known, and every question then asked of the same compressed cache.

Question kinds (``KINDS``; each document asks ``DEFAULT_KINDS`` unless told otherwise):

* ``key``: one key's value. ``KEYS`` facts ``The <attribute> of <Name> is <4 digits>.``, each with another attribute
  (locker number, room number, ...) and person; each is asked (``What is the <attribute> of <Name>?``, answer prefix
  ``The <attribute> of <Name> is``). Metric ``digits``.
* ``keys``: two of those facts at once: both numbers. Metric ``all``.
* ``chain``: a value passed along a chain: ``The safe code of the <red> box is <5 digits>.`` then, later, ``The <blue>
  box has the same safe code as the <red> box.``; ``What is the safe code of the <blue> box?``. Metric ``digits``.
* ``owner``: where a number occurs (the inverse look-up): ``Whose <attribute> is <4 digits>?``, answer prefix ``The
  <attribute> <4 digits> belongs to``. Metric ``part`` (the person's full name).
* ``quote``: a quoted line's continuation: the first ``QUOTE_LEAD`` words of a sentence (a line of code) of the
  document, quoted (``Complete the sentence of the text that begins with "..."``) and repeated as the answer prefix;
  the answer must go on with the text's next ``QUOTE_WORDS`` words. Metric ``continuation``. Not asked by default.
* ``count``: how often a repeated sentence occurs (2-5 times, inserted like the facts). Metric ``count`` (the number
  in digits or in words). Not asked by default.
* ``open``: an open question (``What is the text about?``) with no reference: scored against the full cache's own
  answer (``criticalkv.eval.shared_stats``), never counted in an accuracy.

Checked with the full cache first (the bundled SmolLM2-135M, question-agnostic): on 8 documents of 2,048-2,560 tokens
with one attribute ("locker number") for all four people the model confused them (53 % of 32 ``key`` questions),
``keys`` 56 %, a RULER-style ``VAR`` chain 25 %, ``owner`` 38 %, ``quote`` 12 % (the quotation closed with a quote
mark), ``count`` 0 %; on 4 more documents of 2,048 tokens with an attribute per person and the chain in words: ``key``
75 % of 16, ``keys`` 38 %, ``chain`` 75 %, ``owner`` 25 %, ``quote`` 0 % (the quotation left open), ``count`` 0 %. So a
document asks 5 ``key``, ``keys``, ``chain``, ``owner`` and ``open`` questions: 8 with a reference, 1 scored against
the full cache; ``quote`` and ``count`` stay available (``--kinds``), which the bundled model cannot answer.

Everything random comes from ``random.Random("<seed>/shared/<domain>/<split>/<index>")``: the same documents on every
machine. The numbers inserted do not occur elsewhere in the document.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from criticalkv.eval.domains import get_domain
from criticalkv.eval.prompts import encode, frame, insert_units, nearest_boundary, prompt_seed, rng, take_units
from criticalkv.eval.ruler import QA_FIRST_NAMES, QA_SURNAMES
from criticalkv.eval.scoring import clean_prediction, digits_match, string_match_all, string_match_part

INSTRUCTION = ("Read the following text carefully. A few facts are hidden in it (numbers that belong to people, a "
               "safe code). I will ask you questions about the text afterwards.")
KEY_FACT = "The {attribute} of {name} is {number}."
KEY_QUESTION = "Question: What is the {attribute} of {name}? Answer with the number only."
KEY_PREFIX = "The {attribute} of {name} is"
KEYS_QUESTION = ("Question: What are the {attribute_a} of {a} and the {attribute_b} of {b}? Answer with the two "
                 "numbers only.")
KEYS_PREFIX = "The {attribute_a} of {a} and the {attribute_b} of {b} are"
CHAIN_FACTS = ("The safe code of the {a} box is {value}.", "The {b} box has the same safe code as the {a} box.")
CHAIN_QUESTION = "Question: What is the safe code of the {b} box? Answer with the number only."
CHAIN_PREFIX = "The safe code of the {b} box is"
OWNER_QUESTION = "Question: Whose {attribute} is {number}? Answer with the person's name only."
OWNER_PREFIX = "The {attribute} {number} belongs to"
QUOTE_QUESTION = 'Question: Complete the sentence of the text that begins with "{quote}".'
QUOTE_PREFIX = "{quote}"
COUNT_QUESTION = 'Question: How many times does the sentence "{sentence}" occur in the text? Answer with a number.'
COUNT_PREFIX = "The sentence occurs"
OPEN_QUESTION = "Question: What is the text about? Answer in one short sentence."
OPEN_PREFIX = "The text is about"
#: Sentences the ``count`` questions repeat (one per document).
REPEATED = (
    "The blue heron landed on the old fence.",
    "A red kite circled over the empty market.",
    "The night porter rang the brass bell.",
    "Three grey geese crossed the frozen pond.",
    "The clockmaker opened his shop at dawn.",
    "A paper boat drifted under the stone bridge.",
)
#: What the ``key`` facts give a number for: each fact of a document a different one.
ATTRIBUTES = ("locker number", "room number", "badge number", "phone extension", "parking space", "mailbox number",
              "desk number", "ticket number")
#: The ``chain`` question's two boxes.
COLOURS = ("red", "blue", "green", "yellow", "black", "white", "silver", "golden")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")

#: ``key`` facts per document (each one a ``key`` question).
KEYS = 5
#: Words quoted by a ``quote`` question, and words of the text's continuation its answer must give.
QUOTE_LEAD, QUOTE_WORDS = 8, 3

#: kind -> (metric, max new tokens)
KINDS: dict[str, tuple[str, int]] = {
    "key": ("digits", 8),
    "keys": ("all", 16),
    "chain": ("digits", 10),
    "owner": ("part", 8),
    "quote": ("continuation", 10),
    "count": ("count", 6),
    "open": ("reference", 16),
}
#: The kinds each document asks, in order (``key`` once per fact).
DEFAULT_KINDS = ("key", "keys", "chain", "owner", "open")
METRICS = ("digits", "all", "part", "continuation", "count", "reference")


@dataclass(frozen=True)
class Question:
    """One question about a document: ``ids`` follow the document's context ids (question, end of the user turn,
    assistant header, answer prefix); ``answers`` are what its metric looks for (empty for ``reference``)."""

    key: str
    kind: str
    ids: tuple[int, ...]
    answers: tuple[str, ...]
    metric: str
    max_new_tokens: int
    text: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SharedDocument:
    """A document's context (chat opening + instruction + text with its facts, exactly ``length`` ids) and its
    questions."""

    key: str
    domain: str
    split: str
    length: int
    context_ids: tuple[int, ...]
    questions: tuple[Question, ...]
    meta: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------- scoring
_WORD = re.compile(r"[A-Za-z0-9_]+")


def words(text: str) -> list[str]:
    """Lower-case alphanumeric words of ``text`` (punctuation and layout dropped)."""
    return [w.lower() for w in _WORD.findall(text)]


def continuation_match(prediction: str, expected: Sequence[str]) -> float:
    """1.0 if the answer's first words are ``expected`` (lower-case words, in order), else 0."""
    got = words(prediction)[: len(expected)]
    return 1.0 if got == [w.lower() for w in expected] else 0.0


def count_match(prediction: str, number: str) -> float:
    """1.0 if the answer's first number (digits, or a number word up to ten) is ``number``."""
    for w in words(prediction):
        if w.isdigit():
            return 1.0 if w == number else 0.0
        if w in NUMBER_WORDS:
            return 1.0 if str(NUMBER_WORDS.index(w)) == number else 0.0
    return 0.0


def score_answer(metric: str, prediction: str, answers: Sequence[str]) -> float | None:
    """A question's score in [0, 1] by its metric; None for ``reference`` (scored against the full cache's answer)."""
    text = clean_prediction(prediction)
    if metric == "reference":
        return None
    if not answers:
        raise ValueError(f"score_answer: metric {metric!r} needs reference answers")
    if metric == "digits":
        return min(digits_match(text, a) for a in answers)
    if metric == "all":
        return string_match_all(text, answers)
    if metric == "part":
        return string_match_part(text, answers)
    if metric == "continuation":
        return continuation_match(text, answers)
    if metric == "count":
        return count_match(text, answers[0])
    raise ValueError(f"score_answer: unknown metric {metric!r}; choose one of {', '.join(METRICS)}")


def overlap_f1(prediction: str, reference: str) -> float:
    """Word-level F1 of two answers (SQuAD's token F1 on lower-case words): an open answer against full's."""
    p, r = words(prediction), words(reference)
    if not p and not r:
        return 1.0
    common: dict[str, int] = {}
    for w in p:
        common[w] = common.get(w, 0) + 1
    same = 0
    for w in r:
        if common.get(w, 0) > 0:
            common[w] -= 1
            same += 1
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(r)
    return 2 * precision * recall / (precision + recall)


# ---------------------------------------------------------------------------------------------------- building
def _split_units(tokenizer, domain: str, split: str) -> tuple[list[str], list[list[int]]]:
    """(units as text, their ids with the joiner in front) of a domain's evaluation or training documents."""
    d = get_domain(domain)
    if split == "eval":
        texts = list(d.sentences())
    elif split == "train":
        texts = [u for _, blocks in d.documents("train") for u in d.units_of(blocks)]
    else:
        raise ValueError(f"split: 'eval' or 'train', got {split!r}")
    key = (id(tokenizer), d.name, split)
    hit = _UNITS.get(key)
    if hit is not None and hit[0] is tokenizer:
        return texts, hit[1]
    ids = [list(x) for x in tokenizer([d.unit_text(t) for t in texts], add_special_tokens=False)["input_ids"]]
    _UNITS[key] = (tokenizer, ids)
    return texts, ids


_UNITS: dict[tuple, tuple[object, list[list[int]]]] = {}


def build_document(tokenizer, domain: str, index: int, length: int, seed: int = 0, split: str = "eval",
                   kinds: Sequence[str] = DEFAULT_KINDS, chat: bool = True) -> SharedDocument:
    """Document ``index`` of ``domain``'s ``split``: a context of exactly ``length`` tokens and its questions."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"question kinds: unknown {', '.join(unknown)}; choose from {', '.join(KINDS)}")
    d = get_domain(domain)
    seed_str = prompt_seed(seed, "shared", d.name, split, index)
    r = rng(seed_str)
    texts, units = _split_units(tokenizer, d.name, split)
    start = r.randrange(len(units))
    people = r.sample([f"{f} {s}" for f in QA_FIRST_NAMES for s in QA_SURNAMES], KEYS)
    numbers: list[str] = []
    while len(numbers) < KEYS:
        n = str(r.randint(1000, 9999))
        if n not in numbers:
            numbers.append(n)
    attributes = r.sample(ATTRIBUTES, KEYS)
    var_a, var_b = r.sample(COLOURS, 2)
    var_value = str(r.randint(10000, 99999))
    repeated = r.choice(REPEATED)
    repeats = r.randint(2, 5)
    facts = [KEY_FACT.format(attribute=a, name=p, number=n) for a, p, n in zip(attributes, people, numbers)]
    chain = [CHAIN_FACTS[0].format(a=var_a, value=var_value), CHAIN_FACTS[1].format(a=var_a, b=var_b)]
    inserted = list(facts) + (chain if "chain" in kinds else []) + ([repeated] * repeats if "count" in kinds else [])
    r.shuffle(inserted)
    if "chain" in kinds:  # the assignment of the value comes before the one that passes it on
        i, j = inserted.index(chain[0]), inserted.index(chain[1])
        if i > j:
            inserted[i], inserted[j] = inserted[j], inserted[i]
    # the prefix (chat opening, instruction) is the same for every question: frame() with a placeholder question
    prefix = frame(tokenizer, INSTRUCTION, "Question: ?", "", chat).prefix
    fact_ids = [list(tokenizer(d.needle_text(f), add_special_tokens=False)["input_ids"]) for f in inserted]
    room = length - len(prefix)
    used = sum(map(len, fact_ids))
    if room - used < 256:
        raise ValueError(f"shared-context: a {length}-token context is too short for {len(inserted)} facts "
                         f"({len(prefix)} tokens of instruction, {used} of facts); use at least {len(prefix) + used + 256}")
    haystack, starts = take_units(units, start, room - used)
    depths = sorted(r.sample(range(3, 98), len(inserted)))
    offsets = [nearest_boundary(starts, len(haystack), p / 100) for p in depths]
    document, positions = insert_units(haystack, list(zip(offsets, fact_ids)))
    context_ids = tuple(prefix) + tuple(document)
    text = tokenizer.decode(document)
    for n in numbers + ([var_value] if "chain" in kinds else []):  # a number also in the text: an ambiguous answer
        if len(re.findall(rf"(?<!\d){n}(?!\d)", text)) != 1:
            raise ValueError(f"{seed_str}: the number {n} does not occur exactly once; change the seed")
    fact_at = {f: len(prefix) + p for f, p in zip(inserted, positions)}
    questions: list[tuple[str, str, str, tuple[str, ...], dict]] = []
    for kind in kinds:
        if kind == "key":
            for a, p, n in zip(attributes, people, numbers):
                questions.append((kind, KEY_QUESTION.format(attribute=a, name=p), KEY_PREFIX.format(attribute=a, name=p),
                                  (n,), {"fact_start": fact_at[KEY_FACT.format(attribute=a, name=p, number=n)]}))
        elif kind == "keys":
            a, b = r.sample(range(KEYS), 2)
            names = {"attribute_a": attributes[a], "a": people[a], "attribute_b": attributes[b], "b": people[b]}
            questions.append((kind, KEYS_QUESTION.format(**names), KEYS_PREFIX.format(**names),
                              (numbers[a], numbers[b]), {}))
        elif kind == "chain":
            questions.append((kind, CHAIN_QUESTION.format(b=var_b), CHAIN_PREFIX.format(b=var_b), (var_value,),
                              {"chain": chain}))
        elif kind == "owner":
            j = r.randrange(KEYS)
            questions.append((kind, OWNER_QUESTION.format(attribute=attributes[j], number=numbers[j]),
                              OWNER_PREFIX.format(attribute=attributes[j], number=numbers[j]), (people[j],), {}))
        elif kind == "quote":
            lead, expected, where = _quote(r, tokenizer, haystack, starts, texts, units, start, text)
            questions.append((kind, QUOTE_QUESTION.format(quote=lead), QUOTE_PREFIX.format(quote=lead),
                              tuple(expected), {"quote_unit": where}))
        elif kind == "count":
            questions.append((kind, COUNT_QUESTION.format(sentence=repeated), COUNT_PREFIX, (str(repeats),),
                              {"repeats": repeats}))
        elif kind == "open":
            questions.append((kind, OPEN_QUESTION, OPEN_PREFIX, (), {}))
    key = f"{d.name}/{split}/d{index}"
    out = []
    for j, (kind, question, answer_prefix, answers, meta) in enumerate(questions):
        f = frame(tokenizer, INSTRUCTION, question, answer_prefix, chat)
        if f.prefix != tuple(prefix):  # the chat template put the question inside the prefix: no shared context
            raise AssertionError("the chat template's opening depends on the question")
        metric, max_new = KINDS[kind]
        out.append(Question(key=f"{key}/q{j}", kind=kind, ids=f.suffix, answers=answers, metric=metric,
                            max_new_tokens=max_new, text=question, meta=meta))
    return SharedDocument(key=key, domain=d.name, split=split, length=length, context_ids=context_ids,
                          questions=tuple(out), meta={"seed": seed_str, "facts": inserted, "depths": depths,
                                                      "fact_starts": [fact_at[f] for f in inserted]})


def _quote(r, tokenizer, haystack, starts, texts, units, start, document_text) -> tuple[str, list[str], int]:
    """A sentence (line) of the document, whole, with enough words, quoted once in the document: (its first
    ``QUOTE_LEAD`` words as they stand in the text, the next ``QUOTE_WORDS`` lower-case words, its unit index)."""
    candidates = list(range(1, len(starts) - 1))
    r.shuffle(candidates)
    for j in candidates:
        text = texts[(start + j) % len(texts)]
        tokens = re.findall(r"\S+", text)
        if len(words(text)) < QUOTE_LEAD + QUOTE_WORDS + 1 or len(tokens) < QUOTE_LEAD + QUOTE_WORDS:
            continue
        lead = " ".join(tokens[:QUOTE_LEAD])
        rest = words(" ".join(tokens[QUOTE_LEAD:]))[:QUOTE_WORDS]
        if len(rest) < QUOTE_WORDS or document_text.count(lead) != 1:
            continue
        return lead, rest, j
    raise ValueError("shared-context: no sentence of the document can be quoted (too short or repeated)")


#: Document lengths in turn (tokens of context, chat opening and instruction included): of 10 documents, 8 of
#: 2,048-3,072 tokens and 2 of 4,096.
DEFAULT_LENGTHS = (2048, 2560, 3072, 4096)


#: Consecutive draws that may fail their checks before ``shared_documents`` gives up (a tokenizer or text where every
#: draw fails would otherwise redraw forever).
MAX_REDRAWS = 50


def shared_documents(tokenizer, domains: Sequence[str], documents: int, lengths: Sequence[int] = DEFAULT_LENGTHS,
                     seed: int = 0, split: str = "eval", kinds: Sequence[str] = DEFAULT_KINDS,
                     chat: bool = True) -> list[SharedDocument]:
    """``documents`` documents of every domain, interleaved by domain (d0 of each domain, then d1, ...), document
    ``i`` of ``lengths[i % len(lengths)]`` tokens. A draw that fails its checks (a number the text already holds, no
    sentence to quote) is redrawn under the next index's seed, recorded in the document's ``meta``."""
    if documents < 1:
        raise ValueError(f"--documents must be >= 1, got {documents}")
    per_domain: dict[str, list[SharedDocument]] = {}
    for domain in domains:
        docs, index, failed = [], 0, 0
        while len(docs) < documents:
            length = lengths[len(docs) % len(lengths)]
            try:
                doc = build_document(tokenizer, domain, index, length, seed, split, kinds, chat)
            except ValueError as err:
                failed += 1
                if "too short" in str(err) or failed >= MAX_REDRAWS:
                    raise ValueError(f"shared-context: {domain}: {failed} draws in a row failed their checks, the "
                                     f"last: {err}") if failed >= MAX_REDRAWS else err
                index += 1
                continue
            docs.append(doc)
            failed = 0
            index += 1
        per_domain[domain] = docs
    return [per_domain[d][i] for i in range(documents) for d in domains]
