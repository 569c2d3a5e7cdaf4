"""This CPU's floors, measured in the same run as the engines they bound: the fp32 GEMM rate at the prefill's
shapes and the read bandwidth of the decode step's weight GEMVs.

Both run on ONNX Runtime (the runtime the engines use, same thread count), on single-node models with random
weights of the engine's shapes, weights as initializers (MLAS prepacks them: the best this runtime reaches):

* ``gemm_rate``: ``MatMul`` [1, n, K] x [K, N] for the projections of one decoder layer (QKV, o_proj, gate-up,
  down) at the prompt length n; GFLOP/s = sum of 2 n K N over the shapes / sum of the medians of their times;
* ``gemv_bandwidth``: one model holding every projection matrix of every layer plus the LM head
  (the bytes a decode step must read, larger than any cache), each multiplied by one token's activations;
  GB/s = weight bytes / median time of one run (the bandwidth floor of a decode step).

``torch_rates`` gives the same GEMM shapes and a large GEMV on torch (the reference numbers the CPU targets
were set from were measured with torch) when torch is installed; ``copy_bandwidth`` is a NumPy copy (read + write).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LayerShapes:
    """The projection shapes (K, N) of one decoder layer and the LM head, from an engine's model spec."""

    hidden: int
    qkv_out: int
    attn_width: int
    intermediate: int
    vocab: int
    layers: int

    @classmethod
    def from_spec(cls, spec: dict) -> "LayerShapes":
        return cls(spec["hidden_size"], (spec["num_heads"] + 2 * spec["num_kv_heads"]) * spec["head_dim"],
                   spec["num_heads"] * spec["head_dim"], spec["intermediate_size"], spec["vocab_size"], spec["num_layers"])

    def projections(self) -> dict[str, tuple[int, int]]:
        """name -> (K, N) of ``x [.., K] @ W [K, N]``."""
        return {"qkv_proj": (self.hidden, self.qkv_out), "o_proj": (self.attn_width, self.hidden),
                "gate_up_proj": (self.hidden, 2 * self.intermediate), "down_proj": (self.intermediate, self.hidden)}

    def weight_bytes(self) -> int:
        """fp32 bytes of every projection matrix and the LM head: what one decode step reads at least."""
        per_layer = sum(k * n for k, n in self.projections().values())
        return 4 * (self.layers * per_layer + self.vocab * self.hidden)


def _session(model, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (allocations, prepacking)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _matmul_model(k: int, n: int, rng: np.random.Generator):
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(rng.standard_normal((k, n), dtype=np.float32) * 0.02, "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "gemm",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "n", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "n", n])], [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def gemm_rate(shapes: LayerShapes, tokens: int, threads: int = 0, repeats: int = 5, seed: int = 0) -> dict:
    """ONNX Runtime fp32 GEMM rate at the prefill's projection shapes ([1, tokens, K] x [K, N]).

    Returns {"gflops": aggregate GFLOP/s, "per_shape": {name: {"k", "n", "seconds", "gflops"}}}."""
    rng = np.random.default_rng(seed)
    per_shape, flops, seconds = {}, 0.0, 0.0
    for name, (k, n) in shapes.projections().items():
        session = _session(_matmul_model(k, n, rng), threads)
        x = rng.standard_normal((1, tokens, k), dtype=np.float32)
        s = _median_seconds(lambda: session.run(None, {"x": x}), repeats)
        f = 2.0 * tokens * k * n
        per_shape[name] = {"k": k, "n": n, "seconds": s, "gflops": f / s / 1e9}
        flops += f
        seconds += s
    return {"tokens": tokens, "gflops": flops / seconds / 1e9, "per_shape": per_shape}


def _weights_model(shapes: LayerShapes, rng: np.random.Generator):
    """Every projection of every layer and the LM head, each applied to one token (independent GEMVs)."""
    from onnx import TensorProto, helper, numpy_helper

    nodes, inits, outputs = [], [], []
    for layer in range(shapes.layers):
        for name, (k, n) in shapes.projections().items():
            w = f"{name}.{layer}"
            inits.append(numpy_helper.from_array(rng.standard_normal((k, n), dtype=np.float32) * 0.02, w))
            src = "h_wide" if k == shapes.intermediate else ("a" if k == shapes.attn_width else "h")
            nodes.append(helper.make_node("MatMul", [src, w], [f"y.{w}"]))
            outputs.append(helper.make_tensor_value_info(f"y.{w}", TensorProto.FLOAT, [1, n]))
    inits.append(numpy_helper.from_array(rng.standard_normal((shapes.vocab, shapes.hidden), dtype=np.float32) * 0.02, "lm_head"))
    nodes.append(helper.make_node("Gemm", ["h", "lm_head"], ["logits"], transB=1))
    outputs.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, shapes.vocab]))
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, k])
              for name, k in (("h", shapes.hidden), ("a", shapes.attn_width), ("h_wide", shapes.intermediate))]
    if shapes.attn_width == shapes.hidden:  # one input serves both
        inputs = [i for i in inputs if i.name != "a"]
        for node in nodes:
            node.input[0] = "h" if node.input[0] == "a" else node.input[0]
    graph = helper.make_graph(nodes, "gemv", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def gemv_bandwidth(shapes: LayerShapes, threads: int = 0, repeats: int = 7, seed: int = 0) -> dict:
    """Read bandwidth of one decode step's weight GEMVs on ONNX Runtime (random weights of the engine's shapes).

    Returns {"bytes", "seconds" (median run), "gbps"}: the floor of a decode step is bytes / gbps."""
    rng = np.random.default_rng(seed)
    session = _session(_weights_model(shapes, rng), threads)
    feeds = {i.name: rng.standard_normal((1, i.shape[1]), dtype=np.float32) for i in session.get_inputs()}
    seconds = _median_seconds(lambda: session.run(None, feeds), repeats)
    size = shapes.weight_bytes()
    return {"bytes": size, "seconds": seconds, "gbps": size / seconds / 1e9}


def copy_bandwidth(megabytes: int = 256, repeats: int = 5) -> dict:
    """NumPy copy of ``megabytes`` (GB/s counts the bytes read + written)."""
    src = np.ones(megabytes * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    seconds = _median_seconds(lambda: np.copyto(dst, src), repeats)
    return {"bytes": 2 * src.nbytes, "seconds": seconds, "gbps": 2 * src.nbytes / seconds / 1e9}


def torch_rates(shapes: LayerShapes, tokens: int, threads: int = 0, repeats: int = 5) -> dict | None:
    """torch fp32 GEMM GFLOP/s at the same shapes and GEMV GB/s over a 512 MiB matrix (None without torch)."""
    try:
        import torch
    except ImportError:
        return None
    if threads:
        torch.set_num_threads(threads)
    flops, seconds = 0.0, 0.0
    with torch.inference_mode():
        for k, n in shapes.projections().values():
            x, w = torch.randn(tokens, k), torch.randn(k, n)
            seconds += _median_seconds(lambda: torch.mm(x, w), repeats)
            flops += 2.0 * tokens * k * n
        matrix, vector = torch.randn(32768, 4096), torch.randn(4096)
        gemv_s = _median_seconds(lambda: torch.mv(matrix, vector), repeats)
    return {"gemm_gflops": flops / seconds / 1e9, "gemv_gbps": matrix.numel() * 4 / gemv_s / 1e9,
            "threads": torch.get_num_threads(), "version": torch.__version__}


def measure(spec: dict, tokens: int, threads: int = 0, with_torch: bool = True) -> dict:
    """All floors for an engine's model spec and prompt length (one dict, JSON-ready)."""
    shapes = LayerShapes.from_spec(spec)
    out = {"gemm": gemm_rate(shapes, tokens, threads), "gemv": gemv_bandwidth(shapes, threads),
           "copy": copy_bandwidth(), "threads": threads or "default"}
    if with_torch:
        out["torch"] = torch_rates(shapes, tokens, threads)
    return out
