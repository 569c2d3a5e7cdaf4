"""criticalkv.tensorrt on CPU: plugin library discovery, optimization profiles, and the 'why not here' report."""

import importlib.util
from pathlib import Path

import pytest

from criticalkv.tensorrt import (
    PLUGIN_LIBRARY_ENV,
    DimRange,
    EngineBuildResult,
    TensorRTUnavailable,
    build_tensorrt_engines,
    check_plugin_library,
    default_dim_ranges,
    dim_role,
    engine_plan,
    extend_dim_ranges,
    find_plugin_library,
    load_plugin_library,
    onnx_graph_inputs,
    profile_shapes,
    select_dim_ranges,
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
    # the extend and select graphs: new tokens and the prompt are sequences, the buffers' capacities past entries,
    # and the last min(window, n) queries a window (it matched "token" as a sequence before)
    assert dim_role("new_tokens") == dim_role("prompt_tokens") == "sequence"
    assert dim_role("capacity_0") == dim_role("capacity_29") == "past"
    assert dim_role("window_tokens") == "window"
    with pytest.raises(ValueError, match="'heads'"):
        dim_role("heads")
    with pytest.raises(ValueError, match="'window_tokens', a window dimension\\) has no range"):
        profile_shapes([("q", ["batch", "window_tokens"])], default_dim_ranges(1, 10, 5))


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


LAYERS, KV_HEADS, HEADS, HEAD_DIM = 3, 2, 6, 16


@pytest.fixture(scope="module")
def exported_graphs(tmp_path_factory):
    """A tiny Llama exported with every graph: max_input_len 256, extend_chunk 64, window 8, max batch 4."""
    from criticalkv import KVPolicy
    from criticalkv.export import BuildConfig, export_model
    from hf.conftest import tiny_model

    folder = tmp_path_factory.mktemp("graphs")
    config = BuildConfig(max_input_len=256, max_new_tokens=16, max_batch_size=4, extend_chunk=64, max_question_len=24,
                         attention_chunk=32)
    result = export_model(tiny_model("llama", seed=5), KVPolicy("criticalkv", budget=40, window=8), folder, config)
    return folder, result


def plan_of(folder, result, **overrides):
    config = result.config
    return engine_plan(
        folder / "prefill_tensorrt.onnx", folder / "decode.onnx", folder / "tensorrt", config.max_batch_size,
        config.max_input_len, max(result.prefill_capacities), onnx_extend_path=folder / "extend_tensorrt.onnx",
        onnx_select_path=folder / "select_tensorrt.onnx", extend_chunk=config.extend_chunk,
        extend_capacities=[max(c, config.max_input_len) for c in result.decode_capacities], window=result.policy.window,
        **overrides)


def test_every_graph_gets_a_profile_from_its_dimension_names(exported_graphs):
    # the four engines of an engine directory, each input's (min, opt, max) shape from the exported graphs' own
    # dimension names: what build_tensorrt_engines gives TensorRT's optimization profiles
    folder, result = exported_graphs
    plan = plan_of(folder, result)
    assert [(p.graph, p.onnx_path.name, p.engine_path.name, p.expect_plugin) for p in plan] == [
        ("prefill", "prefill_tensorrt.onnx", "prefill.engine", True), ("decode", "decode.onnx", "decode.engine", False),
        ("extend", "extend_tensorrt.onnx", "extend.engine", False), ("select", "select_tensorrt.onnx", "select.engine", True)]
    shapes = {p.graph: profile_shapes(onnx_graph_inputs(p.onnx_path), p.ranges) for p in plan}
    assert shapes["prefill"]["input_ids"] == ((1, 1), (4, 128), (4, 256))
    assert shapes["decode"]["past_key_values.2.key"] == ((1, 2, result.decode_capacities[2], 16),
                                                         (4, 2, result.decode_capacities[2], 16),
                                                         (4, 2, result.decode_capacities[2], 16))
    # extend: one sequence, 1..extend_chunk new tokens, any buffer from 1 entry to the larger of the decode buffer
    # and the longest prompt per layer
    extend = shapes["extend"]
    assert extend["input_ids"] == extend["position_ids"] == ((1, 1), (1, 64), (1, 64))
    for layer, capacity in enumerate(result.decode_capacities):
        largest = max(capacity, 256)
        assert extend[f"past_key_values.{layer}.key"] == ((1, 2, 1, 16), (1, 2, largest // 2, 16), (1, 2, largest, 16))
        assert extend[f"past_key_values.{layer}.value"] == extend[f"past_key_values.{layer}.key"]
        assert extend[f"past_key_values.{layer}.lengths"] == ((1, 2), (1, 2), (1, 2))
    assert len(extend) == 2 + 3 * LAYERS
    # select: the prompt's n entries (1..max_input_len), the last min(window, n) queries, the budget is static
    select = shapes["select"]
    for layer in range(LAYERS):
        assert select[f"window_queries.{layer}"] == ((1, HEADS, 1, 16), (1, HEADS, 8, 16), (1, HEADS, 8, 16))
        assert select[f"past_key_values.{layer}.key"] == ((1, 2, 1, 16), (1, 2, 128, 16), (1, 2, 256, 16))
    assert "kv_budget" not in select and len(select) == 4 * LAYERS
    # the ranges of a dimension name are one (TensorRT checks same-named dimensions against each other)
    for graph, by_input in shapes.items():
        seen = {}
        for name, dims in onnx_graph_inputs(next(p for p in plan if p.graph == graph).onnx_path):
            for axis, dim in enumerate(dims):
                if isinstance(dim, str):
                    bounds = tuple(shape[axis] for shape in by_input[name])
                    assert seen.setdefault(dim, bounds) == bounds, (graph, name, dim)


def test_engine_plan_rules():
    plan = engine_plan("p.onnx", "d.onnx", "out", 2, 100, 50)
    assert [p.graph for p in plan] == ["prefill", "decode"]  # engines built before extend and select existed
    with pytest.raises(ValueError, match="both or neither"):
        engine_plan("p.onnx", "d.onnx", "out", 2, 100, 50, onnx_extend_path="e.onnx")
    with pytest.raises(ValueError, match="extend_chunk, extend_capacities"):
        engine_plan("p.onnx", "d.onnx", "out", 2, 100, 50, onnx_extend_path="e.onnx", onnx_select_path="s.onnx")
    plan = engine_plan("p.onnx", "d.onnx", "out", 2, 100, 50, onnx_extend_path="e.onnx", onnx_select_path="s.onnx",
                       extend_chunk=16, extend_capacities=[120, 130], window=4,
                       dim_ranges={"capacity_1": DimRange(1, 7, 9)})
    assert plan[2].ranges["capacity_0"] == DimRange(1, 65, 120) and plan[2].ranges["capacity_1"] == DimRange(1, 7, 9)
    with pytest.raises(ValueError, match="extend_chunk"):
        extend_dim_ranges(0, [10], 4)
    with pytest.raises(ValueError, match=r"capacities\[1\]"):
        extend_dim_ranges(8, [10, 0], 4)
    assert select_dim_ranges(100, 4, opt_input_len=30)["sequence"] == DimRange(1, 30, 100)


def test_the_build_result_names_its_files_relative_to_the_engine_directory(tmp_path):
    out = tmp_path / "engine" / "tensorrt"
    result = EngineBuildResult(out / "prefill.engine", out / "decode.engine", out / "libcriticalkv_trt_plugin.so",
                               "10.14.1", "float16", 3, extend_engine=out / "extend.engine",
                               select_engine=out / "select.engine", select_plugin_layers=3)
    assert result.manifest_entry(tmp_path / "engine") == {
        "built": True, "tensorrt_version": "10.14.1", "dtype": "float16", "plugin_layers": 3, "select_plugin_layers": 3,
        "plugin_library": "tensorrt/libcriticalkv_trt_plugin.so",
        "engines": {"prefill": "tensorrt/prefill.engine", "decode": "tensorrt/decode.engine",
                    "extend": "tensorrt/extend.engine", "select": "tensorrt/select.engine"}}
    older = EngineBuildResult(out / "prefill.engine", out / "decode.engine", out / "lib.so", "10.14.1", "float16", 3)
    assert set(older.manifest_entry(tmp_path / "engine")["engines"]) == {"prefill", "decode"}


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="tensorrt is installed here")
def test_unavailable_reason_names_tensorrt(tmp_path):
    reason = tensorrt_unavailable_reason()
    assert reason and "tensorrt" in reason
    with pytest.raises(TensorRTUnavailable, match="tensorrt"):
        build_tensorrt_engines(tmp_path / "p.onnx", tmp_path / "d.onnx", tmp_path / "out", None, 1, 128, 64, "float16")
    with pytest.raises(ValueError, match="dtype"):
        build_tensorrt_engines(tmp_path / "p.onnx", tmp_path / "d.onnx", tmp_path / "out", None, 1, 128, 64, "int8")


def test_plugin_library_discovery(native_build, trt_plugin, monkeypatch, tmp_path):
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


def test_the_plugin_library_is_loaded_once_per_process(trt_plugin):
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
    TensorRT headers (or decides to skip the plugin), prints where, then stops at cmake."""
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
    # no headers: the plugin is skipped with the reason, the build goes on (to cmake, which has no sources here)
    skipped = [line for line in offline.stdout.splitlines() if line.startswith("TensorRT plugin: skipped")]
    assert len(skipped) == 1 and "could not be downloaded (offline?)" in skipped[0] and "TRT_INCLUDE_DIR" in skipped[0]
    assert not any(line.startswith("TensorRT headers:") for line in offline.stdout.splitlines())
    assert "could not be downloaded" not in offline.stderr
    empty = tmp_path / "empty-headers"
    elsewhere = run_header_step(tmp_path, {"TRT_HEADERS_DIR": str(empty)})
    assert f"none in {empty}" in elsewhere.stdout and empty.is_dir() and not any(empty.iterdir())
    bad = run_header_step(tmp_path, {"TRT_INCLUDE_DIR": str(tmp_path)})  # asked for: an error, not a skip
    assert bad.returncode == 2 and "has no NvInfer.h" in bad.stderr
    # a wheel copied into build/trt-headers is unpacked without the network
    wheel = glob.glob(str(native_build.parent / "trt-headers" / "kernel_lens-*.whl"))[0]
    (tmp_path / "build" / "trt-headers").mkdir(parents=True, exist_ok=True)
    shutil.copy(wheel, tmp_path / "build" / "trt-headers")
    copied = run_header_step(tmp_path, {})
    headers = tmp_path / "build" / "trt-headers" / "kernel_lens" / "include" / "tensorrt"
    assert f"TensorRT headers: {headers}" in copied.stdout and (headers / "NvInfer.h").is_file()
    assert "fetching" not in copied.stdout and "skipped" not in copied.stdout
    given = run_header_step(tmp_path, {"TRT_INCLUDE_DIR": str(headers)})  # headers given: used as they are
    assert f"TensorRT headers: {headers}" in given.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_engines_build_in_every_dtype_and_twice_in_one_process(native_build, trt_plugin, tmp_path, dtype):
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
                          BuildConfig(max_input_len=256, max_batch_size=2, extend_chunk=64))
    folder = tmp_path / "onnx"
    for attempt in range(2):
        out = tmp_path / f"trt{attempt}"
        built = build_tensorrt_engines(
            folder / "prefill_tensorrt.onnx", folder / "decode.onnx", out, find_plugin_library(),
            max_batch=2, max_input_len=256, max_capacity=max(result.prefill_capacities), dtype=dtype,
            strongly_typed=dtype == "float32", onnx_extend_path=folder / "extend_tensorrt.onnx",
            onnx_select_path=folder / "select_tensorrt.onnx", extend_chunk=64, window=8,
            extend_capacities=[max(c, 256) for c in result.decode_capacities],
        )
        assert built.plugin_layers == built.select_plugin_layers == result.spec.num_layers and built.dtype == dtype
        info = json.loads((out / "engines.json").read_text())
        assert info["plugin_library"] == "libcriticalkv_trt_plugin.so" and (out / info["plugin_library"]).is_file()
        for graph in ("prefill", "decode", "extend", "select"):
            assert info[f"{graph}_engine"] == f"{graph}.engine" and (out / f"{graph}.engine").stat().st_size > 0
            assert info["profiles"][graph], graph
        assert info["profiles"]["extend"]["input_ids"] == [[1, 1], [1, 64], [1, 64]]
