"""criticalkv.serving.Scheduler in process (no server): continuous batching on a tiny engine, on ONNX Runtime and on
the torch backend (the scheduler drives both through the Engine API alone)."""

import threading

import numpy as np
import pytest
import torch

from criticalkv import KVPolicy
from criticalkv.runtime import Engine, EngineError
from criticalkv.request import Request, SamplingParams
from criticalkv.serving import RequestError, Scheduler
from export.tiny_engine import ENGINE_BACKENDS, export_tiny_engine, load_engine
from hf.conftest import tiny_model


def prompt(n, seed=1):
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=ENGINE_BACKENDS)
def engine(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("engine")
    policy = KVPolicy("criticalkv", budget=40, window=8)
    model = tiny_model("llama", seed=4)
    engine = load_engine(export_tiny_engine(model, policy, folder, max_batch_size=4), request.param, model)
    yield engine
    engine.close()


@pytest.fixture
def scheduler(engine):
    scheduler = Scheduler(engine, max_num_seqs=4)
    yield scheduler
    scheduler.close()


def submit(scheduler, prompt_ids, max_tokens=None, sampling=None, stop_token_ids=None, kv_budget=None, on_output=None):
    """One request: ``stop_token_ids`` given = exactly those end it (the model's EOS ids do not)."""
    params = sampling or SamplingParams()
    params = SamplingParams(max_tokens=max_tokens, temperature=params.temperature, top_p=params.top_p, seed=params.seed,
                            stop_token_ids=tuple(stop_token_ids or ()), ignore_eos=stop_token_ids is not None)
    return scheduler.submit(Request(prompt_ids, params, kv_budget), on_output=on_output)


def first_token_order():
    """(the names in the order their first token came, ``first(name)``: an ``on_output`` callback that records it)."""
    firsts, lock = [], threading.Lock()

    def first(name):
        def on_output(out):
            with lock:
                if out.new_token_ids and name not in firsts:
                    firsts.append(name)
        return on_output
    return firsts, first


def alone(engine, ids, max_tokens, stop=(), sampling=None):
    return engine.generate([ids], max_new_tokens=max_tokens, stop_token_ids=list(stop), sampling=sampling).tokens[0]


def test_greedy_outputs_do_not_depend_on_the_batch(engine, scheduler):
    # 10 requests of mixed prompt lengths and max_tokens through 4 slots: sequences join and leave the
    # decode batch at different steps and move between rows, yet each equals the request served alone
    requests = [(prompt(20 + 23 * i, seed=i), 3 + (7 * i) % 20) for i in range(10)]
    expected = [alone(engine, ids, m) for ids, m in requests]
    handles = [submit(scheduler, ids, max_tokens=m, stop_token_ids=[]) for ids, m in requests]
    results = [h.result(timeout=120) for h in handles]
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason == "length" and r.error is None for r in results)
    # nothing is held once they are done but the prefix cache's blocks of their prompts
    assert scheduler.num_running == 0 and scheduler.kv_bytes_reserved == scheduler.prefix_cache.stats.bytes_held > 0


def test_streaming_outputs_per_token_and_requests_joining_late(engine, scheduler):
    long = submit(scheduler, prompt(200, seed=40), max_tokens=30, stop_token_ids=[])
    first = next(iter(long))  # the long request is decoding ...
    late = submit(scheduler, prompt(60, seed=41), max_tokens=5, stop_token_ids=[])  # ... when this one arrives
    late_outputs = list(late)
    long_outputs = [first, *long]
    assert [len(o.new_token_ids) for o in long_outputs] == [1] * 30
    assert [t for o in long_outputs for t in o.new_token_ids] == alone(engine, prompt(200, seed=40), 30)
    assert [t for o in late_outputs for t in o.new_token_ids] == alone(engine, prompt(60, seed=41), 5)
    assert [o.finished for o in late_outputs] == [False] * 4 + [True]
    assert late_outputs[-1].ttft_s is not None and late_outputs[-1].ttft_s < late_outputs[-1].elapsed_s
    kept, full = late_outputs[-1].kv_bytes_kept, late_outputs[-1].kv_bytes_full
    assert full == 60 * 2 * 3 * 2 * 16 * 4 and 0 < kept < full  # 60 tokens x 2 heads x 3 layers x K,V x d_h x fp32


