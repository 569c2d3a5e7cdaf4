"""A compressed context made by one scheduler serves another one (what the replicas' shared store does, here without
Ray): the scheduler's hooks (``on_context_compressed``, ``context_key``, ``offer_context``) and the host copy that
travels through Ray's object store (``to_host`` / ``from_host``, pickled), on ONNX Runtime and the torch backend."""

import pickle

import numpy as np
import pytest
import torch

from criticalkv import KVPolicy
from criticalkv.replicas.store import HostSnapshot, from_host, route_digest, store_key, to_host
from criticalkv.request import Request, SamplingParams
from criticalkv.serving import RequestError, Scheduler
from criticalkv.serving.context_cache import context_key, narrow
from export.tiny_engine import ENGINE_BACKENDS, export_tiny_engine, load_engine
from hf.conftest import tiny_model


def prompt(n, seed):
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def ask(context, question, max_tokens=5):
    return Request(question, SamplingParams(max_tokens=max_tokens, ignore_eos=True), context_token_ids=context)


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    model = tiny_model("llama", seed=4)
    folder = export_tiny_engine(model, KVPolicy("criticalkv", budget=40, window=8), tmp_path_factory.mktemp("engine"),
                                max_batch_size=2, extend_chunk=32, max_question_len=24)
    return folder, model


def from_copy(engine, context, question, dtype, n=5):
    """The greedy tokens of ``question`` after ``context`` answered from the context cache's copy of it (``dtype``)."""
    engine.prefill(0, Request(context))
    copy = narrow(engine.save(0), dtype)
    engine.release(0)
    engine.restore(0, copy)
    tokens = [int(np.asarray(engine.extend(0, question)).argmax())]
    while len(tokens) < n:
        tokens.append(int(np.asarray(engine.decode([0], [tokens[-1]])[0]).argmax()))
    engine.release(0)
    return tokens


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("backend", ENGINE_BACKENDS)
def test_a_context_compressed_by_one_scheduler_is_a_hit_on_another(engine_dir, backend, dtype):
    # float32: the engine's exact tokens; float16 (the copy the store carries, half the bytes): the tokens of the
    # engine answering from that rounded copy, on the replica that made it and on the other one
    folder, model = engine_dir
    a, b = (load_engine(folder, backend, model, threads=1) for _ in range(2))  # two replicas of one engine
    made, first, second = [], None, None
    context, questions = prompt(150, seed=3), [prompt(6, seed=4), prompt(5, seed=5)]
    expected = [a.generate([context], 5, stop_token_ids=[], questions=[q]).tokens[0] for q in questions]
    if dtype == "float16":
        expected = [from_copy(a, context, q, dtype) for q in questions]
    one, two = (Scheduler(e, prefill_chunk=32, context_cache_dtype=dtype) for e in (a, b))
    try:
        one.on_context_compressed = lambda key, snapshot: made.append((key, snapshot))
        first = one.submit(ask(context, questions[0])).result(120)
        assert first.context_cache_hit is False and first.token_ids == expected[0]
        assert len(made) == 1 and made[0][0] == one.context_key(ask(context, questions[0]))
        key, snapshot = made[0]
        assert one.holds_context(key) and one.cached_context_keys() == [key]
        # the host copy pickles (Ray's object store) and restores into the other engine
        host = pickle.loads(pickle.dumps(to_host(snapshot)))
        assert isinstance(host, HostSnapshot) and host.nbytes == snapshot.nbytes
        assert all(isinstance(k, np.ndarray) and k.dtype == np.dtype(dtype) for k in host.keys)
        copy = from_host(host, b)
        assert type(copy.row.keys[0]) is type(snapshot.row.keys[0])
        # the same request names the same context on the other replica (one engine, one policy, one budget)
        assert two.context_key(ask(context, questions[1])) == key and not two.holds_context(key)
        two.offer_context(key, copy)
        second = two.submit(ask(context, questions[1])).result(120)
        assert second.context_cache_hit is True and second.token_ids == expected[1]
        assert two.cached_context_keys() == [key]
        with pytest.raises(RequestError, match="no context"):
            two.context_key(Request(questions[0], SamplingParams(max_tokens=3)))
    finally:
        one.close()
        two.close()
        a.close()
        b.close()


def test_an_offered_context_that_does_not_fit_is_compressed_instead(engine_dir):
    folder, model = engine_dir
    engine = load_engine(folder, "onnxruntime", model, threads=1)
    context, question = prompt(150, seed=6), prompt(5, seed=7)
    expected = engine.generate([context], 5, stop_token_ids=[], questions=[question]).tokens[0]
    maker = Scheduler(engine, prefill_chunk=32, context_cache_dtype="float32")  # exact copies: generate's tokens
    made = []
    maker.on_context_compressed = lambda key, snapshot: made.append((key, snapshot))
    try:
        maker.submit(ask(context, question)).result(120)
    finally:
        maker.close()
    key, snapshot = made[0]
    tight = Scheduler(engine, prefill_chunk=32, context_cache_mib=snapshot.nbytes / 2**20 / 2,  # half its size
                      context_cache_dtype="float32")
    try:
        tight.offer_context(key, snapshot)
        out = tight.submit(ask(context, question)).result(120)
        assert out.context_cache_hit is False and out.token_ids == expected  # compressed here, the same answer
    finally:
        tight.close()
        engine.close()


def test_store_keys_name_engine_policy_budget_and_tokens():
    ids = list(range(40))
    base = context_key(ids, '{"name": "p"}', None)
    keys = {store_key("m", "e1", "B", base), store_key("m", "e2", "B", base), store_key("m", "e1", "C", base),
            store_key("m", "e1", "B", context_key(ids, '{"name": "q"}', None)),
            store_key("m", "e1", "B", context_key(ids, '{"name": "p"}', 16)),
            store_key("m", "e1", "B", context_key(ids[:-1], '{"name": "p"}', None))}
    assert len(keys) == 6
    assert route_digest(base[0]) == base[0][:16] and len(route_digest(base[0])) == 16
