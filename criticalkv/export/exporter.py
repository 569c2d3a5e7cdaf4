"""``export_model``: a transformers Llama-family model -> prefill / decode / extend / select ONNX graphs + shared weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import onnx

from criticalkv.export.config import (  # noqa: F401 (re-exported: the build's names live in the light config module)
    DEFAULT_CONTEXT_POLICY,
    EXPORT_DTYPES,
    WEIGHT_FORMATS,
    BuildConfig,
)
from criticalkv.export.graph import IR_VERSION, OPSET
from criticalkv.export.decoder import (
    ModelSpec,
    add_stream,
    collect_weights,
    graph_builder,
    layer_capacities,
    model_spec,
)
from criticalkv.export.model_select import tensorrt_refusal
from criticalkv.export.openvino_rules import check_openvino_model, describe, openvino_refusal
from criticalkv.export.quantize import quantize_store
from criticalkv.graphs import FILES
from criticalkv.methods.phases import REREAD_PROMPT_ROOM, BuildPhases
from criticalkv.node import DOMAIN, OPSET_VERSION
from criticalkv.policy import KVPolicy
from criticalkv.weights import WEIGHTS_FILE

PREFILL_FILE = FILES["prefill"]
PREFILL_TENSORRT_FILE = FILES["prefill_tensorrt"]
DECODE_FILE = FILES["decode"]
#: The ONNX-Runtime-only decode graph (com.microsoft GroupQueryAttention, SkipSimplifiedLayerNormalization): written
#: beside decode.onnx, which stays the portable graph TensorRT parses
DECODE_ORT_FILE = FILES["decode_ort"]
#: The ONNX-Runtime-only prompt graphs (GroupQueryAttention over the prompt, no Loop; the fused norms; the engine's weight
#: format): written beside prefill.onnx and extend.onnx, which stay the portable graphs
PREFILL_ORT_FILE = FILES["prefill_ort"]
EXTEND_ORT_FILE = FILES["extend_ort"]
EXTEND_HEADS_ORT_FILE = FILES["extend_heads_ort"]
EXTEND_FILE = FILES["extend"]
EXTEND_TENSORRT_FILE = FILES["extend_tensorrt"]
SELECT_FILE = FILES["select"]
SELECT_TENSORRT_FILE = FILES["select_tensorrt"]
#: The select graph of the engine's context policy (``export_model(context_policy=...)``), when it is not the engine's
SELECT_CONTEXT_FILE = FILES["select_context"]
#: The extend graph that scores the past entries (``DecoderGraphBuilder.extend(score=True)``), for an engine whose policy
#: or context policy re-reads prompts (``criticalkv.methods.phases.RereadPass``)
REREAD_FILE = FILES["reread"]
#: The same on the fused extend graph (``DecoderGraphBuilder.extend_fused(score=True)``: ONNX Runtime only,
#: GroupQueryAttention's probabilities), beside the fused prompt graphs when the re-read graph is written
REREAD_ORT_FILE = FILES["reread_ort"]
#: The openvino flavour (the selection bodies inlined, attention without a Loop, standard operators only:
#: ``criticalkv.export.openvino_rules``), by graph
OPENVINO_FILES = {"prefill": FILES["prefill_openvino"], "extend": FILES["extend_openvino"],
                  "select": FILES["select_openvino"], "decode": FILES["decode_openvino"]}
SELECT_CONTEXT_OPENVINO_FILE = FILES["select_context_openvino"]
TOKENIZER_DIR = "tokenizer"
@dataclass
class ExportResult:
    """What ``export_model`` wrote into the folder, and the shapes the runtime needs."""

    folder: Path
    spec: ModelSpec
    policy: KVPolicy
    config: BuildConfig
    prefill_capacities: list[int]
    decode_capacities: list[int]
    weights_bytes: int
    #: the fused decode graph: {"file", "per_head_lengths", "max_positions"}, or {"file": None, "refused": why}
    fused_decode: dict | None = None
    #: the fused prompt graphs: {"prefill", "extend", "max_positions"} files, or {"prefill": None, "refused": why}
    fused_prompt: dict | None = None
    #: the weight setting of the fused graphs (``quantize_store``): {"format", ...}
    weights: dict | None = None
    #: the policy contexts are compressed with (the serving context cache) and its per-layer selection capacities
    context_policy: KVPolicy | None = None
    context_capacities: list[int] | None = None
    #: what the policies' methods need beyond their layers (``criticalkv.methods.phases``): the streams whose weights
    #: the engine holds, whether it re-reads prompts, the methods' data for the manifest
    phases: BuildPhases = field(default_factory=BuildPhases)
    #: the openvino flavour: {"prefill", "extend", "select", "select_context"} files, or {"prefill": None, "refused": why}
    openvino: dict | None = None

    def shapes(self) -> dict:
        shapes = {
            "prefill_capacity": self.prefill_capacities,
            "decode_capacity": self.decode_capacities,
            "kv_buffer_bytes": kv_buffer_bytes(self.spec, self.decode_capacities, self.config.max_batch_size,
                                               self.config.kv_dtype),
        }
        if self.context_capacities is not None:
            shapes["context_capacity"] = self.context_capacities
        return shapes


def build_phases(model, tokenizer, *policies: KVPolicy | None) -> BuildPhases:
    """What an engine for ``policies`` (its own and its context policy) needs of their methods' phases: each method
    scored apart (``Method.scored_apart``) declares its streams (their weights found for ``model``), whether it
    re-reads prompts and its data (``BaseMethod.streams``, ``rereads``, ``engine_data``); ValueError from a method
    whose model lacks what it needs (a surrogate-scored kvzip policy without the model's surrogate)."""
    phases = BuildPhases()
    for policy in policies:
        if policy is None or not policy.method.scored_apart:
            continue
        base = policy.method.base
        phases = phases.merged(BuildPhases(base.streams(policy, model), base.rereads(policy), base.data_key,
                                           base.engine_data(policy, model, tokenizer)))
    return phases


def kv_buffer_bytes(spec: ModelSpec, decode_capacities: list[int], batch: int, kv_dtype: str = "float32") -> int:
    """Bytes of the ONNX Runtime K and V decode buffers (``kv_dtype``) for ``batch`` sequences."""
    element = 2 if kv_dtype == "float16" else 4
    return 2 * batch * spec.num_kv_heads * spec.head_dim * element * sum(decode_capacities)


def check_model_limits(model, spec: ModelSpec, config: BuildConfig) -> None:
    # a question after a context counts in max_input_len (they are one prompt): positions stay below this total
    total = config.max_input_len + config.max_new_tokens
    what = "max_input_len + max_new_tokens"
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and total > limit:
        raise ValueError(f"{what} = {total} exceeds the model's max_position_embeddings ({limit})")
    if spec.sliding_window is not None and total > spec.sliding_window:
        raise ValueError(f"{what} = {total} exceeds the model's sliding window ({spec.sliding_window}); "
                         "sliding-window attention is not exported")


def export_model(model, policy: KVPolicy, folder: str | Path, config: BuildConfig | None = None, tokenizer=None,
                 context_policy: KVPolicy | None = None) -> ExportResult:
    """Write into ``folder``: ``weights.bin`` (shared by every graph), ``prefill.onnx`` (selection nodes + their
    function body), ``decode.onnx`` (portable: the graph TensorRT parses), ``decode_ort.onnx`` (the fused decode ONNX
    Runtime runs, unless the model refuses it: ``ExportResult.fused_decode`` says why), ``extend.onnx`` and
    ``select.onnx`` (the chunked prefill's chunks and its last step), their TensorRT flavours ``prefill_tensorrt.onnx``, ``extend_tensorrt.onnx`` and ``select_tensorrt.onnx``
    (nodes without body for the plugin, attention without a Loop; none for a model-level policy), and the tokenizer.

    ``model``: a transformers Llama / Mistral / Qwen2 causal LM (fp32 weights are exported).
    The folder should be a fresh temporary directory (``build_engine`` renames it into place).

    ``context_policy``: the policy the serving context cache compresses contexts with (question-agnostic), when it is
    not ``policy``: its select graph ``select_context.onnx`` (ONNX Runtime flavour) is written too, and the decode
    buffers hold the larger of the two policies' selections. A policy whose method scores prompts apart
    (``criticalkv.methods.phases``, engine's or context's) adds its streams to the extend graphs (their weights to
    ``weights.bin``) and, when it re-reads prompts, ``reread.onnx`` (the extend graph that scores the past entries).
    """
    config = config or BuildConfig()
    folder = Path(folder)
    spec = model_spec(model)
    check_model_limits(model, spec, config)
    if context_policy is not None and context_policy == policy:
        context_policy = None

    folder.mkdir(parents=True, exist_ok=True)
    store = collect_weights(model, spec)
    decode_builder = graph_builder(spec, store, policy)
    refusal = decode_builder.fused_decode_refusal()
    if config.weights != "fp32" and refusal:
        raise ValueError(f"weights {config.weights}: the lower-precision weights live in the fused ONNX Runtime graphs, "
                         f"which this model cannot have ({refusal}); build it with weights fp32")
    weights = quantize_store(store, spec, config.weights)
    phases = build_phases(model, tokenizer, policy, context_policy)
    for stream in phases.streams:  # returned by the extend graphs, no extra pass
        add_stream(store, stream, spec)
    store.write(folder)
    capacities = layer_capacities(policy, spec, config.max_input_len)
    context_capacities = None if context_policy is None else layer_capacities(context_policy, spec, config.max_input_len)
    held = capacities if context_capacities is None else [max(a, b) for a, b in zip(capacities, context_capacities)]
    decode_capacities = [c + config.max_question_len + config.max_new_tokens for c in held]
    flavours = [("onnxruntime", {"prefill": PREFILL_FILE, "extend": EXTEND_FILE, "select": SELECT_FILE}),
                ("tensorrt", {"prefill": PREFILL_TENSORRT_FILE, "extend": EXTEND_TENSORRT_FILE, "select": SELECT_TENSORRT_FILE})]
    if tensorrt_refusal(policy, spec.num_layers):  # no TensorRT flavour (it says why)
        flavours = flavours[:1]
    for flavour, files in flavours:
        builder = graph_builder(spec, store, policy, capacities, flavour, config.attention_chunk)
        for graph, name in files.items():
            onnx.save(getattr(builder, graph)(), folder / name)
    if context_policy is not None:
        context_builder = graph_builder(spec, store, context_policy, context_capacities, "onnxruntime", config.attention_chunk)
        onnx.save(context_builder.select(), folder / SELECT_CONTEXT_FILE)
    if phases.rereads:
        scorer = graph_builder(spec, store, policy, None, "onnxruntime", config.attention_chunk)
        onnx.save(scorer.extend(score=True), folder / REREAD_FILE)
    onnx.save(decode_builder.decode(decode_capacities), folder / DECODE_FILE)
    fused = fused_decode_info(decode_builder, policy, config, context_policy)
    if fused["file"]:
        onnx.save(decode_builder.decode_fused(decode_capacities, fused.get("max_positions", 0), fused["per_head_lengths"],
                                              config.kv_dtype), folder / DECODE_ORT_FILE)
    prompt = fused_prompt_info(refusal, config, policy, context_policy)
    if prompt["prefill"]:
        builder = graph_builder(spec, store, policy, capacities, "onnxruntime", config.attention_chunk)
        onnx.save(builder.prefill_fused(prompt["max_positions"]), folder / PREFILL_ORT_FILE)
        onnx.save(builder.extend_fused(prompt["max_positions"]), folder / EXTEND_ORT_FILE)
        if prompt["extend_heads"]:
            onnx.save(builder.extend_fused(prompt["max_positions"], per_head_lengths=True), folder / EXTEND_HEADS_ORT_FILE)
        if phases.rereads:
            prompt["reread"] = REREAD_ORT_FILE
            prompt["reread_max_positions"] = 2 * config.max_input_len + REREAD_PROMPT_ROOM
            onnx.save(builder.extend_fused(prompt["reread_max_positions"], score=True), folder / REREAD_ORT_FILE)
    openvino = export_openvino(spec, store, policy, capacities, decode_capacities, config, folder, context_policy,
                               context_capacities)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder / TOKENIZER_DIR)
    return ExportResult(folder, spec, policy, config, capacities, decode_capacities, store.nbytes(), fused, prompt,
                        weights, context_policy, context_capacities, phases, openvino)