def test_async_outputs(engine, scheduler):
    import asyncio

    async def collect():
        handles = [submit(scheduler, prompt(40 + i, seed=50 + i), max_tokens=6, stop_token_ids=[]) for i in range(3)]
        return await asyncio.gather(*[_tokens(h) for h in handles])

    async def _tokens(handle):
        return [t async for out in handle.outputs_async() for t in out.new_token_ids]

    assert asyncio.run(collect()) == [alone(engine, prompt(40 + i, seed=50 + i), 6) for i in range(3)]


def test_stop_tokens_and_sampling_per_request(engine, scheduler):
    ids = prompt(90, seed=3)
    free = alone(engine, ids, 12)
    stop = free[4]
    config = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    sampled = alone(engine, prompt(70, seed=5), 12, sampling=config)
    a = submit(scheduler, ids, max_tokens=12, stop_token_ids=[stop])
    b = submit(scheduler, prompt(70, seed=5), max_tokens=12, sampling=config, stop_token_ids=[])
    c = submit(scheduler, prompt(50, seed=6), max_tokens=12, stop_token_ids=[])
    ra, rb, rc = a.result(60), b.result(60), c.result(60)
    assert ra.token_ids == free[: free.index(stop) + 1] and ra.finish_reason == "stop"
    assert rb.token_ids == sampled
    assert rc.token_ids == alone(engine, prompt(50, seed=6), 12)


def test_cancel_frees_the_slot_at_once(engine):
    scheduler = Scheduler(engine, max_num_seqs=1)
    try:
        outputs = []
        started, checked = threading.Event(), threading.Event()

        def on_output(out):
            outputs.append(out)
            if not started.is_set():  # hold the scheduler at the first token until the queue is looked at: a
                started.set()         # starved test thread must not find the first request already finished
                checked.wait(60)

        first = submit(scheduler, prompt(80, seed=8), max_tokens=32, stop_token_ids=[], on_output=on_output)
        queued = submit(scheduler, prompt(40, seed=9), max_tokens=4, stop_token_ids=[])
        assert started.wait(60)
        try:
            assert scheduler.num_waiting == 1  # one slot: the second request waits
            first.cancel()
        finally:
            checked.set()
        done = queued.result(60)
        assert done.token_ids == alone(engine, prompt(40, seed=9), 4)
        assert outputs[-1].finished and outputs[-1].finish_reason == "cancelled" and len(outputs[-1].token_ids) < 32
    finally:
        scheduler.close()


def test_max_num_seqs_and_the_kv_pool_queue_requests(engine):
    scheduler = Scheduler(engine, max_num_seqs=2)
    try:
        seen = []
        lock = threading.Lock()

        def watch(out):
            with lock:
                seen.append(scheduler.num_running)

        handles = [submit(scheduler, prompt(60 + i, seed=20 + i), max_tokens=10, stop_token_ids=[], on_output=watch)
                   for i in range(3)]
        results = [h.result(60) for h in handles]
        assert max(seen) == 2 and all(r.finish_reason == "length" for r in results)
        assert results[2].queue_s > results[0].queue_s  # the third waited for a slot
        assert [r.token_ids for r in results] == [alone(engine, prompt(60 + i, seed=20 + i), 10) for i in range(3)]
    finally:
        scheduler.close()
    one = engine.kv_bytes_bound(60, 10)  # the KV bytes one such request is charged before its prefill
    pooled = Scheduler(engine, max_num_seqs=4, kv_memory_mib=1.2 * one / 2**20)  # room for one at a time
    try:
        seen.clear()

        def watch_pool(out):
            with lock:
                seen.append((pooled.num_running, pooled.kv_bytes_reserved))

        handles = [submit(pooled, prompt(60, seed=30 + i), max_tokens=10, stop_token_ids=[], on_output=watch_pool)
                   for i in range(3)]
        results = [h.result(60) for h in handles]
        assert [r.token_ids for r in results] == [alone(engine, prompt(60, seed=30 + i), 10) for i in range(3)]
        assert max(n for n, _ in seen) == 1 and max(b for _, b in seen) <= 1.2 * one
        with pytest.raises(RequestError, match="more than the whole KV memory"):
            submit(pooled, prompt(200), max_tokens=32)
    finally:
        pooled.close()


