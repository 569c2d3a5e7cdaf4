"""Every policy `criticalkv policies` lists, built the way a user types it and generated from.

`scripts/build_engine.py --kv-policy NAME [--budget B] --output X` (and `--model FOLDER` for a checkpoint other than
the bundled one: nothing else, so the build's defaults run: 4,096-token limit, the default context policy and its
stand-in, the smoke test against the PyTorch path, the TensorRT step's report), then `criticalkv generate --engine-dir
X`. On random checkpoints of every supported architecture (tests/model_families.py): `full` on each, and each other
policy on one architecture, rotating, so that every architecture builds several (the whole matrix with
CRITICALKV_TEST_EVERY_FAMILY=1: every policy x 7 checkpoints); the policies' kept entries
against the PyTorch path on every architecture are tests/runtime/test_model_families.py's. On the bundled model: `full`
here (the baseline of every comparison the README makes), the README's own engine in tests/test_docs.py (its first
block) and tests/runtime/test_bundled_parity.py.

The builds and generations run in this process (``main(argv)`` of the script and of the command line: the same
argument parsing and code as the commands, without a new interpreter's start-up per case); the bundled `full` runs
both as real processes.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from criticalkv import POLICIES
from criticalkv.runtime.onnxruntime_backend import THREADS_ENV
from model_families import FAMILIES, random_checkpoint

ROOT = Path(__file__).resolve().parents[1]
NEEDLE = ROOT / "examples" / "needle_2k.txt"
BUDGET = 64
PROMPT_WORDS = 200  # each with a punctuation mark: longer than the budget in every tokenizer (all but full evict)
NEW_TOKENS = 8

EVERY = os.environ.get("CRITICALKV_TEST_EVERY_FAMILY") == "1"
CASES = [(fam.id, name) for i, name in enumerate(POLICIES) for k, fam in enumerate(FAMILIES)
         if EVERY or name == "full" or k == i % len(FAMILIES)]


def test_the_cases_cover_every_listed_policy_and_every_architecture(capsys):
    """The names `criticalkv policies` prints are the ones built here; each architecture builds full and at least
    two other policies."""
    from criticalkv.cli import main

    assert main(["policies"]) == 0
    table = capsys.readouterr().out.split("\n\n")[0]
    listed = [line.split("`")[1] for line in table.splitlines() if line.startswith("| `")]
    assert listed == list(POLICIES) and len(listed) >= 17
    assert {name for _, name in CASES} == set(listed)
    for fam in FAMILIES:
        built = [name for fid, name in CASES if fid == fam.id]
        assert "full" in built and len(built) >= 3, (fam.id, built)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, one_thread):
    """Each architecture's random checkpoint as a Hugging Face folder, with the word tokenizer, and the model itself
    (the oracle of `full`). Its positions and sliding window (Mistral's, Ministral's) hold the build's defaults, a
    4,096-token prompt and 256 new tokens (a checkpoint whose window is shorter is refused by the build, naming it)."""
    from export.tiny_engine import word_tokenizer

    root = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for fam in FAMILIES:
        model = random_checkpoint(fam)
        model.config.max_position_embeddings = 8192
        if getattr(model.config, "sliding_window", None) is not None:
            model.config.sliding_window = 8192
        model.save_pretrained(root / fam.id)
        word_tokenizer().save_pretrained(root / fam.id)
        out[fam.id] = (root / fam.id, model)
    return out


@pytest.fixture(scope="module")
def build_script():
    spec = importlib.util.spec_from_file_location("build_engine_script", ROOT / "scripts" / "build_engine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    """Words of the word tokenizer, each followed by a punctuation mark of its vocabulary. The mark is there for
    Qwen2: transformers loads a qwen2 checkpoint's tokenizer as Qwen2Tokenizer, byte-level BPE over the same
    vocabulary without merges, which reads only the one-character entries (`.`, `,`, `:`) and drops the words."""
    from export.tiny_engine import vocabulary, words
    from model_families import random_prompt

    marks = [vocabulary().index(mark) for mark in ".,:"]
    ids = [2 + i % 126 for i in random_prompt(PROMPT_WORDS, seed=11)]
    path = tmp_path_factory.mktemp("prompt") / "prompt.txt"
    path.write_text(words([t for k, i in enumerate(ids) for t in (i, marks[k % 3])]))
    return path


@pytest.mark.parametrize("family_id, name", CASES, ids=[f"{f}-{n}" for f, n in CASES])
def test_the_build_script_builds_the_policy_and_generate_answers(checkpoints, build_script, prompt_file, tmp_path,
                                                                 capsys, family_id, name):
    from criticalkv.cli import main as cli

    folder, model = checkpoints[family_id]
    engine = tmp_path / "engine"
    argv = ["--model", str(folder), "--kv-policy", name, *([] if name == "full" else ["--budget", str(BUDGET)]),
            "--output", str(engine)]
    status = build_script.main(argv)
    err = capsys.readouterr().err
    assert status == 0, f"scripts/build_engine.py {' '.join(argv)} exited {status}:\n{err[-3000:]}"
    assert "TensorRT engines: SKIPPED because" in err or "building TensorRT engines" in err
    manifest = json.loads((engine / "manifest.json").read_text())
    smoke = manifest["smoke_test"]
    assert smoke["tokens_match_pytorch"] and smoke["kept_indices_match_pytorch"], smoke

    assert cli(["generate", "--engine-dir", str(engine), "--prompt-file", str(prompt_file),
                "--max-new-tokens", str(NEW_TOKENS), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"]["name"] == name and out["backend"] == "onnxruntime"
    ids = folder_ids(folder, prompt_file)  # the checkpoint's own tokenizer, as transformers loads it
    assert out["prompt_tokens"] == len(ids) >= PROMPT_WORDS > BUDGET and 1 <= out["new_tokens"] <= NEW_TOKENS
    if name == "full":
        assert out["kv_bytes"]["kept_fraction"] == 1.0
        ids = torch.tensor([ids])
        greedy = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, ids.shape[1]:].tolist()
        assert out["token_ids"] == greedy[:len(out["token_ids"])]  # transformers' own greedy tokens
    else:
        assert not out["kept_whole"] and 0 < out["kv_bytes"]["kept"] < out["kv_bytes"]["full"]


def folder_ids(folder: Path, prompt_file: Path) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)(prompt_file.read_text())["input_ids"]


@pytest.mark.slow
def test_full_on_the_bundled_model_builds_and_answers_the_needle(tmp_path):
    """`scripts/build_engine.py --kv-policy full --output X` as typed (the baseline of the README's comparisons; it
    once failed on the context policy a full engine does not have), then `criticalkv generate` on the needle."""
    env = {**os.environ, THREADS_ENV: "1", "OMP_NUM_THREADS": "1"}
    output = tmp_path / "engines" / "full"
    build = subprocess.run([sys.executable, "scripts/build_engine.py", "--kv-policy", "full", "--output", str(output)],
                           capture_output=True, text=True, env=env, cwd=ROOT)
    assert build.returncode == 0, build.stderr[-3000:]
    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["policy"]["name"] == "full" and "context_policy" not in manifest
    assert manifest["smoke_test"]["tokens_match_pytorch"] and manifest["smoke_test"]["kept_indices_match_pytorch"]
    run = subprocess.run([sys.executable, "-m", "criticalkv.cli", "generate", "--engine-dir", str(output),
                          "--prompt-file", str(NEEDLE), "--chat", "--max-new-tokens", "16", "--json"], capture_output=True,
                         text=True, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out["policy"]["name"] == "full" and out["kv_bytes"]["kept_fraction"] == 1.0 and out["prompt_tokens"] > 1500
    assert "7481" in out["text"]
