"""build_engine's TensorRT step when TensorRT itself fails: the ONNX Runtime engine survives, the failure is
printed and recorded in the manifest, scripts/build_engine.py exits 3.

TensorRT does not run on this machine, so its failure is simulated at the one function that calls it
(``criticalkv.tensorrt.build_tensorrt_engines``), with the message its ONNX parser gave for defect 1."""

import importlib.util
from pathlib import Path

import pytest

import criticalkv.tensorrt as trt_engine
from criticalkv import KVPolicy
from criticalkv.export import BuildConfig
from criticalkv.build import build_engine
from criticalkv.runtime import Engine, EngineError, read_manifest
from export.tiny_engine import save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
PARSER_ERROR = ("TensorRT could not parse prefill_tensorrt.onnx: In node 215 with name: Loop_229 and operator: Loop "
                "(importLoop): INVALID_GRAPH: Node input was not registered: cond_in_140")


@pytest.fixture
def failing_tensorrt(monkeypatch, tmp_path):
    library = tmp_path / "libcriticalkv_trt_plugin.so"
    library.write_bytes(b"\x7fELF")
    calls = []

    def build_tensorrt_engines(prefill, decode, output_dir, **kwargs):
        calls.append(kwargs)
        Path(output_dir).mkdir(parents=True)
        (Path(output_dir) / "decode.engine").write_bytes(b"half written")
        raise RuntimeError(PARSER_ERROR)

    monkeypatch.setattr(trt_engine, "tensorrt_unavailable_reason", lambda: None)
    monkeypatch.setattr(trt_engine, "find_plugin_library", lambda required=True: library)
    monkeypatch.setattr(trt_engine, "build_tensorrt_engines", build_tensorrt_engines)
    return calls


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", "llama", seed=3)


def test_a_tensorrt_failure_keeps_the_onnxruntime_engine(failing_tensorrt, checkpoint, tmp_path):
    messages = []
    config = BuildConfig(max_input_len=128, max_new_tokens=8, attention_chunk=32)
    output = build_engine(tmp_path / "engine", KVPolicy("snapkv", budget=40, window=8), config, model=str(checkpoint),
                          smoke=False, log=messages.append)
    assert failing_tensorrt[0]["dtype"] == "float16" and failing_tensorrt[0]["strongly_typed"] is False
    info = read_manifest(output, verify=True)["tensorrt"]
    assert info == {"built": False, "failed": True, "error": f"RuntimeError: {PARSER_ERROR}"}
    assert not (output / "tensorrt").exists()  # no half-written engines
    assert any(m.startswith("TensorRT engines: FAILED (RuntimeError: TensorRT could not parse") for m in messages)
    engine = Engine.load(output)
    assert len(engine.generate([list(range(5, 60))], max_new_tokens=3, stop_token_ids=[]).tokens[0]) == 3
    engine.close()
    with pytest.raises(EngineError, match="the TensorRT build failed: RuntimeError: TensorRT could not parse"):
        Engine.load(output, backend="tensorrt")


def test_build_engine_script_exits_3_when_tensorrt_fails(failing_tensorrt, checkpoint, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("build_engine_script", ROOT / "scripts" / "build_engine.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    code = script.main(["--model", str(checkpoint), "--kv-policy", "snapkv", "--budget", "40", "--window", "8",
                        "--max-input-len", "128", "--max-new-tokens", "8", "--skip-smoke-test", "--dtype", "float32",
                        "--output", str(tmp_path / "engine")])
    assert code == 3
    assert failing_tensorrt[0]["dtype"] == "float32" and failing_tensorrt[0]["strongly_typed"] is True
    assert "TensorRT engines: FAILED" in capsys.readouterr().err
    assert (tmp_path / "engine" / "manifest.json").is_file()


