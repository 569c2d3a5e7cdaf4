"""Compress a context without its question, then ask (the serving context cache's operation, PyTorch path)."""

import pytest
import torch

from criticalkv import KVPolicy
from criticalkv.hf import generate
from hf.conftest import tiny_model
from hf.test_integration import prompt, reference_masked_decode


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_full_context_then_question_is_transformers_generate_on_both(model_type):
    # the full cache is lossless: context, then question through the cache == one prompt of both (transformers)
    model = tiny_model(model_type)
    context, question = prompt(90, seed=5), prompt(7, seed=6)
    both = torch.cat([context, question], dim=1)
    ref = model.generate(both, max_new_tokens=12, do_sample=False)[0, both.shape[1]:].tolist()
    out = generate(model, context, KVPolicy("full"), max_new_tokens=12, question_ids=question)
    assert out.tokens[0] == ref and out.prompt_lengths == [90]


@pytest.mark.parametrize("name", ["snapkv", "criticalkv", "ada-criticalkv", "streamingllm", "defensivekv"])
def test_compressed_context_then_question_equals_masked_full_attention(name):
    # eviction on the context alone (its own last tokens are the window); the question and the answer then attend
    # to the kept context entries of each head and to each other: exactly the masked full-attention model
    model = tiny_model()
    context, question = prompt(120, seed=3), prompt(9, seed=4)
    out = generate(model, context, KVPolicy(name, budget=40, window=8), max_new_tokens=8, question_ids=question)
    assert out.tokens[0] == reference_masked_decode(model, context, out.prefill.selections, 8, question)
    # the selection saw no question: it is the context's own selection
    alone = generate(model, context, KVPolicy(name, budget=40, window=8), max_new_tokens=1)
    for a, b in zip(out.prefill.selections, alone.prefill.selections):
        assert torch.equal(a.indices, b.indices)


def test_question_errors(llama=None):
    model = tiny_model()
    with pytest.raises(ValueError, match=r"question_ids: expected \[B, q\]"):
        generate(model, prompt(30), KVPolicy("full"), question_ids=torch.zeros(1, 0, dtype=torch.long))
