"""The bundled SmolLM2-135M-Instruct on ONNX Runtime against the PyTorch path, every policy (slow).

Greedy output must be identical token for token (32 new tokens after a 1,100-token prompt) and the kept
indices identical for every layer and KV head. One PyTorch model instance serves every policy; each
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

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NEEDLE = ROOT / "examples" / "needle_2k.txt"
PROMPT_TOKENS = 1100
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    os.environ[THREADS_ENV] = "1"
    yield
    torch.set_num_threads(previous)
    os.environ.pop(THREADS_ENV, None)


@pytest.fixture(scope="module")
def bundled(single_thread):
    model, tokenizer = load_model()
    ids = tokenizer(NEEDLE.read_text())["input_ids"][:PROMPT_TOKENS]
    assert len(ids) == PROMPT_TOKENS
    return model, ids


@pytest.fixture(scope="module")
def engines_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("bundled")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("name", list(POLICIES))
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
    ref = generate(model, torch.tensor([ids]), policy, max_new_tokens=NEW_TOKENS)
    assert got.tokens[0] == ref.tokens[0]
    assert len(got.tokens[0]) == NEW_TOKENS
    for layer, selection in enumerate(ref.prefill.selections):
        for head in range(selection.indices.shape[1]):
            expect = [i for i in selection.indices[0, head].tolist() if i >= 0]
            assert got.kept(layer, 0, head) == expect, f"{name}: layer {layer}, KV head {head}"
    assert got.kv_bytes_kept == ref.kv_bytes_kept
    shutil.rmtree(folder)


def test_readme_main_command_builds_and_answers_the_needle(tmp_path, single_thread):
    """build_engine.py --kv-policy criticalkv --budget 256, then criticalkv generate --engine-dir --json."""
    env = {**os.environ, THREADS_ENV: "1", "OMP_NUM_THREADS": "1"}
    output = tmp_path / "engines" / "smollm2-criticalkv"
    build = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_engine.py"), "--kv-policy", "criticalkv", "--budget", "256",
         "--output", str(output)],
        capture_output=True, text=True, env=env, cwd=ROOT,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    assert "TensorRT engines: SKIPPED because" in build.stderr or "building TensorRT engines" in build.stderr
    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["smoke_test"]["tokens_match_pytorch"] and manifest["smoke_test"]["kept_indices_match_pytorch"]
    run = subprocess.run(
        [sys.executable, "-m", "criticalkv.cli", "generate", "--engine-dir", str(output), "--prompt-file", str(NEEDLE),
         "--chat", "--json", "--max-new-tokens", "24"],
        capture_output=True, text=True, env=env, cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
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
