"""The prefix cache of plain prompts (criticalkv/serving/prefix_cache.py): its block chains and LRU alone, then on tiny
engines on ONNX Runtime, torch and OpenVINO (every CPU backend with an extend graph): a prompt whose first blocks are
cached prefills only the rest, and keeps the entries, returns the logits and generates the tokens of a cold run."""

import os

import numpy as np
import pytest
import torch

from criticalkv import KVPolicy
from criticalkv.request import Request, SamplingParams
from criticalkv.runtime import EngineError
from criticalkv.runtime.backend import PromptEntries
from criticalkv.serving import Scheduler
from criticalkv.serving.prefix_cache import PrefixCache, block_hashes
from export.tiny_engine import export_tiny_engine, load_engine
from hf.conftest import tiny_model

BACKENDS = ["onnxruntime", "torch", "openvino"]


def prompt(n, seed=1):
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def entries(tokens: int, fill: float = 0.0) -> PromptEntries:
    """Stand-in entries of ``tokens`` tokens: 2 layers, 1 KV head, d_h 4 (float32: 64 bytes per token)."""
    return PromptEntries(keys=np.full((2, 1, tokens, 4), fill, np.float32),
                         values=np.full((2, 1, tokens, 4), fill, np.float32))


# ---------------------------------------------------------------------------------------------- the cache alone
def test_a_blocks_hash_stands_for_its_whole_prefix():
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2  # full blocks only: the last 8 tokens make none
    assert block_hashes(list(range(32)), 16) == a  # a longer prompt with the same beginning: the same chain
    other = block_hashes([99] + list(range(1, 40)), 16)
    assert other[0] != a[0] and other[1] != a[1]  # block 1's tokens are equal, its prefix is not
    assert block_hashes(list(range(16, 32)), 16)[0] != a[1]  # the same tokens as a first block: another block
    assert block_hashes(list(range(10)), 16) == []


def test_lookup_finds_the_longest_cached_run_and_eviction_takes_a_chains_last_blocks_first():
    cache = PrefixCache(capacity_bytes=64 * 16 * 6, block_size=16)  # room for 6 blocks
    first, second = block_hashes(list(range(64)), 16), block_hashes(list(range(32)) + [7] * 32, 16)
    assert cache.add(first, 0, [entries(16, j) for j in range(4)]) == 4
    assert cache.add(second, 2, [entries(16, 10 + j) for j in range(2)]) == 2  # shares first's two leading blocks
    assert len(cache) == 6 and cache.stats.bytes_held == 6 * 64 * 16
    got = cache.lookup(first)
    assert [int(e.keys[0, 0, 0, 0]) for e in got] == [0, 1, 2, 3]
    assert [int(e.keys[0, 0, 0, 0]) for e in cache.lookup(second, max_blocks=3)] == [0, 1, 10]
    # a chain that branches off after one block: two more blocks must go: second's last one (its lookup stopped
    # before it), then first's last one (least recently used first, a block never before its descendants)
    third = block_hashes(list(range(16)) + [5] * 32, 16)
    assert cache.add(third, 1, [entries(16, 20), entries(16, 21)]) == 2
    assert cache.cached(first) == 3 and cache.cached(second) == 3 and cache.cached(third) == 3
    assert cache.stats.evictions == 2 and len(cache) == 6


def test_add_stops_at_the_capacity_and_keeps_its_own_chain():
    cache = PrefixCache(capacity_bytes=64 * 16 * 3, block_size=16)
    chain = block_hashes(list(range(80)), 16)
    assert cache.add(chain, 0, [entries(16) for _ in range(5)]) == 3  # the chain's first three: its later blocks never
    assert cache.cached(chain) == 3 and cache.stats.evictions == 0
    assert cache.add(chain, 4, [entries(16)]) == 0  # block 3 is not held: block 4 could never be found
    assert cache.add(chain, 3, [entries(16)], capacity_bytes=0) == 0
    cache.record(80, 48)
    cache.record(20, 0)
    assert cache.stats.as_dict() == {"queries": 100, "hits": 48, "requests": 2, "hit_requests": 1, "evictions": 0,
                                     "bytes_held": 3 * 1024, "blocks": 3}
    assert cache.shrink(1024, keep=frozenset(chain[:1])) == 2048 and cache.cached(chain) == 1
    with pytest.raises(ValueError, match="block size"):
        PrefixCache(100, block_size=0)


