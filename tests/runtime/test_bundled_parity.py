"""The bundled SmolLM2-135M-Instruct on ONNX Runtime and on the torch backend against the PyTorch path, every
policy (slow).

Greedy output must be identical token for token (16 new tokens after a 640-token prompt: 2.5x the budget of 256, three
of the prefill's 256-query attention blocks; 1,100 and 32 until the CI time was trimmed) and the kept
indices identical for every layer and KV head, on both backends (the torch backend runs the same engine directory
through its own decoder and the selection op, fp32 on the CPU). One PyTorch model instance serves every policy; each
policy's engine directory is deleted once compared. Both backends run single-threaded here: on the
2 shared vCPUs of CI, two threads were measured several times slower than one for both torch and ONNX
Runtime; the thread count does not change what is compared.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from criticalkv import POLICIES, KVPolicy
from criticalkv.export import BuildConfig
from criticalkv.build import export_engine
from criticalkv.hf import generate, load_model
from criticalkv.runtime import Engine, create_backend
from criticalkv.runtime.onnxruntime_backend import THREADS_ENV
from policies import POLICY_CASES, make_policy

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NEEDLE = ROOT / "examples" / "needle_2k.txt"
PROMPT_TOKENS = 640
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def bundled(one_thread):
    model, tokenizer = load_model()
    ids = tokenizer(NEEDLE.read_text())["input_ids"][:PROMPT_TOKENS]
    assert len(ids) == PROMPT_TOKENS
    return model, ids


@pytest.fixture(scope="module")
def engines_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("bundled")
    yield root
    shutil.rmtree(root, ignore_errors=True)


#: kvzip's family re-reads the 2k prompt (~50 s each here): kvzip-criticalkv stands for it on the bundled model; kvzip
#: is held to the PyTorch path on the tiny models (tests/export/test_export_graphs.py, tests/runtime/test_engine_extend.py),
#: layer-kvzip and layer-kvzip-criticalkv in tests/serving/test_context_policy.py and tests/selection/test_kvzip.py
BUNDLED = [name for name in POLICIES if name not in ("kvzip", "layer-kvzip", "layer-kvzip-criticalkv")]


@pytest.mark.parametrize("name", BUNDLED)
def test_onnxruntime_equals_pytorch_on_the_bundled_model(bundled, engines_root, name):
    model, ids = bundled
    policy = KVPolicy(name, budget=256)
    folder = engines_root / name
    config = BuildConfig(max_input_len=PROMPT_TOKENS, max_new_tokens=NEW_TOKENS)
    _, manifest = export_engine(model, policy, folder, config, validate=name == "criticalkv")
    engine = Engine(folder, manifest, create_backend("onnxruntime", folder, manifest))
    try:
        got = engine.generate([ids], max_new_tokens=NEW_TOKENS, stop_token_ids=[])
    finally:
        engine.close()
    # every policy on the torch backend too (kvzip-criticalkv: its re-read through the model's own layers)
    engine = Engine(folder, manifest, create_backend("torch", folder, manifest, model=model))
    try:
        on_torch = engine.generate([ids], max_new_tokens=NEW_TOKENS, stop_token_ids=[])
    finally:
        engine.close()
    ref = generate(model, torch.tensor([ids]), policy, max_new_tokens=NEW_TOKENS)
    assert got.tokens[0] == ref.tokens[0]
    assert len(got.tokens[0]) == NEW_TOKENS
    assert on_torch.tokens[0] == got.tokens[0], f"{name}: the torch backend's tokens differ from ONNX Runtime's"
    for layer, selection in enumerate(ref.prefill.selections):
        for head in range(selection.indices.shape[1]):
            expect = [i for i in selection.indices[0, head].tolist() if i >= 0]
            assert got.kept(layer, 0, head) == expect, f"{name}: layer {layer}, KV head {head}"
            assert on_torch.kept(layer, 0, head) == expect, f"{name} on torch: layer {layer}, KV head {head}"
    assert got.kv_bytes_kept == ref.kv_bytes_kept == on_torch.kv_bytes_kept
    shutil.rmtree(folder)


#: The knob variants of tests/policies.py beyond the policy names above.
VARIANTS = [case for case in POLICY_CASES if case[0] not in POLICIES]


@pytest.mark.parametrize("case", VARIANTS, ids=[case[0] for case in VARIANTS])
def test_the_torch_backend_equals_onnxruntime_for_the_knob_variants(bundled, engines_root, case):
    """The knob variants of the policy table (stage-2 scores, value norm, kvpress's reduction, defensivekv's stage-1
    mass): the torch backend keeps ONNX Runtime's entries and generates its tokens (a shorter run: 600 tokens, 8 new)."""
    model, ids = bundled
    case_id, kwargs = case
    policy = make_policy(kwargs, budget=256, window=32)
    folder = engines_root / case_id
    config = BuildConfig(max_input_len=600, max_new_tokens=8)
    _, manifest = export_engine(model, policy, folder, config, validate=False)
    outputs = {}
    for backend, options in (("onnxruntime", {}), ("torch", {"model": model})):
        engine = Engine(folder, manifest, create_backend(backend, folder, manifest, **options))
        try:
            outputs[backend] = engine.generate([ids[:600]], max_new_tokens=8, stop_token_ids=[])
        finally:
            engine.close()
    ort, on_torch = outputs["onnxruntime"], outputs["torch"]
    assert on_torch.tokens == ort.tokens and len(ort.tokens[0]) == 8
    for layer in range(len(ort.kept_lengths)):
        for head in range(ort.kept_lengths[layer].shape[1]):
            assert on_torch.kept(layer, 0, head) == ort.kept(layer, 0, head), f"{case_id}: layer {layer}, KV head {head}"
    shutil.rmtree(folder)


