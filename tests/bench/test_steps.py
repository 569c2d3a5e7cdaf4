"""``python -m benchmarks.steps`` (benchmarks.steps): the scheduler's steps timed around an engine's graph runs."""

from __future__ import annotations

import pytest

from benchmarks import steps


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    from criticalkv import KVPolicy
    from criticalkv.runtime import Engine
    from export.tiny_engine import export_tiny_engine
    from hf.conftest import tiny_model

    folder = export_tiny_engine(tiny_model("llama", seed=5), KVPolicy("criticalkv", budget=40, window=8),
                                tmp_path_factory.mktemp("steps") / "tiny")
    engine = Engine.load(folder)
    yield engine
    engine.close()


def ids(n: int, start: int) -> list[list[int]]:
    """One prompt of ``n`` token ids of the tiny model's vocabulary (128)."""
    return [[1 + (start + i) % 120 for i in range(n)]]


def test_the_spans_nest_and_count_every_step(tiny_engine):
    """Chunked prompts (32-token chunks of 100- and 40-token prompts), then decode: the graph time lies inside the
    engine's call, which lies inside the scheduler's step; one decode step per token after the first."""
    osl = 16
    workloads = {"single": ids(100, 5), "batch": [ids(40, 7 + i)[0] for i in range(3)]}
    report = steps.profile_workloads(tiny_engine, workloads, ids(100, 9)[0], osl,
                                     scheduler_options={"prefill_chunk": 32, "prefix_cache_mib": 0})
    single = report["single"]["spans"]
    assert single["chunk/engine"]["n"] == 4  # 100 tokens in chunks of 32
    assert single["select/engine"]["n"] == 1
    assert single["decode/step"]["n"] == osl - 1 and single["decode/engine"]["n"] == osl - 1
    assert single["decode/graph"]["n"] == osl - 1  # one graph run per decode step on ONNX Runtime
    for graph, engine, step in (("chunk/graph", "chunk/engine", None), ("select/graph", "select/engine", None),
                                ("decode/graph", "decode/engine", "decode/step")):
        assert 0 < single[graph]["total_ms"] <= single[engine]["total_ms"]
        if step:
            assert single[engine]["total_ms"] <= single[step]["total_ms"]
    inner = single["chunk/engine"]["total_ms"] + single["select/engine"]["total_ms"]
    assert single["prefill/step"]["total_ms"] >= inner
    batch = report["batch"]["spans"]
    # every decode step ran at batch 3 (counted as decode) or while prompts came in (decode_partial)
    steps_run = batch["decode/step"]["n"] + (batch.get("decode_partial/step") or {"n": 0})["n"]
    assert batch["decode/step"]["n"] >= 1 and steps_run >= osl - 1
    assert batch["chunk/engine"]["n"] == 3 * 2  # 40 tokens in chunks of 32, three prompts
    assert batch["decode/loop"]["n"] >= 1
    # each request's first token and the gap to its second, as the scheduler stamped them
    assert len(report["single"]["ttft_s"]) == 1 and len(report["batch"]["second_s"]) == 3
    assert 0 < report["single"]["ttft_s"][0] and all(0 < s for s in report["batch"]["second_s"])
    text = steps.render({"command": "test", "backend": "onnxruntime", "osl": osl, "workloads": report})
    assert "decode step (Scheduler._decode_step)" in text and "outside the graph" in text
    assert text.count("first token ") == 2 and "ms after it (median)" in text


def test_the_runtimes_are_unwrapped_afterwards(tiny_engine):
    import onnxruntime as ort

    run = ort.InferenceSession.run_with_iobinding
    steps.profile_workloads(tiny_engine, {"single": ids(40, 5)}, ids(20, 9)[0], 3,
                            scheduler_options={"prefill_chunk": 32, "prefix_cache_mib": 0})
    assert ort.InferenceSession.run_with_iobinding is run
    assert "decode_greedy" not in vars(tiny_engine)


def test_bad_arguments_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        steps.main(["--engine-dir", str(tmp_path), "--isl", "10"])
    assert err.value.code == 2 and "--isl must be >= 64" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        steps.main(["--engine-dir", str(tmp_path)])
    assert "not an engine directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        steps.main(["--engine-dir", str(tmp_path), "--prefill-run", "0"])
    assert err.value.code == 2 and "--prefill-chunk and --prefill-run must be >= 1" in capsys.readouterr().err
