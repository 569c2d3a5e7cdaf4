"""One prefill per prompt, shared by every policy and budget of an evaluation.

``criticalkv.hf.generate`` prefills the prompt once per policy. The prompt's forward pass does not
depend on the policy (each layer attends over its full cache; compression happens after the layer
ran), so an evaluation of P policies x B budgets can prefill once, keep every layer's full keys,
values and window queries, and then for each policy only select, gather and decode. This module does
that with the same public pieces ``prefill_and_compress`` and ``generate`` use (``window_queries``,
``CompressedLayer``, ``CompressedKVCache``, ``packed_decoding``, ``Sampler``) and the same calls in
the same order, so the generated tokens are identical to ``criticalkv.hf.generate``:
``tests/eval/test_eval_engine.py`` checks this for every policy of the shared table on a tiny model, and
``--verify N`` re-checks it on the first N real prompts of a run (and refuses to go on otherwise).

The selection's scores do not depend on the budget either. ``ScoreBank`` holds a ``ScoreMemo`` of the
prompt, and ``select_from_bank`` is ``select_layer`` itself with that memo: each layer's window
attention, pooled scores and projected-value norms are computed once for every policy and budget.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from criticalkv.hf.cache import CompressedKVCache, CompressedLayer, cache_kwargs, hook_cache, packed_decoding
from criticalkv.hf.compress import hooked_prefill, window_queries
from criticalkv.hf.generate import extend_cache, generate
from criticalkv.hf.loading import check_supported
from criticalkv.hf.reconstruct import cache_of, reconstruction_prompt, reconstruction_scores
from criticalkv.methods.kvzip import ReconstructionPrompt
from criticalkv.methods.surrogate import mask_opening, surrogate_of, uses_surrogate
from criticalkv.policy import KVPolicy
from criticalkv.sampling import Sampler, decode_loop
from criticalkv.selection import LayerScores, LayerSelection, ScoreMemo, layer_scores, select_layer, select_model


@dataclass
class SharedPrefill:
    """Everything the policies need from one prompt's forward pass (batch 1, no padding).

    logits : [1, V] of the last prompt token
    keys, values : per layer [1, H_kv, n, d_h] post-RoPE keys and values (the full cache)
    queries : window size w -> per layer [1, H, w, d_h] post-RoPE queries of the last w tokens
    o_proj : per layer the attention's ``o_proj.weight`` [d, H * d_h]
    """

    input_ids: torch.Tensor
    logits: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    queries: dict[int, list[torch.Tensor]]
    o_proj: list[torch.Tensor]
    prefill_s: float
    inv_freq: "np.ndarray | None" = None  # RoPE's [d_h / 2] (expected-attention reads it)
    model: object = field(default=None, repr=False)  # the model that ran it (kvzip re-reads the prompt through it)
    #: per layer [1, n, d] the attention's input (``shared_prefill(keep_hidden=True)``: a kvzip surrogate reads it)
    hidden: list | None = field(default=None, repr=False)

    @property
    def n(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_layers(self) -> int:
        return len(self.keys)


def _capture_hook(keys: list, values: list, queries: dict, hidden_states: list | None,
                  before: SharedPrefill | None = None):
    """``make_hook(idx)`` for the attention layers of a prefill that fills ``keys``/``values`` (the layer's cache after
    the forward), ``queries[w]`` (the last w post-RoPE queries) and ``hidden_states`` (the attention's input, when not
    None). With ``before`` the forward runs only tokens after ``before``'s prompt: the hidden states are appended to
    its, and a window longer than the new tokens takes its first queries from ``before``'s."""

    def make_hook(idx):
        def hook(module, args, kwargs, output):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cache_layer = hook_cache(kwargs).layers[idx]
            keys[idx], values[idx] = cache_layer.keys, cache_layer.values
            q = hidden.shape[1]
            if hidden_states is not None:
                hidden_states[idx] = (hidden.detach() if before is None
                                      else torch.cat([before.hidden[idx], hidden.detach()], dim=1))
            for w in queries:
                own = window_queries(module, hidden, kwargs["position_embeddings"], min(w, q))
                if before is not None and w > q:  # the window reaches back into the document: its queries, post-RoPE
                    held = min(v for v in before.queries if v >= w - q)
                    own = torch.cat([before.queries[held][idx][:, :, held - (w - q):], own], dim=2)
                queries[w][idx] = own

        return hook

    return make_hook


