"""What this machine can run (``criticalkv env``), the way ``python -m torch.utils.collect_env`` and vLLM's
``collect_env`` report theirs: versions (Python, torch and its CUDA, transformers, ONNX Runtime and its providers,
OpenVINO and its CPU plugin's default precision, TensorRT), the GPUs torch sees, nvcc, the selection ops
(``libcriticalkv_torch.so``: whether it loads, its CPU and CUDA registrations), the TensorRT plugin library, and for
every policy where its selection runs: the ops (the CUDA kernels or their host version), the TensorRT plugin, or the
PyTorch reference only, with the reason.

Every probe catches its own failure and reports it (a missing package, a library that does not load): the report is
the place a user looks when something does not run, so it never stops at the first problem.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from importlib import metadata
from typing import Any

#: Distributions the report names (with their versions where installed).
PACKAGES = ("criticalkv", "torch", "transformers", "onnx", "onnxruntime", "tensorrt", "numpy")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _nvcc() -> dict[str, Any]:
    default = "/usr/local/cuda/bin/nvcc"
    path = shutil.which("nvcc") or (default if os.path.exists(default) else None)
    if path is None:
        return {"found": False}
    try:
        text = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return {"found": True, "path": path, "error": str(err)}
    found = re.search(r"release (\d+\.\d+)", text)
    return {"found": True, "path": path, "release": found.group(1) if found else None}


def _torch() -> dict[str, Any]:
    try:
        import torch
    except Exception as err:  # noqa: BLE001 (any import failure is the answer)
        return {"error": f"{type(err).__name__}: {err}"}
    out: dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda, "cuda_available": False,
                           "gpus": []}
    try:
        out["cuda_available"] = bool(torch.cuda.is_available())
        for i in range(torch.cuda.device_count() if out["cuda_available"] else 0):
            p = torch.cuda.get_device_properties(i)
            out["gpus"].append({"name": p.name, "capability": f"{p.major}.{p.minor}",
                                "memory_gib": round(p.total_memory / 2**30, 1), "multiprocessors": p.multi_processor_count})
    except Exception as err:  # noqa: BLE001
        out["cuda_error"] = f"{type(err).__name__}: {err}"
    return out


def _ops() -> dict[str, Any]:
    try:
        from criticalkv.selection import op
    except Exception as err:  # noqa: BLE001
        return {"loads": False, "reason": f"{type(err).__name__}: {err}"}
    reason = op.load_torch_ops()
    return {"library": str(op.torch_ops_candidates()[0]), "loads": reason is None, "reason": reason,
            "cpu": op.kernels_registered("cpu"), "cuda": op.kernels_registered("cuda"),
            "implementation": op.resolve_implementation(None)}


def _tensorrt() -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        from criticalkv.tensorrt.plugin import check_plugin_library, find_plugin_library
        from criticalkv.tensorrt.tensorrt_build import tensorrt_unavailable_reason
    except Exception as err:  # noqa: BLE001
        return {"error": f"{type(err).__name__}: {err}"}
    out["builds_engines"] = tensorrt_unavailable_reason() is None
    out["reason"] = tensorrt_unavailable_reason()
    path = find_plugin_library(required=False)
    out["plugin"] = str(path) if path else None
    if path is not None:
        try:
            check_plugin_library(path)
            out["plugin_loads"] = True
        except (OSError, RuntimeError) as err:
            out["plugin_loads"] = False
            out["plugin_error"] = str(err)
    return out


def _onnxruntime() -> dict[str, Any]:
    try:
        import onnxruntime
    except Exception as err:  # noqa: BLE001
        return {"error": f"{type(err).__name__}: {err}"}
    return {"version": onnxruntime.__version__, "providers": onnxruntime.get_available_providers()}


def _openvino() -> dict[str, Any]:
    """OpenVINO's version and what its CPU plugin computes in by default (``--backend openvino``: bf16 where the CPU
    has it, else f32)."""
    try:
        import openvino as ov
    except Exception as err:  # noqa: BLE001
        return {"error": f"not installed ({type(err).__name__}); pip install -e '.[openvino]' for --backend openvino"}
    try:
        core = ov.Core()
        hint = core.get_property("CPU", "INFERENCE_PRECISION_HINT")
        precision = hint.to_string() if hasattr(hint, "to_string") else str(hint)
        capabilities = [str(c) for c in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")]
    except Exception as err:  # noqa: BLE001
        return {"version": _version("openvino") or ov.__version__,
                "error": f"the CPU plugin: {type(err).__name__}: {err}"}
    return {"version": _version("openvino") or ov.__version__, "cpu_precision": precision,
            "cpu_capabilities": capabilities}


def _policies(ops: dict[str, Any], torch_info: dict[str, Any]) -> list[dict[str, Any]]:
    """Where each policy's selection runs on the CPU and on CUDA: "kernels", "host", "reference: why"."""
    from criticalkv.methods import METHODS
    from criticalkv.policy import KVPolicy

    rows = []
    try:
        import torch

        from criticalkv.selection.op import native_reason
    except Exception:  # noqa: BLE001
        torch = None
    for name, method in METHODS.items():
        policy = KVPolicy(name)
        base = method.base
        row: dict[str, Any] = {"name": name, "tensorrt_plugin": bool(base.native),
                               "model_level": bool(base.model_level), "scores_input": bool(base.external_scores)}
        for device in ("cpu", "cuda"):
            if torch is None:
                row[device] = "reference: torch does not import"
                continue
            if device == "cuda" and not torch_info.get("cuda_available"):
                row[device] = "no GPU"
                continue
            probe = torch.empty(0, device=device)
            scores = probe if base.external_scores else None
            reason = native_reason(policy, probe, scores=scores)
            row[device] = ("kernels" if device == "cuda" else "host version") if reason is None else f"reference: {reason}"
        rows.append(row)
    return rows


