"""Target checks read the result files: ratios and met / not met from hand-made results."""

import json

import pytest

from benchmarks.targets import check, render


def run(policy, budget, isl, osl, conc, throughput, kept=None, full=None):
    return {"engine": {"label": policy if budget is None else f"{policy} b={budget}", "policy": policy, "budget": budget},
            "isl": isl, "osl": osl, "concurrency": conc,
            "summary": {"completed": 8, "output_throughput": throughput,
                        "kv_mib_kept_per_seq": {"avg": kept}, "kv_mib_full_per_seq": {"avg": full}}}


def test_targets_from_result_files(tmp_path):
    (tmp_path / "serving.json").write_text(json.dumps({"runs": [
        run("full", None, 2048, 64, 8, 10.0, 45.0, 45.0),
        run("criticalkv", 256, 2048, 64, 8, 12.0, 5.625, 45.0),
        run("ada-criticalkv", 256, 2048, 4, 1, 1.0, 5.0, 45.0),  # not b/n: must be reported as not met
        run("criticalkv", 256, 512, 256, 1, 4.0),
        run("criticalkv", 256, 512, 256, 8, 11.0),
    ]}))
    (tmp_path / "single_request.json").write_text(json.dumps({"single": {"isl": 2048, "new_tokens": 16, "impls": {
        "criticalkv": {"median_s": 3.0}, "kvpress": {"median_s": 5.0}}}}))
    rows = {r["target"]: r for r in check(tmp_path)}
    t1 = rows["ISL 2048 OSL 64 conc 8: criticalkv b=256 output tokens/s >= 1.8x full"]
    assert t1["ratio"] == pytest.approx(1.2) and t1["met"] is False
    t2 = rows["ISL 512 OSL 256 (criticalkv b=256): conc 8 output tokens/s >= 2.5x conc 1"]
    assert t2["ratio"] == pytest.approx(2.75) and t2["met"] is True
    kv = rows["KV bytes per sequence, criticalkv b=256, ISL 2048: kept / full = b / n"]
    assert kv["ratio"] == pytest.approx(0.125) and kv["met"] is True
    assert rows["KV bytes per sequence, ada-criticalkv b=256, ISL 2048: kept / full = b / n"]["met"] is False
    single = rows["single request ISL 2048 OSL 16: criticalkv (ONNX Runtime) <= 0.5x kvpress"]
    assert single["ratio"] == pytest.approx(0.6) and single["met"] is False
    text = render(list(rows.values()))
    assert "NOT met" in text and "| met |" in text
