"""The Engine over the extend and select graphs: chunked prefill, a question after a compressed context, the
engine against the PyTorch path (``criticalkv.hf.generate(question_ids=...)``) token for token; on ONNX Runtime and
on the torch backend (the same engine directories through the model's own layers)."""

import numpy as np
import pytest
import torch

from criticalkv.hf import generate as torch_generate
from criticalkv.runtime import Engine, EngineError, Request, SamplingParams
from criticalkv.runtime.engine import PREFILL_RUN
from criticalkv.sampling import Sampler
from export.tiny_engine import ENGINE_BACKENDS, export_tiny_engine, load_engine
from hf.conftest import tiny_model
from policies import POLICY_CASES, make_policy

IDS = [c[0] for c in POLICY_CASES]
CHUNK = 32  # the tiny engines' attention block (export_tiny_engine): chunks of it are exact


def prompt(n, seed=1):
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=4)


@pytest.fixture(scope="module", params=[(case, backend) for case in POLICY_CASES for backend in ENGINE_BACKENDS],
                ids=[f"{case_id}-{backend}" for case_id in IDS for backend in ENGINE_BACKENDS])
def engine(request, model, tmp_path_factory):
    (case_id, kwargs), backend = request.param
    policy = make_policy(kwargs, budget=40, window=8)
    folder = tmp_path_factory.mktemp(case_id)
    # one thread: ONNX Runtime's GEMM over non-prepacked (shared) weights splits its work across threads by the
    # number of rows, so with two threads a chunk's rows may round differently from the whole prompt's (~1e-7)
    engine = load_engine(export_tiny_engine(model, policy, folder, extend_chunk=CHUNK, max_question_len=24), backend,
                         model, threads=1)
    yield engine
    engine.release_all()
    engine.close()


def greedy(logits):
    return int(Sampler()(np.asarray(logits)[None, :])[0])


def decode_greedy(engine, slot, first, steps):
    tokens = [first]
    for _ in range(steps):
        tokens.append(greedy(engine.decode([slot], [tokens[-1]])[0]))
    return tokens


@pytest.mark.parametrize("n, step", [(107, CHUNK), (37, CHUNK), (150, 2 * CHUNK)])
def test_chunked_prefill_is_the_one_shot_prefill(engine, n, step):
    # chunks that are multiples of the attention block: the same logits and kept entries bitwise, so the same
    # tokens; 107 = 3 chunks + a last one of 11 (longer than the window 8), 37 = 1 chunk + 5 (shorter than it),
    # 150 in chunks of two blocks (one run of the graph each: these backends' extend graphs take any number of
    # tokens, so a chunk runs in pieces of Engine.prefill_run, not of the build's extend_chunk = CHUNK)
    assert engine.prefill_run == max(CHUNK, PREFILL_RUN) > CHUNK
    ids = prompt(n, seed=n)
    one = engine.prefill(0, Request(ids))
    one_row = engine.save(0)
    one_tokens = decode_greedy(engine, 0, greedy(one.logits), 5)
    engine.release(0)
    job = engine.begin_prefill(Request(ids))
    runs, extend_buffer = [], engine.backend.extend_buffer
    engine.backend.extend_buffer = lambda buffer, token_ids, positions: \
        runs.append(token_ids.shape[1]) or extend_buffer(buffer, token_ids, positions)
    try:
        steps = 0
        while not engine.prefill_step(job, step):
            steps += 1
    finally:
        del engine.backend.extend_buffer
    assert steps == -(-n // step) - 1 and job.remaining == 0
    assert runs == [min(step, n - at) for at in range(0, n, step)]  # one run per chunk
    chunked = engine.finish_prefill(job, 1)
    # ONNX Runtime: bitwise. torch: a chunk's attention (SDPA over the chunk's queries and the buffer's keys) rounds
    # differently from the whole prompt's by ~1e-7, so the floats are close and the kept entries and tokens the same
    same = np.array_equal if engine.backend.name == "onnxruntime" else \
        (lambda a, b: np.allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5))
    assert same(chunked.logits, one.logits) and chunked.kept_entries == one.kept_entries
    row = engine.save(1)
    for layer in range(len(row.row.keys)):
        assert np.array_equal(np.asarray(row.row.lengths[layer]), np.asarray(one_row.row.lengths[layer]))
        assert same(row.row.keys[layer], one_row.row.keys[layer])
        assert same(row.row.values[layer], one_row.row.values[layer])
    assert decode_greedy(engine, 1, greedy(chunked.logits), 5) == one_tokens
    engine.release_all()


def test_a_question_after_a_compressed_context_equals_the_pytorch_path(engine, model):
    # the context compressed alone (question-agnostic), the question through the extend graph, then decoding:
    # token for token what criticalkv.hf.generate(context, question_ids=question) gives
    context, question = prompt(120, seed=11), prompt(13, seed=12)
    got = engine.generate([context], max_new_tokens=10, stop_token_ids=[], questions=[question]).tokens[0]
    ref = torch_generate(model, torch.tensor([context]), engine.policy, 10, question_ids=torch.tensor([question]))
    assert got == ref.tokens[0]


def test_extend_through_a_slot_in_pieces_equals_one_piece(engine):
    context = prompt(90, seed=21)
    question = prompt(40, seed=22)  # longer than the extend chunk: two runs of the graph
    engine.prefill(0, Request(context))
    whole = engine.extend(0, question)
    engine.prefill(1, Request(context))
    engine.extend(1, question[:17])
    pieces = engine.extend(1, question[17:])
    engine.release_all()
    np.testing.assert_allclose(pieces, whole, rtol=1e-4, atol=1e-5)
    assert greedy(pieces) == greedy(whole)


def test_context_requests_are_checked(engine):
    with pytest.raises(EngineError, match="more than the engine's max question length 24"):
        engine.check(Request(prompt(25), context_token_ids=prompt(50)))
    with pytest.raises(EngineError, match=r"the context and the prompt after it have 240 \+ 20 tokens"):
        engine.check(Request(prompt(20), context_token_ids=prompt(240)))
    assert engine.check(Request(prompt(20), SamplingParams(max_tokens=4), context_token_ids=prompt(200))).kv_budget is None
