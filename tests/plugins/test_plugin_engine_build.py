"""criticalkv.tensorrt on CPU: plugin library discovery, optimization profiles, and the 'why not here' report."""

import importlib.util
from pathlib import Path

import pytest

from criticalkv.tensorrt import (
    PLUGIN_LIBRARY_ENV,
    DimRange,
    TensorRTUnavailable,
    build_tensorrt_engines,
    check_plugin_library,
    default_dim_ranges,
    dim_role,
    find_plugin_library,
    load_plugin_library,
    profile_shapes,
    tensorrt_unavailable_reason,
)

GENAI_PREFILL_INPUTS = [
    ("input_ids", ["batch_size", "sequence_length"]),
    ("attention_mask", ["batch_size", "total_sequence_length"]),
    ("position_ids", ["batch_size", "sequence_length"]),
    ("prompt_lengths", ["batch_size"]),
]
GENAI_DECODE_INPUTS = [
    ("input_ids", ["batch_size", 1]),
    ("position_ids", ["batch_size", 1]),
    ("past_key_values.0.key", ["batch_size", 3, "past_sequence_length", 64]),
    ("past_key_values.0.value", ["batch_size", 3, "past_sequence_length", 64]),
    ("past_key_values.lengths", [30, "batch_size", 3]),
    ("attention_mask", ["batch_size", "total_sequence_length"]),
]


def test_dim_roles_follow_the_export_naming_conventions():
    assert dim_role("batch_size") == dim_role("batch") == "batch"
    assert dim_role("sequence_length") == dim_role("seq_len") == dim_role("prompt_length") == "sequence"
    assert dim_role("past_sequence_length") == dim_role("kv_capacity") == dim_role("kept_len") == "past"
    assert dim_role("total_sequence_length") == "total"
    with pytest.raises(ValueError, match="'heads'"):
        dim_role("heads")


def test_prefill_profile():
    ranges = default_dim_ranges(max_batch=4, max_input_len=8192, max_capacity=1024, opt_batch=2, opt_input_len=2000)
    shapes = profile_shapes(GENAI_PREFILL_INPUTS, ranges)
    assert shapes["input_ids"] == ((1, 1), (2, 2000), (4, 8192))
    assert shapes["attention_mask"] == ((1, 1), (2, 2000), (4, 8192))
    assert shapes["prompt_lengths"] == ((1,), (2,), (4,))


def test_decode_profile_keeps_static_dims_and_bounds_the_cache_by_the_capacity():
    ranges = default_dim_ranges(max_batch=8, max_input_len=8192, max_capacity=1024, decode=True)
    shapes = profile_shapes(GENAI_DECODE_INPUTS, ranges)
    assert shapes["input_ids"] == ((1, 1), (8, 1), (8, 1))
    assert shapes["past_key_values.0.key"] == ((1, 3, 1, 64), (8, 3, 512, 64), (8, 3, 1024, 64))
    assert shapes["past_key_values.lengths"] == ((30, 1, 3), (30, 8, 3), (30, 8, 3))
    assert shapes["attention_mask"] == ((1, 2), (8, 513), (8, 1025))


def test_profile_overrides_and_errors():
    ranges = {**default_dim_ranges(2, 100, 50), "sequence_length": DimRange(16, 32, 64)}
    assert profile_shapes([("input_ids", ["batch_size", "sequence_length"])], ranges)["input_ids"][2] == (2, 64)
    assert profile_shapes([("static", [1, 2, 3])], ranges) == {}
    with pytest.raises(ValueError, match="unnamed"):
        profile_shapes([("x", ["batch_size", -1])], ranges)
    with pytest.raises(ValueError):
        DimRange(5, 4, 6)
    with pytest.raises(ValueError, match="max_capacity"):
        default_dim_ranges(1, 10, 0)


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="tensorrt is installed here")
def test_unavailable_reason_names_tensorrt(tmp_path):
    reason = tensorrt_unavailable_reason()
    assert reason and "tensorrt" in reason
    with pytest.raises(TensorRTUnavailable, match="tensorrt"):
        build_tensorrt_engines(tmp_path / "p.onnx", tmp_path / "d.onnx", tmp_path / "out", None, 1, 128, 64, "float16")
    with pytest.raises(ValueError, match="dtype"):
        build_tensorrt_engines(tmp_path / "p.onnx", tmp_path / "d.onnx", tmp_path / "out", None, 1, 128, 64, "int8")


