"""kvpress beside `criticalkv eval shared-context`: one forward per document shared by every press and budget (and
extended by each question, question-aware) gives the answers of kvpress's own pipeline, a prefill with each press.

Runs in kvpress's environment ($CRITICALKV_PEERS_DIR/kvpress, `criticalkv bench setup-peers --peers kvpress`); skipped
without it."""

import json
import subprocess

import pytest

from criticalkv.bench.peers import peer_python, peer_ready, peers_dir
from criticalkv.bench.peers.kvpress import RUNNER

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    root = peers_dir()
    if not peer_ready(root, "kvpress"):
        pytest.skip(f"no kvpress environment in {root} (create it: criticalkv bench setup-peers --peers kvpress; "
                    "CRITICALKV_PEERS_DIR names the folder)")
    from transformers import AutoTokenizer

    from criticalkv.eval.shared_context import shared_documents
    from criticalkv.hf.loading import resolve_model

    model_dir = resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    doc = shared_documents(tokenizer, ["legal"], 1, [1024], kinds=("key", "chain", "quote"))[0]
    runs = [{"key": f"kvpress {p}@25%", "setting": s, "press": p, "kwargs": {}, "fraction": 0.25}
            for s, p in (("agnostic", "KnormPress"), ("agnostic", "ExpectedAttentionPress"),
                         ("agnostic", "LeverageScorePress"), ("aware", "SnapKVPress"),
                         ("aware", "CriticalKVPress(SnapKVPress)"), ("aware", "CriticalAdaKVPress(SnapKVPress)"))]
    runs.append({"key": "kvpress CriticalKVPress(SnapKVPress):window_size=32:kernel_size=7@25%", "setting": "aware",
                 "press": "CriticalKVPress(SnapKVPress)", "kwargs": {"window_size": 32, "kernel_size": 7},
                 "fraction": 0.25})
    folder = tmp_path_factory.mktemp("kvpress-shared")
    path = folder / "prompts.json"
    stops = sorted({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")})
    path.write_text(json.dumps({"runs": runs, "stop_token_ids": stops, "documents": [
        {"key": doc.key, "context_ids": list(doc.context_ids),
         "questions": [{"key": q.key, "ids": list(q.ids), "max_new_tokens": q.max_new_tokens} for q in doc.questions]}]}))
    return root, model_dir, path, folder


def _answers(spec, *extra):
    root, model_dir, path, folder = spec
    out = folder / f"answers{len(extra)}.jsonl"
    subprocess.run([str(peer_python(root, "kvpress")), str(RUNNER), "shared", "--model", str(model_dir), "--prompts",
                    str(path), "--out", str(out), "--threads", "2", *extra], check=True, timeout=900)
    return {(r["question"], r["run"]): r for r in map(json.loads, out.read_text().splitlines())}


def test_one_shared_forward_answers_as_kvpress_pipeline(spec):
    shared = _answers(spec)
    pipeline = _answers(spec, "--via-pipeline")
    assert set(shared) == set(pipeline) and len(shared) == 8 * 7  # 7 runs and full, 7 questions
    different = {k: (shared[k]["tokens"], pipeline[k]["tokens"]) for k in shared
                 if shared[k]["tokens"] != pipeline[k]["tokens"]}
    assert not different
    for k in shared:  # the first answer token's distribution too (the KL against kvpress's full cache)
        if "kl" in shared[k]:
            assert shared[k]["kl"] == pytest.approx(pipeline[k]["kl"], rel=1e-3, abs=1e-4)


def test_a_wrapped_press_knob_goes_to_the_press_that_has_it(spec):
    """``CriticalKVPress(SnapKVPress):window_size=32:kernel_size=7:epsilon=0.001``: the window and the pool are
    SnapKVPress's fields, epsilon is CriticalKVPress's."""
    root, _, _, _ = spec
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from kvpress_runner import build_press; "
            "p = build_press({'press': 'CriticalKVPress(SnapKVPress)', 'kwargs': {'window_size': 32, 'kernel_size': 7, "
            "'epsilon': 0.001}}, 0.75); print(p.press.window_size, p.press.kernel_size, p.press.compression_ratio, "
            "p.epsilon)")
    out = subprocess.run([str(peer_python(root, "kvpress")), "-c", code, str(RUNNER.parent)], check=True,
                         capture_output=True, text=True, timeout=300).stdout.split()
    assert out == ["32", "7", "0.75", "0.001"]
