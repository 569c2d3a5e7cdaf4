"""``layer-defensivekv`` on the bundled SmolLM2-135M-Instruct: ONNX Runtime (CriticalKVScore per layer, one
CriticalKVSelectModel after the last layer) against the PyTorch path, with a per-head cap (slow).

tests/runtime/test_bundled_parity.py covers the uncapped policy at budget 256; this is the capped one, whose
engine's per-layer KV buffers hold head_cap_ratio x budget entries per head instead of the prompt."""

import os
from pathlib import Path

import pytest
import torch

from criticalkv import KVPolicy
from criticalkv.build import export_engine
from criticalkv.export import BuildConfig
from criticalkv.hf import generate, load_model
from criticalkv.runtime import Engine, create_backend
from criticalkv.runtime.onnxruntime_backend import THREADS_ENV
from criticalkv.methods.budget import head_cap

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PROMPT_TOKENS, NEW_TOKENS, BUDGET, RATIO = 600, 16, 96, 2.0


def test_capped_layer_defensivekv_onnxruntime_equals_pytorch(tmp_path, monkeypatch):
    monkeypatch.setenv(THREADS_ENV, "1")
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tokenizer = load_model()
        ids = tokenizer((ROOT / "examples" / "needle_2k.txt").read_text())["input_ids"][:PROMPT_TOKENS]
        policy = KVPolicy("layer-defensivekv", budget=BUDGET, head_cap_ratio=RATIO)
        config = BuildConfig(max_input_len=PROMPT_TOKENS, max_new_tokens=NEW_TOKENS)
        _, manifest = export_engine(model, policy, tmp_path / "engine", config)  # validate_export included
        cap = head_cap(RATIO, BUDGET)
        assert manifest["shapes"]["prefill_capacity"] == [cap] * 30
        assert manifest["onnx"]["validation"]["prefill"]["score_nodes"] == 30
        engine = Engine(tmp_path / "engine", manifest, create_backend("onnxruntime", tmp_path / "engine", manifest))
        try:
            got = engine.generate([ids], max_new_tokens=NEW_TOKENS, stop_token_ids=[])
        finally:
            engine.close()
        ref = generate(model, torch.tensor([ids]), policy, max_new_tokens=NEW_TOKENS)
    finally:
        torch.set_num_threads(previous)
    assert got.tokens[0] == ref.tokens[0] and len(got.tokens[0]) == NEW_TOKENS
    for layer, selection in enumerate(ref.prefill.selections):
        assert got.kept_lengths[layer].tolist() == selection.lengths.tolist(), f"layer {layer}"
        for head in range(selection.indices.shape[1]):
            assert got.kept(layer, 0, head) == [i for i in selection.indices[0, head].tolist() if i >= 0], \
                f"layer {layer}, KV head {head}"
    lengths = torch.stack([s.lengths[0] for s in ref.prefill.selections])
    assert int(lengths.sum()) == 30 * 3 * BUDGET  # the kept total: L * H_kv * budget
    assert int(lengths.max()) <= cap and int(lengths.min()) < BUDGET  # shares differ across layers and heads
    assert got.kv_bytes_kept == ref.kv_bytes_kept
