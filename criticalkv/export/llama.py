"""Prefill and decode ONNX graphs of a Llama-family model (Llama, Mistral, Qwen2, SmolLM), written
directly with ``onnx.helper`` from the Hugging Face weights (standard operators only).

Graph I/O follows onnxruntime-genai's decoder naming (B = batch, n = padded prompt length,
cap_l = layer l's fixed decode capacity, H_kv KV heads, d_h head dim):

prefill (left-padded prompts)
  in   ``input_ids`` [B, n] int64, ``attention_mask`` [B, n] int64 (1 = token), ``position_ids`` [B, n] int64,
       ``kv_budget`` [1] int64 (the request's budget in [min_budget, built budget]; the runtime feeds the built one
       when a caller gives none)
  out  ``logits`` [B, vocab] (each sequence's last token);
       per layer l: ``present.{l}.key`` / ``.value`` [B, H_kv, min(n, capacity_l), d_h] (kept entries,
       ascending position, zero padded), ``present.{l}.lengths`` [B, H_kv] int32 (kept per head),
       ``present.{l}.indices`` [B, H_kv, min(n, capacity_l)] int32 (kept positions, -1 padded)
decode (one new token per sequence)
  in   ``input_ids`` [B, 1], ``position_ids`` [B, 1] (absolute position len_b + t: RoPE ignores eviction),
       per layer: ``past_key_values.{l}.key`` / ``.value`` [B, H_kv, cap_l, d_h] (fixed-capacity buffers),
       ``past_key_values.{l}.lengths`` [B, H_kv] int32 (valid entries per head: the attention mask)
  out  ``logits`` [B, vocab]; ``present.{l}.key`` / ``.value`` [B, H_kv, 1, d_h]: the new token's entries,
       which the runtime writes in place at slot ``lengths[b, g]`` of each head's buffer (a shared
       past/present buffer, like onnxruntime-genai's past_present_share_buffer: no per-step copy of the cache)

Prompt attention on ONNX Runtime never materialises n x n scores: the queries are processed in blocks of
``attention_chunk`` inside a ``Loop``; block i attends keys [0, (i + 1) * chunk) (causal), so a layer holds
at most H * chunk * n scores at a time. The TensorRT flavour has no Loop: one causal attention per layer
(MatMul, ``Where`` with a finite mask value, Softmax, MatMul) that TensorRT fuses into one attention kernel,
and the selection node without its body. ``criticalkv.export.tensorrt_rules`` checks both TensorRT inputs
(``prefill_tensorrt.onnx``, ``decode.onnx``) against the ONNX-TensorRT importer's rules.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import onnx
from onnx import helper

from criticalkv.export.graph import FLOAT, INT32, INT64, IR_VERSION, OPSET, GraphBuilder, value_info
from criticalkv.export.select_function import FLOAT32_MIN, selection_function, selection_node, selection_opset
from criticalkv.weights import WeightStore
from criticalkv.node import node_capacity
from criticalkv.policy import KVPolicy

#: RoPE variants whose inverse frequencies do not depend on the sequence length (precomputed once).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelSpec:
    """What the graphs need to know of a Llama-family config."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_attention_scaling: float
    sliding_window: int | None
    #: Qwen3: RMSNorm over d_h of every query and key head (weights ``layers.{i}.q_norm`` / ``.k_norm`` [d_h], eps
    #: rms_norm_eps) after the projections and before RoPE
    qk_norm: bool = False

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict:
        return asdict(self)


def model_spec(model) -> ModelSpec:
    """Read a transformers Llama/Mistral/Qwen2 model's config (raises ValueError when unsupported)."""
    from criticalkv.hf.loading import check_supported

    config = model.config
    check_supported(config, export=True)
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (Llama-family MLPs use silu)")
    rotary = model.model.rotary_emb
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(STATIC_ROPE_TYPES)}")
    heads = config.num_attention_heads
    sliding = getattr(config, "sliding_window", None)
    if sliding is not None and not getattr(config, "use_sliding_window", True):
        sliding = None
    return ModelSpec(
        model_type=config.model_type,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        rms_norm_eps=float(config.rms_norm_eps),
        rope_attention_scaling=float(getattr(rotary, "attention_scaling", 1.0)),
        sliding_window=sliding,
        qk_norm=getattr(model.model.layers[0].self_attn, "q_norm", None) is not None,
    )


