"""The Engine's slot API (prefill into a slot, decode the occupied slots, release): what serving calls."""

import numpy as np
import pytest
import torch

from criticalkv import KVPolicy
from criticalkv.runtime import Engine, EngineError, Request, RequestError, SamplingParams
from criticalkv.sampling import Sampler
from export.tiny_engine import ENGINE_BACKENDS, export_tiny_engine, load_engine
from hf.conftest import tiny_model


def prompt(n, seed=1):
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=ENGINE_BACKENDS)
def engine(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("engine")
    policy = KVPolicy("ada-criticalkv", budget=40, window=8)  # heads keep different lengths
    model = tiny_model("llama", seed=4)
    engine = load_engine(export_tiny_engine(model, policy, folder, max_batch_size=3), request.param, model)
    yield engine
    engine.release_all()
    engine.close()


def alone(engine, ids, n):
    return engine.generate([ids], max_new_tokens=n, stop_token_ids=[]).tokens[0]


def greedy(logits):
    return int(Sampler()(np.asarray(logits)[None, :] if np.ndim(logits) == 1 else logits)[0])


def test_slots_decode_like_generate_in_any_order_and_after_releases(engine):
    prompts = {0: prompt(120, seed=1), 2: prompt(50, seed=2), 1: prompt(90, seed=3)}
    expected = {slot: alone(engine, ids, 8) for slot, ids in prompts.items()}
    got = {}
    for slot, ids in prompts.items():  # slots filled out of order: rows 0, 1, 2 hold slots 0, 2, 1
        result = engine.prefill(slot, Request(ids))
        assert result.num_prompt_tokens == len(ids) and 0 < result.kv_bytes_kept < result.kv_bytes_full
        got[slot] = [greedy(result.logits)]
    assert sorted(engine.occupied_slots()) == [0, 1, 2] and engine.free_slots() == []
    order = [1, 0, 2]  # any order of the occupied slots; logits come back in that order
    for step in range(7):
        if step == 3:  # a sequence leaves mid-way: the last row moves into its row, the others go on unchanged
            engine.release(0)
            order = [2, 1]
        logits = engine.decode(order, [got[s][-1] for s in order])
        for i, slot in enumerate(order):
            got[slot].append(greedy(logits[i]))
    assert got[1] == expected[1] and got[2] == expected[2]
    assert got[0][:4] == expected[0][:4]
    engine.release_all()
    assert engine.occupied_slots() == [] and engine.free_slots() == [0, 1, 2]


def test_slot_errors_name_the_problem(engine):
    engine.prefill(1, Request(prompt(30)))
    try:
        with pytest.raises(EngineError, match="slot 1 is occupied"):
            engine.prefill(1, Request(prompt(30)))
        with pytest.raises(EngineError, match="not one of the engine's slots 0..2"):
            engine.prefill(3, Request(prompt(30)))
        with pytest.raises(EngineError, match=r"decode runs every occupied slot once: occupied \[1\]"):
            engine.decode([0], [5])
        with pytest.raises(EngineError, match="slot 2 holds no sequence"):
            engine.release(2)
        with pytest.raises(EngineError, match="release them first"):
            engine.generate([prompt(10)], max_new_tokens=2)
        with pytest.raises(RequestError, match=r"kv_budget must lie in \[8, 40\]"):
            engine.prefill(0, Request(prompt(30), kv_budget=41))
        assert 0 in engine.free_slots()  # a refused request takes no slot
    finally:
        engine.release_all()


def test_a_request_budget_in_a_slot_keeps_fewer_entries(engine):
    full = engine.prefill(0, Request(prompt(150, seed=5)))
    small = engine.prefill(1, Request(prompt(150, seed=5), SamplingParams(max_tokens=2), kv_budget=16))
    engine.release_all()
    assert small.kept_entries < full.kept_entries
    assert engine.kv_bytes_bound(150, 4) >= full.kv_bytes_kept + engine.growth_bytes(4)


def test_a_saved_slot_restored_elsewhere_continues_exactly(engine):
    ids = prompt(140, seed=7)
    expected = alone(engine, ids, 6)
    first = greedy(engine.prefill(2, Request(ids)).logits)
    logits = engine.decode([2], [first])
    snapshot = engine.save(2)
    assert snapshot.position == 141 and 0 < snapshot.nbytes and snapshot.kept_entries > 0
    engine.release(2)
    engine.prefill(0, Request(prompt(60, seed=8)))  # another sequence takes row 0 meanwhile
    engine.restore(1, snapshot)  # restored into another slot (row 1)
    tokens = [first, greedy(logits[0])]
    for _ in range(4):
        out = engine.decode([0, 1], [3, tokens[-1]])
        tokens.append(greedy(out[1]))
    engine.release_all()
    assert tokens == expected
    with pytest.raises(EngineError, match="holds no sequence"):
        engine.save(2)


def test_a_packed_copy_of_a_slot_restores_as_the_padded_one(engine):
    """The context cache's packed form (each head's kept entries, no padding: ``pack``) restored head by head into a
    row that held another sequence: the next steps' logits equal the padded copy's, bitwise (entries beyond a head's
    length are never read), float32 and float16 copies. A backend that cannot write it says so."""
    from criticalkv.serving.context_cache import narrow, pack

    engine.prefill(0, Request(prompt(140, seed=11)))
    exact = engine.save(0)
    engine.release_all()
    lengths = [np.asarray(n.cpu() if hasattr(n, "cpu") else n) for n in exact.row.lengths]
    assert any(len(set(n.tolist())) > 1 for n in lengths)  # the heads keep different counts: real padding

    def steps(snapshot):
        engine.prefill(0, Request(prompt(150, seed=12)))  # another sequence's entries in the row first
        engine.release_all()
        engine.restore(0, snapshot)
        try:
            return [np.array(engine.decode([0], [token])) for token in (5, 9)]
        finally:
            engine.release_all()

    for snapshot in (exact, narrow(exact, "float16")):
        packed = pack(snapshot)
        if not engine.restores_packed:
            with pytest.raises(EngineError, match="unpacked snapshots only"):
                engine.restore(0, packed)
            assert engine.occupied_slots() == []
            continue
        padded = steps(snapshot)
        assert all(np.array_equal(a, b) for a, b in zip(steps(packed), padded))


def test_decode_greedy_is_the_argmax_of_decode(engine):
    # the scheduler's step when every request is greedy: the torch backend takes the argmax on its device, the others
    # on the logits; either way it is the argmax of the step's logits (slots in any order)
    for slot, n in ((0, 70), (1, 110)):
        engine.prefill(slot, Request(prompt(n, seed=n)))
    saved = [engine.save(slot) for slot in (0, 1)]
    logits = engine.decode([1, 0], [3, 4]).copy()
    engine.release_all()
    for slot in (0, 1):
        engine.restore(slot, saved[slot])
    tokens = engine.decode_greedy([1, 0], [3, 4])
    assert tokens.dtype == np.int64 and tokens.tolist() == logits.argmax(axis=-1).tolist()
    engine.release_all()


def test_a_float16_copy_of_a_slot_restores_within_float16_rounding(engine):
    """The context cache's float16 store (``narrow``): half the bytes, every entry within float16's rounding of the
    float32 one (relative 2**-11, absolute 2**-25 below float16's normal range), widened back on restore to exactly
    those values, and the next step's logits close to the exact copy's."""
    from criticalkv.serving.context_cache import narrow

    def host(x):
        return (x.float().cpu().numpy() if hasattr(x, "cpu") else np.asarray(x)).astype(np.float32)

    engine.prefill(0, Request(prompt(140, seed=9)))
    exact = engine.save(0)
    half = narrow(exact, "float16")
    assert narrow(exact, "float32") is exact and narrow(half, "float16") is half
    assert half.nbytes * 2 == exact.nbytes
    assert (half.position, half.kept_entries) == (exact.position, exact.kept_entries)
    for a, b in zip(exact.row.keys + exact.row.values, half.row.keys + half.row.values):
        assert "float16" in str(b.dtype)
        a, b = host(a), host(b)
        assert np.all(np.abs(b - a) <= 2.0**-11 * np.abs(a) + 2.0**-25)
    engine.release(0)
    engine.restore(1, half)
    widened = engine.save(1)
    for a, b in zip(half.row.keys + half.row.values, widened.row.keys + widened.row.values):
        assert "float32" in str(b.dtype) and np.array_equal(host(a), host(b))
    for a, b in zip(exact.row.lengths, widened.row.lengths):
        assert host(a).tolist() == host(b).tolist()
    from_half = np.array(engine.decode([1], [5])[0], np.float32)
    engine.release(1)
    engine.restore(1, exact)
    from_exact = np.array(engine.decode([1], [5])[0], np.float32)
    engine.release_all()
    assert 0 < np.abs(from_half - from_exact).max() < 1e-2 * np.abs(from_exact).max()
