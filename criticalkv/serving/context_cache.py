"""The compressed context cache: compress a context once, answer many questions about it.

A request may carry a ``context`` (a document, a conversation's earlier turns) besides its question. The
scheduler compresses the context alone, question-agnostically (the selection's window is the context's own last
tokens), keeps a copy of the kept entries here (``Engine.save``), and answers every later request on the same
context from a copy of them (``Engine.restore`` into a slot, then the question through the extend graph). A `full`
engine keeps its contexts uncompressed: the lossless prefix cache vLLM and TensorRT-LLM have, so a benchmark of
`full` against an evicting policy compares like with like.

Entries are keyed by (context token ids, policy, budget) and evicted least recently used first when the bytes
held would pass the capacity. The cache is used by the scheduler thread only.

The entries may be stored narrower than the engine's KV buffers (``narrow``: ``criticalkv serve
--context-cache-dtype float16``): float32 keys and values rounded to float16 take half the bytes, so the same memory
holds twice the contexts; ``Engine.restore`` widens them back into the engine's buffers (``Backend.restore_row``).
And they are stored packed (``pack``): a snapshot holds every layer's heads padded to the layer's longest one, which a
policy whose heads keep different counts (AdaKV's heads, ``head_cap_ratio``) fills with padding (the bundled engine's
context policy: ~1.8x its kept entries); the cache keeps each head's kept entries only and pads them back on ``get``.
The cache counts the bytes it stores.
"""

from __future__ import annotations

import hashlib
import sys
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from criticalkv.runtime.backend import RowSnapshot

#: Element types the context cache stores its entries in (``--context-cache-dtype``): float32 keeps the engine's
#: float32 entries as they are (exact), float16 rounds them to float16 (half the bytes; widened back on restore).
CONTEXT_CACHE_DTYPES = ("float32", "float16")
#: The default: float16 (twice the contexts in the same memory; see docs/performance.md for its parity and speed).
DEFAULT_CONTEXT_CACHE_DTYPE = "float16"
_FLOAT16_MAX = float(np.finfo(np.float16).max)


def check_cache_dtype(name: object) -> str:
    """``name`` if it is one of ``CONTEXT_CACHE_DTYPES``; ValueError naming them otherwise."""
    if not isinstance(name, str) or name not in CONTEXT_CACHE_DTYPES:
        raise ValueError(f"context cache dtype must be one of {', '.join(CONTEXT_CACHE_DTYPES)}, got {name!r}")
    return name


def _is_float32(x: Any) -> bool:
    return str(x.dtype) in ("float32", "torch.float32")  # a NumPy array or a torch tensor (TensorRT, torch backends)


def _fits_float16(x: Any) -> bool:
    if isinstance(x, np.ndarray):
        return x.size == 0 or float(np.abs(x).max()) <= _FLOAT16_MAX
    return x.numel() == 0 or float(x.abs().max()) <= _FLOAT16_MAX


def _to_float16(x: Any) -> Any:
    return x.astype(np.float16) if isinstance(x, np.ndarray) else x.half()


def narrow(snapshot, dtype: str):
    """``snapshot`` (a ``SlotSnapshot``) as the context cache stores it with ``dtype``: float16 rounds float32 keys and
    values to float16 (half their bytes). Unchanged when ``dtype`` is float32, when its entries are not float32 (an
    engine's float16 or bfloat16 buffers are 16 bits already) or when one of them lies beyond float16's range (+-65504:
    rounding would make it infinite)."""
    check_cache_dtype(dtype)
    row = snapshot.row
    if dtype == "float32" or not row.keys or not all(_is_float32(x) for x in (*row.keys, *row.values)):
        return snapshot
    if not all(_fits_float16(x) for x in (*row.keys, *row.values)):
        return snapshot
    return replace(snapshot, row=RowSnapshot([_to_float16(k) for k in row.keys], [_to_float16(v) for v in row.values],
                                             row.lengths))