def _t(param) -> np.ndarray:
    return param.detach().to("cpu").float().numpy()


def collect_weights(model, spec: ModelSpec) -> WeightStore:
    """The weights in graph layout: fused QKV and gate/up matrices as [in, out], o_proj as [d, H*d_h]."""
    store = WeightStore()
    m = model.model
    store.add("embed_tokens", _t(m.embed_tokens.weight))
    lm_head = model.lm_head.weight
    if lm_head.data_ptr() != m.embed_tokens.weight.data_ptr():
        store.add("lm_head", _t(lm_head))
    store.add("norm", _t(m.norm.weight))
    store.add("inv_freq", _t(m.rotary_emb.inv_freq))
    for i, layer in enumerate(m.layers):
        a, mlp = layer.self_attn, layer.mlp
        p = f"layers.{i}."
        store.add(p + "input_layernorm", _t(layer.input_layernorm.weight))
        store.add(p + "post_attention_layernorm", _t(layer.post_attention_layernorm.weight))
        store.add(p + "qkv_proj", np.concatenate([_t(a.q_proj.weight), _t(a.k_proj.weight), _t(a.v_proj.weight)]).T)
        if a.q_proj.bias is not None:
            store.add(p + "qkv_bias", np.concatenate([_t(a.q_proj.bias), _t(a.k_proj.bias), _t(a.v_proj.bias)]))
        store.add(p + "o_proj", _t(a.o_proj.weight))  # [d, H*d_h]: also the selection node's o_proj_weight
        if getattr(a, "q_norm", None) is not None:  # Qwen3's per-head RMSNorm weights [d_h]
            store.add(p + "q_norm", _t(a.q_norm.weight))
            store.add(p + "k_norm", _t(a.k_norm.weight))
        if a.o_proj.bias is not None:
            store.add(p + "o_bias", _t(a.o_proj.bias))
        store.add(p + "gate_up_proj", np.concatenate([_t(mlp.gate_proj.weight), _t(mlp.up_proj.weight)]).T)
        store.add(p + "down_proj", _t(mlp.down_proj.weight).T)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            if getattr(mlp, proj).bias is not None:
                raise ValueError("MLP biases (mlp_bias=True) are not supported by the export")
    return store


def layer_capacities(policy: KVPolicy, spec: ModelSpec, max_input_len: int) -> list[int]:
    """Per-layer static capacity of the selection node (``node_capacity``) for prompts up to max_input_len."""
    return [node_capacity(policy, max_input_len, spec.num_kv_heads, i, spec.num_layers) for i in range(spec.num_layers)]


