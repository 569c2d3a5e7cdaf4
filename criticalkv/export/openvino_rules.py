"""OpenVINO's ONNX frontend and CPU plugin rules, checked without OpenVINO: what makes ``Core.read_model`` fail, or
the CPU plugin compute another result, on the graphs of the ``openvino`` flavour.

``check_openvino_model(model)`` returns every ``Violation``; ``validate_export`` runs it on every openvino-flavour graph
of every build, so a graph OpenVINO could not convert fails the build (and CI) on a machine without OpenVINO. The rules
follow OpenVINO 2026.4 (github.com/openvinotoolkit/openvino, ``src/frontends/onnx/frontend``, file named at each rule),
and each was seen to fail, with the message quoted, on a graph that breaks it (docs/openvino.md):

* ``function``: no model-local function. The frontend converts a node through the translator registered for its
  domain and type and inlines no ``FunctionProto`` of the model: a ``CriticalKVSelect`` node with its body fails with
  "No conversion rule found for operations: ai.criticalkv.CriticalKVSelect" (``common_translators/src/
  unconverted_ops_report.cpp``). The flavour inlines the bodies (``onnx.inliner.inline_local_functions``).
* ``domain``: standard operators only. No ``ai.criticalkv`` node (above) and no ``com.microsoft`` operator: ONNX
  Runtime's ``GroupQueryAttention`` over a prompt has no past, and ``op/com.microsoft/group_query_attention.cpp``
  requires one ("past_key (input 3) and past_value (input 4) must be provided as tensors"); what follows such a node
  then has no static element type, so the ``ReduceMax`` and ``TopK`` after it fail too.
* ``reduce``: a ``Reduce*`` node's axes input is a constant (its shape must be static, ``op/reduce.cpp``
  ``get_reduction_axes_from_input``: "The axes tensor's shape needs to be known(static)"), and its input element type
  is one the translator takes (``make_ov_reduction_op``: no boolean ``ReduceSum`` / ``ReduceMean``; "Unsupported
  input type").
* ``topk``: ``TopK``'s k has one element in a shape known before running (``op/topk.cpp`` ``get_k``: ``shape_size(
  k_node.get_shape()) == 1``; a k whose shape is not static fails with "to_shape was called on a dynamic shape").
* ``empty-constant``: no constant without elements: the frontend gives it another shape (a [1, 2, 0] float
  constant came out of ``read_model`` with shape [], so an ``Expand`` of it to [B, 2, 1] gave rank 2: "Axis 2 out of
  the tensor rank range [-2, 1]" at the ``Concat`` after it). A graph makes such a tensor by slicing 0 entries off a
  constant (which OpenVINO then broadcasts as ONNX does).
* ``int64``: the CPU plugin computes int64 tensors as int32 (``src/plugins/intel_cpu/src/transformations/
  transformation_pipeline.cpp``, ``get_convert_precisions``: i64 -> i32): no integer constant beyond int32 other
  than the int64 bounds (saturated: "to the end" of a ``Slice`` keeps its meaning), and no float scaled past 2^31 and cast to an integer (defensivekv's exact
  48-bit fixed-point mass sums: such a policy has no openvino flavour, ``openvino_refusal``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, numpy_helper

from criticalkv.export.tensorrt_rules import Violation, describe  # one form of a broken rule for both importers

#: The OpenVINO release whose ONNX frontend and CPU plugin these rules follow.
OPENVINO_VERSION = "2026.4"

REDUCE_OPS = frozenset({"ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean",
                        "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare"})
#: Element types ``make_ov_reduction_op`` takes (op/reduce.cpp: supported_types_v3; boolean only for ReduceMax /
#: ReduceMin of opset 20+, which convert it to u8 first).
REDUCE_TYPES = frozenset({TensorProto.UINT32, TensorProto.UINT64, TensorProto.INT32, TensorProto.INT64,
                          TensorProto.FLOAT16, TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.BFLOAT16,
                          TensorProto.INT8, TensorProto.UINT8})
BOOL_REDUCE_OPS = frozenset({"ReduceMax", "ReduceMin"})
INT32_MIN, INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)
#: int64 values a graph may hold beyond int32: the bounds ("to the end" of a Slice), saturated to int32's
INT64_BOUNDS = frozenset({int(np.iinfo(np.int64).max), int(np.iinfo(np.int64).min)})
#: The rules whose violation is a property of the policy's method (its openvino flavour is refused, not a bug).
POLICY_RULES = frozenset({"int64"})


class _Checker:
    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.violations: list[Violation] = []
        self.types: dict[str, onnx.TypeProto] = {}
        self.collect_types(onnx.shape_inference.infer_shapes(model).graph)
        self.constants: dict[str, np.ndarray] = {}
        for tensor in model.graph.initializer:
            if tensor.data_location != TensorProto.EXTERNAL:
                self.constants[tensor.name] = numpy_helper.to_array(tensor)
            self.types.setdefault(tensor.name, onnx.helper.make_tensor_type_proto(tensor.data_type, list(tensor.dims)))
        self.producers: dict[str, onnx.NodeProto] = {}
        self.collect_producers(model.graph)

    def collect_producers(self, graph: onnx.GraphProto) -> None:
        for node in graph.node:
            self.producers.update({o: node for o in node.output})
            for attr in node.attribute:
                if attr.type == AttributeProto.GRAPH:
                    self.collect_producers(attr.g)

    def collect_types(self, graph: onnx.GraphProto) -> None:
        """The inferred types of every value, subgraphs (If branches) included (names are unique over a model)."""
        for value in list(graph.input) + list(graph.value_info) + list(graph.output):
            self.types[value.name] = value.type
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == AttributeProto.GRAPH:
                    self.collect_types(attr.g)

    def add(self, rule: str, where: str, message: str) -> None:
        self.violations.append(Violation(rule, where, message))

    def elem_type(self, name: str) -> int | None:
        value = self.types.get(name)
        return value.tensor_type.elem_type if value is not None and value.HasField("tensor_type") else None

    def dims(self, name: str) -> list[int | None] | None:
        value = self.types.get(name)
        if value is None or not value.HasField("tensor_type") or not value.tensor_type.HasField("shape"):
            return None
        return [d.dim_value if d.HasField("dim_value") else None for d in value.tensor_type.shape.dim]

    def check(self) -> None:
        m = self.model
        for f in m.functions:
            self.add("function", "model", f"model-local function {f.domain}::{f.name}: OpenVINO's ONNX frontend does not "
                     "inline it (\"No conversion rule found for operations\"); inline it into the graph")
        for o in m.opset_import:
            if o.domain not in ("", "ai.onnx"):
                self.add("domain", "model", f"operator domain {o.domain!r} is imported: only standard operators convert")
        self.check_graph(m.graph)

    def check_graph(self, graph: onnx.GraphProto) -> None:
        for node in graph.node:
            name = node.name or node.op_type
            if node.domain not in ("", "ai.onnx"):
                reason = (" (GroupQueryAttention over a prompt has no past; group_query_attention.cpp requires one)"
                          if node.domain == "com.microsoft" else "")
                self.add("domain", name, f"{node.domain}::{node.op_type} has no OpenVINO translator here{reason}")
            if node.op_type == "Constant":
                self.constants.update({o: numpy_helper.to_array(a.t) for o in node.output[:1] for a in node.attribute
                                       if a.name == "value" and a.type == AttributeProto.TENSOR})
            check = {"TopK": self.check_topk, "Cast": self.check_cast}.get(node.op_type)
            if node.op_type in REDUCE_OPS:
                self.check_reduce(node, name)
            elif check is not None:
                check(node, name)
            for attr in node.attribute:
                if attr.type == AttributeProto.GRAPH:
                    self.check_graph(attr.g)
        for tensor in graph.initializer:
            self.check_integers(tensor.name, tensor)
            self.check_empty(tensor.name, tensor)
        for node in graph.node:
            if node.op_type == "Constant":
                for attr in node.attribute:
                    if attr.name == "value" and attr.type == AttributeProto.TENSOR:
                        self.check_integers(node.name or node.output[0], attr.t)
                        self.check_empty(node.name or node.output[0], attr.t)

    def check_empty(self, name: str, tensor: onnx.TensorProto) -> None:
        if 0 in tensor.dims:
            self.add("empty-constant", name, f"constant of shape {list(tensor.dims)} has no elements: OpenVINO's ONNX "
                     "frontend loses its shape (slice the entries off a constant instead)")

    def check_integers(self, name: str, tensor: onnx.TensorProto) -> None:
        """No int64 constant beyond int32 but the int64 bounds, which the plugin's conversion saturates to int32's
        (they stand for "to the end" in a Slice, "no limit" in a Min: the same meaning at either width)."""
        if tensor.data_type != TensorProto.INT64 or tensor.data_location == TensorProto.EXTERNAL:
            return
        values = [int(v) for v in numpy_helper.to_array(tensor).ravel()]
        wide = [v for v in values if not INT32_MIN <= v <= INT32_MAX and v not in INT64_BOUNDS]
        if wide:
            self.add("int64", name, f"int64 constant {int(wide[0])} is beyond int32: the CPU plugin computes int64 as int32")

    def check_reduce(self, node: onnx.NodeProto, name: str) -> None:
        if len(node.input) > 1 and node.input[1] and node.input[1] not in self.constants:
            dims = self.dims(node.input[1])
            if dims is None or any(d is None for d in dims):
                self.add("reduce", name, f"axes input {node.input[1]!r} has no static shape (op/reduce.cpp: \"The axes "
                         "tensor's shape needs to be known(static)\")")
        elem = self.elem_type(node.input[0])
        allowed = REDUCE_TYPES | ({TensorProto.BOOL} if node.op_type in BOOL_REDUCE_OPS else set())
        if elem is None or elem == TensorProto.UNDEFINED:
            self.add("reduce", name, f"input {node.input[0]!r} has no element type known before running (\"Unsupported "
                     "input type dynamic\")")
        elif elem not in allowed:
            self.add("reduce", name, f"{node.op_type} of {TensorProto.DataType.Name(elem)}: \"Unsupported input type\" "
                     "(op/reduce.cpp)")

    def check_topk(self, node: onnx.NodeProto, name: str) -> None:
        if len(node.input) < 2 or node.input[1] in self.constants:
            return
        dims = self.dims(node.input[1])
        if dims is None or any(d is None for d in dims) or int(np.prod(dims, dtype=np.int64)) != 1:
            self.add("topk", name, f"k ({node.input[1]!r}) must hold one value in a shape known before running, has "
                     f"{dims} (op/topk.cpp get_k)")

    def check_cast(self, node: onnx.NodeProto, name: str) -> None:
        """A float scaled past 2^31 (Mul by a constant, through Floor / Ceil / Round) and cast to an integer."""
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        if to not in (TensorProto.INT64, TensorProto.INT32):
            return
        source = self.producers.get(node.input[0])
        if source is not None and source.op_type in ("Floor", "Ceil", "Round"):
            source = self.producers.get(source.input[0])
        if source is None or source.op_type != "Mul":
            return
        for factor in source.input:
            if factor in self.constants and np.issubdtype(self.constants[factor].dtype, np.floating):
                if np.max(np.abs(self.constants[factor])) >= 2.0**31:
                    self.add("int64", name, f"a float scaled by {float(np.max(np.abs(self.constants[factor]))):g} is "
                             "cast to an integer: beyond int32, which the CPU plugin computes int64 in")


def check_openvino_model(model: onnx.ModelProto) -> list[Violation]:
    """Every violation of OpenVINO's rules in ``model`` (empty list: it converts and computes what ONNX says)."""
    checker = _Checker(model)
    checker.check()
    return checker.violations


def check_openvino_file(path: str | Path) -> list[Violation]:
    """``check_openvino_model`` of an ONNX file (external weights are not loaded)."""
    return check_openvino_model(onnx.load(str(path), load_external_data=False))


def openvino_refusal(violations: list[Violation]) -> str | None:
    """Why a policy has no openvino flavour, when every violation of its graph is one of its method's (``POLICY_RULES``);
    None when there is none. Any other violation is a bug of the flavour (the caller raises it)."""
    if violations and all(v.rule in POLICY_RULES for v in violations):
        return (f"OpenVINO's CPU plugin computes int64 as int32 and the policy's selection needs wider integers "
                f"({violations[0]})")
    return None
