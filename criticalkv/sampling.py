"""Next-token choice shared by every backend: greedy, temperature and nucleus (top-p) sampling."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 is greedy (argmax, ties to the lower token id); top_p in (0, 1]; seed for repeatability."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature: must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must lie in (0, 1], got {self.top_p}")


class Sampler:
    """Turns last-position logits [B, V] (NumPy, any float dtype) into token ids [B] int64."""

    def __init__(self, config: SamplingConfig | None = None):
        self.config = config or SamplingConfig()
        self.rng = np.random.default_rng(self.config.seed)

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        logits = np.asarray(logits, dtype=np.float64)
        if logits.ndim != 2:
            raise ValueError(f"logits: expected [batch, vocab], got shape {logits.shape}")
        if self.config.temperature == 0:
            return logits.argmax(axis=-1).astype(np.int64)
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