class _Decoder:
    """The shared decoder-layer pieces of both graphs."""

    def __init__(self, g: GraphBuilder, spec: ModelSpec, store: WeightStore):
        self.g, self.spec, self.store = g, spec, store
        self.scale = g.const(1.0 / math.sqrt(spec.head_dim), np.float32)

    def rms_norm(self, x: str, weight: str) -> str:
        g = self.g
        variance = g.ReduceMean(g.Pow(x, g.const(2.0, np.float32)), g.i64(-1), keepdims=1)
        return g.Mul(g.Div(x, g.Sqrt(g.Add(variance, g.const(self.spec.rms_norm_eps, np.float32)))), weight)

    def rope_tables(self, position_ids: str) -> tuple[str, str]:
        """cos, sin [B, 1, s, d_h] for positions [B, s]."""
        g = self.g
        freqs = g.Mul(g.unsqueeze(g.Cast(position_ids, to=FLOAT), -1), "inv_freq")  # [B, s, d_h/2]
        emb = g.concat(freqs, freqs, axis=-1)
        cos, sin = g.Cos(emb), g.Sin(emb)
        if self.spec.rope_attention_scaling != 1.0:
            factor = g.const(self.spec.rope_attention_scaling, np.float32)
            cos, sin = g.Mul(cos, factor), g.Mul(sin, factor)
        return g.unsqueeze(cos, 1), g.unsqueeze(sin, 1)

    def rope(self, x: str, cos: str, sin: str, rotation_matmul: bool = False) -> str:
        """x * cos + rotate_half(x) * sin for x [B, heads, s, d_h]; rotate_half(x) = (-x2, x1).

        ``rotation_matmul``: rotate_half as one MatMul with a signed permutation matrix (exact: one
        non-zero term per output), fewer nodes for the one-token decode step."""
        g = self.g
        d, half = self.spec.head_dim, self.spec.head_dim // 2
        if rotation_matmul:
            rotation = np.zeros((d, d), np.float32)
            rotation[np.arange(half) + half, np.arange(half)] = -1.0
            rotation[np.arange(half), np.arange(half) + half] = 1.0
            rotated = g.MatMul(x, g.const(rotation, hint="rotate_half"))
        else:
            rotated = g.concat(g.Neg(g.slice_axis(x, half, d, axis=3)), g.slice_axis(x, 0, half, axis=3), axis=-1)
        return g.Add(g.Mul(x, cos), g.Mul(rotated, sin))

    def qkv(self, i: int, h: str, cos: str, sin: str, decode: bool = False, kv_names: tuple = ()) -> tuple[str, str, str]:
        """Post-RoPE q [B, H, s, d_h], k and v [B, H_kv, s, d_h] from h [B, s, d].

        One MatMul for q, k and v; RoPE once over the q and k heads together. ``decode`` (s = 1):
        [B, 1, N*d_h] -> [B, N, 1, d_h] is a plain reshape. ``kv_names``: output names for k and v.
        """
        g, s = self.g, self.spec
        x = g.MatMul(h, f"layers.{i}.qkv_proj")
        if f"layers.{i}.qkv_bias" in self.store.arrays:
            x = g.Add(x, f"layers.{i}.qkv_bias")
        heads = s.num_heads + 2 * s.num_kv_heads
        if decode:
            x = g.reshape(x, [0, heads, 1, s.head_dim])
        else:
            x = g.Transpose(g.reshape(x, [0, 0, heads, s.head_dim]), perm=[0, 2, 1, 3])  # [B, N, s, d_h]
        k_name, v_name = kv_names or (g.fresh("k"), g.fresh("v"))
        qk, v = g.op("Split", x, g.i64(s.num_heads + s.num_kv_heads, s.num_kv_heads), outputs=[g.fresh("qk"), v_name], axis=1)
        qk = self.rope(qk, cos, sin, rotation_matmul=decode)
        q, k = g.op("Split", qk, g.i64(s.num_heads, s.num_kv_heads), outputs=[g.fresh("q"), k_name], axis=1)
        return q, k, v

    def output_projection(self, i: int, attn: str, transposed_gemm: bool = False) -> str:
        """attn [B, s, H*d_h] @ o_proj^T (+ bias) -> [B, s, d].

        ``transposed_gemm``: one ``Gemm(transB=1)`` over the 2-D view instead of ``MatMul(x, Transpose(W))``,
        so that TensorRT multiplies by the stored o_proj (the matrix the selection node also reads) instead of
        constant-folding a transposed second copy of it into the engine."""
        g = self.g
        bias = f"layers.{i}.o_bias" if f"layers.{i}.o_bias" in self.store.arrays else None
        if transposed_gemm:
            flat = g.reshape(attn, [-1, self.spec.num_heads * self.spec.head_dim])
            out = g.Gemm(flat, f"layers.{i}.o_proj", *([bias] if bias else []), transB=1)
            return g.Reshape(out, g.concat(g.shape_of(attn, 0, 2), g.i64(self.spec.hidden_size)))
        out = g.MatMul(attn, g.Transpose(f"layers.{i}.o_proj", perm=[1, 0]))
        if bias:
            out = g.Add(out, bias)
        return out

    def mlp(self, i: int, x: str) -> str:
        g, s = self.g, self.spec
        gate, up = g.op("Split", g.MatMul(x, f"layers.{i}.gate_up_proj"), g.i64(s.intermediate_size, s.intermediate_size),
                        outputs=2, axis=-1)
        return g.MatMul(g.Mul(g.Mul(gate, g.Sigmoid(gate)), up), f"layers.{i}.down_proj")

    def logits(self, last: str) -> str:
        """[B, vocab] from the last hidden state [B, d]."""
        head = "lm_head" if "lm_head" in self.store.arrays else "embed_tokens"
        return self.g.Gemm(self.rms_norm(last, "norm"), head, transB=1, outputs=["logits"])


