"""The TensorRT backend of the runtime. Its host logic runs everywhere; the engines need a GPU and TensorRT
(`pytest -m gpu tests/runtime/test_tensorrt_backend.py` on a GPU machine after `bash scripts/build_plugin.sh`)."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from criticalkv import KVPolicy
from criticalkv.runtime import Engine
from criticalkv.runtime.manifest import EngineError
from criticalkv.runtime.tensorrt_backend import torch_dtype
from export.tiny_engine import export_tiny_engine, save_tiny_checkpoint, words
from hf.conftest import tiny_model


class FakeDataType:  # TensorRT's DataType members expose .name
    def __init__(self, name):
        self.name = name


def test_tensorrt_types_map_to_torch():
    assert torch_dtype(FakeDataType("FLOAT")) is torch.float32
    assert torch_dtype(FakeDataType("HALF")) is torch.float16
    assert torch_dtype(FakeDataType("BF16")) is torch.bfloat16
    assert torch_dtype("DataType.INT64") is torch.int64
    with pytest.raises(EngineError, match="FP8 is not supported"):
        torch_dtype(FakeDataType("FP8"))


@pytest.fixture(scope="module")
def onnx_only_engine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trt") / "engine"
    return export_tiny_engine(tiny_model(), KVPolicy("criticalkv", budget=40, window=8), folder)


def test_an_engine_without_tensorrt_engines_says_why(onnx_only_engine):
    with pytest.raises(EngineError, match="no TensorRT engines in this engine directory"):
        Engine.load(onnx_only_engine, backend="tensorrt")


def test_cli_reports_a_missing_tensorrt_build_clearly(onnx_only_engine):
    run = subprocess.run(
        [sys.executable, "-m", "criticalkv.cli", "generate", "--engine-dir", str(onnx_only_engine), "--backend",
         "tensorrt", "--prompt", words(range(10, 70))],
        capture_output=True, text=True,
    )
    assert run.returncode == 2 and "no TensorRT engines" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["criticalkv", "pyramidkv", "ada-criticalkv", "laprox", "full"])
def test_tensorrt_engine_generates_the_onnxruntime_tokens(tmp_path, name):
    pytest.importorskip("tensorrt")
    from criticalkv.export import BuildConfig
    from criticalkv.export.build import build_engine

    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt")
    config = BuildConfig(max_input_len=256, max_new_tokens=32, max_batch_size=2, attention_chunk=32)
    folder = build_engine(tmp_path / "engine", KVPolicy(name, budget=40, window=8), config, model=str(checkpoint))
    prompts = [list(range(5, 125)), list(range(20, 110))]
    reference = Engine.load(folder, backend="onnxruntime").generate(prompts, 24, stop_token_ids=[])
    for graphs in (True, False):
        engine = Engine.load(folder, backend="tensorrt", cuda_graphs=graphs)
        got = engine.generate(prompts, 24, stop_token_ids=[])
        engine.close()
        assert got.tokens == reference.tokens, f"cuda_graphs={graphs}"
        for layer in range(len(reference.kept_lengths)):
            assert np.array_equal(got.kept_lengths[layer], reference.kept_lengths[layer])
            assert np.array_equal(got.kept_indices[layer], reference.kept_indices[layer])
