"""``criticalkv env``: what this machine can run, as collect_env reports it (versions, GPUs, the selection ops, the
TensorRT plugin, where each policy's selection runs)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from criticalkv.bench.environment import render
from criticalkv.selection.op import load_torch_ops

ROOT = Path(__file__).resolve().parents[2]


def test_env_reports_this_machine_and_where_each_policy_selects():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("CRITICALKV_SELECTION", None)
    result = subprocess.run([sys.executable, "-m", "criticalkv.cli", "env", "--json"], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["torch"]["version"] == torch.__version__ and report["torch"]["cuda"] == torch.version.cuda
    assert report["torch"]["cuda_available"] == torch.cuda.is_available()
    assert len(report["torch"]["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    ops = report["ops"]
    assert ops["loads"] == (load_torch_ops() is None) and ops["implementation"] == "native"
    rows = {row["name"]: row for row in report["policies"]}
    from criticalkv.methods import POLICIES

    assert set(rows) == set(POLICIES) and len(rows) == 18
    assert rows["keydiff"]["tensorrt_plugin"] and not rows["keydiff"]["scores_input"]
    if ops["loads"]:
        assert ops["cpu"] and rows["layer-defensivekv"]["cpu"] == "host version"
        assert rows["layer-kvzip-criticalkv"]["cpu"] == "host version" and rows["layer-kvzip-criticalkv"]["scores_input"]
    assert rows["expected-attention"]["cpu"].startswith("reference: expected-attention: reads RoPE")
    assert rows["criticalkv"]["tensorrt_plugin"] and not rows["layer-defensivekv"]["tensorrt_plugin"]
    if not torch.cuda.is_available():
        assert all(row["cuda"] == "no GPU" for row in rows.values())
    from importlib.metadata import version

    assert report["openvino"]["version"] == version("openvino")
    assert report["openvino"]["cpu_precision"] in ("bf16", "f16", "f32")
    text = render(report)
    for line in ("torch CUDA", "selection ops", "TensorRT plugin", "| layer-defensivekv |", "OpenVINO "):
        assert line in text, line
    if not ops["loads"]:  # the ops' reason once, on their own line, not on every policy's row
        assert text.count(ops["reason"]) == 1, text
        assert rows["criticalkv"]["cpu"] == f"reference: {ops['reason']}"
        assert "| criticalkv | reference (selection ops: above) |" in text