#: Score of a masked attention entry in the graphs TensorRT builds (the TensorRT prefill flavour, decode):
#: finite in fp16 and bf16 (a FLOAT32_MIN constant becomes -inf in a weakly typed fp16 engine, and a row masked
#: everywhere then turns to NaN), and far enough below any real score that its softmax weight underflows to
#: exactly 0 in fp32, fp16 and bf16.
MASKED_SCORE = -30000.0


def _prompt_attention(dec: _Decoder, q: str, k: str, v: str, ctx: dict, chunk: int) -> str:
    """Causal attention of the prompt [B, n, H*d_h], in query blocks of ``chunk`` (a Loop; ONNX Runtime flavour).

    Per block: scores [B, H, c, k] = (q / sqrt(d_h)) K^T (one MatMul per KV head for its G query heads),
    + a [B, 1, c, k] additive mask (causal and left padding, float32 minimum), Softmax, @ V.
    The Loop has a trip count and no condition input; its body therefore never reads its ``cond_in`` input
    and returns a constant True as the condition (the ONNX-TensorRT Loop importer registers ``cond_in`` only
    when the node has a condition input, see criticalkv/export/tensorrt_rules.py).
    """
    g, s = dec.g, dec.spec
    qg = g.reshape(g.Mul(q, dec.scale), [0, s.num_kv_heads, s.group, -1, s.head_dim])  # [B, H_kv, G, n, d_h]
    qg = g.Pad(qg, g.concat(g.i64(0, 0, 0, 0, 0, 0, 0, 0), ctx["pad_len"], g.i64(0)), mode="constant")
    body = g.child()
    step = body.fresh("iter")
    cond_in = body.fresh("cond_in")
    start = body.Mul(body.unsqueeze(step, 0), body.i64(chunk))  # [1]
    end = body.Add(start, body.i64(chunk))
    qc = body.reshape(body.slice_axis(qg, start, end, axis=3), [0, 0, -1, s.head_dim])  # [B, H_kv, G*c, d_h]
    key_end = body.Min(end, ctx["n"])
    kc = body.slice_axis(k, 0, key_end, axis=2)
    vc = body.slice_axis(v, 0, key_end, axis=2)
    scores = body.reshape(body.MatMul(qc, body.Transpose(kc, perm=[0, 1, 3, 2])), [0, s.num_heads, chunk, -1])
    query_pos = body.Add(body.Range(body.scalar(0), body.scalar(chunk), body.scalar(1)), body.squeeze(start, 0))
    key_pos = body.Range(body.scalar(0), body.squeeze(key_end, 0), body.scalar(1))
    causal = body.Greater(body.unsqueeze(key_pos, 0), body.unsqueeze(query_pos, 1))  # [c, k]
    blocked = body.Or(causal, body.slice_axis(ctx["key_padding"], 0, key_end, axis=3))  # [B, 1, c, k]
    bias = body.Where(blocked, body.const(FLOAT32_MIN, np.float32), body.const(0.0, np.float32))
    probs = body.Softmax(body.Add(scores, bias), axis=-1)  # [B, H, c, k]
    probs = body.Reshape(probs, body.concat(body.i64(0, s.num_kv_heads, -1), key_end))
    out = body.reshape(body.MatMul(probs, vc), [0, 0, s.group, chunk, s.head_dim])
    out = body.reshape(body.Transpose(out, perm=[0, 3, 1, 2, 4]), [0, 0, s.num_heads * s.head_dim])  # [B, c, H*d_h]
    cond_out = body.const(True, np.bool_, hint="cond_out")
    loop_body = body.graph(
        "attention_block",
        [value_info(step, INT64, []), value_info(cond_in, onnx.TensorProto.BOOL, [])],
        [value_info(cond_out, onnx.TensorProto.BOOL, []), value_info(out, FLOAT, None)],
    )
    blocks = g.op("Loop", ctx["num_blocks"], "", body=loop_body, hint="attention_blocks")  # [T, B, c, H*d_h]
    merged = g.reshape(g.Transpose(blocks, perm=[1, 0, 2, 3]), [0, -1, s.num_heads * s.head_dim])
    return g.slice_axis(merged, 0, ctx["n"], axis=1)


