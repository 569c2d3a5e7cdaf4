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

The selection's scores do not depend on the budget either. ``ScoreBank`` computes each layer's
window attention, pooled scores and projected-value norms once and hands every policy the
``LayerScores`` that ``criticalkv.selection.layer_scores`` would compute (bit-identical: the same
functions on the same tensors), and ``select_from_bank`` is ``select_layer`` for one unpadded prompt
on top of them (tested equal to ``select_layer`` for every policy, budget and window).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from criticalkv.hf.cache import CompressedKVCache, CompressedLayer, packed_decoding
from criticalkv.hf.compress import hooked_prefill, window_queries
from criticalkv.hf.loading import check_supported
from criticalkv.policy import KVPolicy
from criticalkv.sampling import Sampler
from criticalkv.selection import (
    LayerScores,
    LayerSelection,
    layer_selectable_budget,
    mask_to_indices,
    max_pool_positions,
    value_projection_norms,
    window_attention,
)
from criticalkv.selection.layer import choose_older_tokens


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

    @property
    def n(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_layers(self) -> int:
        return len(self.keys)


@torch.no_grad()
def shared_prefill(model, input_ids: torch.Tensor, windows: Sequence[int]) -> SharedPrefill:
    """Run the prompt [1, n] once with a full ``DynamicCache``; keep every layer's K/V and the
    window queries for each window size in ``windows`` (as ``prefill_and_compress`` computes them)."""
    check_supported(model.config)
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids: expected one non-empty prompt [1, n], got shape {tuple(input_ids.shape)}")
    n = input_ids.shape[1]
    layers = model.model.layers
    sizes = sorted({min(w, n) for w in windows})
    keys: list = [None] * len(layers)
    values: list = [None] * len(layers)
    queries: dict[int, list] = {w: [None] * len(layers) for w in sizes}

    def make_hook(idx):
        def hook(module, args, kwargs, output):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cache_layer = kwargs["past_key_values"].layers[idx]
            keys[idx], values[idx] = cache_layer.keys, cache_layer.values
            for w in sizes:
                queries[w][idx] = window_queries(module, hidden, kwargs["position_embeddings"], w)

        return hook

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
    )


class ScoreBank:
    """Budget-independent per-layer scores of one prompt, computed once and shared by every policy.

    ``scores(policy, layer)`` returns exactly ``criticalkv.selection.layer_scores(policy, ...)`` for
    the unpadded prompt, built from the same functions on the same tensors in the same order.
    """

    def __init__(self, prefill: SharedPrefill):
        self.prefill = prefill
        self._raw: dict = {}
        self._pooled: dict = {}
        self._norms: dict = {}
        self._result: dict = {}
        self.seconds = 0.0

    def _probs_raw(self, layer: int, w: int, g: int):
        key = (layer, w, g)
        if key not in self._raw:
            q = self.prefill.queries[w][layer]
            k_all = self.prefill.keys[layer]
            batch, num_heads = q.shape[:2]
            num_kv_heads, n = k_all.shape[1], k_all.shape[2]
            group = num_heads // num_kv_heads
            m = n - w
            k = k_all[:, g : g + 1].expand(batch, group, n, k_all.shape[-1])
            valid_start = torch.zeros(batch, dtype=torch.int64, device=k_all.device)
            probs = window_attention(q[:, g * group : (g + 1) * group], k, valid_start)[..., :m]  # [B, G, w, m]
            self._raw[key] = (probs, probs.mean(dim=2))
        return self._raw[key]

    def _pooled_g(self, layer: int, w: int, kernel: int, g: int):
        key = (layer, w, kernel, g)
        if key not in self._pooled:
            self._pooled[key] = max_pool_positions(self._probs_raw(layer, w, g)[1], kernel)
        return self._pooled[key]

    def _norms_g(self, layer: int, w: int, kind: str, g: int):
        key = (layer, w, kind, g)
        if key not in self._norms:
            values = self.prefill.values[layer]
            num_heads = self.prefill.queries[w][layer].shape[1]
            group = num_heads // values.shape[1]
            m = values.shape[2] - w
            heads = range(g * group, (g + 1) * group)
            self._norms[key] = value_projection_norms(values[..., :m, :], self.prefill.o_proj[layer], num_heads, kind, heads)
        return self._norms[key]

    def scores(self, policy: KVPolicy, layer: int) -> LayerScores:
        """The LayerScores of ``policy`` for ``layer`` (the policy's window and scoring knobs)."""
        n = self.prefill.n
        w = min(policy.window, n)
        key = (layer, w, policy.pool_kernel, policy.two_stage, policy.base == "laprox", policy.value_norm,
               policy.stage2_scores, policy.gqa_reduce, policy.epsilon)
        if key in self._result:
            return self._result[key]
        start = time.perf_counter()
        keys = self.prefill.keys[layer]
        batch, num_kv_heads = keys.shape[:2]
        m = n - w
        attention = torch.empty(batch, num_kv_heads, m, dtype=torch.float32, device=keys.device)
        critical = torch.empty_like(attention) if policy.two_stage else None
        laprox = torch.empty_like(attention) if policy.base == "laprox" else None
        for g in range(num_kv_heads):
            probs, raw = self._probs_raw(layer, w, g)
            pooled = self._pooled_g(layer, w, policy.pool_kernel, g)
            attention[:, g] = pooled.mean(dim=1)
            if critical is not None:
                norms = self._norms_g(layer, w, policy.value_norm, g)
                p = pooled if policy.stage2_scores == "pooled" else raw
                if policy.gqa_reduce == "mean":
                    critical[:, g] = ((p + policy.epsilon) * norms).mean(dim=1)
                else:
                    critical[:, g] = (p.mean(dim=1) + policy.epsilon) * norms.mean(dim=1)
            if laprox is not None:
                laprox[:, g] = (probs.norm(dim=2) * self._norms_g(layer, w, "l2", g)).sum(dim=1)
        result = LayerScores(attention=attention, critical=critical, laprox=laprox)
        self._result[key] = result
        self.seconds += time.perf_counter() - start
        return result


