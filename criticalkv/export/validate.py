"""Checks of the exported graphs: ``onnx.checker`` (full check, with strict shape inference), the
selection nodes' attributes against the policy and the per-layer capacities (prefill and select), and, on the
graphs TensorRT parses (``prefill_tensorrt``, ``decode``, ``extend_tensorrt``, ``select_tensorrt``), the
ONNX-TensorRT importer's rules (``criticalkv.export.tensorrt_rules``). Only the ONNX-Runtime-only graphs
(``decode_ort``, ``prefill_ort``, ``extend_ort``) may hold com.microsoft operators, and only the fused ones each is built
from (``ORT_OPERATORS``, plus the quantized projection's operator of the engine's weight format)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from criticalkv.export.exporter import (
    DECODE_FILE,
    DECODE_ORT_FILE,
    EXTEND_FILE,
    EXTEND_HEADS_ORT_FILE,
    EXTEND_ORT_FILE,
    EXTEND_TENSORRT_FILE,
    PREFILL_FILE,
    PREFILL_ORT_FILE,
    PREFILL_TENSORRT_FILE,
    OPENVINO_FILES,
    REREAD_FILE,
    REREAD_ORT_FILE,
    SELECT_CONTEXT_FILE,
    SELECT_CONTEXT_OPENVINO_FILE,
    SELECT_FILE,
    SELECT_TENSORRT_FILE,
    ExportResult,
)
from criticalkv.export.decoder import ORT_DOMAIN
from criticalkv.export.quantize import QUANTIZED_OPERATORS
from criticalkv.export.model_select import MODEL_OP, SCORE_OP, is_model_level, model_attributes, tensorrt_refusal
from criticalkv.export.openvino_rules import OPENVINO_VERSION, check_openvino_model, describe
from criticalkv.export.tensorrt_rules import TENSORRT_VERSION, check_tensorrt_model
from criticalkv.graphs import is_contract_name, present_stream
from criticalkv.node import DOMAIN, OP_TYPE, policy_from_attributes
from criticalkv.policy import KVPolicy

#: (report key, file, carries the selection nodes, parsed by TensorRT) of every graph of an export.
GRAPHS = (
    ("prefill", PREFILL_FILE, True, False),
    ("prefill_tensorrt", PREFILL_TENSORRT_FILE, True, True),
    ("decode", DECODE_FILE, False, True),
    ("decode_ort", DECODE_ORT_FILE, False, False),
    ("extend", EXTEND_FILE, False, False),
    ("extend_tensorrt", EXTEND_TENSORRT_FILE, False, True),
    ("select", SELECT_FILE, True, False),
    ("select_tensorrt", SELECT_TENSORRT_FILE, True, True),
    ("prefill_ort", PREFILL_ORT_FILE, True, False),
    ("extend_ort", EXTEND_ORT_FILE, False, False),
    ("extend_heads_ort", EXTEND_HEADS_ORT_FILE, False, False),
    ("select_context", SELECT_CONTEXT_FILE, True, False),
    ("reread", REREAD_FILE, False, False),
    ("reread_ort", REREAD_ORT_FILE, False, False),
)
#: The openvino flavour (``criticalkv.export.openvino_rules``): report key -> file. The selection bodies are inlined,
#: so these graphs hold standard operators only and are checked by OpenVINO's rules instead of the nodes' attributes.
OPENVINO_GRAPHS = {**{f"{graph}_openvino": name for graph, name in OPENVINO_FILES.items()},
                   "select_context_openvino": SELECT_CONTEXT_OPENVINO_FILE}
#: The fused prompt graphs (ONNX Runtime only), written unless the model refuses them.
FUSED_PROMPT = ("prefill_ort", "extend_ort", "extend_heads_ort", "reread_ort")
#: Graphs an export writes only for some policies (the context policy's select graph, the re-read graphs of a method
#: that re-reads prompts, the fused extend over heads of different lengths).
OPTIONAL_GRAPHS = ("select_context", "reread", "reread_ort", "extend_heads_ort")
#: The graphs that return the engine's streams for their new entries (``criticalkv.methods.phases.Stream``).
STREAM_GRAPHS = ("extend", "extend_ort", "extend_heads_ort", "extend_openvino")
#: The TensorRT flavours a model-level policy does not have (``decode.onnx`` is also its ONNX Runtime decode graph).
TENSORRT_FLAVOURS = ("prefill_tensorrt", "extend_tensorrt", "select_tensorrt")
#: The only com.microsoft operators of the fused decode graph (``decode_ort``), by its attention form; no other graph
#: holds any.
ORT_OPERATORS = {"group_query_attention": {"GroupQueryAttention", "SkipSimplifiedLayerNormalization"},
                 "cast": {"SkipSimplifiedLayerNormalization"},
                 "prompt": {"GroupQueryAttention", "SkipSimplifiedLayerNormalization", "RotaryEmbedding"}}


def expected_contrib_operators(result: ExportResult, key: str) -> set[str] | None:
    """The com.microsoft operators graph ``key`` must hold (None: it may hold none)."""
    weights = QUANTIZED_OPERATORS[(result.weights or {}).get("format", "fp32")]
    if key == "decode_ort":
        return ORT_OPERATORS[result.fused_decode["attention"]] | weights
    if key in FUSED_PROMPT:
        return ORT_OPERATORS["prompt"] | weights
    return None


def _attributes(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def same_policy(a: KVPolicy, b: KVPolicy) -> bool:
    """Equal up to float32 rounding of the float knobs (ONNX FLOAT attributes are float32)."""
    if a.name != b.name:
        return False
    da, db = a.attributes(), b.attributes()
    return all(
        np.float32(da[k]) == np.float32(db[k]) if isinstance(da[k], float) else da[k] == db[k] for k in da
    )


def checked_graph(path: Path, name: str, result: ExportResult, key: str):
    """(the graph, its strictly inferred form) of an exported file that passes ``onnx.checker``'s full check, strict
    shape inference and the input/output names of ``criticalkv.graphs`` (``check_contract``); ValueError naming the
    file otherwise."""
    try:
        onnx.checker.check_model(str(path), full_check=True)
        model = onnx.load(str(path), load_external_data=False)
        inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as err:
        raise ValueError(f"{name}: the exported graph does not validate: {err}") from None
    check_contract(model, name, result, key)
    return model, inferred


def validate_export(result: ExportResult) -> dict:
    """Validate every graph of an export (``GRAPHS``); returns a report for the manifest. Raises ValueError."""
    report = {}
    model_level = is_model_level(result.policy, result.spec.num_layers)
    refusal = tensorrt_refusal(result.policy, result.spec.num_layers)
    for key, name, selects, tensorrt in GRAPHS:
        path = Path(result.folder) / name
        if refusal and key in TENSORRT_FLAVOURS:
            if path.exists():
                raise ValueError(f"{name}: {result.policy.name} has no TensorRT flavour ({refusal})")
            report[key] = {"file": None, "refused": refusal}
            continue
        if key in OPTIONAL_GRAPHS:
            wanted = result.context_policy is not None if key == "select_context" else result.phases.rereads
            if key == "reread_ort":  # the fused one: only beside the fused prompt graphs
                wanted = wanted and bool((result.fused_prompt or {}).get("prefill"))
            if key == "extend_heads_ort":  # beside the fused prompt graphs, where heads may hold different lengths
                wanted = bool((result.fused_prompt or {}).get("extend_heads"))
            if path.exists() != wanted:
                raise ValueError(f"{name}: {'missing' if wanted else 'written although no policy of the export needs it'}")
            if not wanted:
                continue
        fused_refusal = (result.fused_decode or {}).get("refused")
        if key == "decode_ort" and (fused_refusal or result.fused_decode is None):
            if path.exists():
                raise ValueError(f"{name}: written although the export has no fused decode ({fused_refusal})")
            report[key] = {"file": None, "refused": fused_refusal or "not exported"}
            continue
        prompt_refusal = (result.fused_prompt or {}).get("refused")
        if key in FUSED_PROMPT and (prompt_refusal or result.fused_prompt is None):
            if path.exists():
                raise ValueError(f"{name}: written although the export has no fused prompt graphs ({prompt_refusal})")
            report[key] = {"file": None, "refused": prompt_refusal or "not exported"}
            continue
        model, inferred = checked_graph(path, name, result, key)
        own, capacities = result.policy, result.prefill_capacities
        if key == "select_context":  # the context policy's graph: its own kind of nodes and capacities
            own, capacities = result.context_policy, result.context_capacities
        if selects and (is_model_level(own, result.spec.num_layers) if key == "select_context" else model_level):
            report[key] = _validate_model_level(result, model, inferred, name, expected_contrib_operators(result, key),
                                                own, capacities, tensorrt)
            continue
        selection = [n for n in model.graph.node if n.op_type == OP_TYPE and n.domain == DOMAIN]
        expected = result.spec.num_layers if selects else 0
        if len(selection) != expected:
            raise ValueError(f"{name}: {len(selection)} {OP_TYPE} nodes, expected {expected}")
        for i, node in enumerate(selection):
            policy, layer_idx, num_layers, capacity = policy_from_attributes(_attributes(node))
            if not same_policy(policy, own) or (layer_idx, num_layers, capacity) != (
                i, result.spec.num_layers, capacities[i]
            ):
                raise ValueError(f"{name}: node {node.name} attributes do not match the export's policy / layer / capacity")
        functions = [f"{f.domain}::{f.name}" for f in model.functions]
        body = [f"{DOMAIN}::{OP_TYPE}"] if selects and not tensorrt else []
        if functions != body:
            raise ValueError(f"{name}: expected the function bodies {body}, found {functions}"
                             + (" (the TensorRT flavours carry none: the plugin runs the node)" if tensorrt else ""))
        domains = {n.domain for n in model.graph.node} - {"", DOMAIN}
        domains -= _check_contrib(model, name, expected_contrib_operators(result, key))
        if domains:
            raise ValueError(f"{name}: unexpected operator domains {sorted(domains)}")
        if tensorrt:  # the graphs TensorRT parses: the importer's rules (criticalkv.export.tensorrt_rules)
            violations = check_tensorrt_model(model)
            if violations:
                listed = "; ".join(str(v) for v in violations[:8])
                raise ValueError(f"{name}: TensorRT {TENSORRT_VERSION}'s ONNX importer would reject it: {listed}")
        report[key] = {
            "file": name,
            "checker": "onnx.checker full_check passed",
            "shape_inference": f"strict, {len(inferred.graph.value_info)} inferred value infos",
            "nodes": len(model.graph.node),
            "selection_nodes": len(selection),
            "functions": functions,
            **({"tensorrt_rules": f"TensorRT {TENSORRT_VERSION} ONNX importer rules passed"} if tensorrt else {}),
        }
    report.update(validate_openvino(result))
    return report


def validate_openvino(result: ExportResult) -> dict:
    """The openvino flavour's graphs: written exactly as ``result.openvino`` says (or refused with its reason), each
    passing ``onnx.checker`` (full check, strict shape inference), the names of ``criticalkv.graphs``, no function and no
    operator beyond the standard ones, and OpenVINO's rules (``criticalkv.export.openvino_rules``)."""
    info = result.openvino or {}
    report = {}
    for key, name in OPENVINO_GRAPHS.items():
        path = Path(result.folder) / name
        wanted = bool(info.get(key[:-len("_openvino")]))
        if path.exists() != wanted:
            raise ValueError(f"{name}: {'missing' if wanted else 'written although the export has no such graph'}"
                             + (f" ({info['refused']})" if info.get("refused") else ""))
        if not wanted:
            report[key] = {"file": None, **({"refused": info["refused"]} if info.get("refused") else {})}
            continue
        model, inferred = checked_graph(path, name, result, key)
        violations = check_openvino_model(model)
        if violations:
            raise ValueError(f"{name}: OpenVINO {OPENVINO_VERSION}'s ONNX frontend would reject it: {describe(violations)}")
        report[key] = {"file": name, "checker": "onnx.checker full_check passed",
                       "shape_inference": f"strict, {len(inferred.graph.value_info)} inferred value infos",
                       "nodes": len(model.graph.node),
                       "openvino_rules": f"OpenVINO {OPENVINO_VERSION} ONNX frontend and CPU plugin rules passed"}
    return report


