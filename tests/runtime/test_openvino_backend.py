"""The OpenVINO backend (criticalkv/runtime/openvino_backend.py) on tiny random checkpoints, against the PyTorch path.

* f32 (``precision="f32"``): every policy of tests/policies.py keeps the PyTorch path's entries in every layer and KV
  head of a left-padded batch, at the built and a smaller request budget, and generates its greedy tokens (a head may
  differ only by a swap at a near tie, as on ONNX Runtime: ``model_families.swap_within_noise``); a policy whose
  selection the CPU plugin cannot compute (defensivekv: 48-bit integer sums) has no OpenVINO graphs and is refused
  with the reason;
* the chunked prefill (extend + select) keeps the one-shot prefill's entries, a question after a compressed context
  gives the PyTorch path's tokens, a method's re-read passes run (kvzip), and the serving scheduler (chunked prefill,
  the context cache) gives what the engine gives alone;
* the CPU plugin's default precision (bf16 where the CPU has it) within the flash-attention rule: its last logits at
  most 2x as far from the float64 model as PyTorch's own bf16 model is (plus a small floor), and its kept sets at most
  2x the entries PyTorch's bf16 run misses against float64 (plus one per head), near ties included.
"""

import numpy as np
import pytest
import torch

from criticalkv import KVPolicy
from criticalkv.hf import generate
from criticalkv.request import Request, SamplingParams
from criticalkv.runtime import Engine, EngineError
from criticalkv.serving import Scheduler
from export.tiny_engine import export_tiny_engine
from model_families import family, random_checkpoint, random_prompt, recorded_layers, swap_within_noise
from policies import POLICY_CASES, make_policy

pytest.importorskip("openvino")

WINDOW, BUDGET = 8, 48
LENGTHS = (150, 97)  # a left-padded batch: both compressed, the second with 53 padding positions
NEW_TOKENS = 3
CASES = POLICY_CASES + [("layer-defensivekv", dict(name="layer-defensivekv"))]
#: the policies whose selection the CPU plugin computes differently (int64 as int32): no openvino graphs
REFUSED = ("defensivekv", "defensivekv-mass0.2", "layer-defensivekv")


def load(folder, **options):
    """The engine on OpenVINO, one thread, no compiled-model cache (a test's engine is built once)."""
    return Engine.load(folder, backend="openvino", threads=1, cache_dir="", **{"precision": "f32", **options})


@pytest.fixture(scope="module")
def model():
    return random_checkpoint(family("llama3-gqa"), seed=3)


def padded_batch(prompts):
    n = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), n, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, n - len(p):], mask[row, n - len(p):] = torch.tensor(p), 1
    return ids, mask


@pytest.mark.parametrize("case_id, kwargs", CASES, ids=[c[0] for c in CASES])
def test_every_policy_keeps_the_pytorch_paths_entries_at_f32(case_id, kwargs, model, tmp_path, monkeypatch):
    built = make_policy(kwargs, budget=BUDGET, window=WINDOW)
    folder = export_tiny_engine(model, built, tmp_path / case_id, max_input_len=160, max_new_tokens=NEW_TOKENS,
                                max_batch_size=2)
    if case_id in REFUSED:
        with pytest.raises(EngineError, match="int64 as int32"):
            load(folder)
        return
    prompts = [random_prompt(n, seed=300 + n) for n in LENGTHS]
    ids, mask = padded_batch(prompts)
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    engine = load(folder)
    try:
        assert engine.backend.precision == "f32"
        for budget in ((BUDGET, 20) if built.method.base.evicts else (BUDGET,)):
            policy = built.with_budget(budget)
            if built.method.scored_apart:  # each prompt scored alone by its method's phases (kvzip's re-read)
                refs = [generate(model, torch.tensor([p]), policy, max_new_tokens=NEW_TOKENS) for p in prompts]
                wanted = [[[[i for i in ref.prefill.selections[layer].indices[0, head].tolist() if i >= 0]
                            for head in range(kv_heads)] for ref in refs] for layer in range(layers)]
                ref_tokens = [ref.tokens[0] for ref in refs]
            else:
                ref = generate(model, ids, policy, max_new_tokens=NEW_TOKENS, attention_mask=mask)
                wanted = [[[[i for i in selection.indices[row, head].tolist() if i >= 0] for head in range(kv_heads)]
                           for row in range(len(prompts))] for selection in ref.prefill.selections]
                ref_tokens = ref.tokens
            got = engine.generate(prompts, max_new_tokens=NEW_TOKENS, stop_token_ids=[],
                                  kv_budget=budget if built.method.base.evicts else None)
            inputs, swaps = None, 0
            for layer in range(layers):
                for row in range(len(prompts)):
                    for head in range(kv_heads):
                        kept, want = got.kept(layer, row, head), wanted[layer][row][head]
                        if kept == want:
                            continue
                        if inputs is None and not built.method.model_level and not built.method.scored_apart:
                            inputs = recorded_layers(model, ids, mask, policy, monkeypatch)
                        assert inputs is not None and swap_within_noise(policy, inputs[layer], row, head, kept), (
                            f"{case_id}, budget {budget}: layer {layer}, row {row}, KV head {head}: OpenVINO only "
                            f"{sorted(set(kept) - set(want))}, PyTorch only {sorted(set(want) - set(kept))}")
                        swaps += 1
            if not swaps:
                assert got.tokens == ref_tokens, f"{case_id}, budget {budget}"
    finally:
        engine.close()