@torch.no_grad()
def shared_prefill(model, input_ids: torch.Tensor, windows: Sequence[int], keep_hidden: bool = False) -> SharedPrefill:
    """Run the prompt [1, n] once with a full ``DynamicCache``; keep every layer's K/V and the
    window queries for each window size in ``windows`` (as ``prefill_and_compress`` computes them), and with
    ``keep_hidden`` every layer's attention input (``kvzip_score=surrogate`` scores from it)."""
    check_supported(model.config)
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids: expected one non-empty prompt [1, n], got shape {tuple(input_ids.shape)}")
    n = input_ids.shape[1]
    layers = model.model.layers
    sizes = sorted({min(w, n) for w in windows})
    keys: list = [None] * len(layers)
    values: list = [None] * len(layers)
    queries: dict[int, list] = {w: [None] * len(layers) for w in sizes}
    hidden_states: list | None = [None] * len(layers) if keep_hidden else None

    make_hook = _capture_hook(keys, values, queries, hidden_states)
    position_ids = torch.arange(n, device=input_ids.device)[None]
    start = time.perf_counter()
    out = hooked_prefill(model, make_hook, input_ids, None, position_ids)
    return SharedPrefill(
        input_ids=input_ids,
        logits=out.logits[:, -1],
        keys=keys,
        values=values,
        queries=queries,
        o_proj=[layer.self_attn.o_proj.weight for layer in layers],
        prefill_s=time.perf_counter() - start,
        inv_freq=model.model.rotary_emb.inv_freq.detach().float().cpu().numpy(),
        model=model,
        hidden=hidden_states,
    )