def check_contract(model: onnx.ModelProto, name: str, result: ExportResult, key: str) -> None:
    """Every input and output of graph ``key`` is a name of ``criticalkv.graphs`` (the one place the exporter and the
    backends take them from), and the graphs that return streams return exactly the export's
    (``ExportResult.phases``)."""
    names = [v.name for v in model.graph.input] + [v.name for v in model.graph.output]
    stray = [n for n in names if not is_contract_name(n)]
    if stray:
        raise ValueError(f"{name}: inputs or outputs named outside criticalkv.graphs: {stray[:5]}")
    outputs = {v.name for v in model.graph.output}
    want = {present_stream(i, s.name) for i in range(result.spec.num_layers) for s in result.phases.streams}
    got = {n for n in outputs if ".stream." in n}
    if key in STREAM_GRAPHS and got != want:
        raise ValueError(f"{name}: returns the streams {sorted(got)[:4]}, the export has {sorted(want)[:4]}")
    if key not in STREAM_GRAPHS and got:
        raise ValueError(f"{name}: returns streams {sorted(got)[:4]}, which only {', '.join(STREAM_GRAPHS)} return")


def _check_contrib(model: onnx.ModelProto, name: str, expected: set[str] | None) -> set[str]:
    """An ONNX-Runtime-only graph holds exactly its fused operators (``expected``) of the com.microsoft domain, and
    nothing else of that domain; returns the domain as checked ({} for the other graphs)."""
    if expected is None:
        return set()
    contrib = {n.op_type for n in model.graph.node if n.domain == ORT_DOMAIN}
    if contrib != expected:
        raise ValueError(f"{name}: expected the {ORT_DOMAIN} operators {sorted(expected)}, found {sorted(contrib)}")
    return {ORT_DOMAIN}


