"""``criticalkv eval`` on the bundled SmolLM2-135M-Instruct (slow: loads the real model)."""

import json

import pytest

from criticalkv.cli import main

pytestmark = pytest.mark.slow


def test_needle_on_the_bundled_model_matches_generate(tmp_path):
    out = tmp_path / "needle"
    assert main(["eval", "needle", "--lengths", "1024", "--depths", "50", "--samples", "1", "--policies",
                 "full,snapkv,criticalkv", "--budgets", "128", "--verify", "1", "--threads", "1",
                 "--out", str(out)]) == 0
    doc = json.loads((out / "needle.json").read_text())
    (rec,) = doc["records"]
    assert all(r["verified"] for r in rec["results"].values())  # shared prefill == criticalkv.hf.generate
    assert rec["results"]["full"]["score"] == 1.0  # the full cache finds the needle (FACTS.md)
    assert doc["model"]["layers"] == 30 and doc["model"]["kv_heads"] == 3