def test_prompts_shorter_than_the_attention_pieces_generate_onnx_runtimes_tokens(model, tmp_path):
    """The openvino prefill splits a prompt's queries into OPENVINO_ATTENTION_PIECES causal pieces: prompts of 1 and
    3 tokens (empty pieces) and left-padded batches give ONNX Runtime's tokens at f32."""
    from criticalkv.export.decoder import OPENVINO_ATTENTION_PIECES

    assert OPENVINO_ATTENTION_PIECES > 3
    folder = export_tiny_engine(model, KVPolicy("criticalkv", budget=40, window=8), tmp_path / "e", max_batch_size=2)
    ort, ov = Engine.load(folder), load(folder)
    try:
        for prompts in ([random_prompt(1, 1)], [random_prompt(3, 2)], [random_prompt(2, 3), random_prompt(58, 4)],
                        [random_prompt(9, 5), random_prompt(1, 6)]):
            want = ort.generate(prompts, 4, stop_token_ids=[]).tokens
            assert ov.generate(prompts, 4, stop_token_ids=[]).tokens == want, [len(p) for p in prompts]
    finally:
        ort.close()
        ov.close()


@pytest.fixture(scope="module", params=["ada-criticalkv", "kvzip"])
def chunky(request, model, tmp_path_factory):
    """An engine with its extend and select graphs (kvzip: its re-read passes through reread.onnx)."""
    folder = tmp_path_factory.mktemp(request.param)
    policy = KVPolicy(request.param, budget=40, window=8)
    engine = load(export_tiny_engine(model, policy, folder, max_batch_size=3, extend_chunk=32, max_question_len=24))
    yield engine
    engine.close()


def test_chunked_prefill_keeps_the_one_shot_prefills_entries(chunky):
    ids = random_prompt(137, seed=5)
    one = chunky.prefill(0, Request(ids))
    job = chunky.begin_prefill(Request(ids))
    while not chunky.prefill_step(job, 32):
        pass
    chunked = chunky.finish_prefill(job, 1)
    # the chunks' attention sums in another order than the whole prompt's: close floats, the same entries
    np.testing.assert_allclose(chunked.logits, one.logits, rtol=1e-4, atol=1e-4)
    assert chunked.kept_entries == one.kept_entries
    for a, b in zip(one.kept_indices, chunked.kept_indices):
        assert np.array_equal(a, b)
    chunky.release_all()


def test_a_question_after_a_compressed_context_equals_the_pytorch_path(chunky, model):
    context, question = random_prompt(120, seed=11), random_prompt(13, seed=12)
    got = chunky.generate([context], max_new_tokens=8, stop_token_ids=[], questions=[question]).tokens[0]
    ref = generate(model, torch.tensor([context]), chunky.policy, 8, question_ids=torch.tensor([question]))
    assert got == ref.tokens[0]


def test_the_scheduler_serves_a_cached_context_on_openvino(chunky):
    context = random_prompt(150, seed=70)
    questions = [random_prompt(6 + i, seed=71 + i) for i in range(3)]
    expected = [chunky.generate([context], 5, stop_token_ids=[], questions=[q]).tokens[0] for q in questions]
    scheduler = Scheduler(chunky, prefill_chunk=64, context_cache_dtype="float32")  # exact copies: the engine's tokens
    try:
        params = SamplingParams(max_tokens=5, ignore_eos=True)
        first = scheduler.submit(Request(questions[0], params, context_token_ids=context)).result(120)
        later = [scheduler.submit(Request(q, params, context_token_ids=context)) for q in questions[1:]]
        outs = [first] + [h.result(120) for h in later]
        assert [o.token_ids for o in outs] == expected
        assert [o.context_cache_hit for o in outs] == [False, True, True]
        plain = [random_prompt(70 + 29 * i, seed=60 + i) for i in range(3)]  # chunked prefill beside decode steps
        alone = [chunky.generate([p], 4, stop_token_ids=[]).tokens[0] for p in plain]
        handles = [scheduler.submit(Request(p, SamplingParams(max_tokens=4, ignore_eos=True))) for p in plain]
        assert [h.result(120).token_ids for h in handles] == alone
    finally:
        scheduler.close()


