"""Request and SamplingParams: every rule of a request in one place, one message each."""

import numpy as np
import pytest

from criticalkv import KVPolicy
from criticalkv.errors import EngineError, RequestError
from criticalkv.request import DEFAULT_MAX_TOKENS, CheckedRequest, EngineLimits, Request, SamplingParams


def limits(policy=None, **changes):
    values = dict(max_input_len=100, max_new_tokens=32, vocab_size=50, policy=policy or KVPolicy(budget=40, window=8),
                  accepts_kv_budget=True, eos_token_ids=(2,))
    return EngineLimits(**{**values, **changes})


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens must be >= 1, got 0"),
    (dict(max_tokens=2.5), "max_tokens must be an integer"),
    (dict(max_tokens="3"), "max_tokens must be an integer"),
    (dict(temperature=-1), "temperature: must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature: must be a finite number >= 0"),
    (dict(temperature=True), "temperature must be a number"),
    (dict(top_p=0), r"top_p: must lie in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p: must lie in \(0, 1\]"),
    (dict(seed=-1), "seed must be an integer >= 0"),
    (dict(seed=1.5), "seed must be an integer >= 0"),
    (dict(stop=[1]), "stop must be a non-empty string or a list of them"),
    (dict(stop=[""]), "stop must be a non-empty string or a list of them"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must be a list of token ids"),
    (dict(ignore_eos="yes"), "ignore_eos must be true or false"),
])
def test_sampling_params_refuse_bad_values_naming_the_field(kwargs, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_normalise_and_read_json():
    params = SamplingParams(max_tokens=np.int32(5), temperature=1, stop="w9", stop_token_ids=[np.int64(7)], seed=3)
    assert (params.max_tokens, params.temperature, params.stop, params.stop_token_ids) == (5, 1.0, ("w9",), (7,))
    assert type(params.max_tokens) is int and params.stop_ids([2]) == {2, 7}
    assert SamplingParams(ignore_eos=True, stop_token_ids=[7]).stop_ids([2]) == {7}
    assert SamplingParams.from_dict({"max_tokens": 4, "temperature": None}) == SamplingParams(max_tokens=4)
    with pytest.raises(RequestError, match="sampling_parameters: unknown key.*colour"):
        SamplingParams.from_dict({"colour": 1})
    assert SamplingParams.from_dict({"colour": 1, "top_p": 0.5}, strict=False) == SamplingParams(top_p=0.5)
    with pytest.raises(RequestError, match="request parameters: max_tokens must be >= 1"):
        SamplingParams.from_dict({"max_tokens": 0}, strict=False, source="request parameters")
    with pytest.raises(RequestError, match="sampling_parameters: expected a JSON object, got list"):
        SamplingParams.from_dict([1, 2])


def test_request_checked_against_an_engine():
    ok = Request([3, 4, 5]).checked(limits())
    assert ok.sampling.max_tokens == DEFAULT_MAX_TOKENS and ok.kv_budget is None
    assert Request([3]).checked(limits(max_new_tokens=8)).sampling.max_tokens == 8  # the default, capped
    assert Request([3], kv_budget=40).checked(limits()).kv_budget is None  # the built budget
    assert Request([3], kv_budget=20).checked(limits()).kv_budget == 20
    cases = [
        (Request([]), "the prompt is empty"),
        (Request(list(range(101))), "the prompt has 101 tokens, more than the engine's max input length 100"),
        (Request([3, 50]), r"prompt token ids must lie in \[0, 50\)"),
        (Request([3], SamplingParams(max_tokens=33)), r"max_tokens must lie in \[1, 32\] \(the engine's built maximum\)"),
        (Request([3], kv_budget=41), r"^kv_budget must lie in \[8, 40\] \(the window and the engine.s built budget\), got 41$"),
        (Request([3], kv_budget=7), r"kv_budget must lie in \[8, 40\]"),
        (Request([3], kv_budget=20.5), "kv_budget: expected an integer"),
        (Request([3], kv_budget=True), "kv_budget: expected an integer"),
    ]
    for request, message in cases:
        with pytest.raises(RequestError, match=message):
            request.checked(limits())
    with pytest.raises(RequestError, match="built without a runtime budget input; rebuild it"):
        Request([3], kv_budget=20).checked(limits(accepts_kv_budget=False))
    assert Request([3], kv_budget=40).checked(limits(accepts_kv_budget=False)).kv_budget is None
    with pytest.raises(RequestError, match="prompt_token_ids: every token id must be an integer"):
        Request([1.5])
    assert issubclass(RequestError, EngineError) and issubclass(RequestError, ValueError)


def test_the_budget_range_is_the_policys_one_rule():
    # streamingllm keeps sink_tokens + recent tokens: its smallest budget is max(window, sink_tokens), and the
    # request's range said so only in the policy; the scheduler used the window (a budget of 6 passed it)
    policy = KVPolicy("streamingllm", budget=40, window=4, sink_tokens=8)
    assert policy.min_budget == 8
    for budget in (4, 6, 7):
        with pytest.raises(RequestError, match=r"kv_budget must lie in \[8, 40\] \(the window or sink_tokens"):
            Request([3], kv_budget=budget).checked(limits(policy))
    assert Request([3], kv_budget=8).checked(limits(policy)).kv_budget == 8
    with pytest.raises(RequestError, match="policy 'full' keeps every entry"):
        Request([3], kv_budget=20).checked(limits(KVPolicy("full")))
    assert Request([3]).checked(limits(KVPolicy("full"))).kv_budget is None
    # with_budget applies the same range
    with pytest.raises(ValueError, match=r"kv_budget must lie in \[8, 40\]"):
        policy.with_budget(6)
    assert policy.with_budget(12).budget == 12 and KVPolicy("full").with_budget(12) == KVPolicy("full")


def test_a_checked_request_carries_its_int_budget_and_is_checked_once():
    mine = limits()
    checked = Request([3, 4], kv_budget=20).checked(mine)
    assert isinstance(checked, CheckedRequest) and checked.budget == 20 and checked.kv_budget == 20
    built = Request([3, 4]).checked(mine)
    assert built.budget == 40 and type(built.budget) is int and built.kv_budget is None  # the built budget, as an int
    assert checked.checked(mine) is checked  # checked once: its own engine takes it as it is
    # another engine's limits check it again, with that engine's rules
    with pytest.raises(RequestError, match="kv_budget"):
        checked.checked(limits(KVPolicy(budget=16, window=8)))
    with pytest.raises(RequestError, match=r"max_tokens must lie in \[1, 8\]"):  # its filled default is now its own
        checked.checked(limits(max_new_tokens=8))


# ------------------------------------------------------------------ TextBound: characters known before tokenising
def _byte_level_tokenizer(texts):
    """A small byte-level BPE (the family of SmolLM2, Llama 3, Qwen) trained here on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=core)


def test_a_text_bound_never_refuses_what_fits_and_refuses_what_cannot():
    """TextBound.of: the longest vocabulary entry bounds the characters of one token, so a text the bound refuses has
    more tokens than the max input length; one it passes is counted exactly afterwards."""
    import random

    from criticalkv.chat import max_token_chars
    from criticalkv.request import BODY_OVERHEAD_BYTES, JSON_BYTES_PER_CHAR, TextBound

    rng = random.Random(0)
    words = ["the", "secret", "passcode", "      ", "\n\n", "é", "日本", "🙂", "x" * 40, "=" * 30]
    texts = ["".join(rng.choice(words) + rng.choice([" ", "", "\t"]) for _ in range(rng.randint(1, 400)))
             for _ in range(60)]
    tokenizer = _byte_level_tokenizer(texts[:30])
    longest = max_token_chars(tokenizer)
    assert longest == max(len(t) for t in tokenizer.get_vocab())
    for text in texts:  # every token decodes to at most `longest` characters: the bound is sound on these texts
        ids = tokenizer(text)["input_ids"]
        for limit in (len(ids) - 1, len(ids), len(ids) + 1):
            bound = TextBound.of(tokenizer, max(limit, 1))
            try:
                bound.check(text)
            except RequestError:
                assert len(ids) > bound.max_input_len, (text, len(ids), bound)
    bound = TextBound(max_input_len=100, max_token_chars=5)
    assert bound.max_chars == 500 and bound.max_body_bytes == JSON_BYTES_PER_CHAR * 500 + BODY_OVERHEAD_BYTES
    bound.check("x" * 500)
    bound.check("x" * 300, None, "y" * 200)  # the texts of one request count together
    bound.check("x " * 500 + "\u3000" * 1000)  # 500 characters besides whitespace, which a tokenizer may drop
    with pytest.raises(RequestError, match=r"^the prompt: 501 characters \(whitespace apart\), more than the engine "
                                           r"takes: at most 500 \(its max input length 100 tokens x 5 characters"):
        bound.check("x" * 501)
    with pytest.raises(RequestError, match="^context: 900 characters"):
        bound.check("x" * 300, "y " * 300 + "z" * 300, what="context")


def test_the_word_tokenizer_of_the_serving_tests_is_bounded_by_its_longest_word():
    from criticalkv.chat import max_token_chars
    from export.tiny_engine import vocabulary, word_tokenizer

    assert max_token_chars(word_tokenizer()) == max(map(len, vocabulary())) == len("lighthouse")