def test_plugin_library_discovery(native_build, needs_nvcc, monkeypatch, tmp_path):
    found = find_plugin_library()
    assert found.name == "libcriticalkv_trt_plugin.so" and check_plugin_library(found) == found
    monkeypatch.setenv(PLUGIN_LIBRARY_ENV, str(found))
    assert find_plugin_library() == found
    with pytest.raises(RuntimeError, match="getCreators"):
        check_plugin_library(native_build / "libcriticalkv_host.so")

    class FakeRegistry:
        def __init__(self):
            self.loaded = []

        def load_library(self, path):
            self.loaded.append(path)
            return object()

    registry = FakeRegistry()
    assert load_plugin_library(found, registry) == found and registry.loaded == [str(found)]


def test_missing_library_says_how_to_build_it(monkeypatch, tmp_path):
    import criticalkv.tensorrt.plugin as plugin

    monkeypatch.setattr(plugin, "REPO_ROOT", tmp_path)
    monkeypatch.delenv(PLUGIN_LIBRARY_ENV, raising=False)
    assert find_plugin_library(required=False) is None
    with pytest.raises(FileNotFoundError, match="scripts/build_plugin.sh"):
        find_plugin_library()
    assert isinstance(Path(plugin.plugin_library_candidates()[0]), Path)


class RegistryLikeTensorRT:
    """IPluginRegistry's documented behaviour: loadLibrary registers the library's creators, and returns null
    when they are already registered (NvInferRuntime.h, IPluginRegistry::loadLibrary)."""

    def __init__(self):
        self.loads, self.creators = [], set()

    def load_library(self, path):
        self.loads.append(path)
        if ("CriticalKVSelect", "1", "") in self.creators:
            return None
        self.creators |= {("CriticalKVSelect", "1", ""), ("CriticalKVSelect", "1", "ai.criticalkv")}
        return object()

    def get_creator(self, name, version, namespace):
        return object() if (name, version, namespace) in self.creators else None


def test_the_plugin_library_is_loaded_once_per_process(native_build, needs_nvcc):
    # build then run in one process, two backends, parametrised tests: every caller asks for the library
    found = find_plugin_library()
    registry = RegistryLikeTensorRT()
    for _ in range(3):
        assert load_plugin_library(found, registry) == found
    assert registry.loads == [str(found)]
    with pytest.raises(RuntimeError, match="could not load"):  # a registry that refuses it is still an error
        load_plugin_library(found, type("Refusing", (), {"load_library": lambda self, path: None})())


def test_a_moved_engine_directory_finds_its_own_plugin_copy(monkeypatch, tmp_path):
    import criticalkv.tensorrt.plugin as plugin

    monkeypatch.delenv(PLUGIN_LIBRARY_ENV, raising=False)
    monkeypatch.setattr(plugin, "REPO_ROOT", tmp_path / "checkout")
    engine = tmp_path / "engines" / "a"
    (engine / "tensorrt").mkdir(parents=True)
    (engine / "tensorrt" / "libcriticalkv_trt_plugin.so").write_bytes(b"x")
    moved = tmp_path / "elsewhere" / "b"
    moved.parent.mkdir()
    engine.rename(moved)
    recorded = "tensorrt/libcriticalkv_trt_plugin.so"  # what the build writes into manifest.json
    assert plugin.resolve_plugin_library(moved, recorded) == moved / recorded
    explicit = tmp_path / "explicit.so"
    explicit.write_bytes(b"x")
    monkeypatch.setenv(PLUGIN_LIBRARY_ENV, str(explicit))
    assert plugin.resolve_plugin_library(moved, recorded) == explicit  # the environment variable comes first
    assert plugin.resolve_plugin_library(moved, recorded, explicit=moved / recorded) == moved / recorded
    monkeypatch.delenv(PLUGIN_LIBRARY_ENV)
    (moved / recorded).unlink()
    with pytest.raises(FileNotFoundError, match="searched: .*tensorrt/libcriticalkv_trt_plugin.so.*build_plugin.sh"):
        plugin.resolve_plugin_library(moved, recorded)