def select_from_bank(policy: KVPolicy, bank: ScoreBank, layer: int) -> LayerSelection:
    """``select_layer(policy, ...)`` for layer ``layer`` of the bank's (unpadded, batch 1) prompt."""
    prefill = bank.prefill
    keys = prefill.keys[layer]
    batch, num_kv_heads, n, _ = keys.shape
    device = keys.device
    if policy.name == "full" or n <= policy.budget:
        return LayerSelection(*mask_to_indices(torch.ones(batch, num_kv_heads, n, dtype=torch.bool, device=device)))
    pos = torch.arange(n, device=device)
    if policy.base == "streamingllm":
        chosen = ((pos < policy.sink_tokens) | (pos >= n - (policy.budget - policy.sink_tokens)))
        chosen = chosen[None, None, :].expand(batch, num_kv_heads, n)
    else:
        w = min(policy.window, n)
        m = n - w
        eligible = torch.ones(batch, num_kv_heads, m, dtype=torch.bool, device=device)
        r_layer = layer_selectable_budget(policy, layer, prefill.num_layers)
        older = choose_older_tokens(policy, bank.scores(policy, layer), eligible, r_layer)
        window = torch.ones(batch, num_kv_heads, w, dtype=torch.bool, device=device)
        chosen = torch.cat([older, window], dim=-1)
    return LayerSelection(*mask_to_indices(chosen))


def select_all_layers(policy: KVPolicy, bank: ScoreBank) -> list[LayerSelection]:
    return [select_from_bank(policy, bank, layer) for layer in range(bank.prefill.num_layers)]


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
) -> Decoded:
    """``criticalkv.hf.generate``'s greedy decode loop on a cache built from ``prefill`` and ``selections``.

    ``first_step`` is a context-manager factory entered around the first decoding forward (the token
    after the prompt, at position n): the perturbation analysis records hidden states there.
    ``force_first_step`` runs that forward even when no second token is wanted (``max_new_tokens``
    1 or a stop token first); its output is then not part of ``tokens``.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    layers = [
        CompressedLayer.from_selection(k, v, sel, max_new_tokens)
        for k, v, sel in zip(prefill.keys, prefill.values, selections)
    ]
    cache = CompressedKVCache(layers, seen_tokens=prefill.n)
    sampler = Sampler(None)
    stop = {int(t) for t in stop_token_ids}
    tokens = sampler(prefill.logits.float().cpu().numpy())
    generated = [int(tokens[0])]
    done = int(tokens[0]) in stop
    device = prefill.input_ids.device
    positions = torch.full((1,), prefill.n, device=device)
    dummy_mask = torch.zeros(1, 1, 1, 1, dtype=model.dtype, device=device)
    steps = 0
    start = time.perf_counter()
    with packed_decoding(model):
        while (steps < max_new_tokens - 1 and not done) or (steps == 0 and force_first_step):
            wanted = steps < max_new_tokens - 1 and not done
            ctx = first_step() if (steps == 0 and first_step is not None) else None
            if ctx is not None:
                ctx.__enter__()
            try:
                out = model(
                    input_ids=torch.as_tensor(tokens, device=device)[:, None],
                    position_ids=positions[:, None],
                    attention_mask=dummy_mask,
                    past_key_values=cache,
                    use_cache=True,
                )
            finally:
                if ctx is not None:
                    ctx.__exit__(None, None, None)
            steps += 1
            if not wanted:
                break
            tokens = sampler(out.logits[:, -1].float().cpu().numpy())
            positions += 1
            generated.append(int(tokens[0]))
            done = int(tokens[0]) in stop
    return Decoded(tokens=generated, decode_s=time.perf_counter() - start, steps=steps, cache=cache)


def kept_fraction(selections: Sequence[LayerSelection], n: int) -> float:
    """Kept prompt entries / all prompt entries, over every layer and KV head."""
    kept = sum(int(s.lengths.sum()) for s in selections)
    total = sum(s.lengths.numel() for s in selections) * n
    return kept / total


def tokens_equal_generate(model, prefill: SharedPrefill, policy: KVPolicy, tokens: list[int], max_new_tokens: int,
                          stop_token_ids: Sequence[int]) -> tuple[bool, list[int]]:
    """Re-run ``criticalkv.hf.generate`` for one policy and compare its tokens with ``tokens``."""
    from criticalkv.hf import generate

    ref = generate(model, prefill.input_ids, policy, max_new_tokens, stop_token_ids=stop_token_ids).tokens[0]
    return ref == tokens, ref


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy()