# ---------------------------------------------------------------------------------------------- on engines
def load(folder, backend, model):
    if backend == "openvino":
        pytest.importorskip("openvino")
        from criticalkv.runtime import Engine

        return Engine.load(folder, backend="openvino", threads=1, cache_dir="")  # its default precision: bf16 here
    return load_engine(folder, backend, model, threads=1)


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request, tmp_path_factory):
    """An engine with extend and select graphs whose heads keep different counts (ada-criticalkv)."""
    folder = tmp_path_factory.mktemp("prefix")
    model = tiny_model("llama", seed=4)
    engine = load(export_tiny_engine(model, KVPolicy("ada-criticalkv", budget=40, window=8), folder, max_batch_size=3,
                                     extend_chunk=32, max_question_len=24), request.param, model)
    yield engine
    engine.close()


def chunked(engine, ids, prefix=(), chunk=32, keep_buffer=False):
    job = engine.begin_prefill(Request(ids), prefix=prefix)
    while not engine.prefill_step(job, chunk):
        pass
    result = engine.finish_prefill(job, engine.free_slots()[0], keep_buffer=keep_buffer)
    engine.release_all()
    return job, result


def assert_same(engine, got, want):
    assert got.kept_entries == want.kept_entries
    for layer, (a, b) in enumerate(zip(got.kept_indices, want.kept_indices)):
        assert np.array_equal(a, b), f"layer {layer}"
    if engine.backend.name == "torch":  # its CPU matmuls round a chunk's rows by the chunk's shape
        np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    else:  # ONNX Runtime, OpenVINO: a token's entries do not depend on where the chunks end
        assert np.array_equal(got.logits, want.logits)


def test_a_cached_prefix_keeps_a_cold_prefills_entries(engine):
    assert engine.caches_prompts
    ids = prompt(150, seed=3)
    job, cold = chunked(engine, ids, keep_buffer=True)
    blocks = [engine.prompt_entries(job, j * 16, (j + 1) * 16) for j in range(9)]
    assert blocks[0].keys.shape == (engine.spec["num_layers"], engine.spec["num_kv_heads"], 16, engine.spec["head_dim"])
    assert engine.prefix_limit(150) == 142
    for count in (1, 4, 8):  # 16 to 128 tokens from the cache; the chunks after them end elsewhere than cold's
        warm_job, warm = chunked(engine, ids, prefix=blocks[:count])
        assert warm_job.prefix_tokens == 16 * count
        assert_same(engine, warm, cold)
    longer = ids + prompt(30, seed=4)  # another prompt that begins with the same 144 tokens
    _, cold_longer = chunked(engine, longer)
    _, warm_longer = chunked(engine, longer, prefix=blocks)
    assert_same(engine, warm_longer, cold_longer)
    with pytest.raises(EngineError, match="at most 142"):
        engine.begin_prefill(Request(ids[:150]), prefix=blocks)  # 144 > 150 - window
    job.buffer = None


def submit(scheduler, ids, max_tokens=5):
    return scheduler.submit(Request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))


def test_the_scheduler_reuses_a_prompts_blocks_and_answers_as_a_cold_run(engine):
    doc = prompt(120, seed=10)
    chats = [doc + prompt(20, seed=11), doc + prompt(25, seed=12), doc + prompt(20, seed=11)]
    expected = [engine.generate([c], max_new_tokens=5, stop_token_ids=[]).tokens[0] for c in chats]
    scheduler = Scheduler(engine, prefill_chunk=32, prefix_block=16)
    try:
        assert scheduler.prefix_caching
        outs = [submit(scheduler, c).result(120) for c in chats]
        assert [o.token_ids for o in outs] == expected
        # the first prefills all; the second reuses the document's 7 whole blocks; the third repeats the first and
        # reuses its blocks up to its last window (8 tokens): 140 - 8 = 132 -> 8 blocks
        assert [o.num_cached_tokens for o in outs] == [0, 112, 128]
        stats = scheduler.prefix_cache.stats
        assert (stats.requests, stats.hit_requests, stats.queries, stats.hits) == (3, 2, 140 + 145 + 140, 240)
        # the document's 7 blocks, the first chat's 8th, the second's 8th and 9th (float32: the prefill buffer's type)
        spec = engine.spec
        block = 2 * 4 * 16 * spec["num_layers"] * spec["num_kv_heads"] * spec["head_dim"]
        assert stats.blocks == 10 and stats.bytes_held == 10 * block
        assert scheduler.kv_bytes_reserved == stats.bytes_held  # nothing else held once they are done
        # a prompt within one chunk still goes through the cache: 30 tokens hold one whole block before their last
        # window (8), the document's first, and answer as a cold run
        short = submit(scheduler, doc[:30]).result(120)
        assert short.num_cached_tokens == 16 and stats.requests == 4
        assert short.token_ids == engine.generate([doc[:30]], max_new_tokens=5, stop_token_ids=[]).tokens[0]
        # one with no whole block before its window (23 - 8 < 16) is prefilled at once: no lookup
        tiny = submit(scheduler, doc[:23]).result(120)
        assert tiny.num_cached_tokens == 0 and stats.requests == 4
    finally:
        scheduler.close()
    off = Scheduler(engine, prefill_chunk=32, prefix_cache_mib=0)
    try:
        assert not off.prefix_caching
        assert [submit(off, c).result(120).token_ids for c in chats[:2]] == expected[:2]
        assert off.prefix_cache.stats.requests == 0
    finally:
        off.close()


