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


def test_float16_store_halves_float32_entries_and_leaves_the_rest():
    from criticalkv.runtime.backend import RowSnapshot
    from criticalkv.runtime.engine import SlotSnapshot
    from criticalkv.serving.context_cache import CONTEXT_CACHE_DTYPES, check_cache_dtype, narrow

    rng = np.random.default_rng(0)
    keys = [rng.standard_normal((3, n, 8)).astype(np.float32) for n in (5, 7)]
    values = [rng.standard_normal((3, n, 8)).astype(np.float32) for n in (5, 7)]
    lengths = [np.array([5, 4, 5], np.int32), np.array([7, 7, 6], np.int32)]
    exact = SlotSnapshot(RowSnapshot(keys, values, lengths), position=12, kept_entries=34)
    half = narrow(exact, "float16")
    assert half.nbytes * 2 == exact.nbytes and half.row.lengths is exact.row.lengths and half.position == 12
    assert all(k.dtype == np.float16 for k in half.row.keys + half.row.values)
    assert all(np.array_equal(a.astype(np.float16), b) for a, b in zip(keys + values, half.row.keys + half.row.values))
    cache = ContextCache(10**6)
    key = context_key([1, 2], "{}", None)
    # the stored bytes are counted: float16, and each head's kept entries only (5 + 4 + 5 and 7 + 7 + 6 of 8 numbers,
    # keys and values), not the padding to the layer's longest head
    assert cache.put(key, half) and cache.stats.bytes_held == 34 * 8 * 2 * 2 < exact.nbytes // 2
    # 16-bit entries already (float16 buffers, OpenVINO's bf16 bits) and float16's range exceeded: stored as they are
    bits = SlotSnapshot(RowSnapshot([k.view(np.uint16)[..., ::2] for k in keys], values, lengths), 12, 34)
    assert narrow(bits, "float16") is bits
    big = SlotSnapshot(RowSnapshot([keys[0] * 1e5, keys[1]], values, lengths), 12, 34)
    assert narrow(big, "float16") is big
    assert CONTEXT_CACHE_DTYPES == ("float32", "float16") and check_cache_dtype("float32") == "float32"
    for bad in ("bfloat16", "fp16", None):
        with pytest.raises(ValueError, match="one of float32, float16"):
            narrow(exact, bad)


def test_the_cache_stores_each_heads_kept_entries_and_gives_back_the_snapshot():
    import torch

    from criticalkv.runtime.backend import RowSnapshot
    from criticalkv.runtime.engine import SlotSnapshot
    from criticalkv.serving.context_cache import PackedSnapshot, pack, unpack

    rng = np.random.default_rng(1)
    lengths = [np.array([9, 2, 0], np.int32), np.array([4, 4, 4], np.int32)]  # uneven heads, an empty one, even ones
    keys = [rng.standard_normal((3, 9, 4)).astype(np.float32), rng.standard_normal((3, 6, 4)).astype(np.float32)]
    values = [rng.standard_normal((3, 9, 4)).astype(np.float32), rng.standard_normal((3, 6, 4)).astype(np.float32)]
    for kind in ("numpy", "torch"):
        wrap = (lambda x: x) if kind == "numpy" else torch.from_numpy
        back = (lambda x: x) if kind == "numpy" else (lambda x: x.numpy())
        snapshot = SlotSnapshot(RowSnapshot([wrap(k) for k in keys], [wrap(v) for v in values],
                                            [wrap(n) for n in lengths]), position=40, kept_entries=23)
        packed = pack(snapshot)
        assert packed.nbytes == 23 * 4 * 4 * 2 and packed.nbytes < snapshot.nbytes  # 23 entries of 4 float32, K and V
        assert (packed.position, packed.kept_entries, packed.widths) == (40, 23, [9, 6])
        restored = unpack(packed)
        assert (restored.position, restored.kept_entries) == (40, 23)
        for i in range(2):
            assert restored.row.keys[i].shape == keys[i].shape and restored.row.values[i].shape == values[i].shape
            np.testing.assert_array_equal(back(restored.row.lengths[i]), lengths[i])
            for h, n in enumerate(lengths[i]):  # every kept entry exactly, the padding zeros
                for got, want in ((back(restored.row.keys[i]), keys[i]), (back(restored.row.values[i]), values[i])):
                    np.testing.assert_array_equal(got[h, :n], want[h, :n])
                    assert not got[h, n:].any()
        cache = ContextCache(10**6)
        key = context_key([7], "{}", None)
        assert cache.put(key, snapshot) and cache.stats.bytes_held == packed.nbytes
        assert isinstance(cache.peek(key), PackedSnapshot) and cache.peek(key).kept_entries == 23
        hit = cache.get(key)
        assert isinstance(hit, SlotSnapshot) and all(
            np.array_equal(back(a), back(b)) for a, b in zip(hit.row.keys + hit.row.values,
                                                           restored.row.keys + restored.row.values))
        assert cache.get(key, packed=True) is cache.peek(key) and cache.stats.hits == 2  # as stored, a hit counted


