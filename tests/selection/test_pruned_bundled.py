"""Pruned stage 2 on the bundled SmolLM2-135M and the needle prompt: every layer and head identical (slow).

Prints, per layer, the fraction of the older tokens' L1 norms the pruned stage 2 computed (the unpruned one
computes all of them) and the most candidate rounds a head needed.
"""

from pathlib import Path

import pytest
import torch

from criticalkv import KVPolicy, select_layer
from criticalkv.selection import pruned

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NEEDLE = ROOT / "examples" / "needle_2k.txt"


@pytest.fixture(scope="module")
def prefill():
    from criticalkv.eval.engine import shared_prefill
    from criticalkv.hf import load_model

    model, tokenizer = load_model()
    ids = torch.tensor([tokenizer(NEEDLE.read_text())["input_ids"]])
    return shared_prefill(model, ids, [32])


@pytest.mark.parametrize("name, extra", [("criticalkv", {}), ("ada-criticalkv", {"stage2_scores": "raw"})])
def test_every_layer_and_head_identical_on_the_needle_prompt(prefill, name, extra):
    from criticalkv.selection import ScoreMemo

    policy = KVPolicy(name, budget=256, window=32, **extra)
    layers = prefill.num_layers
    fractions = []
    memo = ScoreMemo()  # the window attention is computed once for both paths; the scores themselves twice
    for layer in range(layers):
        q, k, v, o = prefill.queries[32][layer], prefill.keys[layer], prefill.values[layer], prefill.o_proj[layer]
        pruned.STATS.reset()
        a = select_layer(policy, q, k, v, o, layer, layers, memo=memo)
        memo.entries = {key: value for key, value in memo.entries.items() if key[0] != "scores"}
        fractions.append((pruned.STATS.fraction(), pruned.STATS.calls[0]["rounds"]))
        pruned.PRUNED = False
        try:
            b = select_layer(policy, q, k, v, o, layer, layers, memo=memo)
        finally:
            pruned.PRUNED = True
        assert torch.equal(a.indices, b.indices) and torch.equal(a.lengths, b.lengths), f"layer {layer} differs"
    print(f"\n{name} {extra} n={prefill.n} budget 256: exact L1 norms computed per layer (fraction of the older tokens, "
          "rounds):\n" + " ".join(f"L{i}:{f:.3f}/{r}" for i, (f, r) in enumerate(fractions)))
    mean = sum(f for f, _ in fractions) / layers
    print(f"mean fraction {mean:.3f}")
    assert mean < 0.5, "the bound pruned less than half of the norms on a real model"