def export_openvino(spec: ModelSpec, store, policy: KVPolicy, capacities: list[int], decode_capacities: list[int],
                    config: BuildConfig, folder: Path, context_policy: KVPolicy | None = None,
                    context_capacities: list[int] | None = None) -> dict:
    """Write the openvino flavour (``OPENVINO_FILES``; ``select_context_openvino.onnx`` for a context policy of its
    own) and return what it is (the manifest's ``onnx.openvino``), or why the policy has none: a method whose selection
    breaks a rule of OpenVINO's CPU plugin (``openvino_rules.POLICY_RULES``: defensivekv's 48-bit integer sums), for the
    engine's policy or its context policy. Any other broken rule raises ValueError (a bug of the flavour)."""
    builder = graph_builder(spec, store, policy, capacities, "openvino", config.attention_chunk)
    graphs_ = {name: builder.decode(decode_capacities) if graph == "decode" else getattr(builder, graph)()
               for graph, name in OPENVINO_FILES.items()}
    if context_policy is not None:
        graphs_[SELECT_CONTEXT_OPENVINO_FILE] = graph_builder(spec, store, context_policy, context_capacities,
                                                             "openvino", config.attention_chunk).select()
    for name, model in graphs_.items():
        violations = check_openvino_model(model)
        refusal = openvino_refusal(violations)
        if refusal:
            return {"prefill": None, "refused": f"{name}: {refusal}"}
        if violations:
            raise ValueError(f"{name}: OpenVINO's ONNX frontend would reject it: {describe(violations)}")
    for name, model in graphs_.items():
        onnx.save(model, folder / name)
    return {**{graph: name for graph, name in OPENVINO_FILES.items()},
            "select_context": SELECT_CONTEXT_OPENVINO_FILE if context_policy is not None else None}