def run_header_step(tmp_path, env):
    """scripts/build_plugin.sh in a bare copy of the checkout (no plugins/ sources): it finds or fetches the
    TensorRT headers, prints where, then stops at cmake."""
    import os
    import shutil
    import subprocess

    from ckv_native import ROOT

    (tmp_path / "scripts").mkdir(exist_ok=True)
    shutil.copy(ROOT / "scripts" / "build_plugin.sh", tmp_path / "scripts" / "build_plugin.sh")
    return subprocess.run(["bash", "scripts/build_plugin.sh"], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", **env}, timeout=120)


def test_build_plugin_finds_headers_offline(native_build, tmp_path):
    import glob
    import shutil

    offline = run_header_step(tmp_path, {})  # PIP_NO_INDEX: pip cannot download anything
    assert offline.returncode == 2 and "could not be downloaded (offline?)" in offline.stderr
    assert "TRT_INCLUDE_DIR" in offline.stderr
    bad = run_header_step(tmp_path, {"TRT_INCLUDE_DIR": str(tmp_path)})
    assert bad.returncode == 2 and "has no NvInfer.h" in bad.stderr
    # a wheel copied into build/trt-headers is unpacked without the network
    wheel = glob.glob(str(native_build.parent / "trt-headers" / "kernel_lens-*.whl"))[0]
    (tmp_path / "build" / "trt-headers").mkdir(parents=True, exist_ok=True)
    shutil.copy(wheel, tmp_path / "build" / "trt-headers")
    copied = run_header_step(tmp_path, {})
    headers = tmp_path / "build" / "trt-headers" / "kernel_lens" / "include" / "tensorrt"
    assert f"TensorRT headers: {headers}" in copied.stdout and (headers / "NvInfer.h").is_file()
    assert "fetching" not in copied.stdout
    given = run_header_step(tmp_path, {"TRT_INCLUDE_DIR": str(headers)})  # headers given: used as they are
    assert f"TensorRT headers: {headers}" in given.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_engines_build_in_every_dtype_and_twice_in_one_process(native_build, needs_nvcc, tmp_path, dtype):
    # every CriticalKVSelect node becomes a plugin layer, engines.json names its files relative to its folder
    # (the plugin is copied beside the engines), and a second build in the same process loads the plugin again
    pytest.importorskip("tensorrt")
    import json

    from criticalkv import KVPolicy
    from criticalkv.export import BuildConfig, export_model
    from hf.conftest import tiny_model

    if tensorrt_unavailable_reason():
        pytest.skip(tensorrt_unavailable_reason())
    result = export_model(tiny_model("llama", seed=1), KVPolicy("criticalkv", budget=40, window=8), tmp_path / "onnx",
                          BuildConfig(max_input_len=256, max_batch_size=2))
    for attempt in range(2):
        out = tmp_path / f"trt{attempt}"
        built = build_tensorrt_engines(
            tmp_path / "onnx" / "prefill_tensorrt.onnx", tmp_path / "onnx" / "decode.onnx", out, find_plugin_library(),
            max_batch=2, max_input_len=256, max_capacity=max(result.prefill_capacities), dtype=dtype,
            strongly_typed=dtype == "float32",
        )
        assert built.plugin_layers == result.spec.num_layers and built.dtype == dtype
        info = json.loads((out / "engines.json").read_text())
        assert info["plugin_library"] == "libcriticalkv_trt_plugin.so" and (out / info["plugin_library"]).is_file()
        assert info["prefill_engine"] == "prefill.engine" and (out / "prefill.engine").stat().st_size > 0
