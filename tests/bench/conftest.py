import pytest


@pytest.fixture(scope="session")
def tokenizer():
    """The evaluations' tiny byte-level BPE trained on the haystack (tests/eval/conftest.py)."""
    from eval.conftest import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture(scope="session")
def bos_tokenizer():
    """The same tokenizer, adding a BOS token in front of every text (as Llama tokenizers do)."""
    from tokenizers.processors import TemplateProcessing

    from eval.conftest import tiny_tokenizer

    tok = tiny_tokenizer()
    bos = tok.convert_tokens_to_ids("<|im_start|>")
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    return tok
