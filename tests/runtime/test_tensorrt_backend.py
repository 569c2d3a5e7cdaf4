"""The TensorRT backend of the runtime. Its host logic runs everywhere; the engines need a GPU and TensorRT
(`pytest -m gpu tests/runtime/test_tensorrt_backend.py` on a GPU machine after `bash scripts/build_plugin.sh`)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from criticalkv import KVPolicy
from criticalkv.runtime import Engine, read_manifest
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


PROMPTS = [list(range(5, 125)), list(range(20, 110))]  # a left-padded batch of two


def build_tiny(tmp_path, name="criticalkv", dtype="float32", batch=2):
    pytest.importorskip("tensorrt")
    from criticalkv.export import BuildConfig
    from criticalkv.build import build_engine

    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt")
    config = BuildConfig(max_input_len=256, max_new_tokens=32, max_batch_size=batch, attention_chunk=32, dtype=dtype)
    folder = build_engine(tmp_path / "engine", KVPolicy(name, budget=40, window=8), config, model=str(checkpoint))
    manifest = read_manifest(folder, verify=False)
    assert manifest["tensorrt"]["built"], manifest["tensorrt"]
    return folder, checkpoint


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["criticalkv", "pyramidkv", "ada-criticalkv", "laprox", "full"])
def test_tensorrt_engine_generates_the_onnxruntime_tokens(tmp_path, name):
    # the fp32 parity build (strongly typed, TF32 cleared): token- and index-identical to ONNX Runtime
    folder, _ = build_tiny(tmp_path, name, "float32")
    reference = Engine.load(folder, backend="onnxruntime").generate(PROMPTS, 24, stop_token_ids=[])
    for graphs in (True, False):
        engine = Engine.load(folder, backend="tensorrt", cuda_graphs=graphs)
        got = engine.generate(PROMPTS, 24, stop_token_ids=[])
        engine.close()
        assert got.tokens == reference.tokens, f"cuda_graphs={graphs}"
        for layer in range(len(reference.kept_lengths)):
            assert np.array_equal(got.kept_lengths[layer], reference.kept_lengths[layer])
            assert np.array_equal(got.kept_indices[layer], reference.kept_indices[layer])


def kept_sets(indices, lengths):
    """{(layer, row, head): set of kept positions} from per-layer [B, H_kv, cap] indices and [B, H_kv] lengths."""
    return {(layer, b, h): set(idx[b, h, : lengths[layer][b, h]].tolist())
            for layer, idx in enumerate(indices) for b in range(idx.shape[0]) for h in range(idx.shape[1])}


def missed_fraction(got, reference):
    """Share of the reference's kept entries (all layers, rows, heads) that ``got`` does not keep."""
    total = sum(len(v) for v in reference.values())
    return sum(len(reference[key] - got.get(key, set())) for key in reference) / total


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_engines_keep_what_the_fp32_reference_keeps(tmp_path, dtype):
    # flash-attention's tolerance rule (STYLE.md): a low-precision result may be at most twice as far from the
    # fp32 reference as PyTorch's own result in the same precision. Kept sets are compared by overlap (a
    # near-tie may swap one entry), logits by their largest absolute error; on a left-padded batch.
    import torch

    from criticalkv.hf import load_model, prefill_and_compress

    folder, checkpoint = build_tiny(tmp_path, "criticalkv", dtype)
    width = max(map(len, PROMPTS))
    ids = np.zeros((2, width), np.int64)
    mask = np.zeros((2, width), np.int64)
    for row, prompt in enumerate(PROMPTS):
        ids[row, width - len(prompt):], mask[row, width - len(prompt):] = prompt, 1
    positions = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    ort_engine = Engine.load(folder, backend="onnxruntime")
    reference = ort_engine.backend.prefill(ids, mask, positions)
    ort_engine.close()
    engine = Engine.load(folder, backend="tensorrt")
    got = engine.backend.prefill(ids, mask, positions)
    engine.close()
    model, _ = load_model(str(checkpoint), dtype=getattr(torch, dtype))
    policy = KVPolicy.from_dict(read_manifest(folder, verify=False)["policy"])
    low = prefill_and_compress(model.cuda(), torch.from_numpy(ids).cuda(), policy, torch.from_numpy(mask).cuda())
    low_indices = [s.indices.cpu().numpy() for s in low.selections]
    low_lengths = [s.lengths.cpu().numpy() for s in low.selections]

    ref_sets = kept_sets(reference.indices, reference.lengths)
    torch_missed = missed_fraction(kept_sets(low_indices, low_lengths), ref_sets)
    trt_missed = missed_fraction(kept_sets(got.indices, got.lengths), ref_sets)
    one_entry = 1 / sum(len(v) for v in ref_sets.values())
    assert trt_missed <= 2 * torch_missed + one_entry, (trt_missed, torch_missed)
    assert np.isfinite(got.logits).all()
    torch_error = np.abs(low.logits.float().cpu().numpy() - reference.logits).max()
    trt_error = np.abs(got.logits - reference.logits).max()
    assert trt_error <= 2 * torch_error + 1e-3, (trt_error, torch_error)


@pytest.mark.gpu
def test_a_moved_engine_deserialises_in_a_fresh_process(tmp_path):
    # the manifest names the plugin relative to the engine directory: a moved directory loads in a new process
    folder, _ = build_tiny(tmp_path, "ada-criticalkv", "float16")
    in_process = Engine.load(folder, backend="tensorrt")
    expected = in_process.generate(PROMPTS, 8, stop_token_ids=[]).tokens
    in_process.close()
    moved = tmp_path / "moved" / "engine"
    moved.parent.mkdir()
    folder.rename(moved)
    code = (
        "import json, sys\n"
        "from criticalkv.runtime import Engine\n"
        "engine = Engine.load(sys.argv[1], backend='tensorrt')\n"
        "print(json.dumps(engine.generate(json.loads(sys.argv[2]), 8, stop_token_ids=[]).tokens))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CRITICALKV_PLUGIN_LIBRARY"}
    run = subprocess.run([sys.executable, "-c", code, str(moved), json.dumps(PROMPTS)], capture_output=True,
                         text=True, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == expected