def test_bad_requests_are_refused_with_the_problem_named(engine, scheduler):
    cases = [
        (dict(prompt_ids=[]), "prompt is empty"),
        (dict(prompt_ids=prompt(257)), "more than the engine's max input length 256"),
        (dict(prompt_ids=[5, 500]), r"token ids must lie in \[0, 128\)"),
        (dict(prompt_ids=prompt(10), max_tokens=0), r"max_tokens must be >= 1"),
        (dict(prompt_ids=prompt(10), max_tokens=33), r"max_tokens must lie in \[1, 32\]"),
        (dict(prompt_ids=prompt(10), kv_budget=41), r"kv_budget must lie in \[8, 40\]"),
        (dict(prompt_ids=prompt(10), kv_budget=7), r"kv_budget must lie in \[8, 40\]"),
    ]
    for kwargs, message in cases:
        with pytest.raises(RequestError, match=message):
            submit(scheduler, **kwargs)
    if not engine.backend.accepts_kv_budget:
        with pytest.raises(RequestError, match="built without a runtime budget input; rebuild it"):
            submit(scheduler, prompt(10), kv_budget=20)
    # the built budget itself is always accepted
    assert submit(scheduler, prompt(30), max_tokens=3, kv_budget=40, stop_token_ids=[]).result(60).token_ids == \
        alone(engine, prompt(30), 3)


def test_max_num_seqs_above_the_built_batch_size_is_refused(engine):
    with pytest.raises(EngineError, match="rebuild the engine with --max-batch-size 5"):
        Scheduler(engine, max_num_seqs=5)


def test_backend_decodes_rows_independently(engine):
    # the backend contract the scheduler relies on: a row decoded in a batch == the row decoded alone, and a
    # row moved by move_row decodes as before. Not bitwise across batch sizes: ONNX Runtime's CPU GEMM takes
    # another path for one row (GEMV) than for several, which moves fp32 logits by ~1e-7; the greedy tokens
    # above are identical
    backend = engine.backend
    pres = []
    for p in (prompt(50, seed=11), prompt(120, seed=12)):
        x = np.array([p])
        pres.append(backend.prefill(x, np.ones_like(x), np.arange(len(p))[None]))
    backend.load_row(0, pres[1])
    alone_logits = backend.decode(np.array([4]), np.array([120])).copy()
    backend.load_row(0, pres[0])
    backend.load_row(1, pres[1])
    both = backend.decode(np.array([3, 4]), np.array([50, 120])).copy()
    np.testing.assert_allclose(both[1], alone_logits[0], rtol=0, atol=1e-5)
    backend.load_row(0, pres[0])
    backend.load_row(1, pres[1])
    backend.move_row(1, 0)
    moved = backend.decode(np.array([4]), np.array([120])).copy()
    np.testing.assert_array_equal(moved[0], alone_logits[0])  # same batch size: bitwise


@pytest.fixture(scope="module", params=ENGINE_BACKENDS)
def chunky(request, tmp_path_factory):
    """An engine with extend/select graphs whose attention block (32) the prefill chunks below are multiples of."""
    folder = tmp_path_factory.mktemp("chunky")
    policy = KVPolicy("ada-criticalkv", budget=40, window=8)
    model = tiny_model("llama", seed=4)
    engine = load_engine(export_tiny_engine(model, policy, folder, max_batch_size=4, extend_chunk=32,
                                            max_question_len=24), request.param, model, threads=1)
    yield engine
    engine.close()


def context_request(context, question, max_tokens, kv_budget=None):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(question, params, kv_budget, context_token_ids=context)


def test_chunked_prefill_gives_the_tokens_of_one_prefill(chunky):
    # prompts longer than a chunk go through extend chunks interleaved with the others' decode steps; a chunk of
    # the attention block keeps the one-shot prefill's floats, so every request gets exactly its tokens alone
    requests = [(prompt(70 + 37 * i, seed=60 + i), 4 + 3 * i) for i in range(5)]
    expected = [alone(chunky, ids, m) for ids, m in requests]
    scheduler = Scheduler(chunky, prefill_chunk=32)
    try:
        assert scheduler.chunked
        handles = [submit(scheduler, ids, max_tokens=m, stop_token_ids=[]) for ids, m in requests]
        assert [h.result(120).token_ids for h in handles] == expected
        # every request's reservation returned: what stays held is the prefix cache's blocks of their prompts
        assert scheduler.kv_bytes_reserved == scheduler.prefix_cache.stats.bytes_held > 0
        assert scheduler.context_cache.stats.bytes_held == 0
    finally:
        scheduler.close()