def _causal_attention(dec: _Decoder, q: str, k: str, v: str, ctx: dict) -> str:
    """Causal attention of the prompt [B, n, H*d_h] in one block, without a Loop (TensorRT flavour).

    The pattern TensorRT fuses into one attention kernel ("Fused Attention", method 2 of the TensorRT
    developer guide): Q already scaled by 1/sqrt(d_h) before the first MatMul, scores [B, H, n, n] = Q K^T,
    ``Where(allowed, scores, MASKED_SCORE)`` with the causal and left-padding mask [B, 1, n, n] (a finite value:
    see MASKED_SCORE), Softmax, @ V, on 4-D [B, heads, n, d_h] tensors; K and V are repeated to the H query
    heads with Unsqueeze-Expand-Reshape, the ``repeat_kv`` form of exported Llama graphs (GQA). The ONNX
    ``Attention`` operator (opset 23, imported by TensorRT >= 10.14 as ``IAttention``) is not used:
    ``IAttention::setCausal`` cannot be combined with ``setMask`` (NvInfer.h 10.14), and left-padded batches
    need a mask.
    """
    g, s = dec.g, dec.spec

    def repeat_kv(x: str) -> str:  # [B, H_kv, n, d_h] -> [B, H, n, d_h], query head h reads KV head h // G
        return g.reshape(g.Expand(g.unsqueeze(x, 2), g.i64(1, 1, s.group, 1, 1)), [0, s.num_heads, -1, s.head_dim])

    scores = g.MatMul(g.Mul(q, dec.scale), g.Transpose(repeat_kv(k), perm=[0, 1, 3, 2]))  # [B, H, n, n]
    probs = g.Softmax(g.Where(ctx["allowed"], scores, g.const(MASKED_SCORE, np.float32)), axis=-1)
    out = g.Transpose(g.MatMul(probs, repeat_kv(v)), perm=[0, 2, 1, 3])  # [B, n, H, d_h]
    return g.reshape(out, [0, 0, s.num_heads * s.head_dim])


