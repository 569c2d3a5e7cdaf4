"""The compressed context cache's store: LRU eviction by bytes, keys, statistics."""

import numpy as np
import pytest

from criticalkv.serving.context_cache import ContextCache, context_key


class Entry:
    def __init__(self, nbytes):
        self.nbytes = nbytes


def test_lru_eviction_by_bytes_and_statistics():
    cache = ContextCache(100)
    a, b, c = (context_key([i, i + 1], "{}", None) for i in range(3))
    assert cache.put(a, Entry(40)) and cache.put(b, Entry(40))
    assert cache.get(a) is not None  # a is now the most recently used
    assert cache.put(c, Entry(40))  # 120 > 100: the least recently used (b) goes
    assert b not in cache and a in cache and c in cache
    assert cache.get(b) is None
    assert cache.stats.as_dict() == {"hits": 1, "misses": 1, "evictions": 1, "bytes_held": 80, "entries": 2}
    assert not cache.put(context_key([9], "{}", None), Entry(101))  # larger than the whole cache: not stored
    assert cache.stats.bytes_held == 80 and len(cache) == 2
    assert cache.shrink(40) == 40 and len(cache) == 1 and cache.stats.evictions == 2
    cache.put(c, Entry(10))  # replacing an entry counts its new size
    assert cache.stats.bytes_held == 10


def test_keys_separate_contexts_policies_and_budgets():
    ids = np.arange(50)
    assert context_key(ids, "p", None) == context_key(list(range(50)), "p", None)
    assert len({context_key(ids, "p", None), context_key(ids[:-1], "p", None), context_key(ids, "q", None),
                context_key(ids, "p", 64)}) == 4
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        ContextCache(-1)
    assert not ContextCache(0).put(context_key(ids, "p", None), Entry(1))