def test_a_plain_prompts_first_token_goes_out_before_its_selection(chunky):
    # the first token is sampled from the last prefill chunk's logits, so it is delivered before the selection over the
    # whole prompt runs (the selection only decides what later tokens attend to); a request that its first token ends
    # runs no selection at all. The tokens are those of the request alone either way
    events = []
    finish_prefill = chunky.finish_prefill

    def observed(job, slot, keep_buffer=False):
        events.append("select")
        return finish_prefill(job, slot, keep_buffer=keep_buffer)

    ids = prompt(100, seed=90)
    expected = alone(chunky, ids, 4)
    scheduler = Scheduler(chunky, prefill_chunk=32)
    chunky.finish_prefill = observed
    try:
        out = submit(scheduler, ids, max_tokens=4, stop_token_ids=[],
                     on_output=lambda o: events.append(tuple(o.new_token_ids))).result(120)
        assert out.token_ids == expected and 0 < out.kv_bytes_kept < out.kv_bytes_full
        assert events == [(expected[0],), "select", *[(t,) for t in expected[1:]]]
        events.clear()
        one = submit(scheduler, prompt(90, seed=91), max_tokens=1, stop_token_ids=[]).result(120)
        assert one.token_ids == alone(chunky, prompt(90, seed=91), 1) and one.finish_reason == "length"
        assert events == [] and one.kv_bytes_kept == 0  # no selection, nothing kept
        assert one.kv_bytes_full == 90 * 2 * 3 * 2 * 16 * 4  # its whole prompt (as in the streaming test above)
        assert scheduler.num_running == scheduler.num_prefilling == 0
        assert scheduler.kv_bytes_reserved == scheduler.prefix_cache.stats.bytes_held > 0  # its blocks were cached
        assert len(chunky.free_slots()) == chunky.num_slots
    finally:
        del chunky.finish_prefill
        scheduler.close()


def test_a_cached_context_answers_like_a_cold_one(chunky):
    # the first request compresses the context (question-agnostic) and caches it; the others restore a copy and
    # only run their question: the same tokens as on a cold cache, which are the engine's generate(questions=...)
    context = prompt(150, seed=70)
    questions = [prompt(6 + i, seed=71 + i) for i in range(4)]
    expected = [chunky.generate([context], 6, stop_token_ids=[], questions=[q]).tokens[0] for q in questions]
    scheduler = Scheduler(chunky, prefill_chunk=64, context_cache_dtype="float32")  # exact copies (float16: below)
    try:
        first = scheduler.submit(context_request(context, questions[0], 6)).result(120)
        assert first.token_ids == expected[0] and first.context_cache_hit is False
        later = [scheduler.submit(context_request(context, q, 6)) for q in questions[1:]]
        outs = [h.result(120) for h in later]
        assert [o.token_ids for o in outs] == expected[1:] and all(o.context_cache_hit for o in outs)
        stats = scheduler.context_cache.stats
        assert (stats.hits, stats.misses, stats.entries) == (3, 1, 1) and stats.bytes_held > 0
        assert outs[0].kv_bytes_kept == first.kv_bytes_kept < first.kv_bytes_full
        # another budget is another context: compressed again
        other = scheduler.submit(context_request(context, questions[1], 6, kv_budget=16)).result(120)
        assert other.context_cache_hit is False and scheduler.context_cache.stats.entries == 2
    finally:
        scheduler.close()
    cold = Scheduler(chunky, context_cache_mib=0)  # no cache: every request compresses its context
    try:
        outs = [cold.submit(context_request(context, q, 6)).result(120) for q in questions]
        assert [o.token_ids for o in outs] == expected and not any(o.context_cache_hit for o in outs)
        assert cold.context_cache.stats.entries == 0
    finally:
        cold.close()


def from_float16_copy(engine, context, question, n):
    """The greedy tokens of ``question`` after ``context`` answered from the context cache's float16 copy of it."""
    from criticalkv.serving.context_cache import narrow

    engine.prefill(0, Request(context))
    half = narrow(engine.save(0), "float16")
    engine.release(0)
    engine.restore(0, half)
    tokens = [int(np.asarray(engine.extend(0, question)).argmax())]
    while len(tokens) < n:
        tokens.append(int(np.asarray(engine.decode([0], [tokens[-1]])[0]).argmax()))
    engine.release(0)
    return tokens