@torch.no_grad()
def extend_shared_prefill(model, prefill: SharedPrefill, question_ids: torch.Tensor,
                          windows: Sequence[int] | None = None, keep_hidden: bool | None = None) -> SharedPrefill:
    """``shared_prefill`` of the prompt ``prefill.input_ids + question_ids`` [1, n + q], from ``prefill``'s full cache:
    only the q new tokens run through the model (at positions n..n+q-1, attending to the n full entries and causally to
    each other), so one prefill of a document serves every question asked of it (question-aware: the question inside
    the window). The same tensors as one prefill of the whole prompt, up to float rounding
    (``tests/eval/test_shared_context.py`` checks it, and the kept entries and answers on the bundled model).

    windows : the window sizes to keep queries for (default: ``prefill``'s); a window longer than q takes its first
        queries from ``prefill``'s (a window of ``prefill`` at least that long must have been kept)
    keep_hidden : keep every layer's attention input over the whole prompt (default: when ``prefill`` kept them)
    """
    from transformers import DynamicCache

    if question_ids.dim() != 2 or question_ids.shape[0] != 1 or question_ids.shape[1] == 0:
        raise ValueError(f"question_ids: expected [1, q] with q >= 1, got shape {tuple(question_ids.shape)}")
    n, q = prefill.n, question_ids.shape[1]
    keep_hidden = prefill.hidden is not None if keep_hidden is None else keep_hidden
    if keep_hidden and prefill.hidden is None:
        raise ValueError("keep_hidden: the document's prefill kept no hidden states (shared_prefill(keep_hidden=True))")
    layers = model.model.layers
    total = n + q
    sizes = sorted({min(w, total) for w in (windows if windows is not None else prefill.queries)})
    for w in sizes:
        if w > q and not any(v >= w - q for v in prefill.queries):
            raise ValueError(f"window {w}: the document's prefill kept window queries for {sorted(prefill.queries)} only")
    cache = DynamicCache(config=model.config)
    for idx, (k, v) in enumerate(zip(prefill.keys, prefill.values)):
        cache.update(k, v, idx)  # the document's tensors, uncopied: the question's forward concatenates new ones
    keys: list = [None] * len(layers)
    values: list = [None] * len(layers)
    queries: dict[int, list] = {w: [None] * len(layers) for w in sizes}
    hidden_states: list | None = [None] * len(layers) if keep_hidden else None

    make_hook = _capture_hook(keys, values, queries, hidden_states, prefill)
    handles = [layer.self_attn.register_forward_hook(make_hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    start = time.perf_counter()
    try:
        out = model(input_ids=question_ids.to(prefill.input_ids.device),
                    position_ids=torch.arange(n, total, device=prefill.input_ids.device)[None],
                    use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
    finally:
        for h in handles:
            h.remove()
    return SharedPrefill(
        input_ids=torch.cat([prefill.input_ids, question_ids.to(prefill.input_ids.device)], dim=1),
        logits=out.logits[:, -1],
        keys=keys,
        values=values,
        queries=queries,
        o_proj=prefill.o_proj,
        prefill_s=time.perf_counter() - start,
        inv_freq=prefill.inv_freq,
        model=model,
        hidden=hidden_states,
    )


class ScoreBank:
    """One prompt's memoised score inputs, shared by every policy and budget of an evaluation.

    Selection is ``criticalkv.selection.select_layer`` itself with this bank's ``ScoreMemo``: each layer's
    window attention, pooled scores and projected-value norms are computed once and reused.
    """

    def __init__(self, prefill: SharedPrefill, model=None, reconstruction: ReconstructionPrompt | None = None):
        """``model`` re-reads the prompt for a policy whose score comes from a context reconstruction (kvzip), with
        ``reconstruction``'s prompt (default: the model's tokenizer's, ``criticalkv.hf.reconstruct``)."""
        self.prefill = prefill
        self.memo = ScoreMemo()
        self.model = model if model is not None else prefill.model
        self.reconstruction = reconstruction

    def external_scores(self, policy: KVPolicy) -> list[torch.Tensor] | None:
        """Per layer [1, H_kv, n] the scores of a method that ranks by a context reconstruction (kvzip), computed once
        per prompt and scoring knobs (their time counts in ``seconds``); None for other methods, and for a bank
        without a model (over given tensors: the method's own fallback, as ``select_layer`` without scores)."""
        if not policy.method.base.external_scores or self.model is None:
            return None
        p = self.prefill
        if uses_surrogate(policy):  # S_hat of the prefill's hidden states (no re-read)
            if p.hidden is None:
                raise ValueError(f"{policy.name}:kvzip_score=surrogate scores from the prefill's hidden states: run "
                                 "shared_prefill(keep_hidden=True)")

            def compute():
                scores = [surrogate_of(self.model).scores(i, h) for i, h in enumerate(p.hidden)]
                return mask_opening(scores, reconstruction_prompt(self.model, self.reconstruction),
                                    p.input_ids[0].tolist(), policy.sink_tokens)

            key = ("surrogate", policy.sink_tokens)
        else:
            def compute():
                cache = cache_of(p.keys, p.values, self.model.config)
                return reconstruction_scores(self.model, cache, p.input_ids[0].tolist(), policy, self.reconstruction)

            key = ("reconstruction", policy.kvzip_chunk, policy.sink_tokens, policy.kvzip_reread)
        if key in self.memo.entries:
            return self.memo.entries[key]
        start = time.perf_counter()
        scores = self.memo.get(key, compute)
        self.memo.seconds += time.perf_counter() - start
        return scores

    def rotation(self, policy: KVPolicy):
        """RoPE's rotation tables for a policy that reads them (``expected-attention``), else None."""
        if not policy.method.base.needs_rotation or self.prefill.inv_freq is None:
            return None  # (select_layer then assumes RoPE's default angles)
        inv_freq = self.prefill.inv_freq
        return torch.from_numpy(policy.method.base.rotation_table(policy, inv_freq, 2 * len(inv_freq)))

    @property
    def seconds(self) -> float:
        """Time spent computing scores so far (memoised ones count once)."""
        return self.memo.seconds

    def layer_inputs(self, policy: KVPolicy, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(queries [1, H, w, d_h], keys, values [1, H_kv, n, d_h], o_proj [d, H * d_h]) of ``layer`` for ``policy``."""
        w = min(policy.window, self.prefill.n)
        p = self.prefill
        if w in p.queries:
            q = p.queries[w][layer]
        else:  # a method that does not score reads no queries: zeros of the shape select_layer checks
            some = next(iter(p.queries.values()))[layer]
            if policy.method.base.scored:
                raise ValueError(f"window {w}: the shared prefill kept window queries for {sorted(p.queries)} only")
            q = some.new_zeros(some.shape[0], some.shape[1], w, some.shape[3])
        return q, p.keys[layer], p.values[layer], p.o_proj[layer]

    def scores(self, policy: KVPolicy, layer: int) -> LayerScores:
        """``criticalkv.selection.layer_scores`` of ``policy`` for ``layer`` (memoised)."""
        q, k, v, o = self.layer_inputs(policy, layer)
        valid_start = torch.zeros(k.shape[0], dtype=torch.int64, device=k.device)
        external = self.external_scores(policy)
        return layer_scores(policy, q, k, v, o, valid_start, self.memo, layer, self.rotation(policy),
                            None if external is None else external[layer])


def select_from_bank(policy: KVPolicy, bank: ScoreBank, layer: int) -> LayerSelection:
    """``select_layer(policy, ...)`` for layer ``layer`` of the bank's (unpadded, batch 1) prompt, memoised scores."""
    q, k, v, o = bank.layer_inputs(policy, layer)
    external = bank.external_scores(policy)
    return select_layer(policy, q, k, v, o, layer, bank.prefill.num_layers, memo=bank.memo,
                        rotation=bank.rotation(policy), scores=None if external is None else external[layer])


def select_all_layers(policy: KVPolicy, bank: ScoreBank) -> list[LayerSelection]:
    """``select_model`` over the bank's layers (memoised scores): every layer's selection, model-level methods
    (the budget shared across layers) included."""
    layers = [bank.layer_inputs(policy, layer) for layer in range(bank.prefill.num_layers)]
    return select_model(policy, layers, memo=bank.memo, rotation=bank.rotation(policy), scores=bank.external_scores(policy))


@dataclass
class Decoded:
    """Greedy decoding from one policy's compressed cache."""

    tokens: list[int]
    decode_s: float
    steps: int
    cache: CompressedKVCache
    extras: dict = field(default_factory=dict)


@torch.no_grad()
def decode(
    model,
    prefill: SharedPrefill,
    selections: Sequence[LayerSelection],
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    first_step: Callable[[], object] | None = None,
    force_first_step: bool = False,
    question_ids: torch.Tensor | None = None,
) -> Decoded:
    """``criticalkv.hf.generate``'s greedy decode loop on a cache built from ``prefill`` and ``selections``.

    ``first_step`` is a context-manager factory entered around the first decoding forward (the token
    after the prompt, at position n): the perturbation analysis records hidden states there.
    ``force_first_step`` runs that forward even when no second token is wanted (``max_new_tokens``
    1 or a stop token first); its output is then not part of ``tokens``.
    ``question_ids`` [1, q]: the prefill was a context compressed without its question; the question runs through
    the compressed cache first (``criticalkv.hf.generate``'s ``question_ids``) and the answer follows it.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    q = 0 if question_ids is None else question_ids.shape[1]
    layers = [
        CompressedLayer.from_selection(k, v, sel, q + max_new_tokens)
        for k, v, sel in zip(prefill.keys, prefill.values, selections)
    ]
    cache = CompressedKVCache(layers, seen_tokens=prefill.n)
    sampler = Sampler(None)
    device = prefill.input_ids.device
    dummy_mask = torch.zeros(1, 1, 1, 1, dtype=model.dtype, device=device)

    def step(tokens, t):
        ctx = first_step() if (t == 0 and first_step is not None) else contextlib.nullcontext()
        with ctx:
            out = model(
                input_ids=torch.as_tensor(tokens, device=device)[:, None],
                position_ids=torch.full((1, 1), prefill.n + q + t, device=device),
                attention_mask=dummy_mask,
                use_cache=True,
                **cache_kwargs(model, cache),
            )
        return out.logits[:, -1].float().cpu().numpy()

    with packed_decoding(model):
        logits = prefill.logits
        if question_ids is not None:
            logits = extend_cache(model, cache, question_ids.to(device), torch.full((1,), prefill.n, device=device))
        first = sampler(logits.float().cpu().numpy())
        generated, steps, seconds = decode_loop(step, first, max_new_tokens, stop_token_ids, sampler,
                                                force_first_step=force_first_step)
    # the first answer token's logits [1, V] (fp32): what the fidelity to the full cache compares
    return Decoded(tokens=generated.tokens[0], decode_s=seconds, steps=steps, cache=cache,
                   extras={"first_logits": logits.float()})


def kept_fraction(selections: Sequence[LayerSelection], n: int) -> float:
    """Kept prompt entries / all prompt entries, over every layer and KV head."""
    kept = sum(int(s.lengths.sum()) for s in selections)
    total = sum(s.lengths.numel() for s in selections) * n
    return kept / total


def tokens_equal_generate(model, prefill: SharedPrefill, policy: KVPolicy, tokens: list[int], max_new_tokens: int,
                          stop_token_ids: Sequence[int], question_ids: torch.Tensor | None = None,
                          reconstruction: ReconstructionPrompt | None = None) -> tuple[bool, list[int]]:
    """Re-run ``criticalkv.hf.generate`` for one policy and compare its tokens with ``tokens``."""
    ref = generate(model, prefill.input_ids, policy, max_new_tokens, stop_token_ids=stop_token_ids,
                   question_ids=question_ids, reconstruction=reconstruction).tokens[0]
    return ref == tokens, ref


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy()