@pytest.fixture
def succeeding_tensorrt(monkeypatch, tmp_path):
    """build_tensorrt_engines replaced by one that writes the files a real build writes (TensorRT cannot run here):
    the build step's wiring and the manifest are what is tested."""
    from criticalkv.tensorrt import EngineBuildResult

    library = tmp_path / "libcriticalkv_trt_plugin.so"
    library.write_bytes(b"\x7fELF")
    calls = []

    def build_tensorrt_engines(prefill, decode, output_dir, **kwargs):
        calls.append({"prefill": Path(prefill), "decode": Path(decode), **kwargs})
        out = Path(output_dir)
        out.mkdir(parents=True)
        for name in ("prefill", "decode", "extend", "select"):
            (out / f"{name}.engine").write_bytes(name.encode())
        (out / library.name).write_bytes(library.read_bytes())
        return EngineBuildResult(out / "prefill.engine", out / "decode.engine", out / library.name, "10.14.1",
                                 kwargs["dtype"], 3, extend_engine=out / "extend.engine",
                                 select_engine=out / "select.engine", select_plugin_layers=3)

    monkeypatch.setattr(trt_engine, "tensorrt_unavailable_reason", lambda: None)
    monkeypatch.setattr(trt_engine, "find_plugin_library", lambda required=True: library)
    monkeypatch.setattr(trt_engine, "build_tensorrt_engines", build_tensorrt_engines)
    return calls


def test_the_build_gives_tensorrt_the_extend_and_select_graphs(succeeding_tensorrt, checkpoint, tmp_path):
    from criticalkv.runtime.tensorrt_backend import engine_files

    config = BuildConfig(max_input_len=128, max_new_tokens=8, attention_chunk=32, extend_chunk=64, max_question_len=16)
    # contexts selected with the engine's own policy (a context policy's larger capacities would size the slots: the
    # TensorRT backend has no context-policy selection)
    output = build_engine(tmp_path / "engine", KVPolicy("snapkv", budget=40, window=8), config, model=str(checkpoint),
                          smoke=False, log=lambda message: None, context_policy="engine")
    call = succeeding_tensorrt[0]
    assert call["prefill"].name == "prefill_tensorrt.onnx" and call["decode"].name == "decode.onnx"
    assert call["onnx_extend_path"].name == "extend_tensorrt.onnx" and call["onnx_select_path"].name == "select_tensorrt.onnx"
    manifest = read_manifest(output, verify=True)
    decode_capacity = manifest["shapes"]["decode_capacity"]
    assert call["extend_chunk"] == 64 and call["window"] == 8 and call["max_input_len"] == 128
    # a slot's decode buffers (selection capacity + question + new tokens) or a prompt's prefill buffer (<= 128)
    assert call["extend_capacities"] == [max(c, 128) for c in decode_capacity] and decode_capacity[0] == 40 + 16 + 8
    info = manifest["tensorrt"]
    assert info["built"] and info["plugin_layers"] == info["select_plugin_layers"] == 3
    assert info["engines"] == {name: f"tensorrt/{name}.engine" for name in ("prefill", "decode", "extend", "select")}
    assert info["plugin_library"] == "tensorrt/libcriticalkv_trt_plugin.so"
    files = engine_files(output, manifest)
    assert {graph: path.read_bytes() for graph, path in files.items()} == {
        graph: graph.encode() for graph in ("prefill", "decode", "extend", "select")}


def test_a_model_level_policy_builds_tensorrt_engines_from_its_plugin_nodes(succeeding_tensorrt, checkpoint, tmp_path):
    # layer-defensivekv's TensorRT flavour holds the CriticalKVScore / CriticalKVSelectModel plugin nodes
    messages = []
    config = BuildConfig(max_input_len=128, max_new_tokens=8, attention_chunk=32)
    output = build_engine(tmp_path / "engine", KVPolicy("layer-defensivekv", budget=40, window=8), config,
                          model=str(checkpoint), smoke=False, log=messages.append)
    assert [call["prefill"].name for call in succeeding_tensorrt] == ["prefill_tensorrt.onnx"]
    info = read_manifest(output, verify=False)["tensorrt"]
    assert info["built"] is True and "skipped_reason" not in info
    assert (output / "extend_tensorrt.onnx").exists() and (output / "select_tensorrt.onnx").exists()
