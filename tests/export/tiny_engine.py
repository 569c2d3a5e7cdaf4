"""Tiny random Llama-family checkpoints on disk (with a word-level tokenizer) and engines built from them."""

from pathlib import Path

from hf.conftest import tiny_model

VOCAB = 128


def vocabulary() -> list[str]:
    """128 words: [UNK], </s>, the words of build_engine's smoke-test text, then w<i> fillers."""
    from tokenizers import pre_tokenizers

    from criticalkv.build import SMOKE_TEXT

    smoke = dict.fromkeys(w for w, _ in pre_tokenizers.Whitespace().pre_tokenize_str(SMOKE_TEXT))
    words = ["[UNK]", "</s>", *smoke]
    return words + [f"w{i}" for i in range(len(words), VOCAB)]


def word_tokenizer():
    """A 128-word tokenizer (``vocabulary()``, id = position) with a minimal chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(vocabulary())}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", eos_token="</s>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tokenizer


def save_tiny_checkpoint(folder: Path, model_type: str = "llama", seed: int = 0) -> Path:
    """``tiny_model(model_type)`` + ``word_tokenizer()`` saved as a Hugging Face folder."""
    model = tiny_model(model_type, seed=seed)
    model.save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return folder


def words(ids) -> str:
    """Text that the word tokenizer turns back into ``ids``."""
    vocab = vocabulary()
    return " ".join(vocab[i] for i in ids)


def export_tiny_engine(model, policy, folder: Path, tokenizer=None, context_policy=None, **limits) -> Path:
    """An engine directory for an in-memory model (export + validation + manifest; no smoke test); ``context_policy``:
    the policy its contexts are compressed with (none: ``policy``)."""
    from criticalkv.export import BuildConfig
    from criticalkv.build import export_engine
    from criticalkv.runtime.manifest import write_manifest

    config = BuildConfig(**{"max_input_len": 256, "max_new_tokens": 32, "max_batch_size": 3, "attention_chunk": 32, **limits})
    _, content = export_engine(model, policy, folder, config, tokenizer, model_name="tiny", context_policy=context_policy)
    write_manifest(folder, content)
    return folder


#: The backends the engine tests that are cheap to repeat run on: ONNX Runtime, and torch (the same engine directory
#: through the model's own layers and the selection op, given the in-memory model it was exported from).
ENGINE_BACKENDS = ("onnxruntime", "torch")


def backends_for(policy) -> tuple[str, ...]:
    """The ENGINE_BACKENDS that run ``policy``: every one runs every policy (a method's phases included)."""
    return ENGINE_BACKENDS


def load_engine(folder: Path, backend: str, model, **options):
    """``Engine.load(folder, backend)``; the torch backend gets ``model`` (the directory names no checkpoint)."""
    from criticalkv.runtime import Engine

    if backend == "torch":
        options["model"] = model
    return Engine.load(folder, backend=backend, **options)


def padded(prompts):
    """A left-padded batch of token-id lists: ids, attention mask and position ids, [B, n] int64 each (pad 0)."""
    import numpy as np

    n = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), n), np.int64)
    mask = np.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, n - len(p):], mask[row, n - len(p):] = p, 1
    return ids, mask, np.clip(np.cumsum(mask, axis=1) - 1, 0, None)

