"""``python -m benchmarks.openvino_attention``: a chunk's attention in three forms on OpenVINO, the same numbers."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("openvino")

from benchmarks import openvino_attention  # noqa: E402

SPEC = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "hidden_size": 32, "intermediate_size": 48}


def reference(feeds: dict) -> np.ndarray:
    """The chunk's attention in numpy (float64): query head h reads KV head h // G; a key counts where its head holds
    it and it is not after the query."""
    q, k, v = (feeds[x].astype(np.float64) for x in ("q", "k", "v"))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    allowed = np.repeat(feeds["seen"], group, axis=1)[:, :, None, :] & feeds["causal"][None, None]
    scores = np.where(allowed, q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1]), -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    out = (probs / probs.sum(-1, keepdims=True)) @ v  # [1, H, N, d]
    return out.transpose(0, 2, 1, 3).reshape(1, q.shape[2], -1)


@pytest.mark.parametrize("form", openvino_attention.FORMS)
def test_every_form_computes_the_chunks_attention(form):
    import openvino as ov

    request = ov.Core().compile_model(openvino_attention.attention_model(form, 4, 2, 16), "CPU",
                                      {"INFERENCE_PRECISION_HINT": "f32"}).create_infer_request()
    for past, n in ((0, 8), (20, 8), (20, 1)):  # a first chunk, a later one (a head holding 7 fewer), one token
        feeds = openvino_attention.chunk_inputs(past, n, 4, 2, 16, seed=past + n)
        np.testing.assert_allclose(request.infer(feeds)[0], reference(feeds), rtol=1e-5, atol=1e-5)


def test_the_benchmark_compares_the_forms_and_writes_its_table(tmp_path):
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "manifest.json").write_text(json.dumps({"model": {"spec": SPEC}}))
    out = tmp_path / "attention"
    assert openvino_attention.main(["--engine-dir", str(engine), "--chunk", "8", "--pasts", "0,16", "--rounds", "2",
                                    "--precision", "f32", "--threads", "1", "--out", str(out)]) == 0
    results = json.loads(out.with_suffix(".json").read_text())
    assert [row["past"] for row in results["attention"]] == [0, 16]
    for row in results["attention"]:
        assert set(row["ms"]) == set(openvino_attention.FORMS) and all(t > 0 for t in row["ms"].values())
        assert row["ratio"]["repeat"] == 1.0 and max(row["max_diff"].values()) < 1e-5  # f32: the same numbers
    assert results["gemm"]["gflops"] > 0 and results["gemm"]["m"] == 8
    text = out.with_suffix(".txt").read_text()
    assert "| 16 | 8 |" in text and "sdpa / repeat" in text and "GEMM [8, 32] x [32, 48]" in text


def test_bad_arguments_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        openvino_attention.main(["--engine-dir", str(tmp_path), "--pasts", "a,b"])
    assert err.value.code == 2 and "--pasts: 'a,b' is not a comma-separated list" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        openvino_attention.main(["--engine-dir", str(tmp_path)])  # no manifest.json
    assert "not an engine directory" in capsys.readouterr().err
