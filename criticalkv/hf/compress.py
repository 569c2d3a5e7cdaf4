"""Prefill a transformers Llama-family model and compress every layer's cache as it is produced.

A forward hook on each attention module recomputes the post-RoPE queries of the last ``window``
prompt tokens (from the module's own q_proj and the rotary embedding it received; eager, SDPA or
any attention implementation alike), runs ``select_layer`` on that layer's full keys/values, keeps
the selected entries in a ``CompressedLayer`` and frees the full tensors, so at most one layer's
uncompressed K/V exists at a time. A model-level method (``layer-defensivekv``: the budget shared across layers)
selects after the last layer, with ``select_model`` over every layer; until then the full K/V of the prompt stays.
A method that ranks by a score computed outside the layer (``kvzip``) keeps the full cache until the prompt has been
re-read (``criticalkv.hf.reconstruct``), then selects every layer with its scores.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from criticalkv.hf.cache import CompressedKVCache, CompressedLayer, cache_kwargs, hook_cache
from criticalkv.hf.loading import check_supported
from criticalkv.hf.queries import window_queries
from criticalkv.hf.reconstruct import reconstruction_prompt, reconstruction_scores
from criticalkv.methods.kvzip import ReconstructionPrompt
from criticalkv.methods.surrogate import mask_opening, surrogate_of, uses_surrogate
from criticalkv.padding import left_padded_lengths
from criticalkv.policy import KVPolicy
from criticalkv.selection import LayerSelection, select_layer, select_model


@dataclass
class PrefillResult:
    """logits: [B, V] of each sequence's last prompt token; cache: the compressed cache;
    selections: one LayerSelection per layer (indices into the left-padded prompt axis)."""

    logits: torch.Tensor
    cache: CompressedKVCache
    selections: list[LayerSelection]
    prompt_lengths: torch.Tensor
    prefill_s: float
    selection_s: float
    kv_bytes_full: int
    kv_bytes_kept: int
    window_queries: list[torch.Tensor] = field(default_factory=list)
    scoring_s: float = 0.0  # kvzip: the context reconstruction that scored the entries (not in prefill_s)


def hooked_prefill(model, make_hook, input_ids, attention_mask, position_ids):
    """The prompt's forward pass with a fresh ``DynamicCache`` and ``make_hook(layer_idx)`` registered as a
    forward hook (with kwargs) on every layer's attention, removed afterwards; only the last logits."""
    layers = model.model.layers
    handles = [layer.self_attn.register_forward_hook(make_hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        return model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **cache_kwargs(model, DynamicCache(config=model.config)),
        )
    finally:
        for h in handles:
            h.remove()


def validate_prompt(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Check a [B, n] prompt batch; returns per-sequence lengths [B] (None when unpadded)."""
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids: expected a non-empty [batch, n] tensor, got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        return None
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask: shape {tuple(attention_mask.shape)} differs from input_ids")
    lengths = torch.from_numpy(left_padded_lengths(attention_mask.cpu().numpy())).to(attention_mask.device)
    if lengths.min() < 1:
        raise ValueError("attention_mask: a prompt in the batch is empty")
    return lengths


def model_rotation(model, policy: KVPolicy):
    """RoPE's rotation tables of ``model`` for a policy that reads them (``expected-attention``), else None."""
    if not policy.method.base.needs_rotation:
        return None
    inv_freq = model.model.rotary_emb.inv_freq.detach().float().cpu().numpy()
    return torch.from_numpy(policy.method.base.rotation_table(policy, inv_freq, 2 * len(inv_freq)))


@torch.no_grad()
def prefill_and_compress(
    model,
    input_ids: torch.Tensor,
    policy: KVPolicy,
    attention_mask: torch.Tensor | None = None,
    tail_capacity: int = 0,
    keep_window_queries: bool = False,
    reconstruction: ReconstructionPrompt | None = None,
) -> PrefillResult:
    """Run the prompt through ``model`` and return its compressed cache and last-token logits.

    input_ids [B, n] (left-padded with ``attention_mask`` [B, n] when lengths differ). Decoding then
    continues at absolute position ``prompt_lengths[b] + t`` (see ``criticalkv.hf.generate``).
    reconstruction : kvzip's repeat prompt (``criticalkv.hf.reconstruct.reconstruction_prompt``: default the model's
        tokenizer's); a kvzip policy scores one prompt at a time (B = 1)
    """
    check_supported(model.config)
    lengths = validate_prompt(input_ids, attention_mask)
    batch, n = input_ids.shape
    sliding = getattr(model.config, "sliding_window", None)
    if sliding is not None and getattr(model.config, "use_sliding_window", True) and n > sliding:
        raise ValueError(f"prompt of {n} tokens exceeds the model's sliding window ({sliding}); not supported")
    layers = model.model.layers
    num_layers = len(layers)
    w = min(policy.window, n)
    compressed: list[CompressedLayer | None] = [None] * num_layers
    selections: list[LayerSelection | None] = [None] * num_layers
    queries_kept: list[torch.Tensor] = []
    selection_s = 0.0
    full_bytes = 0
    model_level = policy.method.base.model_level and num_layers > 1
    rotation = model_rotation(model, policy)
    pending: list = []  # model-level methods: every layer's (queries, keys, values, o_proj) until the last layer
    reconstructs = policy.method.base.external_scores and policy.method.base.evicts
    if reconstructs and batch != 1:
        raise ValueError(f"{policy.name} re-reads each context alone: give one prompt (batch 1), got {batch}")
    held: dict = {}  # reconstructs: the prefill's cache, kept whole until the context has been re-read
    surrogate = surrogate_of(model) if uses_surrogate(policy) else None
    surrogate_scores: list = [None] * num_layers  # kvzip_score=surrogate: each layer's S_hat, from the prefill itself

    def compress_pending():
        """Select over every layer at once (the budget shared across layers), then free the full K/V."""
        sels = select_model(policy, [entry[:4] for entry in pending], lengths, rotation=rotation)
        for (q, keys, values, o, idx, cache_layer), sel in zip(pending, sels):
            compressed[idx] = CompressedLayer.from_selection(keys, values, sel, tail_capacity)
            selections[idx] = sel
            cache_layer.keys = cache_layer.values = keys.new_zeros(0)
        pending.clear()

    def make_hook(idx):
        def hook(module, args, kwargs, output):
            nonlocal selection_s, full_bytes
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cache_layer = hook_cache(kwargs).layers[idx]
            keys, values = cache_layer.keys, cache_layer.values
            start = time.perf_counter()
            q = window_queries(module, hidden, kwargs["position_embeddings"], w)
            valid = n * batch if lengths is None else int(lengths.sum())
            full_bytes += 2 * valid * keys.shape[1] * keys.shape[3] * keys.element_size()
            if keep_window_queries:
                queries_kept.append(q)
            if reconstructs:  # scored after the forward (the reconstruction reads every layer's full cache)
                held["cache"] = hook_cache(kwargs)
                if surrogate is not None:
                    surrogate_scores[idx] = surrogate.scores(idx, hidden)
                pending.append((q, keys, values, module.o_proj.weight, idx, cache_layer))
                selection_s += time.perf_counter() - start
                return
            if model_level:  # the full K/V of every layer stays until the last layer's (as during any prefill)
                pending.append((q, keys, values, module.o_proj.weight, idx, cache_layer))
                if idx == num_layers - 1:
                    compress_pending()
                selection_s += time.perf_counter() - start
                return
            sel = select_layer(policy, q, keys, values, module.o_proj.weight, idx, num_layers, lengths, rotation=rotation)
            compressed[idx] = CompressedLayer.from_selection(keys, values, sel, tail_capacity)
            selection_s += time.perf_counter() - start
            selections[idx] = sel
            cache_layer.keys = cache_layer.values = keys.new_zeros(0)  # free the full K/V now

        return hook

    if attention_mask is None:
        position_ids = torch.arange(n, device=input_ids.device)[None].expand(batch, n)
    else:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    start = time.perf_counter()
    out = hooked_prefill(model, make_hook, input_ids, attention_mask, position_ids)
    prefill_s = time.perf_counter() - start
    scoring_s = 0.0
    if reconstructs:
        start = time.perf_counter()
        if surrogate is not None:  # no re-read: the chat template's opening beyond the sinks scores 0, as KVzip's
            scores = mask_opening(surrogate_scores, reconstruction_prompt(model, reconstruction), input_ids[0].tolist(),
                                  policy.sink_tokens)
        else:
            scores = reconstruction_scores(model, held["cache"], input_ids[0].tolist(), policy, reconstruction)
        scoring_s = time.perf_counter() - start
        start = time.perf_counter()
        # one selection over every layer (the model's budget, layer-kvzip) or layer by layer
        sels = select_model(policy, [entry[:4] for entry in pending], lengths, rotation=rotation, scores=scores)
        for (q, keys, values, o, idx, cache_layer), sel in zip(pending, sels):
            compressed[idx] = CompressedLayer.from_selection(keys, values, sel, tail_capacity)
            selections[idx] = sel
            cache_layer.keys = cache_layer.values = keys.new_zeros(0)
        pending.clear()
        selection_s += time.perf_counter() - start
    cache = CompressedKVCache(compressed, seen_tokens=n)
    prompt_lengths = torch.full((batch,), n) if lengths is None else lengths.cpu()
    return PrefillResult(
        logits=out.logits[:, -1],
        cache=cache,
        selections=selections,
        prompt_lengths=prompt_lengths,
        prefill_s=prefill_s,
        selection_s=selection_s,
        kv_bytes_full=full_bytes,
        kv_bytes_kept=cache.kv_nbytes(),
        window_queries=queries_kept,
        scoring_s=scoring_s,
    )
