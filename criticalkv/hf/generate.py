"""Generation with a compressed KV cache on a transformers model (the PyTorch path)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from criticalkv.hf.cache import cache_kwargs, packed_decoding
from criticalkv.hf.compress import PrefillResult, prefill_and_compress
from criticalkv.methods.kvzip import ReconstructionPrompt
from criticalkv.policy import KVPolicy
from criticalkv.request import SamplingParams
from criticalkv.sampling import Sampler, decode_loop


@dataclass
class GenerationOutput:
    """tokens: generated ids per sequence (stop token included if hit); timings in seconds."""

    tokens: list[list[int]]
    prompt_lengths: list[int]
    prefill_s: float
    selection_s: float
    decode_s_per_token: float
    kv_bytes_full: int
    kv_bytes_kept: int
    prefill: PrefillResult

    def timings(self) -> dict:
        return {
            "prefill_s": self.prefill_s,
            "selection_s": self.selection_s,
            "decode_s_per_token": self.decode_s_per_token,
        }


@torch.no_grad()
def extend_cache(model, cache, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Run ``token_ids`` [B, q] through a compressed ``cache`` at absolute positions ``positions[b] + j``: the q new
    tokens attend to every kept entry and causally to each other (``packed_attention``), and their K/V join the
    cache. Returns the last new token's logits [B, V] (fp32). Call inside ``packed_decoding(model)``."""
    batch, q = token_ids.shape
    dummy_mask = torch.zeros(batch, 1, q, 1, dtype=model.dtype, device=token_ids.device)  # unused by packed attention
    out = model(
        input_ids=token_ids,
        position_ids=positions.to(token_ids.device)[:, None] + torch.arange(q, device=token_ids.device)[None, :],
        attention_mask=dummy_mask,
        use_cache=True,
        **cache_kwargs(model, cache),
    )
    return out.logits[:, -1].float()


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    policy: KVPolicy,
    max_new_tokens: int = 64,
    attention_mask: torch.Tensor | None = None,
    stop_token_ids: Sequence[int] = (),
    sampling: SamplingParams | None = None,
    on_tokens: Callable[[np.ndarray], None] | None = None,
    question_ids: torch.Tensor | None = None,
    reconstruction: ReconstructionPrompt | None = None,
) -> GenerationOutput:
    """Prefill, compress the cache with ``policy``, then decode up to ``max_new_tokens`` tokens.

    input_ids [B, n] (left-padded with attention_mask [B, n] for prompts of different lengths).
    The token after prompt b sits at absolute position ``len_b + t`` (RoPE), whatever the cache holds.
    ``on_tokens`` receives each step's token ids [B] (streaming).

    question_ids [B, q]: compress ``input_ids`` as a context first, without the question (question-agnostic: the
    selection's window is the context's last tokens, as the serving context cache does), then run the question
    through the compressed cache (``extend_cache``) and answer it: the first token comes from the question's last
    logits and decoding continues at ``len_b + q + t``.

    reconstruction : kvzip's repeat prompt (``prefill_and_compress``; default: from the model's tokenizer)
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    q = 0
    if question_ids is not None:
        if question_ids.dim() != 2 or question_ids.shape[0] != input_ids.shape[0] or question_ids.shape[1] == 0:
            raise ValueError(f"question_ids: expected [B, q] with q >= 1 and the context's B = {input_ids.shape[0]}, "
                             f"got shape {tuple(question_ids.shape)}")
        q = question_ids.shape[1]
    sampler = Sampler(sampling)
    pre = prefill_and_compress(model, input_ids, policy, attention_mask, tail_capacity=q + max_new_tokens,
                               reconstruction=reconstruction)
    batch = input_ids.shape[0]
    positions = pre.prompt_lengths.to(input_ids.device)
    logits = pre.logits
    dummy_mask = torch.zeros(batch, 1, 1, 1, dtype=model.dtype, device=input_ids.device)  # unused by the packed attention

    def step(tokens, t):
        out = model(
            input_ids=torch.as_tensor(tokens, device=input_ids.device)[:, None],
            position_ids=(positions + t)[:, None],
            attention_mask=dummy_mask,
            use_cache=True,
            **cache_kwargs(model, pre.cache),
        )
        return out.logits[:, -1].float().cpu().numpy()

    with packed_decoding(model):
        if question_ids is not None:
            logits = extend_cache(model, pre.cache, question_ids.to(input_ids.device), positions)
            positions = positions + q
        first = sampler(logits.float().cpu().numpy())
        generated, steps, decode_s = decode_loop(step, first, max_new_tokens, stop_token_ids, sampler, on_tokens)
    return GenerationOutput(
        tokens=generated.tokens,
        prompt_lengths=pre.prompt_lengths.tolist(),
        prefill_s=pre.prefill_s,
        selection_s=pre.selection_s,
        decode_s_per_token=decode_s / steps if steps else 0.0,
        kv_bytes_full=pre.kv_bytes_full,
        kv_bytes_kept=pre.kv_bytes_kept,
        prefill=pre,
    )
