"""``python -m benchmarks.openvino_nodes``: OpenVINO's per-node profile of a served prompt, engines side by side."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("openvino")

from benchmarks import openvino_nodes  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from criticalkv import KVPolicy
    from export.tiny_engine import export_tiny_engine
    from hf.conftest import tiny_model

    return export_tiny_engine(tiny_model("llama", seed=5), KVPolicy("ada-criticalkv", budget=40, window=8),
                              tmp_path_factory.mktemp("nodes") / "tiny", extend_chunk=32)


def test_a_prompts_chunks_and_selection_are_profiled_and_compared(folder):
    engine = openvino_nodes.load(folder, threads=1, cache_dir="", precision="f32")
    try:
        ids = [1 + (7 * i) % 120 for i in range(100)]
        runs = [openvino_nodes.profile_prompt(engine, ids, 32) for _ in range(2)]
    finally:
        engine.close()
    for run in runs:  # the four chunks' nodes and the selection's, by node type
        extend = {t: ms for t, ms in run["nodes"].items() if t.startswith("extend: ")}
        assert sum(extend.values()) > 0 and any(t.startswith("select: ") for t in run["nodes"])
        assert run["chunks_ms"] > 0 and run["select_ms"] > 0
    assert np.array_equal(runs[0]["logits"], runs[1]["logits"]) and openvino_nodes.same_row(runs[0]["row"], runs[1]["row"])
    other = runs[1]["row"]
    other.keys[0] = other.keys[0] + 1  # one layer's kept keys changed: not the same entries
    assert not openvino_nodes.same_row(runs[0]["row"], other)
    engines = [{"name": name, "chunks_ms": run["chunks_ms"], "select_ms": run["select_ms"], "rounds_chunks_ms": [1.0],
                "extend_nodes_ms": 1.0, "nodes": run["nodes"]} for name, run in (("a", runs[0]), ("b", runs[1]))]
    engines[1].update(same_logits=True, logits_max_diff=0.0, same_kept=False)
    text = openvino_nodes.render({"isl": 100, "chunk": 32, "rounds": 1, "top": 3, "engines": engines})
    assert "| prompt chunks, wall (ms) |" in text and "ratio to the first" in text
    assert "b against a: last logits equal (max |diff| 0), kept entries DIFFERENT" in text


def test_a_folder_without_an_engine_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        openvino_nodes.main(["--engine-dir", str(tmp_path)])
    assert exit_.value.code == 2 and "not an engine directory" in capsys.readouterr().err