def test_a_float16_cache_answers_from_its_rounded_copy_hit_or_miss(chunky):
    # context_cache_dtype float16: the copy takes half the float32 copy's bytes, and every question about the context,
    # the one that compressed it (a miss) as the later ones (hits), gets the tokens of the engine answering from that
    # rounded copy; float32 keeps the engine's exact tokens
    context = prompt(150, seed=70)
    questions = [prompt(6 + i, seed=71 + i) for i in range(3)]
    rounded = [from_float16_copy(chunky, context, q, 6) for q in questions]
    exact = [chunky.generate([context], 6, stop_token_ids=[], questions=[q]).tokens[0] for q in questions]
    held = {}
    for dtype, expected in (("float16", rounded), ("float32", exact)):
        scheduler = Scheduler(chunky, prefill_chunk=64, context_cache_dtype=dtype)
        try:
            outs = [scheduler.submit(context_request(context, q, 6)).result(120) for q in questions]
            assert [o.token_ids for o in outs] == expected, dtype
            assert [o.context_cache_hit for o in outs] == [False, True, True]
            held[dtype] = scheduler.context_cache.stats.bytes_held
            assert scheduler.kv_bytes_reserved == held[dtype] + scheduler.prefix_cache.stats.bytes_held
        finally:
            scheduler.close()
    assert 0 < 2 * held["float16"] == held["float32"]
    with pytest.raises(ValueError, match="context_cache_dtype: .*one of float32, float16"):
        Scheduler(chunky, context_cache_dtype="bfloat16")


def test_concurrent_requests_on_one_context_compress_it_once(chunky):
    context = prompt(200, seed=80)
    questions = [prompt(5, seed=81 + i) for i in range(4)]
    scheduler = Scheduler(chunky, prefill_chunk=32, context_cache_dtype="float32")  # exact copies: generate's tokens
    try:
        handles = [scheduler.submit(context_request(context, q, 4)) for q in questions]
        outs = [h.result(120) for h in handles]
        assert [o.context_cache_hit for o in outs] == [False, True, True, True]
        assert [o.token_ids for o in outs] == [chunky.generate([context], 4, stop_token_ids=[], questions=[q]).tokens[0]
                                               for q in questions]
    finally:
        scheduler.close()


def test_a_request_waiting_for_its_contexts_compression_lets_later_ones_pass(chunky):
    # A compresses a context in 8 chunks; B asks about the same context and waits for A's copy; C, a short plain prompt
    # sent after B, needs nothing of that compression: it is admitted and answered while A's context is compressed,
    # and B is still answered from the copy (a hit), with the tokens the engine gives it alone
    context = prompt(240, seed=120)
    scheduler = Scheduler(chunky, prefill_chunk=32, context_cache_dtype="float32")
    firsts, first = first_token_order()

    try:
        a = scheduler.submit(context_request(context, prompt(5, seed=121), 3), on_output=first("A"))
        b = scheduler.submit(context_request(context, prompt(5, seed=122), 3), on_output=first("B"))
        c = submit(scheduler, prompt(10, seed=123), max_tokens=3, stop_token_ids=[], on_output=first("C"))
        outs = [h.result(120) for h in (a, b, c)]
        assert firsts == ["C", "A", "B"]
        assert [o.context_cache_hit for o in outs[:2]] == [False, True]
        assert outs[1].token_ids == chunky.generate([context], 3, stop_token_ids=[], questions=[prompt(5, seed=122)]).tokens[0]
        assert outs[2].token_ids == alone(chunky, prompt(10, seed=123), 3)
    finally:
        scheduler.close()


def test_a_hit_passes_a_prompt_that_waits_for_a_prefill_slot(chunky):
    # one prefill slot: A's 240-token prompt takes it for 8 chunks, B's waits for it; C, sent after B, asks about a
    # cached context and needs no prefill: it is admitted and answered while A prefills, before A and B (it waited
    # behind B until A's prefill ended before: A, C, B), from the copy, with the engine's tokens; B's turn is unchanged
    context, question = prompt(150, seed=130), prompt(5, seed=131)
    scheduler = Scheduler(chunky, prefill_chunk=32, max_prefills=1, context_cache_dtype="float32")
    firsts, first = first_token_order()

    try:
        assert scheduler.submit(context_request(context, prompt(5, seed=132), 2)).result(120).context_cache_hit is False
        a = submit(scheduler, prompt(240, seed=133), max_tokens=3, stop_token_ids=[], on_output=first("A"))
        b = submit(scheduler, prompt(240, seed=134), max_tokens=3, stop_token_ids=[], on_output=first("B"))
        c = scheduler.submit(context_request(context, question, 3), on_output=first("C"))
        outs = [h.result(120) for h in (a, b, c)]
        assert firsts == ["C", "A", "B"]
        assert outs[2].context_cache_hit is True
        assert outs[2].token_ids == chunky.generate([context], 3, stop_token_ids=[], questions=[question]).tokens[0]
        assert [o.token_ids for o in outs[:2]] == [alone(chunky, prompt(240, seed=s), 3) for s in (133, 134)]
    finally:
        scheduler.close()


