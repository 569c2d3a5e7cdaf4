"""The prefix cache of plain prompts: vLLM's automatic prefix caching, for criticalkv's chunked prefill.

A prompt prefilled in chunks holds its whole (uncompressed) K/V in a prefill buffer until its selection. The scheduler
copies the entries of the prompt's full blocks of ``block_size`` tokens into this cache (``Engine.prompt_entries``);
a later prompt that begins with the same blocks gets their entries written into its own buffer
(``Engine.begin_prefill``'s ``prefix``) and prefills only the rest. The engine's policy then selects over the whole
prompt as it would have without the cache: a chunked prefill's entries do not depend on where its chunks end, so the
kept entries, the logits and the tokens are a cold run's (tests/serving/test_prefix_cache.py). What is cached is
the prompt's full-size K/V, never a selection's: a prompt's kept entries depend on its last tokens, which differ.

Blocks are keyed as vLLM keys them: a block's hash covers its tokens and its parent's hash, so it stands for the whole
prefix up to its end, and a lookup walks a prompt's blocks from the first and stops at the first miss (a partial match
reuses the blocks before it). A block holds its tokens' K and V for every layer and KV head (the prefill buffer's
element type) and the backend's streams of them (``PromptEntries``). The cache is bounded in bytes and evicts least
recently used blocks first; a lookup or an insertion touches a chain from its last block back to its first (vLLM
frees a request's blocks in that order), so a block is always at least as recent as its descendants and eviction
never leaves a block whose parent is gone. Used by the scheduler thread only.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from criticalkv.runtime.backend import PromptEntries

#: tokens per block (vLLM's default block size)
DEFAULT_BLOCK_SIZE = 16


@dataclass
class PrefixCacheStats:
    """queries / hits: prompt tokens looked up / found cached (counts since start, vLLM's
    ``prefix_cache_queries`` and ``prefix_cache_hits``); requests / hit_requests: lookups and those that found at least
    one block; evictions: blocks evicted; bytes_held, blocks: now."""

    queries: int = 0
    hits: int = 0
    requests: int = 0
    hit_requests: int = 0
    evictions: int = 0
    bytes_held: int = 0
    blocks: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"queries": self.queries, "hits": self.hits, "requests": self.requests,
                "hit_requests": self.hit_requests, "evictions": self.evictions, "bytes_held": self.bytes_held,
                "blocks": self.blocks}


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chain hashes of the full blocks of ``token_ids``: block j's digest covers block j - 1's and its tokens."""
    ids = np.asarray(token_ids, dtype=np.int64)
    out, parent = [], b""
    for start in range(0, ids.size - block_size + 1, block_size):
        parent = hashlib.blake2b(parent + ids[start:start + block_size].tobytes(), digest_size=16).digest()
        out.append(parent)
    return out


def off_reason(backend: str, caches_prompts: bool, chunked: bool, capacity_mib: float) -> str | None:
    """Why a server asked for a prefix cache of ``capacity_mib`` MiB serves without one (None: it has one, or 0 was
    asked): the engine on ``backend`` does not copy a prefill buffer's entries out and in (``caches_prompts``:
    ``Engine.caches_prompts``; ONNX Runtime, OpenVINO and torch do, TensorRT does not), or prompts are not prefilled in
    chunks (``chunked``: the engine has extend and select graphs and the prefill chunk is > 0)."""
    if capacity_mib <= 0:
        return None
    if not chunked:
        return ("prefix cache off: prompts are prefilled at once (--prefill-chunk 0, or an engine without extend and "
                "select graphs); it reuses the blocks of prompts prefilled in chunks")
    if not caches_prompts:
        return (f"prefix cache off: the {backend} backend does not copy prompt entries out of its prefill buffers "
                "(ONNX Runtime, OpenVINO and torch do); plain prompts are prefilled whole")
    return None


