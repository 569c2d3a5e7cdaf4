"""The compressed context cache: compress a context once, answer many questions about it.

A request may carry a ``context`` (a document, a conversation's earlier turns) besides its question. The
scheduler compresses the context alone, question-agnostically (the selection's window is the context's own last
tokens), keeps a copy of the kept entries here (``Engine.save``), and answers every later request on the same
context from a copy of them (``Engine.restore`` into a slot, then the question through the extend graph). A `full`
engine keeps its contexts uncompressed: the lossless prefix cache vLLM and TensorRT-LLM have, so a benchmark of
`full` against an evicting policy compares like with like.

Entries are keyed by (context token ids, policy, budget) and evicted least recently used first when the bytes
held would pass the capacity. The cache is used by the scheduler thread only.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np


def context_key(token_ids: Sequence[int], policy_json: str, kv_budget: int | None,
                threshold: float | None = None) -> tuple:
    """The cache key of a context: a digest of its token ids (and their count), the engine's policy, the budget (with
    the request's ``context_threshold`` when it adapts the budget: (kv_budget, threshold))."""
    ids = np.asarray(token_ids, dtype=np.int64)
    budget = kv_budget if threshold is None else (kv_budget, float(threshold))
    return hashlib.sha256(ids.tobytes()).hexdigest(), int(ids.size), policy_json, budget


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_held: int = 0
    entries: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "bytes_held": self.bytes_held, "entries": self.entries}


class ContextCache:
    """An LRU store of compressed contexts bounded by ``capacity_bytes`` (0 = no caching)."""

    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError(f"context cache capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        self._entries: OrderedDict[tuple, Any] = OrderedDict()
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple) -> bool:
        return key in self._entries

    def keys(self) -> list[tuple]:
        """The keys held, least recently used first."""
        return list(self._entries)

    def peek(self, key: tuple):
        """The entry under ``key`` or None, without counting a hit or a miss or touching its recency."""
        return self._entries.get(key)

    def get(self, key: tuple):
        """The entry stored under ``key`` (now the most recently used) or None; counts a hit or a miss."""
        entry = self._entries.get(key)
        if entry is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return entry

    def put(self, key: tuple, entry: Any) -> bool:
        """Store ``entry`` (anything with ``nbytes``), evicting the least recently used ones until it fits.
        Returns False (nothing stored or evicted) when the entry alone is larger than the capacity."""
        size = int(entry.nbytes)
        if size > self.capacity_bytes:
            return False
        if key in self._entries:
            self._drop(key)
        while self.stats.bytes_held + size > self.capacity_bytes:
            self._drop(next(iter(self._entries)))
            self.stats.evictions += 1
        self._entries[key] = entry
        self.stats.bytes_held += size
        self.stats.entries = len(self._entries)
        return True

    def shrink(self, capacity_bytes: int, keep: tuple | None = None) -> int:
        """Evict least recently used entries (never ``keep``) until at most ``capacity_bytes`` are held; returns the
        bytes freed."""
        freed = 0
        while self.stats.bytes_held > capacity_bytes:
            key = next((k for k in self._entries if k != keep), None)
            if key is None:
                break
            freed += int(self._entries[key].nbytes)
            self._drop(key)
            self.stats.evictions += 1
        return freed

    def _drop(self, key: tuple) -> None:
        entry = self._entries.pop(key)
        self.stats.bytes_held -= int(entry.nbytes)
        self.stats.entries = len(self._entries)
