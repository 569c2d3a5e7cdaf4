"""Benchmark prompts: exact token counts after a text round trip, distinct, reproducible."""

import pytest

from criticalkv.bench.prompts import corpus_ids, make_prompts, special_tokens_added


@pytest.mark.parametrize("isl", [1, 7, 128, 513, 2048])
def test_prompt_texts_tokenise_to_exactly_isl(tokenizer, isl):
    prompts = make_prompts(tokenizer, isl, 6, seed=3)
    assert len(prompts) == 6
    for p in prompts:
        again = tokenizer(p.text)["input_ids"]
        assert len(again) == isl and tuple(again) == p.input_ids
    assert len({p.text for p in prompts}) == 6  # no two requests share a prompt


def test_prompts_count_the_special_tokens_a_tokenizer_adds(bos_tokenizer):
    assert special_tokens_added(bos_tokenizer) == 1
    for p in make_prompts(bos_tokenizer, 300, 4):
        ids = bos_tokenizer(p.text)["input_ids"]
        assert len(ids) == 300 and ids[0] == bos_tokenizer.convert_tokens_to_ids("<|im_start|>")
    with pytest.raises(ValueError, match="no room"):
        make_prompts(bos_tokenizer, 1, 1)


def test_prompts_are_reproducible_and_depend_on_the_seed(tokenizer):
    ids = corpus_ids(tokenizer)
    a = make_prompts(tokenizer, 256, 3, seed=0, ids=ids)
    assert a == make_prompts(tokenizer, 256, 3, seed=0, ids=ids)
    assert a != make_prompts(tokenizer, 256, 3, seed=1, ids=ids)


def test_too_long_prompt_is_refused(tokenizer):
    with pytest.raises(ValueError, match="exceeds the benchmark text"):
        make_prompts(tokenizer, 10**7, 1)