def collect() -> dict[str, Any]:
    """Every probe's answer (a JSON-able dict)."""
    torch_info = _torch()
    ops = _ops()
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {dist: _version(dist) for dist in PACKAGES},
        "torch": torch_info,
        "nvcc": _nvcc(),
        "ops": ops,
        "tensorrt": _tensorrt(),
        "onnxruntime": _onnxruntime(),
        "openvino": _openvino(),
        "policies": _policies(ops, torch_info),
    }


def render(report: dict[str, Any]) -> str:
    """The report as aligned lines (collect_env's form), then a policy table."""
    t, ops, trt, ort, nvcc = report["torch"], report["ops"], report["tensorrt"], report["onnxruntime"], report["nvcc"]
    lines = [
        ("criticalkv", report["packages"].get("criticalkv") or "not installed (run from a checkout)"),
        ("Python", report["python"]),
        ("platform", report["platform"]),
        ("torch", t.get("version") or t.get("error")),
        ("torch CUDA", t.get("cuda") or "none (a CPU build)"),
        ("CUDA available", str(t.get("cuda_available", False))),
    ]
    for i, gpu in enumerate(t.get("gpus", [])):
        lines.append((f"GPU {i}", f"{gpu['name']} (sm {gpu['capability']}, {gpu['memory_gib']} GiB, "
                                  f"{gpu['multiprocessors']} SMs)"))
    if t.get("cuda_error"):
        lines.append(("CUDA error", t["cuda_error"]))
    lines.append(("nvcc", f"{nvcc.get('release')} ({nvcc.get('path')})" if nvcc.get("found") else "not found"))
    lines.append(("transformers", report["packages"].get("transformers") or "not installed"))
    lines.append(("ONNX Runtime", f"{ort['version']} ({', '.join(ort['providers'])})" if "version" in ort else ort["error"]))
    ov = report.get("openvino") or {}
    lines.append(("OpenVINO", f"{ov['version']} (its CPU plugin computes in {ov['cpu_precision']} by default)"
                  if "cpu_precision" in ov else ov.get("error", "-")))
    lines.append(("selection ops", (f"{ops.get('library')}: loads; CPU registration {ops.get('cpu')}, CUDA "
                                    f"registration {ops.get('cuda')}") if ops.get("loads") else f"no: {ops.get('reason')}"))
    if "implementation" in ops:
        lines.append(("selection default", f"{ops['implementation']} ($CRITICALKV_SELECTION)"))
    lines.append(("TensorRT", "builds engines" if trt.get("builds_engines") else f"no: {trt.get('reason') or trt.get('error')}"))
    plugin = trt.get("plugin")
    lines.append(("TensorRT plugin", "not built" if not plugin else
                  f"{plugin}: {'loads' if trt.get('plugin_loads') else 'does not load: ' + str(trt.get('plugin_error'))}"))
    width = max(len(k) for k, _ in lines)
    out = [f"{k.ljust(width)} : {v}" for k, v in lines]
    out += ["", "Where each policy's selection runs (ops: torch.ops.criticalkv; plugin: the TensorRT flavour):", ""]
    out.append("| policy | CPU | CUDA | TensorRT plugin |")
    out.append("|---|---|---|---|")
    unbuilt = f"reference: {ops.get('reason')}" if not ops.get("loads") and ops.get("reason") else None

    def cell(text: str) -> str:  # the ops' own reason is said once, on the "selection ops" line above
        return "reference (selection ops: above)" if text == unbuilt else text

    for row in report["policies"]:
        out.append(f"| {row['name']} | {cell(row['cpu'])} | {cell(row['cuda'])} | "
                   f"{'yes' if row['tensorrt_plugin'] else 'no'} |")
    notes = [r for r in report["policies"] if r["scores_input"]]
    if notes:
        out.append("")
        out.append(f"{', '.join(r['name'] for r in notes)}: on the ops with their scores as an input (a context "
                   "reconstruction's or the surrogate's); without them, the PyTorch reference.")
    return "\n".join(out)
