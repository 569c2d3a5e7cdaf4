"""Prompt builders: exact lengths, needles at their depths, determinism, answers present."""

import re
from collections import Counter

import pytest

from criticalkv.eval.needle import NEEDLE, needle_prompts
from criticalkv.eval.prompts import frame, take_units
from criticalkv.eval.ruler import TASKS, ruler_prompts
from criticalkv.eval.units import sentence_units, spaced


def sublist_positions(seq, sub):
    return [i for i in range(len(seq) - len(sub) + 1) if list(seq[i : i + len(sub)]) == list(sub)]


@pytest.mark.parametrize("length", [256, 301, 777])
def test_needle_prompts_have_the_exact_length_and_the_needle_at_its_depth(tokenizer, length):
    depths = [0, 25, 50, 75, 100]
    prompts = needle_prompts(tokenizer, [length], depths, samples=2, seed=3)
    assert len(prompts) == 2 * len(depths)
    max_sentence = max(len(u) for u in sentence_units(tokenizer))
    for p in prompts:
        assert len(p.input_ids) == p.length == length
        needle = spaced(tokenizer, NEEDLE.format(number=p.answers[0]))
        start = p.meta["needle_start"]
        assert list(p.input_ids[start : start + len(needle)]) == needle
        assert sublist_positions(p.input_ids, needle) == [start]  # exactly one needle
        f = frame(tokenizer, *_needle_frame_texts())
        haystack_len = length - f.overhead - len(needle)
        requested = p.meta["depth"] / 100 * haystack_len
        assert abs(p.meta["actual_depth"] / 100 * haystack_len - requested) <= max_sentence
        assert start - len(f.prefix) == round(p.meta["actual_depth"] / 100 * haystack_len)
        if p.meta["depth"] == 0:
            assert start == len(f.prefix)
        if p.meta["depth"] == 100:
            assert start + len(needle) == length - len(f.suffix)
        text = tokenizer.decode(p.input_ids)
        assert text.count(p.answers[0]) == 1  # the number occurs once: in the needle


def _needle_frame_texts():
    from criticalkv.eval import needle

    return needle.INSTRUCTION, needle.QUESTION, needle.ANSWER_PREFIX


def test_needle_grid_shares_haystack_and_number_across_depths(tokenizer):
    prompts = needle_prompts(tokenizer, [300], [10, 90], samples=2, seed=0)
    by_sample = {}
    for p in prompts:
        by_sample.setdefault(p.meta["sample"], set()).add(p.answers[0])
    assert all(len(v) == 1 for v in by_sample.values())
    assert by_sample[0] != by_sample[1]
    a, b = prompts[0].input_ids, prompts[1].input_ids  # same sample, depths 10 and 90
    assert sorted(a) == sorted(b) and a != b


def test_prompts_are_deterministic_from_the_seed(tokenizer):
    assert needle_prompts(tokenizer, [300], [50], 2, seed=5) == needle_prompts(tokenizer, [300], [50], 2, seed=5)
    assert needle_prompts(tokenizer, [300], [50], 1, seed=5)[0].input_ids != needle_prompts(tokenizer, [300], [50], 1, seed=6)[0].input_ids
    assert ruler_prompts(tokenizer, [1500], samples=1, seed=1) == ruler_prompts(tokenizer, [1500], samples=1, seed=1)
    other = ruler_prompts(tokenizer, [1500], samples=1, seed=2)
    assert all(x.input_ids != y.input_ids for x, y in zip(ruler_prompts(tokenizer, [1500], samples=1, seed=1), other))


def test_chat_frame_is_the_chat_template_around_the_context(tokenizer):
    p = needle_prompts(tokenizer, [300], [50], 1, seed=0)[0]
    from criticalkv.eval import needle

    f = frame(tokenizer, needle.INSTRUCTION, needle.QUESTION, needle.ANSWER_PREFIX)
    context = tokenizer.decode(p.input_ids[len(f.prefix) : -len(f.suffix)])
    message = f"{needle.INSTRUCTION}\n\n{context}\n\n{needle.QUESTION}"
    expected = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                             tokenize=False) + needle.ANSWER_PREFIX
    assert tokenizer.decode(p.input_ids) == expected
    plain = frame(tokenizer, needle.INSTRUCTION, needle.QUESTION, needle.ANSWER_PREFIX, chat=False)
    assert "<|im_start|>" not in tokenizer.decode(list(plain.prefix) + list(plain.suffix))


