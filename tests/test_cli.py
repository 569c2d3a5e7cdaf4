import json
import subprocess
import sys

import torch

from criticalkv import KVPolicy, select_layer
from criticalkv.cli import main
from helpers import random_layer


def test_policies_lists_every_policy(capsys):
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    assert "`ada-criticalkv`" in out and "`--pool-kernel`" in out


def test_select_on_saved_tensors_matches_the_reference(tmp_path, capsys):
    q, k, v, o = random_layer(n=100, window=8, seed=3)
    path = tmp_path / "layer.pt"
    torch.save({"queries": q, "keys": k, "values": v, "o_proj_weight": o}, path)
    assert main(["select", str(path), "--kv-policy", "ada-criticalkv", "--budget", "32", "--window", "8"]) == 0
    result = json.loads(capsys.readouterr().out)
    ref = select_layer(KVPolicy("ada-criticalkv", budget=32, window=8), q, k, v, o)
    assert result["lengths"] == ref.lengths.tolist()
    assert result["indices"][0][1] == ref.indices[0, 1, : ref.lengths[0, 1]].tolist()


def test_select_reports_user_errors_without_traceback(tmp_path):
    torch.save({"queries": torch.zeros(1)}, tmp_path / "bad.pt")
    run = subprocess.run(
        [sys.executable, "-m", "criticalkv.cli", "select", str(tmp_path / "bad.pt")], capture_output=True, text=True
    )
    assert run.returncode == 2 and "missing tensor(s) keys" in run.stderr and "Traceback" not in run.stderr
    run = subprocess.run(
        [sys.executable, "-m", "criticalkv.cli", "select", str(tmp_path / "none.pt"), "--budget", "8"],
        capture_output=True, text=True,
    )
    assert run.returncode == 2 and "budget: 8 is smaller than the window" in run.stderr