CONTEXT_QUESTIONS = ("What is the main subject of the text above?",
                     "Which people or places does the text above mention?",
                     "Summarize the text above in one sentence.",
                     "What is the secret number hidden in the text above?")


@pytest.mark.slow
def test_the_bundled_model_answers_from_a_float16_cache_as_from_a_float32_one(tmp_path_factory):
    # SmolLM2-135M-Instruct, criticalkv at budget 256: a 900-token context compressed once, its copy kept as float32
    # (exact) and as float16, each restored and asked 4 questions, 8 greedy tokens each. The float16 copy's logits,
    # fed the float32 copy's tokens, stay within 0.1 % of the logits' scale at every step; the greedy tokens, free
    # running from each copy, agree (measured: 32 of 32, largest logit change 0.0050, median 0.0036, against a
    # largest logit of 33.0)
    from pathlib import Path

    from criticalkv.request import Request
    from criticalkv.runtime import Engine
    from criticalkv.serving.context_cache import narrow
    from serving.test_prefix_cache import bundled_engine

    folder, tokenizer = bundled_engine(tmp_path_factory)
    engine = Engine.load(folder, threads=1, verify=False)
    try:
        text = (Path(__file__).resolve().parents[2] / "examples" / "needle_2k.txt").read_text()
        context = tokenizer(text)["input_ids"][:900]
        engine.prefill(0, Request(context), context=True)
        exact = engine.save(0)
        engine.release(0)
        half = narrow(exact, "float16")
        assert half.nbytes * 2 == exact.nbytes

        def run(snapshot, question, forced=None):
            engine.restore(0, snapshot)
            steps = [np.array(engine.extend(0, question), np.float32)]
            tokens = [int(steps[-1].argmax())]
            for i in range(7):
                feed = tokens[-1] if forced is None else forced[i]
                steps.append(np.array(engine.decode([0], [feed])[0], np.float32))
                tokens.append(int(steps[-1].argmax()))
            engine.release(0)
            return tokens, steps

        same, total, changes, scale = 0, 0, [], 0.0
        for q in CONTEXT_QUESTIONS:
            question = tokenizer("\n\n" + q)["input_ids"]
            ref_tokens, ref_steps = run(exact, question)
            half_tokens, _ = run(half, question)
            _, forced_steps = run(half, question, forced=ref_tokens)
            same += sum(a == b for a, b in zip(ref_tokens, half_tokens))
            total += len(ref_tokens)
            changes += [float(np.abs(a - b).max()) for a, b in zip(ref_steps, forced_steps)]
            scale = max(scale, max(float(np.abs(s).max()) for s in ref_steps))
        print(f"float16 cache: greedy tokens equal {same} of {total}; largest logit change {max(changes):.4f} "
              f"(median {np.median(changes):.4f}) against a logit scale of {scale:.1f}")
        assert 0 < max(changes) < 1e-3 * scale, (changes, scale)
        assert same == total
    finally:
        engine.close()