def build_prefill(
    spec: ModelSpec,
    store: WeightStore,
    policy: KVPolicy,
    capacities: list[int],
    attention_chunk: int = 256,
    flavour: str = "onnxruntime",
) -> onnx.ModelProto:
    """The prefill model. ``flavour``: ``onnxruntime`` (selection node + its function body, attention in
    query blocks inside a Loop) or ``tensorrt`` (the node without a body, for the plugin; attention without a
    Loop, in the form TensorRT fuses; ``attention_chunk`` is not used)."""
    if flavour not in ("onnxruntime", "tensorrt"):
        raise ValueError(f"flavour: {flavour!r} is not onnxruntime or tensorrt")
    from criticalkv.export import model_select

    model_level = model_select.is_model_level(policy, spec.num_layers)
    if model_level and flavour == "tensorrt":
        model_select.check_tensorrt_flavour(policy, spec.num_layers)
    pending = []  # model-level selection: every layer's (ranking, keys, values) until the last layer
    g = GraphBuilder()
    dec = _Decoder(g, spec, store)
    n = g.shape_of("input_ids", 1, 2)
    lengths = g.ReduceSum("attention_mask", g.i64(1), keepdims=0)  # [B]
    prompt_lengths = g.Cast(lengths, to=INT32, hint="prompt_lengths")
    kv_budget = g.Cast("kv_budget", to=INT32, hint="kv_budget_int32")  # the request's budget (node input 5)
    key_pos = g.Range(g.scalar(0), g.squeeze(n, 0), g.scalar(1))
    key_padding = g.Less(g.unsqueeze(key_pos, 0), g.unsqueeze(g.Sub(n, lengths), 1))  # [B, n]: left padding
    if flavour == "onnxruntime":
        num_blocks = g.Div(g.Add(n, g.i64(attention_chunk - 1)), g.i64(attention_chunk))
        ctx = {
            "n": n,
            "key_padding": g.reshape(key_padding, [0, 1, 1, -1]),
            "num_blocks": g.squeeze(num_blocks, 0),
            "pad_len": g.Sub(g.Mul(num_blocks, g.i64(attention_chunk)), n),
        }
    else:
        causal = g.LessOrEqual(g.unsqueeze(key_pos, 0), g.unsqueeze(key_pos, 1))  # [n, n]: key <= query
        ctx = {"allowed": g.And(causal, g.reshape(g.Not(key_padding), [0, 1, 1, -1]))}  # [B, 1, n, n]
    cos, sin = dec.rope_tables("position_ids")
    x = g.Gather("embed_tokens", "input_ids", axis=0)
    outputs = [value_info("logits", FLOAT, ["batch", spec.vocab_size])]
    for i in range(spec.num_layers):
        h = dec.rms_norm(x, f"layers.{i}.input_layernorm")
        q, k, v = dec.qkv(i, h, cos, sin)
        if flavour == "onnxruntime":
            attn = _prompt_attention(dec, q, k, v, ctx, attention_chunk)
        else:
            attn = _causal_attention(dec, q, k, v, ctx)
        x = g.Add(x, dec.output_projection(i, attn, transposed_gemm=flavour == "tensorrt"))
        x = g.Add(x, dec.mlp(i, dec.rms_norm(x, f"layers.{i}.post_attention_layernorm")))
        window_queries = g.slice_axis(q, -policy.window, np.iinfo(np.int64).max, axis=2)
        names = [f"present.{i}.key", f"present.{i}.value", f"present.{i}.lengths", f"present.{i}.indices"]
        node_inputs = [window_queries, k, v, f"layers.{i}.o_proj", prompt_lengths, kv_budget]
        if model_level:  # this layer's ranking; its full K/V stay graph tensors until the model-level node
            ranking = f"ranking_{i}"
            g.nodes.append(model_select.score_node(policy, i, spec.num_layers, capacities[i], node_inputs, ranking))
            pending.append((ranking, k, v))
        else:
            g.nodes.append(selection_node(policy, i, spec.num_layers, capacities[i], node_inputs, names,
                                          name=f"criticalkv_select_{i}"))
        kept = f"kept_{i}"
        outputs += [
            value_info(names[0], FLOAT, ["batch", spec.num_kv_heads, kept, spec.head_dim]),
            value_info(names[1], FLOAT, ["batch", spec.num_kv_heads, kept, spec.head_dim]),
            value_info(names[2], INT32, ["batch", spec.num_kv_heads]),
            value_info(names[3], INT32, ["batch", spec.num_kv_heads, kept]),
        ]
    if model_level:  # one selection over every layer and head, after the last layer
        present = [f"present.{i}.{kind}" for i in range(spec.num_layers) for kind in ("key", "value", "lengths", "indices")]
        g.nodes.append(model_select.model_node(
            policy, capacities, [e[0] for e in pending] + [e[1] for e in pending] + [e[2] for e in pending]
            + [prompt_lengths, kv_budget], present))
    last = g.reshape(g.slice_axis(x, -1, np.iinfo(np.int64).max, axis=1), [-1, spec.hidden_size])
    dec.logits(last)
    inputs = [value_info(name, INT64, ["batch", "sequence"]) for name in ("input_ids", "attention_mask", "position_ids")]
    inputs.append(value_info("kv_budget", INT64, [1]))
    used = _used_initializers(g.nodes)
    graph = g.graph("criticalkv_prefill", inputs, outputs, [store.initializer(w) for w in store.arrays if w in used])
    functions = []
    if flavour == "onnxruntime" and model_level:
        functions += [model_select.score_function(policy, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim),
                      model_select.model_function(policy, spec.num_layers, spec.num_kv_heads)]
    elif flavour == "onnxruntime":
        functions.append(selection_function(policy, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim))
    return _model(graph, functions, f"criticalkv prefill ({flavour} flavour), policy {policy.to_json()}")