def test_a_failure_between_the_queue_and_the_batch_ends_that_request_alone(chunky):
    # a temperature so small that logits / temperature overflow: the sampler's probabilities are NaN and it raises on
    # the scheduler thread, after the request left the queue and before it joined the decode batch. That request gets
    # an error (never silence), and what it held (its slot, its reservation) is given back at once: the question
    # queued behind it about the same context, and a later one, get their tokens (a slot left occupied would fail
    # every later decode step)
    context = prompt(150, seed=85)
    questions = [prompt(5, seed=86 + i) for i in range(3)]
    expected = [chunky.generate([context], 4, stop_token_ids=[], questions=[q]).tokens[0] for q in questions[1:]]
    scheduler = Scheduler(chunky, prefill_chunk=32, context_cache_dtype="float32")  # exact copies: generate's tokens
    try:
        tiny = SamplingParams(max_tokens=4, temperature=1e-310, seed=1, ignore_eos=True)
        bad = scheduler.submit(Request(questions[0], tiny, context_token_ids=context))
        behind = scheduler.submit(context_request(context, questions[1], 4))
        failed = bad.result(60)
        assert failed.finished and failed.finish_reason == "error" and failed.error.startswith("ValueError")
        assert failed.context_cache_hit is False  # it compressed the context before its first token failed
        outs = [behind.result(60), scheduler.submit(context_request(context, questions[2], 4)).result(60)]
        assert [o.token_ids for o in outs] == expected and [o.error for o in outs] == [None, None]
        assert all(o.context_cache_hit for o in outs)
        assert scheduler.num_running == scheduler.num_prefilling == scheduler.num_waiting == 0
        assert scheduler.kv_bytes_reserved == scheduler.context_cache.stats.bytes_held > 0
        assert len(chunky.free_slots()) == chunky.num_slots
    finally:
        scheduler.close()


def test_the_kv_memory_evicts_cached_contexts_before_requests_wait(chunky):
    contexts = [prompt(150, seed=90 + i) for i in range(3)]
    scheduler = Scheduler(chunky, prefill_chunk=32, context_cache_mib=64)
    try:
        sizes = []
        for context in contexts:
            scheduler.submit(context_request(context, prompt(5), 3)).result(120)
            sizes.append(scheduler.context_cache.stats.bytes_held)
        assert 0 < sizes[0] < sizes[1] < sizes[2]  # every context cached (adakv heads: sizes differ a little)
        one = max(sizes[0], sizes[1] - sizes[0], sizes[2] - sizes[1])
    finally:
        scheduler.close()
    # KV memory for one request's full prompt + about 1.5 cached contexts: admitting a cold request leaves room for one
    # context beside it (the older ones go, least recently used first); once compressed, the request holds only its
    # kept entries and its own copy joins the cache
    need = chunky.kv_bytes_full(150)
    tight = Scheduler(chunky, prefill_chunk=32, kv_memory_mib=(need + 1.5 * one) / 2**20)
    try:
        for context in contexts:
            tight.submit(context_request(context, prompt(5), 3)).result(120)
            assert tight.kv_bytes_reserved <= tight.kv_memory_bytes
        assert tight.context_cache.stats.evictions >= 1 and tight.context_cache.stats.entries <= 2
        again = tight.submit(context_request(contexts[-1], prompt(5), 3)).result(120)
        assert again.context_cache_hit  # the most recent one stayed
    finally:
        tight.close()


def test_a_cache_hit_is_charged_what_it_holds_and_keeps_its_context(chunky):
    # a request whose context is cached needs no prefill: it is charged its copy of the kept entries + its question +
    # its growth, not the context's full size, so admitting it evicts nothing (its own context least of all)
    context = prompt(150, seed=95)
    memory = 1.05 * chunky.kv_bytes_full(150)  # a cold request fits alone; a full-size charge and the copy would not
    scheduler = Scheduler(chunky, prefill_chunk=32, kv_memory_mib=memory / 2**20)
    try:
        first = scheduler.submit(context_request(context, prompt(5, seed=96), 3)).result(120)
        assert first.context_cache_hit is False and scheduler.context_cache.stats.entries == 1
        again = scheduler.submit(context_request(context, prompt(5, seed=97), 3)).result(120)
        assert again.context_cache_hit and scheduler.context_cache.stats.evictions == 0
    finally:
        scheduler.close()