def test_the_context_cache_stores_f32_rows_as_float16_and_widens_them_back(chunky):
    # the context cache's float16 copies (--context-cache-dtype float16) of f32 rows: half the bytes, restored as the
    # rounded values, and the scheduler answers from them as the engine does; bf16 rows are stored as they are
    from dataclasses import replace

    from criticalkv.runtime.backend import RowSnapshot
    from criticalkv.serving.context_cache import narrow, pack

    context, question = random_prompt(150, seed=70), random_prompt(7, seed=71)
    chunky.prefill(0, Request(context))
    exact = chunky.save(0)
    half = narrow(exact, "float16")
    assert half.nbytes * 2 == exact.nbytes and half.row.keys[0].dtype == np.float16
    chunky.release(0)
    chunky.restore(0, half)
    widened = chunky.save(0)
    assert all(np.array_equal(a.astype(np.float32), b) for a, b in zip(half.row.keys + half.row.values,
                                                                       widened.row.keys + widened.row.values))
    tokens = [int(chunky.extend(0, question).argmax())]
    while len(tokens) < 5:
        tokens.append(int(chunky.decode([0], [tokens[-1]])[0].argmax()))
    chunky.release_all()
    # one prefill run, as the engine's above (OpenVINO's chunks sum the attention in another order: close floats)
    scheduler = Scheduler(chunky, prefill_chunk=0, context_cache_dtype="float16")
    try:
        params = SamplingParams(max_tokens=5, ignore_eos=True)
        outs = [scheduler.submit(Request(question, params, context_token_ids=context)).result(120) for _ in range(2)]
        assert [o.token_ids for o in outs] == [tokens, tokens] and [o.context_cache_hit for o in outs] == [False, True]
        # the stored bytes are counted: float16, each KV head's kept entries only (no padding to a layer's longest head)
        assert scheduler.context_cache.stats.bytes_held == pack(half).nbytes <= half.nbytes
    finally:
        scheduler.close()
    bits = [np.zeros(k.shape, np.uint16) for k in exact.row.keys]  # bf16 rows' form (their 16 bits as uint16)
    bf16 = replace(exact, row=RowSnapshot(bits, bits, exact.row.lengths))
    assert narrow(bf16, "float16") is bf16


def test_the_default_precision_is_within_the_flash_attention_rule(model, tmp_path):
    """OpenVINO at its CPU default (bf16 where the CPU has it) against the float64 model and PyTorch's own bf16 run."""
    policy = KVPolicy("criticalkv", budget=BUDGET, window=WINDOW)
    folder = export_tiny_engine(model, policy, tmp_path / "engine", max_input_len=160, max_new_tokens=2,
                                max_batch_size=1)
    ids = random_prompt(150, seed=17)
    engine = load(folder, precision="default")
    try:
        low = engine.backend.precision
        pre = engine.backend.prefill(np.array([ids]), np.ones((1, len(ids)), np.int64), np.arange(len(ids))[None])
    finally:
        engine.close()
    dtype = torch.bfloat16 if low == "bf16" else torch.float32
    x = torch.tensor([ids])
    try:
        with torch.no_grad():
            exact = model.double()(x).logits[0, -1].numpy()
            ref64 = generate(model, x, policy, max_new_tokens=1)
            mine = model.to(dtype)(x).logits[0, -1].float().numpy()
            ref_low = generate(model, x, policy, max_new_tokens=1)
    finally:
        model.float()
    theirs = np.abs(pre.logits[0] - exact).max()
    assert theirs <= 2 * np.abs(mine - exact).max() + 1e-3, (low, theirs, np.abs(mine - exact).max())
    kv_heads = model.config.num_key_value_heads
    for layer in range(model.config.num_hidden_layers):
        for head in range(kv_heads):
            want = {i for i in ref64.prefill.selections[layer].indices[0, head].tolist() if i >= 0}
            torch_low = {i for i in ref_low.prefill.selections[layer].indices[0, head].tolist() if i >= 0}
            ours = {int(i) for i in pre.indices[layer][0, head] if i >= 0}
            assert len(want - ours) <= 2 * len(want - torch_low) + 1, (low, layer, head)


def test_bf16_rows_serve_like_the_engine_alone(model, tmp_path):
    """At the CPU's default precision (bf16 rows where the plugin computes in bf16): a cached context, a question
    through the extend graph over a bf16 row and decoding give what the engine gives each request alone; the rows
    take half the bytes of float32 ones."""
    policy = KVPolicy("criticalkv", budget=40, window=8)
    folder = export_tiny_engine(model, policy, tmp_path / "engine", max_batch_size=3, extend_chunk=32,
                                max_question_len=24)
    engine = load(folder, precision="default")
    try:
        bf16 = engine.backend.precision == "bf16"
        assert engine.backend.kv_dtype == (np.uint16 if bf16 else np.float32)
        f32 = load(folder)
        assert engine.backend.kv_buffer_bytes() * (2 if bf16 else 1) == f32.backend.kv_buffer_bytes()
        f32.close()
        context = random_prompt(150, seed=70)
        questions = [random_prompt(6 + i, seed=71 + i) for i in range(3)]
        expected = [engine.generate([context], 5, stop_token_ids=[], questions=[q]).tokens[0] for q in questions]
        scheduler = Scheduler(engine, prefill_chunk=64, context_cache_dtype="float32")  # f32 rows where no bf16: exact
        try:
            params = SamplingParams(max_tokens=5, ignore_eos=True)
            outs = [scheduler.submit(Request(q, params, context_token_ids=context)).result(120) for q in questions]
            assert [o.token_ids for o in outs] == expected
            assert [o.context_cache_hit for o in outs] == [False, True, True]
        finally:
            scheduler.close()
    finally:
        engine.close()