class PrefixCache:
    """Blocks of prompt entries under their chain hashes, LRU, at most ``capacity_bytes`` (0 = no caching)."""

    def __init__(self, capacity_bytes: int, block_size: int = DEFAULT_BLOCK_SIZE):
        if capacity_bytes < 0:
            raise ValueError(f"prefix cache capacity must be >= 0 bytes, got {capacity_bytes}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"prefix cache block size must be an integer >= 1, got {block_size!r}")
        self.capacity_bytes = int(capacity_bytes)
        self.block_size = block_size
        self._blocks: OrderedDict[bytes, PromptEntries] = OrderedDict()  # least recently used first
        self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._blocks

    def hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """``block_hashes`` at this cache's block size."""
        return block_hashes(token_ids, self.block_size)

    def cached(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of the chain ``hashes`` are held (nothing touched)."""
        count = 0
        for digest in hashes:
            if digest not in self._blocks:
                break
            count += 1
        return count

    def touch(self, hashes: Sequence[bytes]) -> None:
        """Make the held blocks of the chain ``hashes`` the most recently used, its first block the most recent."""
        for digest in reversed(hashes):
            if digest in self._blocks:
                self._blocks.move_to_end(digest)

    def lookup(self, hashes: Sequence[bytes], max_blocks: int | None = None) -> list[PromptEntries]:
        """The entries of the longest held leading run of the chain ``hashes`` (at most ``max_blocks`` blocks), which
        become the most recently used. Counts nothing (``record`` does)."""
        count = self.cached(hashes if max_blocks is None else hashes[:max(max_blocks, 0)])
        self.touch(hashes[:count])
        return [self._blocks[digest] for digest in hashes[:count]]

    def record(self, queried_tokens: int, hit_tokens: int) -> None:
        """Count one lookup: ``queried_tokens`` prompt tokens, of which ``hit_tokens`` came from the cache."""
        self.stats.requests += 1
        self.stats.queries += int(queried_tokens)
        self.stats.hits += int(hit_tokens)
        self.stats.hit_requests += int(hit_tokens > 0)

    def add(self, hashes: Sequence[bytes], first: int, blocks: Sequence[PromptEntries],
            capacity_bytes: int | None = None) -> int:
        """Hold ``blocks`` under ``hashes[first:]`` (their chain: blocks 0..first-1 are held, or first is 0), evicting
        least recently used blocks of other chains while the cache would hold more than ``capacity_bytes`` (default
        and at most its capacity); stops at the first block that does not fit. Returns how many were added; the
        chain is then the most recently used."""
        limit = self.capacity_bytes if capacity_bytes is None else min(self.capacity_bytes, int(capacity_bytes))
        if first > self.cached(hashes[:first]):
            return 0  # a parent went meanwhile: the blocks after it could never be found
        chain = set(hashes[:first + len(blocks)])
        added = 0
        for digest, entries in zip(hashes[first:], blocks):
            if digest in self._blocks:
                added += 1
                continue
            size = int(entries.nbytes)
            if self.stats.bytes_held + size > limit:
                self.shrink(limit - size, keep=chain)
            if self.stats.bytes_held + size > limit:
                break
            self._blocks[digest] = entries
            self.stats.bytes_held += size
            added += 1
        self.stats.blocks = len(self._blocks)
        self.touch(hashes[:first + added])
        return added

    def shrink(self, capacity_bytes: int, keep: set | frozenset = frozenset()) -> int:
        """Evict least recently used blocks (never those in ``keep``) until at most ``capacity_bytes`` are held;
        returns the bytes freed."""
        freed = 0
        if self.stats.bytes_held <= capacity_bytes:
            return 0
        for digest in [d for d in self._blocks if d not in keep]:
            if self.stats.bytes_held <= capacity_bytes:
                break
            entries = self._blocks.pop(digest)
            size = int(entries.nbytes)
            self.stats.bytes_held -= size
            self.stats.evictions += 1
            freed += size
        self.stats.blocks = len(self._blocks)
        return freed

    def clear(self) -> None:
        self.shrink(0)


__all__ = ["DEFAULT_BLOCK_SIZE", "PrefixCache", "PrefixCacheStats", "block_hashes", "off_reason"]