def fused_prompt_info(refusal: str | None, config: BuildConfig, policy: KVPolicy | None = None,
                      context_policy: KVPolicy | None = None) -> dict:
    """What the engine's fused prompt graphs are (``prefill_ort.onnx``, ``extend_ort.onnx``; ``extend_heads_ort.onnx``
    where a slot's heads may hold different lengths: a policy or context policy whose method shares its budget across
    heads), or why it has none (the manifest's ``onnx.fused_prompt``): refused for the models the fused decode refuses
    (the same GroupQueryAttention kernel); RoPE caches up to max_input_len + max_question_len + max_new_tokens positions
    (a question after a context and the tokens after it go through the extend graph)."""
    if refusal:
        return {"prefill": None, "extend": None, "extend_heads": None, "refused": refusal}
    equal = all(p.method.base.equal_head_lengths for p in (policy, context_policy) if p is not None)
    return {"prefill": PREFILL_ORT_FILE, "extend": EXTEND_ORT_FILE, "extend_heads": None if equal else EXTEND_HEADS_ORT_FILE,
            "attention": "group_query_attention",
            "max_positions": config.max_input_len + config.max_question_len + config.max_new_tokens,
            "weights": config.weights}


def fused_decode_info(builder, policy: KVPolicy, config: BuildConfig, context_policy: KVPolicy | None = None) -> dict:
    """What the engine's fused decode graph is (``decode_ort.onnx``), or why it has none (the manifest's
    ``onnx.fused_decode``). float32 KV: GroupQueryAttention in place (``attention: group_query_attention``), refused
    for some models (``fused_decode_refusal``); positions reach max_input_len + max_question_len + max_new_tokens at
    most (a context, a question after it, the generated tokens); the per-head mask only for policies whose heads may
    hold different lengths (``BaseMethod.equal_head_lengths``). float16 KV: the masked attention over the buffers cast
    to float32 (``attention: cast``), any lengths, every model."""
    if config.kv_dtype == "float16":
        return {"file": DECODE_ORT_FILE, "attention": "cast", "kv_dtype": "float16", "per_head_lengths": True}
    refusal = builder.fused_decode_refusal()
    if refusal:
        return {"file": None, "refused": refusal, "kv_dtype": "float32"}
    equal = all(p.method.base.equal_head_lengths for p in (policy, context_policy) if p is not None)
    return {"file": DECODE_ORT_FILE, "attention": "group_query_attention", "kv_dtype": "float32",
            "per_head_lengths": not equal,
            "max_positions": config.max_input_len + config.max_question_len + config.max_new_tokens}


def onnx_info() -> dict:
    """Opsets and IR version the graphs are written with (for the manifest)."""
    return {
        "opset": OPSET,
        "ir_version": IR_VERSION,
        "custom_domain": {DOMAIN: OPSET_VERSION},
        "files": {**FILES, "weights": WEIGHTS_FILE},
    }
