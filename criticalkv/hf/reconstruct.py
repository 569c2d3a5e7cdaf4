"""KVzip's context reconstruction on a transformers model: the per-entry scores of a context whose full cache is held.

``reconstruction_scores`` runs each chunk of ``criticalkv.methods.kvzip.reconstruction_chunks`` (the repeat prompt,
then the chunk's own tokens, teacher-forced) through the model over the context's full cache, at positions n, n + 1,
...; a forward hook on every attention module recomputes the chunk's post-RoPE queries from the module's input (as
``window_queries`` does for the window), scores the context entries with ``chunk_scores`` over the keys the cache
then holds (context + chunk) and cuts the cache back to the context's n entries, as kvpress's ``KVzipPress`` does. The
model's own attention runs over the whole cache; only the score's softmax runs over kvpress's subsampled keys.

``reconstruction_prompt(model, given)`` resolves the prompt's token ids: the ones given, else kvpress's prompts in the
tokenizer saved beside the model's weights, else the bare re-read (``ReconstructionPrompt()``, a random model's).
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache

from criticalkv.hf.cache import cache_kwargs, hook_cache
from criticalkv.hf.queries import window_queries
from criticalkv.methods.kvzip import ReconstructionChunk, ReconstructionPrompt, chunk_scores, reconstruction_chunks
from criticalkv.policy import KVPolicy


def reconstruction_prompt(model, given: ReconstructionPrompt | None = None) -> ReconstructionPrompt:
    """The reconstruction prompt of ``model``: ``given``, else kvpress's prompts in the tokenizer of the model's folder
    (``config._name_or_path``, as kvpress loads it), else ``ReconstructionPrompt()`` (no instruction)."""
    return given if given is not None else ReconstructionPrompt.of_model(model)


def cache_of(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], config) -> DynamicCache:
    """A ``DynamicCache`` holding every layer's full keys/values [1, H_kv, n, d_h] (the tensors are not modified)."""
    cache = DynamicCache(config=config)
    for i, (k, v) in enumerate(zip(keys, values)):
        cache.update(k, v, i)
    return cache


def local_cache(cache, chunk: ReconstructionChunk, config) -> tuple[DynamicCache, int, ReconstructionChunk]:
    """``kvzip_reread="chunk"``: a cache of the context's first ``chunk.sinks`` entries and the chunk's [start, end),
    copied from ``cache`` per layer (their keys keep their original positions' RoPE), its length, and the chunk in its
    coordinates (sinks first, then the chunk's entries)."""
    s, e, m = chunk.start, chunk.end, chunk.sinks
    keys = [torch.cat([layer.keys[:, :, :m], layer.keys[:, :, s:e]], dim=2) for layer in cache.layers]
    values = [torch.cat([layer.values[:, :, :m], layer.values[:, :, s:e]], dim=2) for layer in cache.layers]
    held = m + e - s
    return cache_of(keys, values, config), held, ReconstructionChunk(m, held, m, chunk.input_ids)


@torch.no_grad()
def reconstruction_scores(model, cache, context_ids: Sequence[int], policy: KVPolicy,
                          prompt: ReconstructionPrompt | None = None) -> list[torch.Tensor]:
    """KVzip's scores of a context: per layer [1, H_kv, n] fp32 (``criticalkv.methods.kvzip``).

    cache : a transformers cache holding exactly the context's n full entries per layer (a ``DynamicCache``; each
        chunk's entries are appended by the forward and cut off again, so it holds the same n entries afterwards)
    context_ids : the context's n token ids; policy : gives ``kvzip_chunk`` and ``sink_tokens``
    """
    ids = [int(t) for t in context_ids]
    n = len(ids)
    if cache.get_seq_length(0) != n:
        raise ValueError(f"the cache holds {cache.get_seq_length(0)} entries, the context {n} tokens")
    prompt = reconstruction_prompt(model, prompt)
    layers = model.model.layers
    config = model.config
    device = next(model.parameters()).device
    scores = [torch.zeros(1, config.num_key_value_heads, n, dtype=torch.float32, device=device) for _ in layers]
    for chunk in reconstruction_chunks(ids, policy.kvzip_chunk, policy.sink_tokens, prompt):
        r = len(chunk.input_ids)
        seen, held, cut = cache, n, chunk
        if policy.kvzip_reread == "chunk":  # the re-read sees the sinks and the chunk's entries only (original positions)
            seen, held, cut = local_cache(cache, chunk, config)

        def make_hook(idx, chunk=chunk, cut=cut, held=held, r=r):
            def hook(module, args, kwargs, output):
                hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                layer = hook_cache(kwargs).layers[idx]
                q = window_queries(module, hidden, kwargs["position_embeddings"], r)  # every reconstruction query
                scores[idx][:, :, chunk.start : chunk.end] = chunk_scores(q, layer.keys, held, cut)
                layer.keys, layer.values = layer.keys[:, :, :held], layer.values[:, :, :held]  # drop the chunk's entries

            return hook

        handles = [layer.self_attn.register_forward_hook(make_hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
        try:
            model(input_ids=torch.tensor([chunk.input_ids], device=device),
                  position_ids=torch.arange(n, n + r, device=device)[None], use_cache=True, logits_to_keep=1,
                  **cache_kwargs(model, seen))
        finally:
            for h in handles:
                h.remove()
    return scores
