"""Per-request budgets on one engine: every budget in [min_budget, built budget] equals the PyTorch path
(select_layer with that budget) token for token and kept index for kept index."""

import pytest
import torch

from criticalkv import KVPolicy
from criticalkv.hf import generate
from criticalkv.runtime import Engine, EngineError
from export.tiny_engine import export_tiny_engine
from hf.conftest import tiny_model

BUILT = 48
WINDOW = 8


def prompt(n, seed):
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=6)


@pytest.fixture(scope="module", params=["criticalkv", "pyramid-criticalkv", "ada-criticalkv", "streamingllm"])
def engine(request, model, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    engine = Engine.load(export_tiny_engine(model, KVPolicy(request.param, budget=BUILT, window=WINDOW), folder), profile=False)
    yield engine
    engine.close()


def assert_same_as_pytorch(engine, model, prompts, budget, new_tokens=8):
    got = engine.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=[], kv_budget=budget)
    policy = engine.policy if budget is None else engine.policy.replace(budget=budget)
    for row, ids in enumerate(prompts):
        ref = generate(model, torch.tensor([ids]), policy, max_new_tokens=new_tokens)
        assert got.tokens[row] == ref.tokens[0], (policy.name, budget, row)
        for layer, selection in enumerate(ref.prefill.selections):
            for head in range(selection.indices.shape[1]):
                want = [i for i in selection.indices[0, head].tolist() if i >= 0]
                offset = max(len(p) for p in prompts) - len(ids)  # engine indices count the left padding
                assert [i - offset for i in got.kept(layer, row, head)] == want, (policy.name, budget, layer, head)
    return got


@pytest.mark.parametrize("budget", [WINDOW, 13, 24, 37, BUILT - 1, BUILT, None])
def test_every_budget_on_one_engine_equals_the_pytorch_path(engine, model, budget):
    assert_same_as_pytorch(engine, model, [prompt(120, seed=budget or 0)], budget)


def test_a_padded_batch_with_a_smaller_budget(engine, model):
    prompts = [prompt(110, seed=3), prompt(70, seed=4), prompt(30, seed=5)]
    got = assert_same_as_pytorch(engine, model, prompts, 20)
    full_budget = engine.generate(prompts, max_new_tokens=2, stop_token_ids=[])
    assert got.kv_bytes_kept < full_budget.kv_bytes_kept, "a smaller budget keeps fewer entries"


@pytest.mark.parametrize("budget, words", [(BUILT + 1, rf" must lie in \[{WINDOW}, {BUILT}\] .*got {BUILT + 1}$"),
                                           (WINDOW - 1, rf" must lie in \[{WINDOW}, {BUILT}\] .*got {WINDOW - 1}$"),
                                           (2.5, ": .*integer")])
def test_budgets_outside_the_built_range_are_refused(engine, budget, words):
    with pytest.raises(EngineError, match=rf"kv_budget{words}"):
        engine.generate([prompt(60, seed=1)], max_new_tokens=2, kv_budget=budget)
