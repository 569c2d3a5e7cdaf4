"""The bundled SmolLM2-135M-Instruct end to end (loads a real model: the few slow tests of the suite)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NEEDLE = ROOT / "examples" / "needle_2k.txt"

pytestmark = pytest.mark.slow


def cli(*args, check=True):
    run = subprocess.run([sys.executable, "-m", "criticalkv.cli", *args], capture_output=True, text=True, cwd=ROOT)
    if check:
        assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_generate_json_on_the_bundled_model(docs):
    """docs/python_api.md's command (`criticalkv generate --prompt-file examples/needle_2k.txt --chat --kv-policy
    criticalkv --budget 256 --max-new-tokens 16 --json`), run once per session by the docs harness."""
    out = json.loads(docs.run(docs.block("docs/python_api.md", "--kv-policy criticalkv --budget 256")).stdout)
    assert out["prompt_tokens"] > 1500 and 1 <= out["new_tokens"] <= 16
    assert set(out["timings"]) == {"prefill_s", "selection_s", "decode_s_per_token"}
    assert out["kv_bytes"]["kept"] / out["kv_bytes"]["full"] == pytest.approx(256 / out["prompt_tokens"], rel=1e-6)
    # the full cache answers this needle (FACTS.md); CriticalKV at budget 256 keeps the answer
    assert "7481" in out["text"]


@pytest.mark.parametrize("args", [
    ["--prompt", "What is the capital of France?", "--chat"],  # shorter than the window
    ["--prompt-file", str(NEEDLE), "--budget", "4096"],  # longer than the window, within the budget
])
def test_a_prompt_within_the_budget_is_kept_whole(args):
    run = cli("generate", *args, "--max-new-tokens", "4", "--json")
    out = json.loads(run.stdout)
    assert out["kept_whole"] and out["kv_bytes"]["kept_fraction"] == 1.0 and out["new_tokens"] >= 1
    assert f"the prompt ({out['prompt_tokens']} tokens) fits in the budget" in run.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt-file", "missing.txt"], "no such prompt file"),
        (["--prompt-file", str(NEEDLE), "--model", "missing.gguf"], "no such model folder"),
        (["--prompt-file", str(NEEDLE), "--budget", "16"], "smaller than the window"),
    ],
)
def test_generate_rejects_bad_input_clearly(args, message):
    run = cli("generate", *args, check=False)
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr
