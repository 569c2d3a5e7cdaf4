"""``--weights int8|int4``: the integer projection weights of the fused ONNX Runtime graphs (criticalkv.export.quantize).

What is tested here: the integer codes stand for the matrices they replace (a dequantized int8 column or int4 block is
within a step of the float32 one), the quantized product multiplies by exactly the dequantized matrix (up to its
rounded activations), only the ONNX-Runtime-only graphs change (the portable graphs, TensorRT's inputs and the
selection's float32 o_proj stay as an fp32 export writes them), and an int8 / int4 engine computes the model whose
projections are the dequantized matrices reading rounded inputs (per token for int8, per block of 32 for int4): its
prompt logits are far closer to that model run in float64 than to the float32 model.
"""

import copy

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

from criticalkv import KVPolicy
from criticalkv.export.decoder import collect_weights, model_spec
from criticalkv.export.quantize import (BITS, QuantizedWeight, dequantize, quantize_blockwise, quantize_columns,
                                       quantize_store)
from criticalkv.runtime import Engine
from export.tiny_engine import export_tiny_engine
from model_families import family, random_checkpoint, random_prompt

LIMITS = {"max_input_len": 160, "max_new_tokens": 4, "max_batch_size": 2}


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_dequantized_blocks_are_within_a_step(weights):
    matrix = np.random.default_rng(0).standard_normal((100, 24)).astype(np.float32)  # k = 100: a partial last block
    matrix[3, 5] = 40.0  # an outlier only spoils its own block
    q = QuantizedWeight(weights, 100, 24, "c", "s")
    if weights == "int8":  # one scale per column: half a step, the outlier's column coarser than the others
        codes, scales = quantize_columns(matrix)
        restored = dequantize(q, {"c": codes, "s": scales})
        assert np.all(np.abs(restored - matrix) <= 0.5 * scales[None, :] * (1 + 1e-6))
        assert scales[5] * 127 == pytest.approx(40.0) and np.all(np.delete(scales, 5) * 127 < 5.0)
        return
    codes, scales = quantize_blockwise(matrix, BITS[weights])
    restored = dequantize(q, {"c": codes, "s": scales})
    # ONNX Runtime's symmetric scale is signed: the block's largest magnitude maps to code -8 exactly, and the opposite
    # sign reaches only 7, so an element is within one step (half a step unless it clips)
    step = np.abs(np.repeat(scales.reshape(24, -1), 32, axis=1)[:, :100].T)  # [k, n]: each element's block step
    error = np.abs(restored - matrix)
    assert np.all(error <= step * (1 + 1e-6)) and np.mean(error <= 0.5 * step * (1 + 1e-6)) > 0.95
    assert np.all(np.abs(scales.reshape(24, -1))[:, 1:] * 7 < 5.0)  # blocks without the outlier keep a fine step


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_the_quantized_product_multiplies_by_the_dequantized_matrix(weights):
    import onnxruntime as ort

    from criticalkv.export.graph import GraphBuilder
    from criticalkv.export.quantize import quantized_matmul

    rng = np.random.default_rng(1)
    k, n = 96, 40
    matrix = rng.standard_normal((k, n)).astype(np.float32)
    codes, scales = quantize_columns(matrix) if weights == "int8" else quantize_blockwise(matrix, BITS[weights])
    q = QuantizedWeight(weights, k, n, "codes", "scales")
    g = GraphBuilder()
    quantized_matmul(g, "x", q, outputs=["y"])
    graph = g.graph("q", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [7, k])],
                    [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [7, n])],
                    [numpy_helper.from_array(codes, "codes"), numpy_helper.from_array(scales, "scales")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    x = rng.standard_normal((7, k)).astype(np.float32)
    x[2] *= 50  # an outlier token does not spoil the others (per-token or blockwise activation scales)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    want = x.astype(np.float64) @ dequantize(q, {"codes": codes, "scales": scales}).astype(np.float64)
    original = x.astype(np.float64) @ matrix.astype(np.float64)
    rows = [0, 1, 3, 4, 5, 6]
    error = np.abs(y - want)[rows].max() / np.abs(want[rows]).max()
    assert error < 0.01  # ~0.3-0.5 % on these rows
    assert error < 0.5 * np.abs(want - original)[rows].max() / np.abs(original[rows]).max() or weights == "int8"


def int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [..., k] rounded as MatMulNBits' accuracy_level 4 quantizes its input: int8, symmetric, one scale (the block's
    largest magnitude / 127) per block of 32 along k."""
    k = x.shape[-1]
    blocks = torch.nn.functional.pad(x, (0, -k % 32)).unflatten(-1, (-1, 32))
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(blocks / scale) * scale).flatten(-2)[..., :k]


def uint8_tokens(x: torch.Tensor) -> torch.Tensor:
    """x [..., k] rounded as the int8 setting quantizes it: each token divided by its largest magnitude, rounded to
    multiples of 1/127 (in float32, as ONNX Runtime's QuantizeLinear divides), times the magnitude again."""
    x32 = x.float()
    magnitude = x32.abs().amax(-1, keepdim=True).clamp_min(np.finfo(np.float32).tiny)
    scale = float(np.float32(1.0 / 127.0))
    codes = torch.round((x32 / magnitude) / torch.tensor(scale, dtype=torch.float32))
    return codes.double() * scale * magnitude.double()


def dequantized_model(model, weights: str):
    """A float64 copy of ``model`` whose projections and LM head are the dequantized integer matrices and read their
    inputs rounded as the quantized product does (``uint8_tokens`` for int8, ``int8_blocks`` for int4)."""
    spec = model_spec(model)
    store = collect_weights(model, spec)
    quantize_store(store, spec, weights)

    def matrix(name):
        return torch.from_numpy(dequantize(store.quantized[name], store.arrays).astype(np.float64))

    out = copy.deepcopy(model).double()
    heads_q, heads_kv, d = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_size
    with torch.no_grad():
        for i, layer in enumerate(out.model.layers):
            qkv = matrix(f"layers.{i}.qkv_proj").T  # [out, in]
            a, mlp = layer.self_attn, layer.mlp
            a.q_proj.weight.copy_(qkv[:heads_q])
            a.k_proj.weight.copy_(qkv[heads_q:heads_q + heads_kv])
            a.v_proj.weight.copy_(qkv[heads_q + heads_kv:])
            a.o_proj.weight.copy_(matrix(f"layers.{i}.o_proj").T)
            gate_up = matrix(f"layers.{i}.gate_up_proj").T
            mlp.gate_proj.weight.copy_(gate_up[:d])
            mlp.up_proj.weight.copy_(gate_up[d:])
            mlp.down_proj.weight.copy_(matrix(f"layers.{i}.down_proj").T)
        head = "lm_head" if "lm_head" in store.quantized else "embed_tokens"
        out.lm_head = torch.nn.Linear(spec.hidden_size, spec.vocab_size, bias=False).double()  # untied from the embedding
        out.lm_head.weight.copy_(matrix(head).T)
    for module in out.modules():
        if isinstance(module, torch.nn.Linear):
            rounding = uint8_tokens if weights == "int8" else int8_blocks
            module.register_forward_pre_hook(lambda _, args, rounding=rounding: (rounding(args[0]),))
    return out


@pytest.mark.parametrize("weights, fam_id", [("int8", "qwen2"), ("int8", "llama32-tied"), ("int4", "llama32-tied")])
def test_an_integer_engine_computes_the_dequantized_model(weights, fam_id, tmp_path):
    model = random_checkpoint(family(fam_id), seed=4)
    policy = KVPolicy("criticalkv", budget=48, window=8)
    fp32 = export_tiny_engine(model, policy, tmp_path / "fp32", **LIMITS)
    folder = export_tiny_engine(model, policy, tmp_path / weights, weights=weights, **LIMITS)
    manifest = Engine.load(folder).manifest
    assert manifest["onnx"]["weights"]["format"] == weights and manifest["build"]["weights"] == weights
    for name in ("prefill_ort.onnx", "extend_ort.onnx", "decode_ort.onnx"):
        graph = onnx.load(str(folder / name), load_external_data=False).graph
        ops = [n.op_type for n in graph.node]
        op = "MatMulIntegerToFloat" if weights == "int8" else "MatMulNBits"
        assert ops.count(op) == 4 * model.config.num_hidden_layers + 1, name  # 4 projections a layer + the LM head
        assert "MatMul" not in ops or name != "decode_ort.onnx"  # every weight product is an integer one
    for name in ("prefill.onnx", "decode.onnx", "extend.onnx", "select.onnx", "prefill_tensorrt.onnx"):
        a = onnx.load(str(folder / name), load_external_data=False).graph
        b = onnx.load(str(fp32 / name), load_external_data=False).graph
        assert [n.op_type for n in a.node] == [n.op_type for n in b.node], name
        assert sorted(t.name for t in a.initializer) == sorted(t.name for t in b.initializer), name
    prefill = onnx.load(str(folder / "prefill_ort.onnx"), load_external_data=False).graph
    select = [n for n in prefill.node if n.op_type == "CriticalKVSelect"]
    assert [n.input[3] for n in select] == [f"layers.{i}.o_proj" for i in range(model.config.num_hidden_layers)]
    assert all(t.data_type == onnx.TensorProto.FLOAT for t in prefill.initializer if t.name.endswith(".o_proj"))

    reference = dequantized_model(model, weights)
    original = copy.deepcopy(model).double()
    engine = Engine.load(folder)
    try:
        for n in (150, 60):
            ids = random_prompt(n, seed=n)
            x = np.array([ids])
            out = engine.backend.prefill(x, np.ones_like(x), np.arange(n)[None], None)
            with torch.no_grad():
                # the LM head of the last token only, as the engine computes it
                want = reference(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].numpy()
                plain = original(torch.tensor([ids])).logits[0, -1].numpy()
            to_dequantized, to_original = np.abs(out.logits[0] - want).max(), np.abs(out.logits[0] - plain).max()
            # measured 1e-6 (4e-8 to 1e-5; up to 0.09 where a rounded activation lands on the other side of a code
            # boundary) against 0.3-4.4 from the float32 model
            assert to_dequantized < 0.25 * to_original, (n, to_dequantized, to_original)
        got = engine.generate([random_prompt(120, seed=3)], max_new_tokens=4, stop_token_ids=[])
        assert len(got.tokens[0]) == 4
        assert Engine.load(folder, prefill="portable", decode="portable").backend.prefill_form == "portable"
    finally:
        engine.close()