def test_the_kv_memory_evicts_prefix_blocks_before_a_request_waits(engine):
    full = engine.kv_bytes_full(150)  # one 150-token prompt under prefill
    # memory for one prompt under prefill + ~half a prompt's blocks: each new prompt evicts the older blocks
    scheduler = Scheduler(engine, prefill_chunk=32, prefix_block=16, kv_memory_mib=1.5 * full / 2**20)
    try:
        for seed in range(3):
            out = submit(scheduler, prompt(150, seed=20 + seed), max_tokens=3).result(120)
            assert out.error is None and scheduler.kv_bytes_reserved <= scheduler.kv_memory_bytes
        stats = scheduler.prefix_cache.stats
        assert stats.evictions > 0 and stats.bytes_held > 0
        again = submit(scheduler, prompt(150, seed=22), max_tokens=3).result(120)
        assert again.num_cached_tokens > 0  # the most recent prompt's blocks stayed
    finally:
        scheduler.close()


def test_where_the_prefix_cache_is_off_the_server_says_why(engine):
    import argparse

    from criticalkv.commands.model_options import add_model_arguments, prefix_cache_note
    from criticalkv.serving.prefix_cache import off_reason

    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    parser.add_argument("--engine-dir")
    parse = lambda *a: parser.parse_args(["--engine-dir", str(engine.folder), *a])  # noqa: E731
    assert parse().prefix_cache_mib == 512.0  # on by default, as vLLM's
    assert parse("--no-prefix-cache").prefix_cache_mib == 0.0
    assert prefix_cache_note(parse()) is None and prefix_cache_note(parse("--backend", engine.backend.name)) is None
    assert prefix_cache_note(parse("--no-prefix-cache", "--backend", "tensorrt")) is None  # none asked for
    assert "the tensorrt backend does not copy" in prefix_cache_note(parse("--backend", "tensorrt"))
    assert "--prefill-chunk 0" in prefix_cache_note(parse("--prefill-chunk", "0"))
    assert off_reason("onnxruntime", True, True, 512) is None
    on = Scheduler(engine, prefill_chunk=32)
    on.close()
    assert on.prefix_caching and on.prefix_cache_off is None
    whole = Scheduler(engine, prefill_chunk=0)  # prompts prefilled at once: no lookup, the same tokens
    try:
        assert not whole.prefix_caching and "--prefill-chunk 0" in whole.prefix_cache_off
        ids = prompt(140, seed=40)
        want = engine.generate([ids], max_new_tokens=3, stop_token_ids=[]).tokens[0]
        assert [submit(whole, ids, 3).result(120).token_ids for _ in range(2)] == [want, want]
        assert whole.prefix_cache.stats.requests == 0 and whole.kv_bytes_reserved == 0
    finally:
        whole.close()


# ---------------------------------------------------------------------------------------------- streams
@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_a_policy_scored_by_a_stream_gets_the_cached_blocks_stream(backend, tmp_path):
    # kvzip-criticalkv with KVzip's surrogate: its scores come from a stream the extend graph returns per entry; a
    # cached block carries its entries' stream, so the selection ranks the whole prompt as a cold run does
    from criticalkv.hf.surrogate import collect, fit
    from criticalkv.methods.surrogate import FOLDER_FILE, KVzipSurrogate, fingerprint

    model = tiny_model("llama", seed=5)
    model.config._name_or_path = str(tmp_path / "model")
    samples = collect(model, [prompt(160, seed=s) for s in range(4)], 64, KVPolicy("kvzip", kvzip_chunk=64))
    weight, bias, metrics = fit(samples, ridge=1e-3, held_out=0.34)
    (tmp_path / "model").mkdir()
    KVzipSurrogate(weight, bias, fingerprint(model), metrics).save(tmp_path / "model" / FOLDER_FILE)
    policy = KVPolicy("kvzip-criticalkv", budget=40, window=8, kvzip_score="surrogate")
    engine = load_engine(export_tiny_engine(model, policy, tmp_path / "e", extend_chunk=32, max_question_len=24),
                         backend, model, threads=1)
    try:
        assert engine.streams == {"kvzip_score"}
        ids = prompt(150, seed=30)
        job, cold = chunked(engine, ids, keep_buffer=True)
        blocks = [engine.prompt_entries(job, j * 16, (j + 1) * 16) for j in range(6)]
        assert blocks[0].streams["kvzip_score"].shape == (model.config.num_hidden_layers, 2, 16)
        _, warm = chunked(engine, ids, prefix=blocks)
        assert_same(engine, warm, cold)
        with pytest.raises(EngineError, match="stream 'kvzip_score'"):
            engine.begin_prefill(Request(ids), prefix=[PromptEntries(b.keys, b.values) for b in blocks])
    finally:
        engine.close()


