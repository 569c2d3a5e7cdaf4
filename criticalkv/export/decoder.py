"""Every ONNX graph of a decoder-only engine (Llama, Mistral, Qwen2, Qwen3, SmolLM), written directly with
``onnx.helper`` from the Hugging Face weights (standard operators only) by one builder, ``DecoderGraphBuilder``; what
a family does differently is a small subclass of it (``FAMILY_BUILDERS``: Qwen3's q/k norm) or the ``ModelSpec``.

Graph I/O follows onnxruntime-genai's decoder naming (B = batch, n = padded prompt length, N = new tokens of an
extend, cap_l = layer l's buffer capacity, H query heads, H_kv KV heads, d_h head dim, w = min(window, tokens)):

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
decode_ort (the fused decode, ONNX Runtime only; ``DecoderGraphBuilder.decode_fused``)
  in   decode's inputs
  out  ``logits`` [B, vocab]; ``present.{l}.key`` / ``.value`` [B, H_kv, cap_l, d_h]: the buffers themselves, bound to
       the past inputs' memory (com.microsoft GroupQueryAttention writes the new entry at slot max_g lengths[b, g] of
       every head of row b in place; the runtime moves a shorter head's entry to its own length)
extend (N new tokens per sequence, N up to the engine's ``extend_chunk``; no padding among them)
  in   ``input_ids`` [B, N], ``position_ids`` [B, N] (absolute: after eviction the prompt length + t),
       per layer: ``past_key_values.{l}.key`` / ``.value`` [B, H_kv, capacity_l, d_h] (any capacity: a decode slot's
       buffers or a full-size prefill buffer), ``past_key_values.{l}.lengths`` [B, H_kv] int32 (valid entries per head)
  out  ``logits`` [B, vocab] (the last new token); ``present.{l}.key`` / ``.value`` [B, H_kv, N, d_h]: the new
       tokens' entries, which the runtime writes at each head's length (as decode's);
       ``present.{l}.window_queries`` [B, H, min(N, window), d_h]: post-RoPE queries of the last new tokens
select (the selection of a prompt of n tokens whose K/V fill the first n entries of every head of a buffer: the
       chunked prefill's last step; the sequences of a batch have the same n)
  in   per layer: ``window_queries.{l}`` [B, H, w, d_h] (the prompt's last w = min(window, n) queries, from the
       extends' ``present.{l}.window_queries``), ``past_key_values.{l}.key`` / ``.value`` [B, H_kv, capacity_l, d_h],
       ``past_key_values.{l}.lengths`` [B, H_kv] int32 (n on every head); then ``kv_budget`` [1] int64
  out  prefill's per-layer ``present.{l}.key`` / ``.value`` / ``.lengths`` / ``.indices`` (same shapes and dtypes)
       The tensorrt flavour takes buffers of exactly the prompt: ``past_key_values.{l}.key`` / ``.value``
       [B, H_kv, prompt_tokens, d_h] with prompt_tokens = n (no slice to max(lengths): a shape computed from the
       values of an input is data-dependent in TensorRT, see docs/gpu.md)

Prompt attention on ONNX Runtime never materialises n x n scores: the queries are processed in blocks of
``attention_chunk`` inside a ``Loop``; block i attends keys [0, (i + 1) * chunk) (causal), so a layer holds
at most H * chunk * n scores at a time. An extend runs the same blocks over past ⊕ new, so a prompt prefilled in
extend chunks that are multiples of ``attention_chunk`` gets bitwise the prefill's K/V and logits. The TensorRT
flavour has no Loop: one attention per layer (MatMul, ``Where`` with a finite mask value, Softmax, MatMul) that
TensorRT fuses into one attention kernel, and the selection nodes without their body. ``criticalkv.export.
tensorrt_rules`` checks every TensorRT input (``prefill_tensorrt.onnx``, ``decode.onnx``, ``extend_tensorrt.onnx``,
``select_tensorrt.onnx``) against the ONNX-TensorRT importer's rules.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import onnx
import onnx.inliner
from onnx import helper

from criticalkv import graphs
from criticalkv.export import model_select
from criticalkv.export.config import KV_DTYPE_NAMES
from criticalkv.export.graph import FLOAT, INT32, INT64, IR_VERSION, OPSET, GraphBuilder, live_nodes, value_info
from criticalkv.export.quantize import quantized_matmul
from criticalkv.export.select_function import FLOAT32_MIN, selection_function, selection_node, selection_opset
from criticalkv.hf.loading import check_supported
from criticalkv.node import node_capacity
from criticalkv.policy import KVPolicy
from criticalkv.weights import WeightStore

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
    #: Qwen3: RMSNorm over d_h of every query and key head after the projections, before RoPE (eps rms_norm_eps;
    #: weight ``layers.{i}.qk_norm`` [H + H_kv, 1, d_h]: q_norm on the query heads, k_norm on the key heads)
    qk_norm: bool = False

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict:
        return asdict(self)


def model_spec(model) -> ModelSpec:
    """Read a transformers Llama/Mistral/Qwen2 model's config (raises ValueError when unsupported)."""
    config = model.config
    check_supported(config)
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
        if spec.qk_norm:  # Qwen3: q_norm on each of the H query heads, k_norm on each of the H_kv key heads
            qk = [_t(a.q_norm.weight)] * spec.num_heads + [_t(a.k_norm.weight)] * spec.num_kv_heads
            store.add(p + "qk_norm", np.stack(qk)[:, None, :])  # [H + H_kv, 1, d_h]: broadcasts over qk's positions
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


#: The flavours of the graphs: ``onnxruntime`` (selection nodes with their function bodies, prompt attention in
#: query blocks inside a ``Loop``), ``tensorrt`` (selection nodes without bodies, for the plugin; attention without
#: a Loop, in the form TensorRT fuses) and ``openvino`` (the selection nodes' bodies inlined into the graph, since
#: OpenVINO's ONNX frontend converts no model-local function; attention without a Loop, in causal query pieces of the
#: MatMul-Where-Softmax-MatMul chain OpenVINO's CPU plugin fuses into one attention subgraph; no com.microsoft operator:
#: ``criticalkv.export.openvino_rules``). ``decode.onnx`` is one graph for all of them.
FLAVOURS = ("onnxruntime", "tensorrt", "openvino")
#: Query pieces of the openvino flavour's prompt attention (``causal_attention_pieces``): (P + 1) / 2P of the work
#: of one n x n block
OPENVINO_ATTENTION_PIECES = 8

#: Score of a masked attention entry in the graphs TensorRT builds (the TensorRT prefill flavour, decode):
#: finite in fp16 and bf16 (a FLOAT32_MIN constant becomes -inf in a weakly typed fp16 engine, and a row masked
#: everywhere then turns to NaN), and far enough below any real score that its softmax weight underflows to
#: exactly 0 in fp32, fp16 and bf16.
MASKED_SCORE = -30000.0

_INT64_MAX = int(np.iinfo(np.int64).max)


def stream_weight(name: str, i: int) -> str:
    """Name of layer i's weight [d, H_kv] of stream ``name`` in the engine's weights (``add_stream``)."""
    return f"stream.{name}.{i}.weight"


def stream_bias(name: str, i: int) -> str:
    return f"stream.{name}.{i}.bias"


def add_stream(store: WeightStore, stream, spec: ModelSpec) -> None:
    """Add a ``criticalkv.methods.phases.Stream``'s per-layer weight [d, H_kv] and bias [H_kv] to ``store``: the
    extend graphs (onnxruntime flavour) then return it for the new entries (``DecoderGraphBuilder.stream_scores``)."""
    stream.check_shape(spec.num_layers, spec.hidden_size, spec.num_kv_heads)
    for i in range(spec.num_layers):
        store.add(stream_weight(stream.name, i), stream.weight[i])
        store.add(stream_bias(stream.name, i), stream.bias[i])

#: The domain of ONNX Runtime's contrib operators (``GroupQueryAttention``, ``SkipSimplifiedLayerNormalization``): only
#: in the ONNX-Runtime-only decode graph (``decode_fused``), never in a graph TensorRT parses.
ORT_DOMAIN = "com.microsoft"
#: Element types of the ONNX Runtime KV buffers (``BuildConfig.kv_dtype``): float32 (the default, exact parity
#: setting) or float16 (half the KV memory; only the fused decode graph reads them).
KV_DTYPES = dict(zip(KV_DTYPE_NAMES, (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)))
#: ONNX Runtime's CPU GroupQueryAttention kernel takes head sizes that are multiples of this only.
GQA_HEAD_DIM_MULTIPLE = 16