@pytest.mark.parametrize("length", [1500, 2000])
def test_ruler_prompts_have_exact_lengths_and_contain_their_answers(tokenizer, length):
    prompts = ruler_prompts(tokenizer, [length], samples=2, seed=0)
    assert [p.task for p in prompts] == list(TASKS) * 2
    for p in prompts:
        assert len(p.input_ids) == length, p.key
        text = tokenizer.decode(p.input_ids)
        for answer in p.answers:
            assert answer in text, (p.key, answer)
        assert p.metric == TASKS[p.task][1]


def test_niah_needles_sit_where_the_metadata_says(tokenizer):
    for p in ruler_prompts(tokenizer, [1500], ["niah_multikey", "niah_multivalue", "vt"], samples=1, seed=4):
        needles = p.meta.get("needles") or p.meta["chain"]
        assert len(p.meta["needle_starts"]) == len(needles)
        lo = p.meta["context_span"][0]
        found = sorted(sublist_positions(p.input_ids[lo:], spaced(tokenizer, n))[0] + lo for n in needles)
        assert found == sorted(p.meta["needle_starts"])
        if p.task == "niah_multikey":  # the query key has one needle, the other three keys differ
            keys = [n.split(" for ")[1].split(" is:")[0] for n in needles]
            assert len(set(keys)) == 4 and keys.count(p.meta["query"]) == 1
        if p.task == "vt":  # the chain is inserted in order
            order = [sublist_positions(p.input_ids[lo:], spaced(tokenizer, c))[0] for c in needles]
            assert order == sorted(order) and len(p.answers) == len(needles) == 3


def test_cwe_answers_are_the_ten_most_common_words(tokenizer):
    p = ruler_prompts(tokenizer, [1500], ["cwe"], samples=1, seed=0)[0]
    lo, hi = p.meta["context_span"]
    listing = tokenizer.decode(p.input_ids[lo:hi])
    words = Counter(re.findall(r"\d+\. ([a-z]+)", listing))
    top = {w for w, _ in words.most_common(10)}
    assert top == set(p.answers)
    assert min(words[w] for w in p.answers) >= p.meta["freq_common"] - 1  # the cut drops at most one item
    assert max(c for w, c in words.items() if w not in p.answers) <= p.meta["freq_uncommon"]


def test_qa_gold_fact_is_in_one_whole_document(tokenizer):
    p = ruler_prompts(tokenizer, [1500], ["qa"], samples=1, seed=2)[0]
    text = tokenizer.decode(p.input_ids)
    gold = p.meta["facts"][0]
    assert text.count(gold) == 1 and text.count(p.answers[0]) == 1
    doc = text.split(f"Document {p.meta['gold_document']}:")[1].split("\n\nDocument")[0]
    assert gold in doc
    for fact in p.meta["facts"][1:]:
        assert fact in text


def test_too_short_prompts_are_refused_clearly(tokenizer):
    with pytest.raises(ValueError, match="too short.*use a length of at least"):
        needle_prompts(tokenizer, [40], [50], 1)
    with pytest.raises(ValueError, match="niah_multikey: a 200-token prompt is too short"):
        ruler_prompts(tokenizer, [200], ["niah_multikey"], 1)
    with pytest.raises(ValueError, match="unknown RULER-style task"):
        ruler_prompts(tokenizer, [900], ["nope"], 1)
    with pytest.raises(ValueError, match="depths"):
        needle_prompts(tokenizer, [300], [120], 1)


def test_take_units_cuts_to_the_exact_count_and_reports_boundaries():
    ids, starts = take_units([[1, 2], [3], [4, 5, 6]], 1, 5)
    assert ids == [3, 4, 5, 6, 1] and starts == [0, 1, 4]
