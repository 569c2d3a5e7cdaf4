"""Fixtures of the plugin tests: one incremental native build per session, the ctypes libraries on top.

``scripts/build_plugin.sh`` builds build/plugins (ninja makes a rebuild of an up-to-date tree a no-op). A failing
build fails every test that needs it. Without nvcc only the host library is built, and the tests that need the
kernels or the TensorRT plugin are skipped with that reason.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckv_native import BUILD_DIR, ROOT, CudaLibrary, HostLibrary, PluginHarness


def nvcc_path() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


@pytest.fixture(scope="session")
def native_build() -> Path:
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", "scripts/build_plugin.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800
    )
    if result.returncode != 0:
        log = (result.stdout + result.stderr)[-6000:]
        pytest.fail(f"scripts/build_plugin.sh failed (exit {result.returncode}):\n{log}", pytrace=False)
    return BUILD_DIR


@pytest.fixture(scope="session")
def needs_nvcc() -> None:
    if nvcc_path() is None:
        pytest.skip("nvcc not found: the CUDA kernels and the TensorRT plugin are not built on this machine")


@pytest.fixture(scope="session")
def host_lib(native_build) -> HostLibrary:
    return HostLibrary()


@pytest.fixture(scope="session")
def trt_plugin(native_build, needs_nvcc) -> Path:
    """The TensorRT plugin library; skipped where scripts/build_plugin.sh found no TensorRT headers (it builds the
    rest then and says why the plugin is not built)."""
    path = native_build / "libcriticalkv_trt_plugin.so"
    if not path.is_file():
        pytest.skip("the TensorRT plugin is not built here: no TensorRT headers (scripts/build_plugin.sh says why)")
    return path


@pytest.fixture(scope="session")
def harness(trt_plugin) -> PluginHarness:
    return PluginHarness(trt_plugin)


@pytest.fixture(scope="session")
def cuda_lib(native_build, needs_nvcc) -> CudaLibrary:
    lib = CudaLibrary()
    if lib.device_count() == 0:
        pytest.skip("no CUDA device visible to the kernels")
    return lib


#: The modules whose shared-table tests select a layer from its own inputs (the host driver, the kernels).
SELECTING_MODULES = ("test_plugin_host_select", "test_plugin_gpu")


def pytest_collection_modifyitems(config, items):
    """Policies the plugin has no selection flow for (``BaseMethod.native`` False: a model-level method) are refused by the
    plugin's validation (tested in test_plugin_fields.py), and the shared table's tests drive a layer with its own inputs
    alone, which a policy ranking by external scores (the kvzip pair) cannot run without its ``scores`` input (tested
    with it in test_plugin_scores_input.py and tests/selection/test_select_op.py): their shared-table cases are skipped
    here."""
    from criticalkv.methods import METHODS

    here = Path(__file__).resolve().parent
    for item in items:
        if here not in Path(item.path).resolve().parents:  # this hook sees every test of the session
            continue
        case = item.callspec.params.get("case") if hasattr(item, "callspec") else None
        if not (isinstance(case, tuple) and len(case) == 2 and isinstance(case[1], dict) and "name" in case[1]):
            continue  # not a line of the shared policy table
        method = METHODS[case[1]["name"]].base
        if not method.native:
            item.add_marker(pytest.mark.skip(reason=f"{case[1]['name']}: refused by the plugin ({method.cpp_refusal})"))
        elif method.external_scores and Path(item.path).stem in SELECTING_MODULES:
            item.add_marker(pytest.mark.skip(reason=f"{case[1]['name']}: ranks by its scores input, which this shared-table "
                                                    "test does not give"))