def build_decode(spec: ModelSpec, store: WeightStore, buffer_capacities: list[int]) -> onnx.ModelProto:
    """The decode model (one token per sequence) over fixed-capacity per-head KV buffers."""
    g = GraphBuilder()
    dec = _Decoder(g, spec, store)
    s = spec
    cos, sin = dec.rope_tables("position_ids")
    x = g.Gather("embed_tokens", "input_ids", axis=0)  # [B, 1, d]
    inputs = [value_info("input_ids", INT64, ["batch", 1]), value_info("position_ids", INT64, ["batch", 1])]
    outputs = [value_info("logits", FLOAT, ["batch", s.vocab_size])]
    for i in range(s.num_layers):
        cap = buffer_capacities[i]
        past_k, past_v, past_len = (f"past_key_values.{i}.{kind}" for kind in ("key", "value", "lengths"))
        inputs += [
            value_info(past_k, FLOAT, ["batch", s.num_kv_heads, cap, s.head_dim]),
            value_info(past_v, FLOAT, ["batch", s.num_kv_heads, cap, s.head_dim]),
            value_info(past_len, INT32, ["batch", s.num_kv_heads]),
        ]
        h = dec.rms_norm(x, f"layers.{i}.input_layernorm")
        q, k, v = dec.qkv(i, h, cos, sin, decode=True, kv_names=(f"present.{i}.key", f"present.{i}.value"))
        outputs += [value_info(f"present.{i}.{kind}", FLOAT, ["batch", s.num_kv_heads, 1, s.head_dim]) for kind in ("key", "value")]
        qg = g.reshape(g.Mul(q, dec.scale), [0, s.num_kv_heads, s.group, s.head_dim])  # [B, H_kv, G, d_h], scaled
        past_scores = g.MatMul(qg, g.Transpose(past_k, perm=[0, 1, 3, 2]))  # [B, H_kv, G, cap]
        visible = g.Less(g.const(np.arange(cap, dtype=np.int64)), g.unsqueeze(g.Cast(past_len, to=INT64), 2, 3))
        past_scores = g.Where(visible, past_scores, g.const(MASKED_SCORE, np.float32))
        own_score = g.MatMul(qg, g.Transpose(k, perm=[0, 1, 3, 2]))  # [B, H_kv, G, 1]
        probs = g.Softmax(g.concat(past_scores, own_score, axis=-1), axis=-1)
        p_past, p_own = g.op("Split", probs, g.i64(cap, 1), outputs=2, axis=-1)
        attn = g.Add(g.MatMul(p_past, past_v), g.Mul(p_own, v))  # [B, H_kv, G, d_h]
        attn = g.reshape(attn, [0, 1, s.num_heads * s.head_dim])
        x = g.Add(x, dec.output_projection(i, attn))
        x = g.Add(x, dec.mlp(i, dec.rms_norm(x, f"layers.{i}.post_attention_layernorm")))
    dec.logits(g.reshape(x, [-1, s.hidden_size]))
    used = _used_initializers(g.nodes)
    graph = g.graph("criticalkv_decode", inputs, outputs, [store.initializer(w) for w in store.arrays if w in used])
    return _model(graph, [], "criticalkv decode: one token over fixed-capacity per-head KV buffers")


def _used_initializers(nodes: list[onnx.NodeProto]) -> set[str]:
    used = set()
    for node in nodes:
        used.update(node.input)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                used |= _used_initializers(list(attr.g.node))
    return used


def _model(graph: onnx.GraphProto, functions: list, doc: str) -> onnx.ModelProto:
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), selection_opset()],
        functions=functions,
        ir_version=IR_VERSION,
        producer_name="criticalkv",
        doc_string=doc,
    )
    return model
