"""criticalkv.engine on CPU: plugin library discovery, optimization profiles, and the 'why not here' report."""

import importlib.util
from pathlib import Path

import pytest

from criticalkv.engine import (
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
    import criticalkv.engine.plugin as plugin

    monkeypatch.setattr(plugin, "REPO_ROOT", tmp_path)
    monkeypatch.delenv(PLUGIN_LIBRARY_ENV, raising=False)
    assert find_plugin_library(required=False) is None
    with pytest.raises(FileNotFoundError, match="scripts/build_plugin.sh"):
        find_plugin_library()
    assert isinstance(Path(plugin.plugin_library_candidates()[0]), Path)
