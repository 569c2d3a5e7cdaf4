"""criticalkv.runtime.Engine on ONNX Runtime: sampling, stop tokens, streaming, batches, KV buffers."""

import numpy as np
import pytest
import torch

from criticalkv import KVPolicy
from criticalkv.hf import generate
from criticalkv.runtime import Engine, EngineError
from criticalkv.request import SamplingParams
from export.tiny_engine import export_tiny_engine
from hf.conftest import tiny_model


def prompt(n, seed=1):
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=4)


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("engine")
    engine = Engine.load(export_tiny_engine(model, KVPolicy("criticalkv", budget=40, window=8), folder), profile=False)
    yield engine
    engine.close()


def test_sampling_with_a_seed_matches_the_pytorch_path(engine, model):
    ids = prompt(140, seed=2)
    for config in (SamplingParams(temperature=0.9, seed=5), SamplingParams(temperature=0.7, top_p=0.8, seed=9)):
        got = engine.generate([ids], max_new_tokens=16, sampling=config, stop_token_ids=[])
        ref = generate(model, torch.tensor([ids]), engine.policy, max_new_tokens=16, sampling=config)
        assert got.tokens[0] == ref.tokens[0]
    a = engine.generate([ids], max_new_tokens=16, sampling=SamplingParams(temperature=1.0, seed=3), stop_token_ids=[])
    b = engine.generate([ids], max_new_tokens=16, sampling=SamplingParams(temperature=1.0, seed=3), stop_token_ids=[])
    assert a.tokens == b.tokens


def test_stop_tokens_end_each_sequence_and_streaming_sees_every_step(engine):
    a, b = prompt(120, seed=3), prompt(90, seed=4)
    free = engine.generate([a, b], max_new_tokens=12, stop_token_ids=[])
    stop = free.tokens[0][3]
    streamed = []
    got = engine.generate([a, b], max_new_tokens=12, stop_token_ids=[stop], on_tokens=lambda t: streamed.append(t.copy()))
    assert got.tokens[0] == free.tokens[0][: free.tokens[0].index(stop) + 1]
    expect_b = free.tokens[1][: free.tokens[1].index(stop) + 1] if stop in free.tokens[1] else free.tokens[1]
    assert got.tokens[1] == expect_b
    steps = max(len(t) for t in got.tokens)
    assert len(streamed) == steps and all(s.shape == (2,) for s in streamed)
    assert [int(s[0]) for s in streamed[: len(got.tokens[0])]] == got.tokens[0]


def test_batch_rows_equal_each_prompt_alone(engine):
    prompts = [prompt(130, seed=5), prompt(64, seed=6), prompt(20, seed=7)]
    batched = engine.generate(prompts, max_new_tokens=10, stop_token_ids=[])
    for row, ids in enumerate(prompts):
        alone = engine.generate([ids], max_new_tokens=10, stop_token_ids=[])
        assert batched.tokens[row] == alone.tokens[0]
        shift = 130 - len(ids)  # batched indices refer to the left-padded prompt
        for layer in range(3):
            assert [i - shift for i in batched.kept(layer, row, 0)] == alone.kept(layer, 0, 0)


def test_kv_buffers_are_allocated_once_and_bound_in_place(engine):
    backend = engine.backend
    pointers = [(k.ctypes.data, v.ctypes.data) for k, v in zip(backend.keys, backend.values)]
    nbytes = backend.kv_buffer_bytes()
    for n in (50, 200):
        engine.generate([prompt(n, seed=n)], max_new_tokens=20, stop_token_ids=[])
        assert [(k.ctypes.data, v.ctypes.data) for k, v in zip(backend.keys, backend.values)] == pointers
        assert backend.kv_buffer_bytes() == nbytes  # independent of the prompt length
    # the buffers hold the kept prompt entries then one entry per generated token, at each head's length
    out = engine.generate([prompt(150, seed=8)], max_new_tokens=20, stop_token_ids=[])
    for layer in range(3):
        assert (backend.lengths[layer][0] == out.kept_lengths[layer][0] + 19).all()
    assert nbytes == 2 * 3 * 2 * 16 * 4 * sum(c for c in engine.manifest["shapes"]["decode_capacity"])


def test_bad_requests_give_clear_errors(engine):
    with pytest.raises(EngineError, match="more than the engine's max input length 256"):
        engine.generate([prompt(257)], max_new_tokens=4)
    with pytest.raises(EngineError, match="exceeds the engine's max batch size 3"):
        engine.generate([prompt(20)] * 4, max_new_tokens=4)
    with pytest.raises(EngineError, match="max_tokens must lie in"):
        engine.generate([prompt(20)], max_new_tokens=33)
    with pytest.raises(EngineError, match="empty"):
        engine.generate([prompt(20), []], max_new_tokens=4)
    with pytest.raises(EngineError, match="token ids"):
        engine.generate([[5, 500]], max_new_tokens=4)
    ids = np.array([prompt(20), prompt(20)])
    mask = np.ones_like(ids)
    mask[1, -3:] = 0
    with pytest.raises(EngineError, match="left-padded"):
        engine.generate(ids, max_new_tokens=4, attention_mask=mask)


def test_profiling_reports_the_selection_time(model, tmp_path):
    folder = export_tiny_engine(model, KVPolicy("ada-criticalkv", budget=40, window=8), tmp_path / "e")
    engine = Engine.load(folder, profile=True)
    out = engine.generate([prompt(200)], max_new_tokens=4, stop_token_ids=[])
    assert 0 < out.selection_s < out.prefill_s
    assert set(out.timings()) == {"prefill_s", "selection_s", "decode_s_per_token"}
    engine.close()


def test_generated_ends_each_sequence_at_its_first_stop_token():
    from criticalkv.sampling import Generated

    g = Generated(np.array([5, 2]), stop_token_ids=[2, 9])
    assert g.tokens == [[5], [2]] and not g.finished
    g.add(np.array([9, 7]))  # sequence 1 already stopped: its 7 is not recorded
    assert g.tokens == [[5, 9], [2]] and g.finished
