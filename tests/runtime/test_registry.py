"""Every built-in backend is registered in code: a copy of the repository on PYTHONPATH, with no installed package
metadata (what reaches an offline GPU machine), finds the torch backend; a third-party backend still plugs in through
an entry point of ``criticalkv.backends``."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from criticalkv.runtime import registry

ROOT = Path(__file__).resolve().parents[2]


def test_the_built_in_backends_need_no_package_metadata(monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **_: [])
    names = registry.backend_names()
    assert set(names) == {"onnxruntime", "tensorrt", "torch", "openvino"}
    module, cls = names["torch"].split(":")
    assert getattr(__import__(module, fromlist=[cls]), cls).name == "torch"


def test_a_third_party_backend_registers_by_entry_point_and_cannot_shadow_a_built_in(monkeypatch):
    import importlib.metadata

    points = [importlib.metadata.EntryPoint("mine", "my_backend:MyBackend", registry.ENTRY_POINT_GROUP),
              importlib.metadata.EntryPoint("torch", "elsewhere:Other", registry.ENTRY_POINT_GROUP)]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: points if group == registry.ENTRY_POINT_GROUP else [])
    names = registry.backend_names()
    assert names["mine"] == "my_backend:MyBackend" and names["torch"] == registry.BACKENDS["torch"]
    with pytest.raises(ValueError, match="backend 'nope' is not one of onnxruntime, tensorrt, torch, openvino, mine"):
        registry.create_backend("nope", Path("."), {})


def test_a_copy_on_pythonpath_alone_loads_the_torch_backend(tmp_path):
    """The package copied to a folder and put on PYTHONPATH, in an interpreter that sees none of criticalkv's installed
    metadata (its dist-info and editable finder are hidden): ``backend_names`` lists torch and it imports."""
    copy = tmp_path / "copy"
    shutil.copytree(ROOT / "criticalkv", copy / "criticalkv", ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import importlib.metadata as m, json, sys\n"
            "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
            "real = m.distributions\n"
            "hidden = lambda **kw: [d for d in real(**kw) if (d.metadata['Name'] or '').lower() != 'criticalkv']\n"
            "m.distributions = hidden\n"
            "m.entry_points = lambda **kw: m.EntryPoints(p for d in hidden() for p in d.entry_points"
            " if all(getattr(p, k) == v for k, v in kw.items()))\n"
            "import criticalkv.runtime.registry as r\n"
            "names = r.backend_names()\n"
            "module = __import__(names['torch'].split(':')[0], fromlist=['TorchBackend'])\n"
            "print(json.dumps({'names': sorted(names), 'file': module.__file__}))\n")
    env = {**os.environ, "PYTHONPATH": str(copy)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert {"onnxruntime", "tensorrt", "torch"} <= set(result["names"])
    assert result["file"].startswith(str(copy))


def _cpu_computes_bf16() -> bool:
    """What OpenVINO's CPU plugin says it computes in by default here (bf16 on AVX-512 BF16 or AMX)."""
    try:
        import openvino as ov
    except ImportError:
        return False
    hint = ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT")
    return (hint.to_string() if hasattr(hint, "to_string") else str(hint)) == "bf16"


def test_serve_defaults_to_openvino_where_the_cpu_computes_bf16_and_to_the_parity_path_elsewhere(monkeypatch):
    """`criticalkv serve` without --backend (runtime.registry.served_backend): OpenVINO for an exported engine with
    openvino graphs where the CPU plugin computes bf16, else the engine's own default; $CRITICALKV_SERVE_BACKEND wins."""
    from criticalkv.runtime.registry import SERVE_BACKEND_ENV, served_backend

    monkeypatch.delenv(SERVE_BACKEND_ENV, raising=False)
    monkeypatch.delenv("CRITICALKV_OV_PRECISION", raising=False)
    exported = {"onnx": {"files": {}, "openvino": {"prefill": "prefill_openvino.onnx", "decode": "decode_openvino.onnx"}},
                "build": {}}
    backend, why = served_backend(exported)
    if _cpu_computes_bf16():
        assert backend == "openvino" and "computes bf16" in why, why
    else:
        assert backend == "onnxruntime" and ("OpenVINO" in why), why
    # a policy the CPU plugin cannot compute has no openvino graphs: the refusal is the reason
    refused = {"onnx": {"files": {}, "openvino": {"refused": "defensivekv sums int64"}}, "build": {}}
    assert served_backend(refused) == ("onnxruntime", "no OpenVINO graphs: defensivekv sums int64; serve it on onnxruntime")
    assert served_backend({"torch": {}}) == ("torch", "the engine was built for it")
    # buffers the OpenVINO backend refuses (OpenVINOBackend: float32 only)
    assert served_backend({**exported, "build": {"kv_dtype": "float16"}})[0] == "onnxruntime"
    monkeypatch.setenv("CRITICALKV_OV_PRECISION", "f32")  # OpenVINO's f32 is not the faster backend
    assert served_backend(exported)[0] == "onnxruntime"
    monkeypatch.setenv(SERVE_BACKEND_ENV, "openvino")
    assert served_backend(refused) == ("openvino", f"${SERVE_BACKEND_ENV}")  # named: the backend then says what fails
    monkeypatch.setenv(SERVE_BACKEND_ENV, "nonsense")
    with pytest.raises(ValueError, match=r"\$CRITICALKV_SERVE_BACKEND='nonsense' is not one of onnxruntime, tensorrt"):
        served_backend(exported)
