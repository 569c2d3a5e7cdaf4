import pytest
import torch


def tiny_model(model_type="llama", attn="sdpa", seed=0, layers=3):
    """A randomly initialised Llama-family causal LM with GQA (6 query heads, 2 KV heads)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        model_type, vocab_size=128, hidden_size=96, intermediate_size=160, num_hidden_layers=layers,
        num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module")
def llama():
    return tiny_model()
