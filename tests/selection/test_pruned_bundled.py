"""Pruned stage 2 on the bundled SmolLM2-135M and the needle prompt: every layer and head identical (slow).

Prints, per layer, the fraction of the older tokens' L1 norms the pruned PyTorch stage 2 computed (the unpruned one
computes all of them) with the most candidate rounds a head needed, and which branch of the ONNX body ran.
"""

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from criticalkv import KVPolicy, select_layer
from criticalkv.methods import pruned
from criticalkv.selection import ScoreMemo

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


def run_onnx_body(policy, q, k, v, o, layer, layers):
    """(kept_indices, the branch of the pruned stage 2 that ran) of the node on ONNX Runtime."""
    import onnxruntime as ort

    from criticalkv.export.select_function import selection_model
    from criticalkv.runtime.profiling import stage2_branches

    model = selection_model(policy, o.detach().numpy(), q.shape[1], k.shape[1], layer_idx=layer, num_layers=layers,
                            max_prompt_len=k.shape[2])
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.intra_op_num_threads = 1
    options.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "ort_profile")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {"queries": q.numpy(), "keys": k.numpy(), "values": v.numpy(), "prompt_lengths": np.array([k.shape[2]], np.int32)}
    indices = session.run(None, feeds)[3]
    trace = Path(session.end_profiling())
    branches = stage2_branches(trace)
    shutil.rmtree(trace.parent)
    assert sum(branches.values()) == 1, branches
    return indices, max(branches, key=branches.get)


def test_every_layer_and_head_identical_on_the_needle_prompt(prefill):
    policy = KVPolicy("criticalkv", budget=256, window=32)
    layers = prefill.num_layers
    fractions, taken = [], []
    memo = ScoreMemo()  # the window attention is computed once for both paths; the scores themselves twice
    for layer in range(layers):
        q, k, v, o = prefill.queries[32][layer], prefill.keys[layer], prefill.values[layer], prefill.o_proj[layer]
        pruned.STATS.reset()
        a = select_layer(policy, q, k, v, o, layer, layers, memo=memo)
        fractions.append((pruned.STATS.fraction(), pruned.STATS.calls[0]["rounds"]))
        memo.entries = {key: value for key, value in memo.entries.items() if key[0] != "scores"}
        with pruned.pruning(False):
            b = select_layer(policy, q, k, v, o, layer, layers, memo=memo)
        assert torch.equal(a.indices, b.indices) and torch.equal(a.lengths, b.lengths), f"layer {layer} differs"
        indices, branch = run_onnx_body(policy, q, k, v, o, layer, layers)
        assert np.array_equal(indices[..., : a.indices.shape[-1]], a.indices.numpy()), f"ONNX layer {layer} differs"
        taken.append(branch)
    mean = sum(f for f, _ in fractions) / layers
    counts = {b: taken.count(b) for b in ("2k", "4k", "all")}
    print(f"\ncriticalkv n={prefill.n} budget 256. PyTorch: exact L1 norms computed per layer (fraction of the older "
          "tokens / candidate rounds):\n" + " ".join(f"L{i}:{f:.3f}/{r}" for i, (f, r) in enumerate(fractions))
          + f"\nmean fraction {mean:.3f}\nONNX body branch per layer: " + " ".join(f"L{i}:{b}" for i, b in enumerate(taken))
          + f"\nbranch counts {counts}")
    assert mean < 0.5, "the bound pruned less than half of the norms on a real model"
    assert counts["2k"] >= layers // 2, counts