def test_readme_main_command_builds_and_answers_the_needle(docs, one_thread):
    """The README's first block as typed (build_engine.py --kv-policy criticalkv --budget 256 --max-batch-size 8, then
    criticalkv generate --engine-dir --json): run once per session by the docs harness (tests/docs_blocks.py, which
    tests/test_docs.py also checks for 7481), its output read in full here."""
    env = {**os.environ, THREADS_ENV: "1", "OMP_NUM_THREADS": "1"}
    block = docs.run(docs.block("README.md", "scripts/build_engine.py"))  # its build logs on stderr, generate's JSON
    output = docs.tmp / "engines" / "smollm2-criticalkv"
    assert "TensorRT engines: SKIPPED because" in block.stderr or "building TensorRT engines" in block.stderr
    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["smoke_test"]["tokens_match_pytorch"] and manifest["smoke_test"]["kept_indices_match_pytorch"]
    out = json.loads(block.stdout)
    assert set(out) == {"text", "token_ids", "prompt_tokens", "new_tokens", "backend", "model", "policy", "timings",
                        "kv_bytes", "kept_whole"}
    assert out["backend"] == "onnxruntime" and out["model"] == "smollm2-135m" and out["prompt_tokens"] > 1500
    assert out["kv_bytes"]["kept"] / out["kv_bytes"]["full"] == pytest.approx(256 / out["prompt_tokens"], rel=1e-6)
    assert 0 < out["timings"]["selection_s"] < out["timings"]["prefill_s"]
    assert "7481" in out["text"]  # the PyTorch path answers it with the same policy (tests/test_bundled_model.py)
    assert out["kept_whole"] is False
    short = subprocess.run(  # the README's engine with a prompt shorter than the budget (and the window): kept whole
        [sys.executable, "-m", "criticalkv.cli", "generate", "--engine-dir", str(output), "--prompt",
         "What is the capital of France?", "--chat", "--json", "--max-new-tokens", "8"],
        capture_output=True, text=True, env=env, cwd=ROOT,
    )
    assert short.returncode == 0, short.stderr[-3000:]
    assert json.loads(short.stdout)["kept_whole"] and "its KV cache is kept whole" in short.stderr
