"""A tiny random GQA Llama with a small byte-level BPE tokenizer trained here, saved as an HF folder."""

import pytest
import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(vocab_size=2000):
    """A real byte-level BPE (merges across words, digits as bytes) trained on the haystack in ~0.1 s."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from criticalkv.eval.haystack import haystack_sentences

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(haystack_sentences(), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", bos_token="<|im_start|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_llama(vocab_size, layers=2, seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        "llama", vocab_size=vocab_size, hidden_size=96, intermediate_size=160, num_hidden_layers=layers,
        num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        eos_token_id=1, bos_token_id=0, pad_token_id=None, tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def model(tokenizer):
    return tiny_llama(len(tokenizer))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, tokenizer, model):
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread avoids oversubscription on shared CI cores (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
