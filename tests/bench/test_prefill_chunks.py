"""``python -m benchmarks.chunks`` on a tiny engine: every chunk size's steps are timed and the prompt is whole."""

import json

from criticalkv import KVPolicy
from benchmarks import chunks
from export.tiny_engine import export_tiny_engine
from hf.conftest import tiny_model


def test_each_chunk_size_times_every_step_of_the_prompt(tmp_path):
    folder = export_tiny_engine(tiny_model("llama", seed=4), KVPolicy(name="criticalkv", budget=40, window=8),
                                tmp_path / "engine", extend_chunk=32, max_question_len=24)
    out = tmp_path / "out"
    assert chunks.main(["--engine-dir", str(folder), "--isl", "100", "--short", "20", "--chunks", "64,32",
                        "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads((out / "prefill_chunks.json").read_text())
    assert res["extend_chunk"] == 32
    # 100 tokens: 2 steps of 64 (the second shorter), 4 of 32
    assert {c: s["steps"] for c, s in res["chunks"].items()} == {"64": 2, "32": 4}
    for s in res["chunks"].values():
        assert len(s["step_ms_median_by_index"]) == s["steps"] and all(t > 0 for t in s["step_ms_median_by_index"])
        assert abs(s["total_ms"] - sum(s["step_ms_median_by_index"])) < 1e-6  # one round: the medians are the times
    assert res["one_shot_prefill_ms"] > 0 and res["select_ms"] > 0 and res["short_prefill_ms"] > 0
    assert "| 64 | 2 |" in (out / "prefill_chunks.md").read_text()
    # CHUNK:RUN: 64-token chunks in runs of 32 take the same steps as in one run each (the engine's own run size)
    assert chunks.main(["--engine-dir", str(folder), "--isl", "100", "--short", "20", "--chunks", "64:32,64",
                        "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads((out / "prefill_chunks.json").read_text())
    assert {c: (s["steps"], s["run"]) for c, s in res["chunks"].items()} == {"64:32": (2, 32), "64": (2, 1024)}
    assert res["prefill_run"] == 1024 and res["backend"] == "onnxruntime"