@dataclass
class PackedSnapshot:
    """A ``SlotSnapshot`` as the cache holds it (``pack``): per layer the kept entries of its heads one after the other,
    keys and values [sum_h n_h, d_h] (NumPy arrays or torch tensors, the snapshot's element type), its lengths [H_kv]
    as they were, and ``widths`` (per layer the padded length n_l of the snapshot, which ``unpack`` restores)."""

    keys: list[Any]
    values: list[Any]
    lengths: list[Any]
    widths: list[int]
    #: the snapshot without its row (``row`` None): its position and kept entries, and what ``unpack`` rebuilds
    shell: Any

    @property
    def position(self) -> int:
        return self.shell.position

    @property
    def kept_entries(self) -> int:
        return self.shell.kept_entries

    @property
    def nbytes(self) -> int:
        return sum(int(k.nbytes) + int(v.nbytes) for k, v in zip(self.keys, self.values))


def _counts(lengths: Any) -> list[int]:
    return [int(n) for n in (lengths.tolist() if hasattr(lengths, "tolist") else lengths)]


def _join(pieces: list[Any], like: Any) -> Any:
    if isinstance(like, np.ndarray):
        return np.concatenate(pieces, axis=0)
    return sys.modules["torch"].cat(pieces, dim=0)  # a tensor: torch is loaded (the torch and TensorRT backends)


def pack(snapshot) -> PackedSnapshot:
    """``snapshot`` (a ``SlotSnapshot``) without its padding: each layer's heads' first ``lengths[h]`` entries, joined."""
    row = snapshot.row
    keys, values, widths = [], [], []
    for k, v, n in zip(row.keys, row.values, row.lengths):
        counts = _counts(n)
        keys.append(_join([k[h, :c] for h, c in enumerate(counts)], k))
        values.append(_join([v[h, :c] for h, c in enumerate(counts)], v))
        widths.append(int(k.shape[1]))
    return PackedSnapshot(keys, values, list(row.lengths), widths, replace(snapshot, row=None))


def unpack(packed: PackedSnapshot):
    """The ``SlotSnapshot`` ``pack`` took ``packed`` from, its padding zeros (entries beyond a head's length are never
    read): what ``Engine.restore`` takes."""
    keys, values = [], []
    for k, v, n, width in zip(packed.keys, packed.values, packed.lengths, packed.widths):
        counts = _counts(n)
        rows = []
        for joined in (k, v):
            shape = (len(counts), width, int(joined.shape[1]))
            out = np.zeros(shape, joined.dtype) if isinstance(joined, np.ndarray) else joined.new_zeros(shape)
            at = 0
            for h, c in enumerate(counts):
                out[h, :c] = joined[at:at + c]
                at += c
            rows.append(out)
        keys.append(rows[0])
        values.append(rows[1])
    return replace(packed.shell, row=RowSnapshot(keys, values, list(packed.lengths)))


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
        """The entry under ``key`` as stored (a snapshot packed: ``PackedSnapshot``, its ``nbytes`` and
        ``kept_entries``) or None, without counting a hit or a miss or touching its recency."""
        return self._entries.get(key)

    def get(self, key: tuple, packed: bool = False):
        """The entry stored under ``key`` (now the most recently used) or None; counts a hit or a miss. A snapshot comes
        back unpacked, or as stored with ``packed`` (``Engine.restore`` takes either; a backend that writes each head's
        entries in place, ``Engine.restores_packed``, then makes no padded copy)."""
        entry = self._entries.get(key)
        if entry is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return unpack(entry) if isinstance(entry, PackedSnapshot) and not packed else entry

    def put(self, key: tuple, entry: Any) -> bool:
        """Store ``entry`` (anything with ``nbytes``; a ``SlotSnapshot`` packed), evicting the least recently used
        ones until it fits. Returns False (nothing stored or evicted) when the entry alone is larger than the
        capacity."""
        if hasattr(entry, "row") and hasattr(entry.row, "lengths"):
            entry = pack(entry)
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