def _validate_model_level(result: ExportResult, model: onnx.ModelProto, inferred: onnx.ModelProto, name: str,
                          contrib: set[str] | None = None, own: KVPolicy | None = None,
                          capacities: list[int] | None = None, tensorrt: bool = False) -> dict:
    """The prefill graph of a model-level policy: one ``CriticalKVScore`` node per layer (the layer's attributes), one
    ``CriticalKVSelectModel`` node (the policy and every layer's capacity) after them, and exactly their two bodies
    (``tensorrt``: none, the plugins run the nodes, and the TensorRT importer's rules hold)."""
    ours = [n for n in model.graph.node if n.domain == DOMAIN]
    scores = [n for n in ours if n.op_type == SCORE_OP]
    selects = [n for n in ours if n.op_type == MODEL_OP]
    if len(scores) != result.spec.num_layers or len(selects) != 1 or len(ours) != len(scores) + 1:
        raise ValueError(f"{name}: expected {result.spec.num_layers} {SCORE_OP} nodes and one {MODEL_OP} node, found "
                         f"{[n.op_type for n in ours]}")
    own = result.policy if own is None else own
    capacities = result.prefill_capacities if capacities is None else capacities
    for i, node in enumerate(scores):
        policy, layer_idx, num_layers, capacity = policy_from_attributes(_attributes(node))
        if not same_policy(policy, own) or (layer_idx, num_layers, capacity) != (i, result.spec.num_layers, capacities[i]):
            raise ValueError(f"{name}: node {node.name} attributes do not match the export's policy / layer / capacity")
    policy, num_layers, node_capacities = model_attributes(selects[0])
    if not same_policy(policy, own) or (num_layers, node_capacities) != (result.spec.num_layers, capacities):
        raise ValueError(f"{name}: node {selects[0].name} attributes do not match the export's policy / capacities")
    order = [n.name for n in model.graph.node]
    if order.index(selects[0].name) < max(order.index(n.name) for n in scores):
        raise ValueError(f"{name}: {MODEL_OP} must come after every layer's {SCORE_OP}")
    functions = sorted(f"{f.domain}::{f.name}" for f in model.functions)
    bodies = [] if tensorrt else sorted([f"{DOMAIN}::{SCORE_OP}", f"{DOMAIN}::{MODEL_OP}"])
    if functions != bodies:
        raise ValueError(f"{name}: expected the function bodies {bodies}, found {functions}"
                         + (" (the TensorRT flavours carry none: the plugins run the nodes)" if tensorrt else ""))
    domains = {n.domain for n in model.graph.node} - {"", DOMAIN} - _check_contrib(model, name, contrib)
    if domains:
        raise ValueError(f"{name}: unexpected operator domains {sorted(domains)}")
    if tensorrt:
        violations = check_tensorrt_model(model)
        if violations:
            listed = "; ".join(str(v) for v in violations[:8])
            raise ValueError(f"{name}: TensorRT {TENSORRT_VERSION}'s ONNX importer would reject it: {listed}")
    return {
        "file": name,
        "checker": "onnx.checker full_check passed",
        "shape_inference": f"strict, {len(inferred.graph.value_info)} inferred value infos",
        "nodes": len(model.graph.node),
        "selection_nodes": 1,
        "score_nodes": len(scores),
        "functions": functions,
        **({"tensorrt_rules": f"TensorRT {TENSORRT_VERSION} ONNX importer rules passed"} if tensorrt else {}),
    }
