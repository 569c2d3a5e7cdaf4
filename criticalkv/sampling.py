"""Next-token choice shared by every backend (greedy, temperature and nucleus (top-p) sampling), the
per-sequence stop-token bookkeeping and the decode loop every generation path runs."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from criticalkv.request import SamplingParams


class Sampler:
    """Turns last-position logits [B, V] (NumPy, any float dtype) into token ids [B] int64."""

    def __init__(self, params: SamplingParams | None = None):
        self.config = params or SamplingParams()
        self.rng = np.random.default_rng(self.config.seed)

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        logits = np.asarray(logits)
        if logits.ndim != 2:
            raise ValueError(f"logits: expected [batch, vocab], got shape {logits.shape}")
        if self.config.temperature == 0:
            # in the logits' own dtype: widening is exact and keeps the order, so the argmax is float64's, without a
            # float64 copy of every row (66 MB per decode step for 64 rows of a 128k vocabulary)
            return logits.argmax(axis=-1).astype(np.int64)
        logits = logits.astype(np.float64)
        z = logits / self.config.temperature
        z -= z.max(axis=-1, keepdims=True)
        probs = np.exp(z)
        probs /= probs.sum(axis=-1, keepdims=True)
        out = np.empty(len(probs), dtype=np.int64)
        for b, p in enumerate(probs):
            if self.config.top_p < 1:
                order = np.argsort(-p, kind="stable")
                keep = np.cumsum(p[order]) - p[order] < self.config.top_p  # the smallest prefix reaching top_p
                nucleus = np.zeros_like(p)
                nucleus[order[keep]] = p[order[keep]]
                p = nucleus / nucleus.sum()
            out[b] = self.rng.choice(len(p), p=p)
        return out


class Generated:
    """Token ids generated per sequence of a batch. A sequence ends at its first stop token (kept in its
    output); tokens sampled for it afterwards (the batch steps on) are not recorded."""

    def __init__(self, first: np.ndarray, stop_token_ids):
        self.stop = {int(t) for t in stop_token_ids}
        self.tokens = [[int(t)] for t in first]
        self.done = np.array([int(t) in self.stop for t in first])

    def add(self, tokens: np.ndarray) -> None:
        for b, t in enumerate(tokens):
            if not self.done[b]:
                self.tokens[b].append(int(t))
                self.done[b] = int(t) in self.stop

    @property
    def finished(self) -> bool:
        return bool(self.done.all())


def decode_loop(
    step: Callable[[np.ndarray, int], np.ndarray],
    first_tokens: np.ndarray,
    max_new_tokens: int,
    stop_token_ids,
    sampler: Sampler,
    on_tokens: Callable[[np.ndarray], None] | None = None,
    force_first_step: bool = False,
) -> tuple[Generated, int, float]:
    """The decode loop every generation path shares (transformers path, runtime ``Engine``, evaluation).

    ``first_tokens`` [B] are the tokens sampled from the prompt's logits; ``step(tokens, t)`` runs one
    decoding forward of ``tokens`` [B] (the t-th new token after the prompt) and returns logits [B, vocab].
    Decoding stops after ``max_new_tokens`` tokens or when every sequence produced a stop token.
    ``force_first_step`` runs the first forward even when no second token is wanted (its output is then
    not part of the result). Returns (the generated tokens, forwards run, seconds spent in the loop).
    """
    generated = Generated(first_tokens, stop_token_ids)
    if on_tokens:
        on_tokens(first_tokens)
    tokens = first_tokens
    steps = 0
    start = time.perf_counter()
    while True:
        wanted = steps < max_new_tokens - 1 and not generated.finished
        if not wanted and not (steps == 0 and force_first_step):
            break
        logits = step(tokens, steps)
        steps += 1
        if not wanted:
            break
        tokens = sampler(logits)
        generated.add(tokens)
        if on_tokens:
            on_tokens(tokens)
    return generated, steps, time.perf_counter() - start