class DecoderGraphBuilder:
    """Every graph of an engine for a Llama-family decoder, written from shared pieces.

    The layout of onnxruntime-genai's model builder: one builder emits the whole decoder op by op, a model family is
    a small subclass overriding only what differs, and fused forms sit beside the portable ones. Graphs (each returns
    an ``onnx.ModelProto`` whose initializers are the store's weights, one ``weights.bin`` shared by every graph):

    * ``prefill()``: prompt -> last logits + each layer's selection (kept K/V, lengths, indices);
    * ``decode(buffer_capacities)``: one token per sequence over fixed-capacity per-head KV buffers;
    * ``extend()``: N new tokens per sequence over per-head KV buffers of any capacity (chunked prefill, a question
      after a cached context);
    * ``select()``: the selection of a prompt whose K/V sit in a full-size buffer (the chunked prefill's last step);
    * ``decode_fused(buffer_capacities, max_positions)``: ``decode_ort.onnx``, the ONNX-Runtime-only decode (com.microsoft
      ``GroupQueryAttention`` and ``SkipSimplifiedLayerNormalization``); ``decode.onnx`` stays the portable graph that
      TensorRT parses.

    Pieces, each a method writing into ``self.g`` (a fresh ``GraphBuilder`` per graph) that a subclass may override:
    ``rms_norm``, ``add_rms_norm`` (the residual add and the next norm: com.microsoft
    ``SkipSimplifiedLayerNormalization`` in the fused decode), ``rope_tables`` / ``rope`` (``rope_caches`` in the fused
    decode), ``qk_norm`` (identity for Llama; Qwen3's per-head RMSNorm of q and k before RoPE), ``qkv`` (``packed_qkv``
    in the fused decode), ``output_projection``, ``mlp``, ``logits``, and the attention of each graph:
    ``blocked_attention`` (prefill and extend, onnxruntime flavour), ``causal_attention`` (prefill and extend, tensorrt
    flavour), ``decode_attention`` (portable decode), ``group_query_attention`` (fused decode; a family that cannot use
    it says why in ``fused_decode_refusal``). The selection node's body and every graph of the tensorrt flavour stay
    standard ONNX.

    spec, store : the model's config and weights (``model_spec``, ``collect_weights``)
    policy : the KV policy (prefill, select; extend reads its ``window``); None for a decode-only builder
    capacities : per-layer static capacity of the selection nodes (``layer_capacities``); prefill and select
    flavour : ``onnxruntime`` or ``tensorrt`` (``FLAVOURS``)
    attention_chunk : query block size of the onnxruntime flavour's prompt and extend attention
    """

    def __init__(
        self,
        spec: ModelSpec,
        store: WeightStore,
        policy: KVPolicy | None = None,
        capacities: list[int] | None = None,
        flavour: str = "onnxruntime",
        attention_chunk: int = 256,
    ):
        if flavour not in FLAVOURS:
            raise ValueError(f"flavour: {flavour!r} is not one of {', '.join(FLAVOURS)}")
        if isinstance(attention_chunk, bool) or not isinstance(attention_chunk, int) or attention_chunk < 1:
            raise ValueError(f"attention_chunk: must be a positive integer, got {attention_chunk!r}")
        self.spec, self.store, self.policy, self.capacities = spec, store, policy, capacities
        self.flavour = flavour
        self.attention_chunk = attention_chunk
        self.g: GraphBuilder | None = None
        #: True while ``decode_fused`` writes its graph: ``add_rms_norm`` then emits com.microsoft
        #: ``SkipSimplifiedLayerNormalization``
        self.fused = False

    # ------------------------------------------------------------------ graph lifecycle
    def _begin(self) -> GraphBuilder:
        self.g = GraphBuilder()
        self.scale = self.g.const(1.0 / math.sqrt(self.spec.head_dim), np.float32)
        return self.g

    def _finish(self, name: str, inputs: list, outputs: list, functions: list, doc: str) -> onnx.ModelProto:
        g, store = self.g, self.store
        g.nodes = live_nodes(g.nodes, [o.name for o in outputs])  # e.g. the 1/sqrt(d_h) constant select never reads
        used = _used_initializers(g.nodes)
        graph = g.graph(name, inputs, outputs, [store.initializer(w) for w in store.arrays if w in used])
        self.g = None
        model = _model(graph, functions, doc)
        if self.flavour == "openvino":
            # OpenVINO's ONNX frontend converts no model-local function: every node's body goes into the graph, which
            # then imports the standard operators only
            model = onnx.inliner.inline_local_functions(model) if functions else model
            del model.opset_import[:]
            model.opset_import.append(helper.make_opsetid("", OPSET))
        return model

    def _selection_kind(self, graph: str) -> bool:
        """Whether the policy selects at model level (raises when the builder has no policy, or for the TensorRT
        flavour of a model-level policy)."""
        if self.policy is None or self.capacities is None:
            raise ValueError(f"the {graph} graph needs a policy and the per-layer capacities")

        model_level = model_select.is_model_level(self.policy, self.spec.num_layers)
        if self.flavour == "tensorrt":
            model_select.check_tensorrt_flavour(self.policy, self.spec.num_layers)
        return model_level

    def _window(self, graph: str) -> int:
        if self.policy is None:
            raise ValueError(f"the {graph} graph needs a policy (its window)")
        return self.policy.window

    # ------------------------------------------------------------------ pieces: norms, RoPE, projections
    def rms_norm(self, x: str, weight: str) -> str:
        """RMSNorm of x [..., d] over its last axis, times ``weight`` [d]."""
        g = self.g
        variance = g.ReduceMean(g.Pow(x, g.const(2.0, np.float32)), g.i64(-1), keepdims=1)
        return g.Mul(g.Div(x, g.Sqrt(g.Add(variance, g.const(self.spec.rms_norm_eps, np.float32)))), weight)

    def add_rms_norm(self, x: str, delta: str, weight: str) -> tuple[str, str]:
        """The residual add and the following norm: (x + delta, rms_norm(x + delta)), both [B, s, d].

        In the fused decode (``self.fused``) one com.microsoft ``SkipSimplifiedLayerNormalization`` node computes both
        (its fourth output is the sum; it rounds the variance in another order than the portable nodes: ~1e-7)."""
        if self.fused:
            normed, _, _, total = self.g.op(
                "SkipSimplifiedLayerNormalization", x, delta, weight, domain=ORT_DOMAIN,
                outputs=[self.g.fresh("normed"), "", "", self.g.fresh("residual")], epsilon=self.spec.rms_norm_eps)
            return total, normed
        total = self.g.Add(x, delta)
        return total, self.rms_norm(total, weight)

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

    def qk_norm(self, i: int, qk: str) -> str:
        """Layer i's norm of the query and key heads before RoPE, on qk [B, H + H_kv, s, d_h] (q heads first).

        The identity for Llama, Mistral, Qwen2 and SmolLM; Qwen3 overrides it (per-head RMSNorm over d_h with the
        layer's q_norm weight on the H query heads and k_norm on the H_kv key heads)."""
        return qk

    def qkv(self, i: int, h: str, cos: str, sin: str, decode: bool = False, kv_names: tuple = ()) -> tuple[str, str, str]:
        """Post-RoPE q [B, H, s, d_h], k and v [B, H_kv, s, d_h] from h [B, s, d].

        One MatMul for q, k and v; ``qk_norm``, then RoPE once over the q and k heads together. ``decode`` (s = 1):
        [B, 1, N*d_h] -> [B, N, 1, d_h] is a plain reshape. ``kv_names``: output names for k and v.
        """
        g, s = self.g, self.spec
        x = self.project(h, f"layers.{i}.qkv_proj")
        if f"layers.{i}.qkv_bias" in self.store.arrays:
            x = g.Add(x, f"layers.{i}.qkv_bias")
        heads = s.num_heads + 2 * s.num_kv_heads
        if decode:
            x = g.reshape(x, [0, heads, 1, s.head_dim])
        else:
            x = g.Transpose(g.reshape(x, [0, 0, heads, s.head_dim]), perm=[0, 2, 1, 3])  # [B, N, s, d_h]
        k_name, v_name = kv_names or (g.fresh("k"), g.fresh("v"))
        qk, v = g.op("Split", x, g.i64(s.num_heads + s.num_kv_heads, s.num_kv_heads), outputs=[g.fresh("qk"), v_name], axis=1)
        qk = self.rope(self.qk_norm(i, qk), cos, sin, rotation_matmul=decode)
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
        quantized = self.quantized(f"layers.{i}.o_proj")
        if quantized:  # a second copy of o_proj, [H*d_h, d] in integer form (the selection reads the float32 one)
            out = quantized_matmul(g, attn, quantized)
        else:
            out = g.MatMul(attn, g.Transpose(f"layers.{i}.o_proj", perm=[1, 0]))
        if bias:
            out = g.Add(out, bias)
        return out

    def mlp(self, i: int, x: str) -> str:
        g, s = self.g, self.spec
        gate, up = g.op("Split", self.project(x, f"layers.{i}.gate_up_proj"),
                        g.i64(s.intermediate_size, s.intermediate_size), outputs=2, axis=-1)
        return self.project(g.Mul(g.Mul(gate, g.Sigmoid(gate)), up), f"layers.{i}.down_proj")

    def quantized(self, weight: str):
        """The integer form of ``weight`` that this graph multiplies by (``criticalkv.export.quantize``): only in the
        fused ONNX Runtime graphs of an engine built with ``--weights int8|int4``; None otherwise."""
        return self.store.quantized.get(weight) if self.fused else None

    def project(self, x: str, weight: str) -> str:
        """x [.., k] @ ``weight`` [k, n] (a stored [in, out] projection): MatMul, or its quantized form."""
        quantized = self.quantized(weight)
        return quantized_matmul(self.g, x, quantized) if quantized else self.g.MatMul(x, weight)

    def head_logits(self, normed: str) -> str:
        """``logits`` [B, vocab] from the final-normed last hidden state [B, d]: Gemm with the stored [vocab, d] head,
        or its quantized form."""
        quantized = self.quantized(self.head_weight())
        if quantized:
            return quantized_matmul(self.g, normed, quantized, outputs=[graphs.LOGITS])
        return self.g.Gemm(normed, self.head_weight(), transB=1, outputs=[graphs.LOGITS])

    def head_weight(self) -> str:
        """The LM head's weight [vocab, d]: ``lm_head``, or the tied input embedding."""
        return "lm_head" if "lm_head" in self.store.arrays else "embed_tokens"

    def logits(self, last: str) -> str:
        """[B, vocab] from the last hidden state [B, d]."""
        return self.head_logits(self.rms_norm(last, "norm"))

    def last_logits(self, x: str) -> str:
        """[B, vocab] of the last position of x [B, s, d]."""
        g = self.g
        return self.logits(g.reshape(g.slice_axis(x, -1, _INT64_MAX, axis=1), [-1, self.spec.hidden_size]))

    def decoder_layers(self, x: str, cos: str, sin: str, attention, after_layer=None, decode: bool = False,
                       present_kv: bool = False, transposed_gemm: bool = False, layer_input=None) -> str:
        """Every decoder layer over the embeddings x [B, s, d]; returns the last residual stream [B, s, d].

        ``attention(i, q, k, v)`` -> [B, s, H*d_h] is the graph's attention; ``after_layer(i, q, k, v)`` adds what a
        graph needs of a layer (selection nodes, outputs). ``present_kv``: k and v are named ``present.{i}.key`` /
        ``.value`` (graph outputs). The residual add before each norm is ``add_rms_norm`` (fusable with it).
        ``layer_input(i, h)``: called with each layer's attention input h [B, s, d] (after ``input_layernorm``)."""
        g, layers = self.g, self.spec.num_layers
        h = self.rms_norm(x, "layers.0.input_layernorm")
        for i in range(layers):
            if layer_input is not None:
                layer_input(i, h)
            kv_names = (graphs.present_key(i), graphs.present_value(i)) if present_kv else ()
            q, k, v = self.qkv(i, h, cos, sin, decode=decode, kv_names=kv_names)
            attn = attention(i, q, k, v)
            projected = self.output_projection(i, attn, transposed_gemm=transposed_gemm)
            x, h = self.add_rms_norm(x, projected, f"layers.{i}.post_attention_layernorm")
            out = self.mlp(i, h)
            if i + 1 < layers:
                x, h = self.add_rms_norm(x, out, f"layers.{i + 1}.input_layernorm")
            else:
                x = g.Add(x, out)
            if after_layer is not None:
                after_layer(i, q, k, v)
        return x

    # ------------------------------------------------------------------ pieces: attention
    def blocked_attention(self, q: str, k: str, v: str, ctx: dict) -> str:
        """Causal attention of s queries [B, H, s, d_h] in blocks of ``attention_chunk`` (a Loop; onnxruntime flavour).

        k, v [B, H_kv, past + s, d_h]: query t sits at key position past + t (past = 0 in the prefill). Block j holds
        queries [j c, (j + 1) c) (zero padded to a whole block) and attends keys [0, past + min((j + 1) c, s)):
        scores [B, H_kv, G*c, k] = (q / sqrt(d_h)) K^T (one MatMul per KV head for its G query heads), + an additive
        mask (float32 minimum where ``key > query`` or ``ctx["key_mask"]`` blocks the key), Softmax, @ V. So a layer
        holds at most H * c * (past + s) scores at a time, and block j of an extend over a past P that is a multiple of
        c computes exactly the MatMul shapes and values of block P / c + j of the unchunked prefill.

        ctx: ``queries`` s (int64 [1]); ``num_blocks`` (int64 scalar) and ``pad_len`` (int64 [1]) of the query padding;
        ``past`` (int64 [1], extend only); ``key_mask``: bool, True = blocked, [B, 1, 1, n] (prefill: left padding;
        scores broadcast as [B, H, c, k]) or [B, H_kv, 1, 1, past + s] (extend: each head's entries beyond its own
        length; scores as [B, H_kv, G, c, k]).
        The Loop has a trip count and no condition input; its body therefore never reads its ``cond_in`` input
        and returns a constant True as the condition (the ONNX-TensorRT Loop importer registers ``cond_in`` only
        when the node has a condition input, see criticalkv/export/tensorrt_rules.py).
        """
        g, s, chunk = self.g, self.spec, self.attention_chunk
        past = ctx.get("past")
        qg = g.reshape(g.Mul(q, self.scale), [0, s.num_kv_heads, s.group, -1, s.head_dim])  # [B, H_kv, G, s, d_h]
        qg = g.Pad(qg, g.concat(g.i64(0, 0, 0, 0, 0, 0, 0, 0), ctx["pad_len"], g.i64(0)), mode="constant")
        body = g.child()
        step = body.fresh("iter")
        cond_in = body.fresh("cond_in")
        start = body.Mul(body.unsqueeze(step, 0), body.i64(chunk))  # [1]
        end = body.Add(start, body.i64(chunk))
        qc = body.reshape(body.slice_axis(qg, start, end, axis=3), [0, 0, -1, s.head_dim])  # [B, H_kv, G*c, d_h]
        key_end = body.Min(end, ctx["queries"])
        if past is not None:
            key_end = body.Add(past, key_end)
        kc = body.slice_axis(k, 0, key_end, axis=2)
        vc = body.slice_axis(v, 0, key_end, axis=2)
        score_shape = [0, s.num_heads, chunk, -1] if past is None else [0, s.num_kv_heads, s.group, chunk, -1]
        scores = body.reshape(body.MatMul(qc, body.Transpose(kc, perm=[0, 1, 3, 2])), score_shape)
        query_pos = body.Add(body.Range(body.scalar(0), body.scalar(chunk), body.scalar(1)), body.squeeze(start, 0))
        if past is not None:
            query_pos = body.Add(query_pos, body.squeeze(past, 0))
        key_pos = body.Range(body.scalar(0), body.squeeze(key_end, 0), body.scalar(1))
        causal = body.Greater(body.unsqueeze(key_pos, 0), body.unsqueeze(query_pos, 1))  # [c, k]
        mask_axis = 3 if past is None else 4
        blocked = body.Or(causal, body.slice_axis(ctx["key_mask"], 0, key_end, axis=mask_axis))
        bias = body.Where(blocked, body.const(FLOAT32_MIN, np.float32), body.const(0.0, np.float32))
        probs_block = body.Softmax(body.Add(scores, bias), axis=-1)  # [B, H, c, k] or [B, H_kv, G, c, k]
        probs = body.Reshape(probs_block, body.concat(body.i64(0, s.num_kv_heads, -1), key_end))
        out = body.reshape(body.MatMul(probs, vc), [0, 0, s.group, chunk, s.head_dim])
        out = body.reshape(body.Transpose(out, perm=[0, 3, 1, 2, 4]), [0, 0, s.num_heads * s.head_dim])  # [B, c, H*d_h]
        cond_out = body.const(True, np.bool_, hint="cond_out")
        scan = [value_info(out, FLOAT, None)]
        if "score_visible" in ctx:  # a re-read pass's score of the past entries (``extend(score=True)``)
            scan.append(value_info(self.reread_block_scores(body, probs_block, key_end, start, ctx), FLOAT, None))
        loop_body = body.graph(
            "attention_block",
            [value_info(step, INT64, []), value_info(cond_in, onnx.TensorProto.BOOL, [])],
            [value_info(cond_out, onnx.TensorProto.BOOL, [])] + scan,
        )
        blocks = g.op("Loop", ctx["num_blocks"], "", body=loop_body, outputs=len(scan), hint="attention_blocks")
        if "score_visible" in ctx:  # [T, B, H_kv, P] per block -> the max over the blocks
            blocks, block_scores = blocks
            ctx["score_out"] = g.ReduceMax(block_scores, g.i64(0), keepdims=0)  # [B, H_kv, P]
        merged = g.reshape(g.Transpose(blocks, perm=[1, 0, 2, 3]), [0, -1, s.num_heads * s.head_dim])  # [T, B, c, H*d_h]
        return g.slice_axis(merged, 0, ctx["queries"], axis=1)

    def reread_block_scores(self, body, probs: str, key_end: str, start: str, ctx: dict) -> str:
        """A re-read pass's score of one query block of an extend over a past of P entries
        (``criticalkv.methods.phases.RereadPass``): the softmax of every new query over the keys the pass counts (the
        past entries ``ctx["score_visible"]`` [P + s] marks and the new tokens up to the query), its largest value per
        past entry over the block's real queries and the G heads of each KV head: [B, H_kv, P].

        ``probs`` [B, H_kv, G, c, k] is the block's attention (its softmax over every key the query sees). The pass's
        keys are a subset of those, and a softmax over a subset is the full one renormalised over it: probs / (the mass
        of the counted keys), with no second softmax over the block."""
        chunk = self.attention_chunk
        visible = body.Cast(body.slice_axis(ctx["score_visible"], 0, key_end, axis=0), to=FLOAT)  # [k]
        mass = body.ReduceSum(body.Mul(probs, visible), body.i64(4), keepdims=1)  # [B, H_kv, G, c, 1] (> 0: own key)
        row = body.Add(body.Range(body.scalar(0), body.scalar(chunk), body.scalar(1)), body.squeeze(start, 0))  # [c]
        real = body.Cast(body.Less(row, ctx["queries"]), to=FLOAT)  # the block's padding rows count for nothing
        scale = body.Div(body.unsqueeze(real, 1), mass)  # [B, H_kv, G, c, 1]
        past = body.slice_axis(probs, 0, ctx["past"], axis=4)  # [B, H_kv, G, c, P]
        past = body.Mul(body.Mul(past, body.slice_axis(visible, 0, ctx["past"], axis=0)), scale)
        return body.ReduceMax(past, body.i64(2, 3), keepdims=0)

    def causal_attention(self, q: str, k: str, v: str, allowed: str) -> str:
        """Attention of s queries [B, H, s, d_h] over k, v [B, H_kv, K, d_h] in one block, without a Loop (tensorrt
        flavour); ``allowed`` [B, 1 or H, s, K] bool says which keys each query sees.

        The pattern TensorRT fuses into one attention kernel ("Fused Attention", method 2 of the TensorRT
        developer guide): Q already scaled by 1/sqrt(d_h) before the first MatMul, scores [B, H, s, K] = Q K^T,
        ``Where(allowed, scores, MASKED_SCORE)`` (a finite value: see MASKED_SCORE), Softmax, @ V, on 4-D
        [B, heads, s, d_h] tensors; K and V are repeated to the H query heads with Unsqueeze-Expand-Reshape, the
        ``repeat_kv`` form of exported Llama graphs (GQA). The ONNX ``Attention`` operator (opset 23, imported by
        TensorRT >= 10.14 as ``IAttention``) is not used: ``IAttention::setCausal`` cannot be combined with
        ``setMask`` (NvInfer.h 10.14), and left-padded batches and per-head lengths need a mask.
        """
        g, s = self.g, self.spec
        scores = g.MatMul(g.Mul(q, self.scale), g.Transpose(self.repeat_kv(k), perm=[0, 1, 3, 2]))  # [B, H, s, K]
        scores = g.Where(allowed, scores, g.const(MASKED_SCORE, np.float32))
        probs = g.Softmax(scores, axis=-1)
        out = g.Transpose(g.MatMul(probs, self.repeat_kv(v)), perm=[0, 2, 1, 3])  # [B, s, H, d_h]
        return g.reshape(out, [0, 0, s.num_heads * s.head_dim])

    def grouped_attention(self, q: str, k: str, v: str, seen: str, causal: str) -> str:
        """``causal_attention`` with the G query heads of a KV head as G x s rows of one product over that head's K, V
        [B, H_kv, K, d_h] (openvino flavour's extend; the decode graph's form): no K or V repeated to the H query heads.
        ``seen`` [B, H_kv, 1, K] bool: the keys each KV head holds; ``causal`` [s, K] bool: the keys each query sees
        (tiled over the G row blocks). The same scores, Softmax and sums per row as ``causal_attention``'s (bitwise
        equal outputs on the CPU plugin; 0.92-0.99x its time for a 512-token chunk of the bundled model:
        ``python -m benchmarks.openvino_attention``)."""
        g, s = self.g, self.spec
        rows = g.reshape(g.Mul(q, self.scale), [0, s.num_kv_heads, -1, s.head_dim])  # [B, H_kv, G s, d_h]
        scores = g.MatMul(rows, g.Transpose(k, perm=[0, 1, 3, 2]))  # [B, H_kv, G s, K]
        scores = g.Where(seen, scores, g.const(MASKED_SCORE, np.float32))
        scores = g.Where(g.Tile(causal, g.i64(s.group, 1)), scores, g.const(MASKED_SCORE, np.float32))
        out = g.reshape(g.MatMul(g.Softmax(scores, axis=-1), v), [0, s.num_heads, -1, s.head_dim])  # [B, H, s, d_h]
        return g.reshape(g.Transpose(out, perm=[0, 2, 1, 3]), [0, 0, s.num_heads * s.head_dim])

    def causal_attention_pieces(self, q: str, k: str, v: str, allowed: str, n: str, pieces: int) -> str:
        """``causal_attention`` over a prompt of n tokens in ``pieces`` query pieces (openvino flavour): piece j holds the
        queries [n j / P, n (j + 1) / P) and attends the keys [0, n (j + 1) / P) only, the ones its causal mask can
        let through, so the scores of keys after a piece's last query are never computed ((P + 1) / 2P of the single
        block's work: 56 % for 8 pieces; measured on the bundled model, 2k tokens, bf16: the attention subgraphs 544 ->
        294 ms, the prefill 1.23 -> 1.04 s). Each piece keeps the single block's pattern, which OpenVINO's CPU plugin
        fuses into one attention subgraph; the keys a piece leaves out would have had probability 0."""
        g = self.g
        bounds = [g.i64(0)] + [g.Div(g.Mul(n, g.i64(j)), g.i64(pieces)) for j in range(1, pieces)] + [n]
        outs = []
        for j in range(pieces):
            start, end = bounds[j], bounds[j + 1]
            piece = g.Slice(allowed, g.concat(start, g.i64(0)), g.concat(end, end), g.i64(2, 3))  # [B, 1, s_j, K_j]
            outs.append(self.causal_attention(g.slice_axis(q, start, end, axis=2), g.slice_axis(k, 0, end, axis=2),
                                              g.slice_axis(v, 0, end, axis=2), piece))
        return g.concat(*outs, axis=1)

    def repeat_kv(self, x: str) -> str:
        """[B, H_kv, K, ...] -> [B, H, K, ...] with d_h = the last axis: query head h reads KV head h // G."""
        g, s = self.g, self.spec
        return g.reshape(g.Expand(g.unsqueeze(x, 2), g.i64(1, 1, s.group, 1, 1)), [0, s.num_heads, -1, s.head_dim])

    def decode_attention(self, q: str, k: str, v: str, past_k: str, past_v: str, past_len: str, cap: int) -> str:
        """One query per sequence: q [B, H, 1, d_h], its own k, v [B, H_kv, 1, d_h] and the fixed-capacity buffers
        past_k, past_v [B, H_kv, cap, d_h] of which each head's first ``past_len`` [B, H_kv] int32 entries are valid.
        Returns [B, 1, H*d_h]. The new token's own score is concatenated after the buffer's (no buffer copy)."""
        g, s = self.g, self.spec
        qg = g.reshape(g.Mul(q, self.scale), [0, s.num_kv_heads, s.group, s.head_dim])  # [B, H_kv, G, d_h], scaled
        past_scores = g.MatMul(qg, g.Transpose(past_k, perm=[0, 1, 3, 2]))  # [B, H_kv, G, cap]
        visible = g.Less(g.const(np.arange(cap, dtype=np.int64)), g.unsqueeze(g.Cast(past_len, to=INT64), 2, 3))
        past_scores = g.Where(visible, past_scores, g.const(MASKED_SCORE, np.float32))
        own_score = g.MatMul(qg, g.Transpose(k, perm=[0, 1, 3, 2]))  # [B, H_kv, G, 1]
        probs = g.Softmax(g.concat(past_scores, own_score, axis=-1), axis=-1)
        p_past, p_own = g.op("Split", probs, g.i64(cap, 1), outputs=2, axis=-1)
        attn = g.Add(g.MatMul(p_past, past_v), g.Mul(p_own, v))  # [B, H_kv, G, d_h]
        return g.reshape(attn, [0, 1, s.num_heads * s.head_dim])

    def extend_attention(self, q: str, k: str, v: str, past_k: str, past_v: str, past_len: str, ctx: dict) -> str:
        """N new queries q [B, H, N, d_h] with their own k, v [B, H_kv, N, d_h] over the buffers past_k, past_v
        [B, H_kv, capacity, d_h], each head's first ``past_len`` [B, H_kv] int32 entries valid; new token t sees every
        valid entry and the new tokens 0..t. Returns [B, N, H*d_h].

        onnxruntime flavour: ``blocked_attention`` over past[:, :, :P] ⊕ new, P = the largest length (entries of a head
        beyond its own length masked with the float32 minimum, as the prefill's left padding). tensorrt flavour:
        ``causal_attention`` over the whole capacity ⊕ new (a shape from the input's dims, not from its values, like
        decode), entries beyond each head's length masked. openvino flavour: ``grouped_attention`` over past[:, :, :P] ⊕
        new (P = the largest length), masked likewise by two masks: the held entries per KV head, the causal order per
        query (the same scores as their Or, without it)."""
        g, s = self.g, self.spec
        lengths = g.Cast(past_len, to=INT64)  # [B, H_kv]
        if self.flavour == "onnxruntime":
            past = g.reshape(g.ReduceMax(lengths, keepdims=1), [1])  # P
            keys = g.concat(g.slice_axis(past_k, 0, past, axis=2), k, axis=2)  # [B, H_kv, P + N, d_h]
            values = g.concat(g.slice_axis(past_v, 0, past, axis=2), v, axis=2)
            key_pos = g.Range(g.scalar(0), g.squeeze(g.Add(past, ctx["queries"]), 0), g.scalar(1))
            beyond = g.And(g.GreaterOrEqual(key_pos, g.unsqueeze(lengths, 2)), g.Less(key_pos, past))  # [B, H_kv, P + N]
            inner = {**ctx, "past": past, "key_mask": g.unsqueeze(beyond, 2, 3)}
            if "score_range" in ctx:  # the pass's keys: the sinks, [start, end), every entry of the pass itself
                sinks, start, end, context = (g.slice_axis(ctx["score_range"], j, j + 1, axis=0) for j in range(4))
                visible = g.Or(g.Or(g.Less(key_pos, sinks), g.And(g.GreaterOrEqual(key_pos, start), g.Less(key_pos, end))),
                               g.GreaterOrEqual(key_pos, context))  # [P + N]
                inner["score_visible"] = visible
            out = self.blocked_attention(q, keys, values, inner)
            if "score_range" in ctx:
                ctx["layer_scores"].append(inner["score_out"])
            return out
        if self.flavour == "openvino":  # the held entries only (OpenVINO takes a shape from the lengths' values)
            past = g.reshape(g.ReduceMax(lengths, keepdims=1), [1])  # P
            past_k, past_v = g.slice_axis(past_k, 0, past, axis=2), g.slice_axis(past_v, 0, past, axis=2)
        cap = g.shape_of(past_k, 2, 3)
        keys = g.concat(past_k, k, axis=2)  # [B, H_kv, cap + N, d_h]
        values = g.concat(past_v, v, axis=2)
        key_pos = g.Range(g.scalar(0), g.squeeze(g.Add(cap, ctx["queries"]), 0), g.scalar(1))  # [K]
        if self.flavour == "openvino":
            # two masks, each in its own shape: a key is a held past entry or a new one ([B, H, 1, K], per head), and
            # not after the query ([N, K]: every past entry passes, cap <= each query's position). Their Or broadcast
            # to [B, H, N, K] was rebuilt in every layer (110 ms of a 2k prompt's 1.8 s of nodes on the CPU plugin);
            # two Wheres read them as they are and give the same scores
            seen = g.Or(g.Less(key_pos, g.unsqueeze(lengths, 2)), g.GreaterOrEqual(key_pos, cap))  # [B, H_kv, K]
            query_pos = g.Add(g.Range(g.scalar(0), g.squeeze(ctx["queries"], 0), g.scalar(1)), g.squeeze(cap, 0))  # [N]
            causal = g.LessOrEqual(g.unsqueeze(key_pos, 0), g.unsqueeze(query_pos, 1))  # [N, K]
            return self.grouped_attention(q, keys, values, g.unsqueeze(seen, 2), causal)
        valid = g.Less(key_pos, g.unsqueeze(lengths, 2))  # [B, H_kv, K]: a length <= cap, so only past entries
        valid = g.reshape(g.Expand(g.unsqueeze(valid, 2), g.i64(1, 1, s.group, 1)), [0, s.num_heads, 1, -1])  # [B, H, 1, K]
        query_pos = g.Add(g.Range(g.scalar(0), g.squeeze(ctx["queries"], 0), g.scalar(1)), g.squeeze(cap, 0))  # [N]
        own = g.And(g.GreaterOrEqual(key_pos, cap), g.LessOrEqual(g.unsqueeze(key_pos, 0), g.unsqueeze(query_pos, 1)))
        return self.causal_attention(q, keys, values, g.Or(valid, own))  # [B, H, N, K]

    # ------------------------------------------------------------------ pieces: selection
    def rotation_tables(self) -> str:
        """The graph's constant [2, window, d_h] of a method that reads RoPE's rotation, from this model's inv_freq
        (the method's ``rotation_table``; ``const`` shares it across the layers)."""
        p = self.policy
        return self.g.const(p.method.base.rotation_table(p, self.store.arrays["inv_freq"], self.spec.head_dim),
                            hint="expected_rotation")

    def select_layer(self, i: int, window_queries: str, k: str, v: str, prompt_lengths: str, kv_budget: str,
                     pending: list, model_level: bool, scores: str | None = None) -> list:
        """Layer i's selection node on window_queries [B, H, w, d_h], the prompt's k, v [B, H_kv, n, d_h],
        prompt_lengths [B] int32 and kv_budget [1] int32: outputs ``present.{i}.key/value/lengths/indices`` (or, for a
        model-level policy, the layer's ``CriticalKVScore`` node, its inputs kept in ``pending`` for
        ``select_model``). ``scores``: the node's external scores [B, H_kv, n or 0] for a method that reads them
        (a policy scored apart; None: none given, [1, H_kv, 0]). Returns the value infos of the four outputs."""
        policy, s = self.policy, self.spec
        names = [graphs.present_key(i), graphs.present_value(i), graphs.present_lengths(i), graphs.present_indices(i)]
        node_inputs = [window_queries, k, v, f"layers.{i}.o_proj", prompt_lengths, kv_budget]
        if policy.method.base.needs_rotation:  # RoPE's rotation tables of this model (expected-attention)
            node_inputs.append(self.rotation_tables())
        if policy.method.base.external_scores:  # the phases' scores, or none (the method's fallback)
            node_inputs.append(scores or self.no_scores())
        if model_level:  # this layer's ranking (and critical score); its full K/V stay graph tensors until the model node
            scored = [f"{name}_{i}" for name in model_select.score_outputs(policy)]
            self.g.nodes.append(model_select.score_node(policy, i, s.num_layers, self.capacities[i], node_inputs, scored))
            pending.append((scored, k, v))
        else:
            self.g.nodes.append(selection_node(policy, i, s.num_layers, self.capacities[i], node_inputs, names,
                                               name=f"criticalkv_select_{i}"))
        kept = f"kept_{i}"
        return [
            value_info(names[0], FLOAT, ["batch", s.num_kv_heads, kept, s.head_dim]),
            value_info(names[1], FLOAT, ["batch", s.num_kv_heads, kept, s.head_dim]),
            value_info(names[2], INT32, ["batch", s.num_kv_heads]),
            value_info(names[3], INT32, ["batch", s.num_kv_heads, kept]),
        ]

    def no_scores(self) -> str:
        """[1, H_kv, 0] float32: the selection's scores input when none are given. OpenVINO's ONNX frontend loses the
        shape of a constant without elements (``openvino_rules``, "empty-constant"): its flavour slices 0 entries off a
        [1, H_kv, 1] constant instead."""
        g, heads = self.g, self.spec.num_kv_heads
        if self.flavour == "openvino":
            return g.slice_axis(g.const(np.zeros((1, heads, 1), np.float32), hint="one_score"), 0, 0, axis=2)
        return g.const(np.zeros((1, heads, 0), np.float32), hint="no_scores")

    def select_model(self, pending: list, prompt_lengths: str, kv_budget: str) -> None:
        """The model-level selection node after the last layer (one selection over every layer and head)."""
        present = [name(i) for i in range(self.spec.num_layers) for name in graphs.SELECTED]
        self.g.nodes.append(model_select.model_node(
            self.policy, self.capacities,
            [e[0][j] for j in range(len(pending[0][0])) for e in pending] + [e[1] for e in pending]
            + [e[2] for e in pending] + [prompt_lengths, kv_budget], present))

    def selection_functions(self, model_level: bool) -> list[onnx.FunctionProto]:
        """The selection nodes' function bodies (none in the tensorrt flavour: the plugin runs the node; the openvino
        flavour inlines them, ``_finish``)."""
        if self.flavour == "tensorrt":
            return []

        policy, s = self.policy, self.spec
        if model_level:
            return [model_select.score_function(policy, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim),
                    model_select.model_function(policy, s.num_layers, s.num_kv_heads)]
        return [selection_function(policy, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim)]

    # ------------------------------------------------------------------ graphs
    def prefill(self) -> onnx.ModelProto:
        """The prefill model (left-padded prompts; module docstring for its I/O). onnxruntime flavour: attention in
        query blocks inside a Loop; tensorrt: one causal block per layer (``attention_chunk`` is not used)."""
        model_level = self._selection_kind("prefill")
        policy, spec = self.policy, self.spec
        pending = []  # model-level selection: every layer's (ranking, keys, values) until the last layer
        g = self._begin()
        n = g.shape_of(graphs.INPUT_IDS, 1, 2)
        lengths = g.ReduceSum(graphs.ATTENTION_MASK, g.i64(1), keepdims=0)  # [B]
        prompt_lengths = g.Cast(lengths, to=INT32, hint="prompt_lengths")
        kv_budget = g.Cast(graphs.KV_BUDGET, to=INT32, hint="kv_budget_int32")  # the request's budget (node input 5)
        key_pos = g.Range(g.scalar(0), g.squeeze(n, 0), g.scalar(1))
        key_padding = g.Less(g.unsqueeze(key_pos, 0), g.unsqueeze(g.Sub(n, lengths), 1))  # [B, n]: left padding
        if self.flavour == "onnxruntime":
            ctx = self._block_context(n)
            ctx["key_mask"] = g.reshape(key_padding, [0, 1, 1, -1])

            def attention(i, q, k, v):
                return self.blocked_attention(q, k, v, ctx)
        else:
            causal = g.LessOrEqual(g.unsqueeze(key_pos, 0), g.unsqueeze(key_pos, 1))  # [n, n]: key <= query
            allowed = g.And(causal, g.reshape(g.Not(key_padding), [0, 1, 1, -1]))  # [B, 1, n, n]

            def attention(i, q, k, v):
                if self.flavour == "openvino":
                    return self.causal_attention_pieces(q, k, v, allowed, n, OPENVINO_ATTENTION_PIECES)
                return self.causal_attention(q, k, v, allowed)
        outputs = [value_info(graphs.LOGITS, FLOAT, ["batch", spec.vocab_size])]
        # the tensorrt flavour's plugin ranks an external_scores policy by scores the graph computes (its method's
        # graph_stream: the only ones tensorrt_refusal lets through); the other flavours' nodes fall back to the
        # method's own score without them
        scored = self.flavour == "tensorrt" and policy.method.base.external_scores
        layer_scores = {}

        def score(i, h):
            layer_scores[i] = self.graph_scores(i, h)

        def select(i, q, k, v):
            window_queries = g.slice_axis(q, -policy.window, _INT64_MAX, axis=2)
            outputs.extend(self.select_layer(i, window_queries, k, v, prompt_lengths, kv_budget, pending, model_level,
                                             layer_scores.get(i)))

        cos, sin = self.rope_tables(graphs.POSITION_IDS)
        x = g.Gather("embed_tokens", graphs.INPUT_IDS, axis=0)
        x = self.decoder_layers(x, cos, sin, attention, select, transposed_gemm=self.flavour != "onnxruntime",
                                layer_input=score if scored else None)
        if model_level:
            self.select_model(pending, prompt_lengths, kv_budget)
        self.last_logits(x)
        inputs = [value_info(name, INT64, ["batch", "sequence"]) for name in (graphs.INPUT_IDS, graphs.ATTENTION_MASK, graphs.POSITION_IDS)]
        inputs.append(value_info(graphs.KV_BUDGET, INT64, [1]))
        return self._finish("criticalkv_prefill", inputs, outputs, self.selection_functions(model_level),
                            f"criticalkv prefill ({self.flavour} flavour), policy {policy.to_json()}")

    def _block_context(self, queries: str) -> dict:
        """``blocked_attention``'s query blocking for ``queries`` (int64 [1]) queries."""
        g, chunk = self.g, self.attention_chunk
        num_blocks = g.Div(g.Add(queries, g.i64(chunk - 1)), g.i64(chunk))
        return {"queries": queries, "num_blocks": g.squeeze(num_blocks, 0),
                "pad_len": g.Sub(g.Mul(num_blocks, g.i64(chunk)), queries)}

    def _past_inputs(self, i: int, capacity, kv_type: int = FLOAT) -> list:
        s = self.spec
        return [
            value_info(graphs.past_key(i), kv_type, ["batch", s.num_kv_heads, capacity, s.head_dim]),
            value_info(graphs.past_value(i), kv_type, ["batch", s.num_kv_heads, capacity, s.head_dim]),
            value_info(graphs.past_lengths(i), INT32, ["batch", s.num_kv_heads]),
        ]

    def decode(self, buffer_capacities: list[int]) -> onnx.ModelProto:
        """The decode model (one token per sequence) over fixed-capacity per-head KV buffers (one graph for the
        onnxruntime and tensorrt flavours: TensorRT parses it as it is). The openvino flavour (``decode_openvino.onnx``)
        attends only the first max(lengths) entries of the buffers (``cast_decode_attention`` without the casts: a
        shape from the lengths' values, which OpenVINO takes) and multiplies by the stored o_proj (``Gemm``)."""
        g = self._begin()
        s = self.spec
        cos, sin = self.rope_tables(graphs.POSITION_IDS)
        x = g.Gather("embed_tokens", graphs.INPUT_IDS, axis=0)  # [B, 1, d]
        inputs = [value_info(graphs.INPUT_IDS, INT64, ["batch", 1]), value_info(graphs.POSITION_IDS, INT64, ["batch", 1])]
        outputs = [value_info(graphs.LOGITS, FLOAT, ["batch", s.vocab_size])]
        for i in range(s.num_layers):
            inputs += self._past_inputs(i, buffer_capacities[i])
            outputs += [value_info(name(i), FLOAT, ["batch", s.num_kv_heads, 1, s.head_dim]) for name in (graphs.present_key, graphs.present_value)]

        openvino = self.flavour == "openvino"

        def attention(i, q, k, v):
            past_k, past_v, past_len = (name(i) for name in graphs.PAST)
            if openvino:
                return self.cast_decode_attention(q, k, v, past_k, past_v, past_len, cast=False)
            return self.decode_attention(q, k, v, past_k, past_v, past_len, buffer_capacities[i])

        x = self.decoder_layers(x, cos, sin, attention, decode=True, present_kv=True, transposed_gemm=openvino)
        self.logits(g.reshape(x, [-1, s.hidden_size]))
        return self._finish("criticalkv_decode", inputs, outputs, [],
                            f"criticalkv decode ({self.flavour} flavour): one token over fixed-capacity per-head KV "
                            "buffers")

    # ------------------------------------------------------------------ the fused decode (ONNX Runtime only)
    def fused_decode_refusal(self) -> str | None:
        """Why this model has no fused decode graph (None: it has one). A family subclass adds its own reasons."""
        d = self.spec.head_dim
        if d % GQA_HEAD_DIM_MULTIPLE:
            return (f"head_dim {d} is not a multiple of {GQA_HEAD_DIM_MULTIPLE} (ONNX Runtime's CPU GroupQueryAttention "
                    "kernel requires it)")
        if d % 2:
            return f"head_dim {d} is odd (RoPE rotates half-heads)"
        return None

    def rope_caches(self, max_positions: int) -> tuple[str, str]:
        """GroupQueryAttention's ``cos_cache``, ``sin_cache`` [max_positions, d_h / 2] float32: cos and sin of
        position x inv_freq (the angle rounded to float32 as the portable graph's ``rope_tables`` rounds it), times
        the RoPE attention scaling; constants of the graph."""
        positions = np.arange(max_positions, dtype=np.float32)[:, None]
        angles = (positions * self.store.arrays["inv_freq"].astype(np.float32)[None, :]).astype(np.float64)
        scale = np.float64(np.float32(self.spec.rope_attention_scaling))
        cos = (np.cos(angles) * scale).astype(np.float32)
        sin = (np.sin(angles) * scale).astype(np.float32)
        return self.g.const(cos, hint="cos_cache"), self.g.const(sin, hint="sin_cache")

    def packed_qkv(self, i: int, h: str) -> str:
        """Layer i's one-token q, k, v heads before RoPE, packed as GroupQueryAttention reads them: h [B, 1, d] ->
        [B, 1, (H + 2 H_kv) d_h] (one MatMul, the bias, then ``qk_norm`` on the q and k heads when the family has one)."""
        g, s = self.g, self.spec
        x = self.project(h, f"layers.{i}.qkv_proj")
        if f"layers.{i}.qkv_bias" in self.store.arrays:
            x = g.Add(x, f"layers.{i}.qkv_bias")
        heads = s.num_heads + 2 * s.num_kv_heads
        qk, v = g.op("Split", g.reshape(x, [0, heads, 1, s.head_dim]), g.i64(s.num_heads + s.num_kv_heads, s.num_kv_heads),
                     outputs=2, axis=1)
        normed = self.qk_norm(i, qk)
        if normed == qk:  # no q/k norm (Llama): the packed MatMul output as it is (_finish drops the dead Split)
            return x
        return g.reshape(g.concat(normed, v, axis=1), [0, 1, heads * s.head_dim])

    def group_query_attention(self, i: int, qkv: str, cos_cache: str, sin_cache: str, capacity: int,
                              per_head_lengths: bool) -> str:
        """Layer i's attention of one token per sequence in one com.microsoft ``GroupQueryAttention`` node: RoPE of q
        and k inside (``do_rotary``, absolute ``position_ids``), the new K/V written into the shared buffers at slot
        ``seqlens_k`` = the row's longest head's length, attention over that row's first seqlens_k + 1 entries only.

        qkv [B, 1, (H + 2 H_kv) d_h]; the buffers ``past_key_values.{i}.key`` / ``.value`` [B, H_kv, cap, d_h] are also
        the outputs ``present.{i}.key`` / ``.value`` (the runtime binds both to the same memory: the node then writes
        the new entry in place and copies nothing); ``past_key_values.{i}.lengths`` [B, H_kv] int32. Returns
        [B, 1, H*d_h].

        ``per_head_lengths``: heads of a row may hold different lengths (adakv-style sharing). Each head's entries
        [length_h, seqlens_k) then get an additive ``attention_bias`` [B, H, 1, cap] of -inf (0 elsewhere), so a head
        sees exactly its own entries and the new one, which the node wrote at slot seqlens_k of every head; the runtime
        then moves a shorter head's new entry to its own length (``OnnxRuntimeBackend.decode``), which keeps the
        buffer layout of the portable decode. ``total_sequence_length`` is the constant capacity: the bias keeps one
        shape and the kernel attends each row's own seqlens_k + 1 entries whatever it says."""
        g, s = self.g, self.spec
        past_k, past_v, past_len = (name(i) for name in graphs.PAST)
        longest = g.ReduceMax(past_len, g.i64(1), keepdims=1)  # [B, 1] int32: the write slot of every head
        seqlens = g.reshape(longest, [-1])
        bias = ""
        if per_head_lengths:
            slots = g.const(np.arange(capacity, dtype=np.int32), hint="slots")
            bias = self.holes(slots, past_len, g.unsqueeze(longest, 2))  # [B, H_kv, cap]
            bias = g.reshape(g.Expand(g.unsqueeze(bias, 2), g.i64(1, 1, s.group, 1)), [0, s.num_heads, 1, capacity])
        out, _, _ = g.op(
            "GroupQueryAttention", qkv, "", "", past_k, past_v, seqlens, g.const(np.int32(capacity), hint="total"),
            cos_cache, sin_cache, graphs.POSITION_IDS, bias, domain=ORT_DOMAIN,
            outputs=[g.fresh("attention"), graphs.present_key(i), graphs.present_value(i)],
            num_heads=s.num_heads, kv_num_heads=s.num_kv_heads, scale=1.0 / math.sqrt(s.head_dim), do_rotary=1,
            rotary_interleaved=0)
        return out

    def cast_decode_attention(self, q: str, k: str, v: str, past_k: str, past_v: str, past_len: str,
                              cast: bool = True) -> str:
        """``decode_attention`` over float16 buffers past_k, past_v [B, H_kv, cap, d_h] (the fp16-KV fused decode):
        only the first M = max(past_len) entries are sliced and cast to float32 (a shape from the lengths' values,
        which ONNX Runtime takes and TensorRT would not), then the portable masked attention over them in float32.
        q [B, H, 1, d_h], k, v [B, H_kv, 1, d_h] float32; returns [B, 1, H*d_h]. ``cast=False``: float32 buffers (the
        openvino decode), sliced only."""
        g, s = self.g, self.spec
        lengths = g.Cast(past_len, to=INT64)  # [B, H_kv]
        longest = g.reshape(g.ReduceMax(lengths, keepdims=1), [1])  # M
        keys = g.slice_axis(past_k, 0, longest, axis=2)  # [B, H_kv, M, d_h]
        values = g.slice_axis(past_v, 0, longest, axis=2)
        if cast:
            keys, values = g.Cast(keys, to=FLOAT), g.Cast(values, to=FLOAT)
        qg = g.reshape(g.Mul(q, self.scale), [0, s.num_kv_heads, s.group, s.head_dim])  # [B, H_kv, G, d_h], scaled
        past_scores = g.MatMul(qg, g.Transpose(keys, perm=[0, 1, 3, 2]))  # [B, H_kv, G, M]
        slots = g.Range(g.scalar(0), g.squeeze(longest, 0), g.scalar(1))
        visible = g.Less(slots, g.unsqueeze(lengths, 2, 3))  # [B, H_kv, 1, M]
        past_scores = g.Where(visible, past_scores, g.const(MASKED_SCORE, np.float32))
        own_score = g.MatMul(qg, g.Transpose(k, perm=[0, 1, 3, 2]))  # [B, H_kv, G, 1]
        probs = g.Softmax(g.concat(past_scores, own_score, axis=-1), axis=-1)
        p_past, p_own = g.op("Split", probs, g.concat(longest, g.i64(1)), outputs=2, axis=-1)
        attn = g.Add(g.MatMul(p_past, values), g.Mul(p_own, v))  # [B, H_kv, G, d_h]
        return g.reshape(attn, [0, 1, s.num_heads * s.head_dim])

    def decode_fused(self, buffer_capacities: list[int], max_positions: int, per_head_lengths: bool = True,
                     kv_dtype: str = "float32") -> onnx.ModelProto:
        """The ONNX-Runtime-only decode model ``decode_ort.onnx`` over the KV buffers of dtype ``kv_dtype``.

        float32: ``decode``'s inputs, its outputs ``present.{l}.key`` / ``.value`` [B, H_kv, cap_l, d_h] being the
        updated buffers themselves (bound to the inputs' memory). Per layer one ``GroupQueryAttention``
        (``group_query_attention``) instead of RoPE, the attention over the whole capacity and the runtime's KV write.
        ``max_positions``: positions 0 .. max_positions - 1 have RoPE caches (the engine's longest prompt + question +
        generation). ``per_head_lengths``: see ``group_query_attention`` (False for policies whose heads always hold
        equal lengths: no bias). Raises ValueError with the reason when ``fused_decode_refusal`` gives one.

        float16: the buffers and the ``present`` outputs (the new token's entries [B, H_kv, 1, d_h], stored by the
        runtime as the portable decode's) are float16; the portable RoPE and ``cast_decode_attention`` (ONNX Runtime's
        GroupQueryAttention over a float16 cache with float32 queries measured slower than the portable graph).

        Both: ``SkipSimplifiedLayerNormalization`` for every residual add and the norm after it."""
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype: {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
        reason = self.fused_decode_refusal() if kv_dtype == "float32" else None
        if reason:
            raise ValueError(f"no fused decode graph: {reason}")
        g = self._begin()
        s = self.spec
        kv_type = KV_DTYPES[kv_dtype]
        inputs = [value_info(graphs.INPUT_IDS, INT64, ["batch", 1]), value_info(graphs.POSITION_IDS, INT64, ["batch", 1])]
        outputs = [value_info(graphs.LOGITS, FLOAT, ["batch", s.vocab_size])]
        for i, cap in enumerate(buffer_capacities):
            inputs += self._past_inputs(i, cap, kv_type)
            present = cap if kv_dtype == "float32" else 1
            outputs += [value_info(name(i), kv_type, ["batch", s.num_kv_heads, present, s.head_dim])
                        for name in (graphs.present_key, graphs.present_value)]
        self.fused = True
        try:
            x = g.Gather("embed_tokens", graphs.INPUT_IDS, axis=0)  # [B, 1, d]
            if kv_dtype == "float32":
                cos_cache, sin_cache = self.rope_caches(max_positions)
                h = self.rms_norm(x, "layers.0.input_layernorm")
                for i in range(s.num_layers):
                    qkv = self.packed_qkv(i, h)
                    attn = self.group_query_attention(i, qkv, cos_cache, sin_cache, buffer_capacities[i], per_head_lengths)
                    x, h = self.add_rms_norm(x, self.output_projection(i, attn), f"layers.{i}.post_attention_layernorm")
                    following = f"layers.{i + 1}.input_layernorm" if i + 1 < s.num_layers else "norm"
                    x, h = self.add_rms_norm(x, self.mlp(i, h), following)
                self.head_logits(g.reshape(h, [-1, s.hidden_size]))
            else:
                def attention(i, q, k, v):
                    g.Cast(k, to=kv_type, outputs=[graphs.present_key(i)])
                    g.Cast(v, to=kv_type, outputs=[graphs.present_value(i)])
                    past_k, past_v, past_len = (name(i) for name in graphs.PAST)
                    return self.cast_decode_attention(q, k, v, past_k, past_v, past_len)

                cos, sin = self.rope_tables(graphs.POSITION_IDS)
                x = self.decoder_layers(x, cos, sin, attention, decode=True)
                self.logits(g.reshape(x, [-1, s.hidden_size]))
        finally:
            self.fused = False
        model = self._finish("criticalkv_decode_fused", inputs, outputs, [],
                             f"criticalkv fused decode (ONNX Runtime only: com.microsoft operators) over fixed-capacity "
                             f"per-head {kv_dtype} KV buffers")
        model.opset_import.append(helper.make_opsetid(ORT_DOMAIN, 1))
        return model

    # ------------------------------------------------------------------ the fused prompt graphs (ONNX Runtime only)
    def fused_prompt_qkv(self, i: int, h: str, cos_cache: str, sin_cache: str) -> tuple[str, str, str]:
        """Layer i's post-RoPE q [B, s, H*d_h], k [B, s, H_kv*d_h] and v [B, s, H_kv*d_h] of s tokens h [B, s, d], in the
        packed layout GroupQueryAttention reads (no transposes): one MatMul (+ bias), ``qk_norm`` of the q and k heads
        when the family has one, then one com.microsoft ``RotaryEmbedding`` over the q and k heads at ``position_ids``
        (its cos/sin caches from ``rope_caches``). GroupQueryAttention's own RoPE (``do_rotary``) is not used here: over
        a prompt without past it rotates the stored keys at positions 0..s-1 whatever ``position_ids`` says."""
        g, s = self.g, self.spec
        x = self.project(h, f"layers.{i}.qkv_proj")
        if f"layers.{i}.qkv_bias" in self.store.arrays:
            x = g.Add(x, f"layers.{i}.qkv_bias")
        qk_heads = s.num_heads + s.num_kv_heads
        qk, v = g.op("Split", x, g.i64(qk_heads * s.head_dim, s.num_kv_heads * s.head_dim), outputs=2, axis=-1)
        heads = g.Transpose(g.reshape(qk, [0, 0, qk_heads, s.head_dim]), perm=[0, 2, 1, 3])  # [B, H + H_kv, s, d_h]
        normed = self.qk_norm(i, heads)
        if normed != heads:  # Qwen3: the per-head norm, back to the packed layout (else _finish drops the Transpose)
            qk = g.reshape(g.Transpose(normed, perm=[0, 2, 1, 3]), [0, 0, qk_heads * s.head_dim])
        qk = g.op("RotaryEmbedding", qk, graphs.POSITION_IDS, cos_cache, sin_cache, domain=ORT_DOMAIN, interleaved=0,
                  num_heads=qk_heads)
        q, k = g.op("Split", qk, g.i64(s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim), outputs=2, axis=-1)
        return q, k, v

    def window_rows(self, q: str, window: int, output: str | None = None) -> str:
        """The last min(window, s) queries of q [B, s, H*d_h] as the selection node reads them: [B, H, w, d_h]."""
        g, s = self.g, self.spec
        last = g.reshape(g.slice_axis(q, -window, _INT64_MAX, axis=1), [0, 0, s.num_heads, s.head_dim])
        return g.op("Transpose", last, perm=[0, 2, 1, 3], outputs=[output] if output else 1)

    def prompt_attention(self, i: int, q: str, k: str, v: str, seqlens: str, total: str, in_place: bool = False,
                         probs: bool = False, bias: str = "") -> tuple:
        """Causal attention of s tokens in one com.microsoft ``GroupQueryAttention`` node (no Loop; ONNX Runtime's CPU
        kernel holds no s x s scores per head: a 4k-token prompt measured 33 MiB of working memory for 9 heads).

        q [B, s, H*d_h], k, v [B, s, H_kv*d_h] post-RoPE (``fused_prompt_qkv``); ``seqlens`` [B] int32 = each row's
        index of its last key, ``total`` the int32 scalar max(seqlens) + 1. Without ``in_place`` (a prompt): returns
        (attention [B, s, H*d_h], K, V [B, H_kv, s, d_h]). ``in_place`` (an extend of one sequence): the keys and values
        before the new ones are the buffers ``past_key_values.{i}.key`` / ``.value`` [1, H_kv, cap, d_h], whose
        ``seqlens + 1 - s`` first entries are held; the node writes the new entries after them into its outputs
        ``present.{i}.key`` / ``.value``, which the runtime binds to the same memory (ONNX Runtime takes several new
        tokens over a past for batch 1 only); returns (attention, the two output names). ``probs``: the node also
        returns its attention probabilities [B, H, s, total] (``qk_output=2``: after the softmax over every key the
        query sees, 0 for the later keys), a fourth output (the fused re-read graph's scores read them). ``bias``: the
        node's additive ``attention_bias`` [B, H, s, total] (``head_holes_bias``), none when empty."""
        g, s = self.g, self.spec
        if in_place:
            past = (graphs.past_key(i), graphs.past_value(i))
            names = [graphs.present_key(i), graphs.present_value(i)]
        else:
            past, names = ("", ""), [g.fresh("prompt_key"), g.fresh("prompt_value")]
        extra = {"qk_output": 2} if probs else {}
        tail = ("", "", "", bias) if bias else ()  # cos_cache, sin_cache, position_ids: RoPE ran before the node
        return g.op(
            "GroupQueryAttention", q, k, v, *past, seqlens, total, *tail, domain=ORT_DOMAIN,
            outputs=[g.fresh("attention"), *names] + ([g.fresh("probs")] if probs else []), num_heads=s.num_heads,
            kv_num_heads=s.num_kv_heads, scale=1.0 / math.sqrt(s.head_dim), do_rotary=0, **extra)

    def _fused_prompt_layers(self, max_positions: int, layer_attention, after_layer, layer_input=None) -> str:
        """Every decoder layer of the fused prompt graphs over ``input_ids``; returns the last token's logits' name.
        ``layer_attention(i, q, k, v)`` -> the attention [B, s, H*d_h]; ``after_layer(i, q)`` adds a layer's outputs;
        ``layer_input(i, h)`` reads a layer's attention input (after ``input_layernorm``)."""
        g, s = self.g, self.spec
        cos_cache, sin_cache = self.rope_caches(max_positions)
        x = g.Gather("embed_tokens", graphs.INPUT_IDS, axis=0)  # [B, s, d]
        h = self.rms_norm(x, "layers.0.input_layernorm")
        for i in range(s.num_layers):
            if layer_input is not None:
                layer_input(i, h)
            q, k, v = self.fused_prompt_qkv(i, h, cos_cache, sin_cache)
            attn = layer_attention(i, q, k, v)
            after_layer(i, q)
            x, h = self.add_rms_norm(x, self.output_projection(i, attn), f"layers.{i}.post_attention_layernorm")
            delta = self.mlp(i, h)
            if i + 1 < s.num_layers:
                x, h = self.add_rms_norm(x, delta, f"layers.{i + 1}.input_layernorm")

        def last(t):
            return g.reshape(g.slice_axis(t, -1, _INT64_MAX, axis=1), [-1, s.hidden_size])

        _, normed = self.add_rms_norm(last(x), last(delta), "norm")  # only the last token's final norm
        return self.head_logits(normed)

    def _fused_model(self, name: str, inputs: list, outputs: list, functions: list, doc: str) -> onnx.ModelProto:
        model = self._finish(name, inputs, outputs, functions, doc)
        model.opset_import.append(helper.make_opsetid(ORT_DOMAIN, 1))
        return model

    def prefill_fused(self, max_positions: int) -> onnx.ModelProto:
        """``prefill_ort.onnx``, the ONNX-Runtime-only prefill of prompts WITHOUT padding (``attention_mask`` all ones;
        the runtime prefills a left-padded batch of different lengths one group of equal lengths at a time).

        prefill.onnx's inputs and outputs. Per layer: ``fused_prompt_qkv``, one causal ``prompt_attention`` over the
        whole prompt (no query-block Loop), whose K, V [B, H_kv, n, d_h] and the last ``window`` rows of q are the
        selection node's inputs, as in prefill.onnx (same node, same function body); ``SkipSimplifiedLayerNormalization``
        for every residual add and the norm after it; the projections in the engine's weight format (``project``).
        ``max_positions``: RoPE caches for positions 0 .. max_positions - 1. Raises ValueError with the reason when
        ``fused_decode_refusal`` gives one (the same GroupQueryAttention kernel)."""
        model_level = self._selection_kind("prefill")
        reason = self.fused_decode_refusal()
        if reason:
            raise ValueError(f"no fused prefill graph: {reason}")
        policy, s = self.policy, self.spec
        pending = []
        g = self._begin()
        prompt_lengths = g.Cast(g.ReduceSum(graphs.ATTENTION_MASK, g.i64(1), keepdims=0), to=INT32, hint="prompt_lengths")
        kv_budget = g.Cast(graphs.KV_BUDGET, to=INT32, hint="kv_budget_int32")
        one = g.const(np.int32(1), hint="one")
        seqlens = g.Sub(prompt_lengths, one)  # [B]: the index of each row's last key
        total = g.Cast(g.squeeze(g.shape_of(graphs.INPUT_IDS, 1, 2), 0), to=INT32)  # n
        outputs = [value_info(graphs.LOGITS, FLOAT, ["batch", s.vocab_size])]
        kv = {}

        def attention(i, q, k, v):
            out, kv["key"], kv["value"] = self.prompt_attention(i, q, k, v, seqlens, total)
            return out

        def select(i, q):
            outputs.extend(self.select_layer(i, self.window_rows(q, policy.window), kv["key"], kv["value"],
                                             prompt_lengths, kv_budget, pending, model_level))

        self.fused = True
        try:
            self._fused_prompt_layers(max_positions, attention, select)
        finally:
            self.fused = False
        if model_level:
            self.select_model(pending, prompt_lengths, kv_budget)
        inputs = [value_info(name, INT64, ["batch", "sequence"]) for name in (graphs.INPUT_IDS, graphs.ATTENTION_MASK, graphs.POSITION_IDS)]
        inputs.append(value_info(graphs.KV_BUDGET, INT64, [1]))
        return self._fused_model("criticalkv_prefill_fused", inputs, outputs, self.selection_functions(model_level),
                                 f"criticalkv fused prefill (ONNX Runtime only: com.microsoft operators; prompts without "
                                 f"padding), policy {policy.to_json()}")

    @property
    def streams(self) -> tuple[str, ...]:
        """The streams whose weights the engine holds (``add_stream``): its extend graphs (onnxruntime flavour) return
        each as ``present.{l}.stream.{name}`` (``criticalkv.graphs.present_stream``)."""
        if self.store is None:
            return ()
        return tuple(sorted(name[len("stream."):-len(".0.weight")] for name in self.store.arrays
                            if name.startswith("stream.") and name.endswith(".0.weight")))

    def stream_scores(self, i: int, h: str) -> None:
        """Every stream of layer i: ``present.{i}.stream.{name}`` [B, H_kv, N] = exp(h W + b) of the new entries from
        their attention input h [B, N, d] (``criticalkv.methods.phases.Stream``)."""
        for name in self.streams:
            self.stream_of(name, i, h, graphs.present_stream(i, name))

    def stream_of(self, name: str, i: int, h: str, output: str | None = None) -> str:
        """Stream ``name`` of layer i: [B, H_kv, N] = exp(h W + b) from the attention input h [B, N, d]."""
        g = self.g
        z = g.op("Add", g.op("MatMul", h, stream_weight(name, i)), stream_bias(name, i))  # [B, N, H_kv]
        named = {"outputs": [output]} if output else {"hint": f"stream_{i}"}
        return g.op("Transpose", g.op("Exp", z), perm=[0, 2, 1], **named)

    def graph_scores(self, i: int, h: str) -> str:
        """Layer i's scores [B, H_kv, n] of every entry from its attention input h [B, n, d], as the selection's
        ``scores`` input (the prefill's tensorrt flavour): the stream the policy's method names (``graph_stream``,
        ``stream_of``), which may differ from what its scoring phase makes of it on an engine (``PromptScoring.finish``:
        e.g. entries of the chat template's opening zeroed, which the graph cannot tell apart)."""
        policy = self.policy
        stream = policy.method.base.graph_stream(policy)
        if stream is None:
            raise ValueError(f"{policy.name}: no TensorRT flavour: {policy.method.base.graph_refusal(policy)}")
        if stream not in self.streams:
            raise ValueError(f"{policy.name}: the export holds no weights of its stream {stream!r} (the build "
                             "adds them from the model's: the method's streams)")
        return self.stream_of(stream, i, h)

    def _stream_outputs(self, i: int, batch) -> list:
        return [value_info(graphs.present_stream(i, name), FLOAT, [batch, self.spec.num_kv_heads, "new_tokens"])
                for name in self.streams]

    def reread_scores_fused(self, probs: str, held: str) -> str:
        """A re-read pass's scores of one layer (``criticalkv.methods.phases.RereadPass``) from the fused extend's
        attention probabilities ``probs`` [1, H, N, T] (every new query's softmax over the T = P + N keys it may see,
        ``prompt_attention(probs=True)``) over a past of P = ``held`` (int32 [1]) entries: [1, H_kv, P], the entries
        [start, end) of ``score_range`` scored as ``reread_block_scores`` scores them (the same math, no query blocks),
        every other past entry 0 (the runtime reads [start, end) only).

        The pass's softmax runs over the keys < sinks, in [start, end) and >= n; the node's softmax over all of them,
        so the score is probs / mass, mass = the probability of those keys, summed over the three ranges (not 1 - the
        rest: a query that looks mostly outside the range has a mass near 0, where that difference loses its digits).
        The division and the maxima run over the range's columns only."""
        g, s = self.g, self.spec
        sinks, start, end, context = (g.slice_axis(graphs.SCORE_RANGE, j, j + 1, axis=0) for j in range(4))
        chunk = g.slice_axis(probs, start, end, axis=3)  # [1, H, N, end - start]
        seen = [g.ReduceSum(x, g.i64(3), keepdims=1)
                for x in (g.slice_axis(probs, 0, sinks, axis=3), chunk, g.slice_axis(probs, context, _INT64_MAX, axis=3))]
        chunk = g.Div(chunk, g.Add(g.Add(seen[0], seen[1]), seen[2]))  # [1, H, N, end - start]
        best = g.ReduceMax(g.reshape(g.ReduceMax(chunk, g.i64(2), keepdims=0), [0, s.num_kv_heads, s.group, -1]),
                           g.i64(2), keepdims=0)  # [1, H_kv, end - start]
        after = g.Sub(g.Cast(held, to=INT64), end)
        return g.Pad(best, g.concat(g.i64(0, 0), start, g.i64(0, 0), after), mode="constant")

    def holes(self, slots: str, lengths: str, longest: str) -> str:
        """-inf on each head's slots [length_h, longest), 0 elsewhere: [B, H_kv, T] float32 from ``slots`` [T], the
        heads' ``lengths`` [B, H_kv] and ``longest`` broadcast against [B, H_kv, T] (the slot where the attention node
        writes every head's new entries: the fused decode's and ``head_holes_bias``'s masks)."""
        g = self.g
        hole = g.And(g.GreaterOrEqual(slots, g.unsqueeze(lengths, 2)), g.Less(slots, longest))
        return g.Where(hole, g.const(-np.inf, np.float32), g.const(0.0, np.float32))

    def head_holes_bias(self, lengths: str, longest: str, total: str) -> str:
        """The additive attention bias [1, H, N, total] of an extend whose KV heads hold different lengths: -inf on each
        head's slots [length_h, longest) (the hole between its entries and the new ones, which the node writes at slot
        ``longest`` of every head), 0 elsewhere; the same for the G query heads of a KV head and for every new token.
        lengths [1, H_kv] int32, longest [1] int32, total the int32 scalar longest + N."""
        g, s = self.g, self.spec
        slots = g.Range(g.scalar(0, np.int32), total, g.scalar(1, np.int32))  # [T]
        bias = self.holes(slots, lengths, longest)  # [1, H_kv, T]
        new_tokens = g.shape_of(graphs.INPUT_IDS, 1, 2)  # [1] int64: N
        every = g.Expand(g.unsqueeze(bias, 2, 3), g.concat(g.i64(1, 1, s.group), new_tokens, g.i64(1)))  # [1, H_kv, G, N, T]
        return g.reshape(every, g.concat(g.i64(1, s.num_heads), new_tokens, g.reshape(g.Cast(total, to=INT64), [1])))

    def extend_fused(self, max_positions: int, score: bool = False, per_head_lengths: bool = False) -> onnx.ModelProto:
        """``extend_ort.onnx``, the ONNX-Runtime-only extend of ONE sequence whose KV heads hold equal lengths in each
        layer (a prompt's prefill buffer in a chunked prefill, a slot of a policy that keeps equal lengths); the runtime
        runs extend.onnx for anything else.

        ``per_head_lengths`` (``extend_heads_ort.onnx``): the heads of a layer may hold different lengths (a slot of a
        policy that shares its budget across heads, e.g. a cached context of the default context policy). The node
        writes the N new entries at slots [longest, longest + N) of every head, longest the layer's longest head, and
        ``head_holes_bias`` hides each shorter head's slots [length_h, longest); the runtime then moves a shorter head's
        new entries down to its own length (``OnnxRuntimeBackend.extend``), which keeps the buffer layout of extend.onnx.
        The bias costs N x (longest + N) floats per query head and layer, so the equal-length graph stays for prompts.

        extend's inputs (batch 1). Outputs: ``logits`` and ``present.{l}.window_queries`` as extend's;
        ``present.{l}.key`` / ``.value`` [1, H_kv, cap_l, d_h] are the buffers themselves, bound to the past inputs'
        memory: ``prompt_attention`` (in place) writes the N new entries at slots [length, length + N) of every head. The
        runtime then adds N to the lengths.

        ``score`` (``reread_ort.onnx``, a method's re-read pass on the fused graph): also takes ``score_range`` and
        returns ``present.{l}.scores`` [1, H_kv, P] as the re-read graph (``extend(score=True)``) does for the scored
        entries (``reread_scores_fused``): GroupQueryAttention returns its probabilities."""
        window = self._window("extend")
        reason = self.fused_decode_refusal()
        if reason:
            raise ValueError(f"no fused extend graph: {reason}")
        if score and per_head_lengths:
            raise ValueError("the fused re-read runs over a prompt's buffer, whose heads hold equal lengths")
        s = self.spec
        streams = bool(self.streams) and not score
        g = self._begin()
        one = g.const(np.int32(1), hint="one")
        new_tokens = g.Cast(g.shape_of(graphs.INPUT_IDS, 1, 2), to=INT32)  # [1] N
        inputs = [value_info(name, INT64, [1, "new_tokens"]) for name in (graphs.INPUT_IDS, graphs.POSITION_IDS)]
        outputs = [value_info(graphs.LOGITS, FLOAT, [1, s.vocab_size])]
        for i in range(s.num_layers):
            inputs += self._past_inputs(i, f"capacity_{i}")
            outputs += [value_info(name(i), FLOAT, [1, s.num_kv_heads, f"capacity_{i}", s.head_dim])
                        for name in (graphs.present_key, graphs.present_value)]
            outputs.append(value_info(graphs.present_window_queries(i), FLOAT, [1, s.num_heads, "window_tokens", s.head_dim]))
            if score:
                outputs.append(value_info(graphs.present_scores(i), FLOAT, [1, s.num_kv_heads, "past_tokens"]))
            elif streams:
                outputs += self._stream_outputs(i, 1)
        for value in inputs[2:]:
            value.type.tensor_type.shape.dim[0].dim_value = 1  # batch 1: the past inputs too
        if score:
            inputs.insert(2, value_info(graphs.SCORE_RANGE, INT64, [4]))

        def attention(i, q, k, v):
            lengths = graphs.past_lengths(i)  # [1, H_kv]
            if per_head_lengths:  # [1]: the longest head's, where the node writes
                held = g.reshape(g.ReduceMax(lengths, g.i64(1), keepdims=0), [-1])
            else:
                held = g.reshape(g.slice_axis(lengths, 0, 1, axis=1), [-1])  # [1]: every head's
            seqlens = g.Sub(g.Add(held, new_tokens), one)
            total = g.squeeze(g.Add(seqlens, one), 0)
            bias = self.head_holes_bias(lengths, held, total) if per_head_lengths else ""
            out = self.prompt_attention(i, q, k, v, seqlens, total, in_place=True, probs=score, bias=bias)
            if score:
                g.op("Identity", self.reread_scores_fused(out[3], held), outputs=[graphs.present_scores(i)])
            return out[0]

        def window_queries(i, q):  # post-RoPE, unscaled: the selection node's queries input
            self.window_rows(q, window, output=graphs.present_window_queries(i))

        self.fused = True
        try:
            self._fused_prompt_layers(max_positions, attention, window_queries, self.stream_scores if streams else None)
        finally:
            self.fused = False
        if score:
            return self._fused_model("criticalkv_reread_fused", inputs, outputs, [],
                                     "criticalkv fused re-read (ONNX Runtime only): the fused extend + the scores of a "
                                     "re-read pass")
        return self._fused_model("criticalkv_extend_fused", inputs, outputs, [],
                                 "criticalkv fused extend (ONNX Runtime only: com.microsoft operators): new tokens of one "
                                 "sequence written into its KV buffers in place" +
                                 ("; its heads may hold different lengths" if per_head_lengths else ""))

    def extend(self, score: bool = False) -> onnx.ModelProto:
        """The extend model: N new tokens per sequence over per-head KV buffers of any capacity (module docstring).

        Chunked prefill: a prompt extended in chunks that are multiples of ``attention_chunk`` from an empty buffer
        gives bitwise the prefill's K/V and last logits on ONNX Runtime (``blocked_attention``).

        ``score`` (the re-read graph, onnxruntime flavour): a method's re-read passes run through it
        (``criticalkv.methods.phases.RereadPass``: the new tokens over the prompt's buffer); it takes ``score_range``
        [4] int64 = (sinks, start, end, n): the past entries a pass query's score softmax sees are those < sinks, in
        [start, end) and >= n (the pass's own earlier tokens), and returns per layer ``present.{l}.scores``
        [B, H_kv, P] (P = the past's longest head): every past entry's largest score over the new queries and the
        group's heads (kvzip's ``chunk_scores`` is the PyTorch form), the rest as extend's."""
        window = self._window("extend")
        if score and self.flavour != "onnxruntime":
            raise ValueError("the re-read graph (extend with the past entries' scores) has the onnxruntime flavour only")
        streams = bool(self.streams) and not score and self.flavour != "tensorrt"
        g = self._begin()
        s = self.spec
        new_tokens = g.shape_of(graphs.INPUT_IDS, 1, 2)  # N
        if self.flavour == "onnxruntime":
            ctx = self._block_context(new_tokens)
        else:
            ctx = {"queries": new_tokens}
        inputs = [value_info(name, INT64, ["batch", "new_tokens"]) for name in (graphs.INPUT_IDS, graphs.POSITION_IDS)]
        outputs = [value_info(graphs.LOGITS, FLOAT, ["batch", s.vocab_size])]
        if score:
            inputs.append(value_info(graphs.SCORE_RANGE, INT64, [4]))
            ctx.update(score_range=graphs.SCORE_RANGE, layer_scores=[])
        for i in range(s.num_layers):
            inputs += self._past_inputs(i, f"capacity_{i}")
            outputs += [value_info(name(i), FLOAT, ["batch", s.num_kv_heads, "new_tokens", s.head_dim])
                        for name in (graphs.present_key, graphs.present_value)]
            outputs.append(value_info(graphs.present_window_queries(i), FLOAT,
                                      ["batch", s.num_heads, "window_tokens", s.head_dim]))
            if score:
                outputs.append(value_info(graphs.present_scores(i), FLOAT, ["batch", s.num_kv_heads, "past_tokens"]))
            elif streams:
                outputs += self._stream_outputs(i, "batch")

        def attention(i, q, k, v):
            past_k, past_v, past_len = (name(i) for name in graphs.PAST)
            return self.extend_attention(q, k, v, past_k, past_v, past_len, ctx)

        def window_queries(i, q, k, v):  # post-RoPE, unscaled: the selection node's queries input
            g.op("Slice", q, g.i64(-window), g.i64(_INT64_MAX), g.i64(2), outputs=[graphs.present_window_queries(i)])

        cos, sin = self.rope_tables(graphs.POSITION_IDS)
        x = g.Gather("embed_tokens", graphs.INPUT_IDS, axis=0)  # [B, N, d]
        x = self.decoder_layers(x, cos, sin, attention, window_queries, present_kv=True,
                                transposed_gemm=self.flavour != "onnxruntime",
                                layer_input=self.stream_scores if streams else None)
        self.last_logits(x)
        if score:
            for i, layer_scores in enumerate(ctx["layer_scores"]):
                g.op("Identity", layer_scores, outputs=[graphs.present_scores(i)])
            return self._finish("criticalkv_reread", inputs, outputs, [],
                                "criticalkv re-read (onnxruntime flavour): extend + the scores of a re-read pass")
        return self._finish("criticalkv_extend", inputs, outputs, [],
                            f"criticalkv extend ({self.flavour} flavour): new tokens over per-head KV buffers")

    def select(self) -> onnx.ModelProto:
        """The select model: each layer's selection of a prompt of n tokens held in the first n entries of every head
        of a buffer (module docstring); the prefill's ``present.*`` outputs, same nodes and attributes."""
        model_level = self._selection_kind("select")
        policy, s = self.policy, self.spec
        g = self._begin()
        kv_budget = g.Cast(graphs.KV_BUDGET, to=INT32, hint="kv_budget_int32")
        inputs, outputs, pending, first_lengths = [], [], [], None
        for i in range(s.num_layers):
            past_k, past_v, past_len = (name(i) for name in graphs.PAST)
            queries = graphs.window_queries(i)
            inputs.append(value_info(queries, FLOAT, ["batch", s.num_heads, "window_tokens", s.head_dim]))
            prompt_lengths = g.reshape(g.slice_axis(past_len, 0, 1, axis=1), [-1])  # [B] int32: every head holds n
            first_lengths = first_lengths or prompt_lengths
            if self.flavour == "tensorrt":  # buffers of exactly n entries: no data-dependent shape for TensorRT
                inputs += self._past_inputs(i, "prompt_tokens")
                keys, values = past_k, past_v
            else:
                inputs += self._past_inputs(i, f"capacity_{i}")
                n = g.reshape(g.ReduceMax(g.Cast(past_len, to=INT64), keepdims=1), [1])
                keys, values = g.slice_axis(past_k, 0, n, axis=2), g.slice_axis(past_v, 0, n, axis=2)  # [B, H_kv, n, d_h]
            scores = None
            if policy.method.base.external_scores:  # the phases' scores (or none)
                scores = graphs.scores(i)
                inputs.append(value_info(scores, FLOAT, ["batch", s.num_kv_heads, "scored_tokens"]))
            outputs += self.select_layer(i, queries, keys, values, prompt_lengths, kv_budget, pending, model_level,
                                         scores)
        if model_level:
            self.select_model(pending, first_lengths, kv_budget)
        inputs.append(value_info(graphs.KV_BUDGET, INT64, [1]))
        return self._finish("criticalkv_select", inputs, outputs, self.selection_functions(model_level),
                            f"criticalkv select ({self.flavour} flavour), policy {policy.to_json()}")


class Qwen3GraphBuilder(DecoderGraphBuilder):
    """Qwen3 dense: Llama's graph with a per-head RMSNorm of the queries and keys before RoPE (``q_norm`` / ``k_norm``
    of ``Qwen3Attention``). The kept keys are post-norm, post-RoPE, as the PyTorch path's cache holds them."""

    def qk_norm(self, i: int, qk: str) -> str:
        # the portable RMSNorm over d_h with one weight row per head (a fused form's norm takes one [d] weight)
        return DecoderGraphBuilder.rms_norm(self, qk, f"layers.{i}.qk_norm")


#: Graph builders of the model families that differ from Llama's graph, by ``ModelSpec.model_type``.
FAMILY_BUILDERS: dict[str, type[DecoderGraphBuilder]] = {"qwen3": Qwen3GraphBuilder}


def graph_builder(spec: ModelSpec, store: WeightStore, policy: KVPolicy | None = None, capacities: list[int] | None = None,
                  flavour: str = "onnxruntime", attention_chunk: int = 256) -> DecoderGraphBuilder:
    """The graph builder of ``spec``'s family (``FAMILY_BUILDERS``; Llama's by default)."""
    cls = FAMILY_BUILDERS.get(spec.model_type, DecoderGraphBuilder)
    return cls(spec, store, policy, capacities, flavour, attention_chunk)


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
    return graph_builder(spec, store, policy, capacities, flavour, attention_chunk).prefill()


def build_decode(spec: ModelSpec, store: WeightStore, buffer_capacities: list[int]) -> onnx.ModelProto:
    """The decode model (one token per sequence) over fixed-capacity per-head KV buffers."""
    return graph_builder(spec, store).decode(buffer_capacities)


def build_extend(spec: ModelSpec, store: WeightStore, policy: KVPolicy, attention_chunk: int = 256,
                 flavour: str = "onnxruntime") -> onnx.ModelProto:
    """The extend model (N new tokens over per-head KV buffers); ``policy`` gives the window of its queries output."""
    return graph_builder(spec, store, policy, None, flavour, attention_chunk).extend()


def build_select(spec: ModelSpec, store: WeightStore, policy: KVPolicy, capacities: list[int],
                 flavour: str = "onnxruntime") -> onnx.ModelProto:
    """The select model (the selection of a prompt held in full-size buffers, the chunked prefill's last step)."""
    return graph_builder(spec, store, policy, capacities, flavour).select()


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