# ---------------------------------------------------------------------------------------------- the bundled model
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["onnxruntime", pytest.param("openvino", marks=pytest.mark.skipif(
    not os.environ.get("CRITICALKV_SLOW_OPENVINO"), reason="~160 s of OpenVINO compiles on 2 cores: set "
    "CRITICALKV_SLOW_OPENVINO=1 (tiny engines cover OpenVINO in every run)"))])
def test_the_bundled_model_answers_a_repeated_document_as_a_cold_run(backend, tmp_path_factory):
    # SmolLM2-135M-Instruct (30 layers, GQA 9/3), criticalkv at budget 256 (window 32): a ~900-token document asked
    # two questions as plain prompts, chunks of 256 (the README engine's attention block). The second prompt's prefill
    # starts after the cached blocks of the document (all but its last window of 32 tokens); its kept entries and
    # logits are bitwise a cold chunked prefill's, and the scheduler's tokens are those of a cold run (without the
    # cache). OpenVINO at its default precision (the server's: bf16 on this CPU)
    from pathlib import Path

    from criticalkv.runtime import Engine

    if backend == "openvino":
        pytest.importorskip("openvino")
    folder, tokenizer = bundled_engine(tmp_path_factory)
    engine = Engine.load(folder, backend=backend, threads=1, verify=False,
                         **({"cache_dir": ""} if backend == "openvino" else {}))
    try:
        text = (Path(__file__).resolve().parents[2] / "examples" / "needle_2k.txt").read_text()
        doc = tokenizer(text)["input_ids"][:900]
        chats = [doc + tokenizer("\n\n" + q)["input_ids"] for q in QUESTIONS]
        shared = next(i for i, (a, b) in enumerate(zip(*chats)) if a != b)  # the document and what follows it
        reused = min(shared // 16, engine.prefix_limit(len(chats[1])) // 16)  # all but the last window (32) run
        assert reused >= 50
        job, first = chunked(engine, chats[0], chunk=256, keep_buffer=True)
        blocks = [engine.prompt_entries(job, j * 16, (j + 1) * 16) for j in range(reused)]
        job.buffer = None
        _, cold = chunked(engine, chats[1], chunk=256)
        warm_job, warm = chunked(engine, chats[1], prefix=blocks, chunk=256)
        assert warm_job.prefix_tokens == 16 * reused
        assert_same(engine, warm, cold)

        # the cold run: the same scheduler without the cache (OpenVINO's bf16 one-shot prefill graph rounds otherwise
        # than its extend chunks, so its generate() may differ from any chunked prefill; ONNX Runtime's does not)
        off = Scheduler(engine, prefill_chunk=256, prefix_cache_mib=0)
        try:
            expected = [submit(off, c, max_tokens=6).result(300).token_ids for c in chats]
        finally:
            off.close()
        if backend == "onnxruntime":
            assert expected == [engine.generate([c], max_new_tokens=6, stop_token_ids=[]).tokens[0] for c in chats]
        scheduler = Scheduler(engine, prefill_chunk=256)
        try:
            assert scheduler.prefix_caching
            outs = [submit(scheduler, c, max_tokens=6).result(300) for c in chats]
            assert [o.token_ids for o in outs] == expected
            assert [o.num_cached_tokens for o in outs] == [0, 16 * reused]
            assert outs[1].kv_bytes_kept == outs[0].kv_bytes_kept  # budget 256 per head either way
        finally:
            scheduler.close()
    finally:
        engine.close()


QUESTIONS = ("What is the main subject of the text above?", "Which people or places does the text above mention?")
_BUNDLED = {}


def bundled_engine(tmp_path_factory):
    """The bundled model's engine at budget 256 for prompts up to 1,000 tokens (exported once per session)."""
    if "folder" not in _BUNDLED:
        from criticalkv.build import export_engine
        from criticalkv.export import BuildConfig
        from criticalkv.hf import load_model
        from criticalkv.runtime.manifest import write_manifest

        model, tokenizer = load_model()
        folder = tmp_path_factory.mktemp("bundled")
        config = BuildConfig(max_input_len=1000, max_new_tokens=8, max_batch_size=2)
        _, content = export_engine(model, KVPolicy("criticalkv", budget=256), folder, config, tokenizer,
                                   model_name="bundled", validate=False)
        write_manifest(folder, content)
        _BUNDLED["folder"] = folder, tokenizer
    return _BUNDLED["folder"]
