"""The ONNX-TensorRT importer's rules, checked without TensorRT: what makes ``parser.parse`` fail on a GPU box.

``check_tensorrt_model(model)`` returns every ``Violation`` of the graphs TensorRT parses
(``prefill_tensorrt.onnx`` and ``decode.onnx``); ``validate_export`` runs it on every export, so a graph the
pinned TensorRT could not import fails the build (and CI) on a machine without TensorRT. The rules are
written from the importer of TensorRT 10.14 (github.com/onnx/onnx-tensorrt, release 10.14; file and function
named at each rule) and from this project's own engine build (``criticalkv.tensorrt.tensorrt_build``):

* ``opset``: the default domain's opset within what 10.14 imports; no ``com.microsoft`` or other foreign
  domain (ModelImporter.cpp, ``importModel``: an op without a builtin importer goes to the plugin fallback).
* ``op``: every default-domain op has a builtin importer (onnxOpImporters.cpp, ``DEFINE_BUILTIN_OP_IMPORTER``;
  onnx-tensorrt's operators.md of 10.14 for the unsupported ones).
* ``constant-input``: inputs the importers read as weights are constants (Slice ``axes``/``steps``,
  Squeeze/Unsqueeze/Reduce* ``axes``, Split ``split``; onnx-tensorrt's operators.md: "must be an initializer").
* ``type``: tensor types TensorRT has (``convertDtype`` in importerUtils.cpp): no DOUBLE, STRING, complex.
* ``loop``/``if``/``scan``: subgraph input and output wiring (onnxOpImporters.cpp, ``Loop``, ``If``, ``Scan``
  importers). In particular the Loop importer registers the body's condition input (``body.input(1)``)
  only when the node's condition input is given: a ``Loop(M, "")`` whose body reads it fails with "Node
  input was not registered"; scan outputs need a trip count ("TensorRT cannot infer the shape of scan
  output ... since no trip limit was set").
* ``loop-shape``: no shape inside a loop body depends on the iteration number or a loop-carried value
  (TensorRT loops need loop-invariant shapes: ``ILoop`` recurrences and concatenated outputs are sized once).
* ``fp16-range``: no float constant beyond the fp16 range (a weakly typed fp16 engine turns it to +-inf,
  e.g. an additive FLOAT32_MIN mask, and a fully masked softmax row to NaN).
* ``plugin``: every ``ai.criticalkv`` node is one of the library's plugins (``CriticalKVSelect``, or the model-level
  selection's ``CriticalKVScore`` and ``CriticalKVSelectModel``) with no function body in the model, and its
  attributes are exactly that plugin creator's fields with the importer's type mapping (importerUtils.cpp,
  ``loadFields``: INT -> kINT32, FLOAT -> kFLOAT32, STRING -> kCHAR), INT values within int32 and a capacity (the
  model node: a capacity per layer).
* ``profile``: every dynamic graph-input dimension is named (the engine build derives the optimization
  profile from the names, ``tensorrt_build.profile_shapes``).
* ``data-dependent-shape``: no shape is computed from the values of a graph input (a shape input of Slice,
  Reshape, Range, Expand, ... that derives from input values other than through Shape/Size, or NonZero-like
  operators). TensorRT calls such a dimension data-dependent: ``IExecutionContext::getTensorShape`` reports -1 for
  it (NvInferRuntime.h), a network output with one needs an ``IOutputAllocator``, and a plugin input with one is
  sized from bounds TensorRT has to derive itself. The runtime sizes every output from the input shapes before
  ``enqueueV3`` (``criticalkv.runtime.tensorrt_backend``), so the graphs it runs have none (docs/gpu.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, numpy_helper

from criticalkv.node import MODEL_OP_TYPE, SCORE_OP_TYPE, PluginFieldSpec, plugin_field_specs

#: The TensorRT release whose ONNX importer these rules follow.
TENSORRT_VERSION = "10.14"
#: Opsets of the default domain it imports: 9 (README) up to 23 (the opset-23 ``Attention`` importer was
#: added in 10.14, onnx-tensorrt's Changelog.md).
MIN_OPSET, MAX_OPSET = 9, 23
PLUGIN_DOMAIN = "ai.criticalkv"
PLUGIN_OP = "CriticalKVSelect"
#: Every plugin op of the library: the per-layer selection, the model-level selection's score and select nodes.
PLUGIN_OPS = (PLUGIN_OP, SCORE_OP_TYPE, MODEL_OP_TYPE)
#: Layer attributes the model node does not take (it has ``capacities``, one per layer, instead).
_LAYER_ONLY = ("layer_idx", "capacity", "layer_budgets")


def model_plugin_field_specs() -> list[PluginFieldSpec]:
    """The CriticalKVSelectModel creator's fields: the knobs, num_layers, then capacities (INTS)."""
    return ([s for s in plugin_field_specs() if s.name not in _LAYER_ONLY]
            + [PluginFieldSpec("capacities", "INTS", "kINT32", ())])

#: Default-domain operators with a builtin importer in TensorRT 10.14 (onnxOpImporters.cpp).
SUPPORTED_OPS = frozenset("""
Abs Acos Acosh Add AffineGrid And ArgMax ArgMin Asin Asinh Atan Atanh Attention AveragePool BatchNormalization
Bernoulli BitShift BitwiseAnd BitwiseNot BitwiseOr BitwiseXor BlackmanWindow Cast CastLike Ceil Celu Clip
Compress Concat ConcatFromSequence Constant ConstantOfShape Conv ConvTranspose Cos Cosh CumSum
DeformConv DepthToSpace DequantizeLinear Div Dropout DynamicQuantizeLinear Einsum Elu Equal Erf Exp Expand
EyeLike Flatten Floor GRU Gather GatherElements GatherND Gelu Gemm GlobalAveragePool GlobalLpPool
GlobalMaxPool Greater GreaterOrEqual GridSample GroupNormalization HammingWindow HannWindow HardSigmoid
HardSwish Hardmax Identity If ImageScaler InstanceNormalization IsInf IsNaN LRN LSTM LayerNormalization
LeakyRelu Less LessOrEqual Log LogSoftmax Loop LpNormalization LpPool MatMul MatMulInteger Max MaxPool
MaxRoiPool MaxUnpool Mean MeanVarianceNormalization Min Mish Mod Mul Multinomial Neg NonMaxSuppression
NonZero Not OneHot Or PRelu Pad ParametricSoftplus Pow QLinearConv QLinearMatMul QuantizeLinear RNN
RandomNormal RandomNormalLike RandomUniform RandomUniformLike Range Reciprocal ReduceL1 ReduceL2
ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu
Reshape Resize ReverseSequence RoiAlign Round STFT ScaledTanh Scan Scatter ScatterElements ScatterND Selu
Shape Shrink Sigmoid Sign Sin Sinh Size Slice Softmax Softplus Softsign SpaceToDepth Split Sqrt Squeeze
Sub Sum Tan Tanh ThresholdedRelu Tile TopK Transpose Trilu Unique Unsqueeze Upsample Where Xor
""".split())

#: (op, input index) the importer needs as a constant (weights), by op.
CONSTANT_INPUTS = {
    "Slice": (3, 4),
    "Squeeze": (1,),
    "Unsqueeze": (1,),
    "Split": (1,),
    "ReduceL1": (1,), "ReduceL2": (1,), "ReduceLogSum": (1,), "ReduceLogSumExp": (1,), "ReduceMax": (1,),
    "ReduceMean": (1,), "ReduceMin": (1,), "ReduceProd": (1,), "ReduceSum": (1,), "ReduceSumSquare": (1,),
}

#: Inputs that set an output's shape: inside a Loop body they must not depend on the iteration.
SHAPE_INPUTS = {
    "Slice": (1, 2, 3, 4),
    "Reshape": (1,),
    "Range": (0, 1, 2),
    "Expand": (1,),
    "Pad": (1,),
    "ConstantOfShape": (0,),
    "Tile": (1,),
    "Resize": (2, 3),
    "TopK": (1,),
    "Split": (1,),
    "OneHot": (1,),
    "Unsqueeze": (1,),
    "Squeeze": (1,),
}

#: Operators whose output shape depends on the values of their data input (explicitly data-dependent in TensorRT).
DATA_SHAPED_OPS = frozenset({"NonZero", "Compress", "Unique", "NonMaxSuppression"})
#: Operators whose output carries only the shape of their input, never its values.
SHAPE_ONLY_OPS = frozenset({"Shape", "Size"})

#: Tensor element types TensorRT represents (importerUtils.cpp ``convertDtype``).
SUPPORTED_TYPES = frozenset({
    TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.INT32, TensorProto.INT64,
    TensorProto.INT8, TensorProto.UINT8, TensorProto.BOOL, TensorProto.FLOAT8E4M3FN, TensorProto.INT4,
})

#: ONNX attribute type -> the PluginFieldType the importer passes to the creator (the ``switch`` on
#: ``attrs.type(fieldName)`` in the plugin-field loader of onnxOpImporters.cpp): lists go as arrays of the
#: element type (INTS -> kINT32 with one entry per element, narrowed to int32).
ATTRIBUTE_FIELD_TYPES = {
    AttributeProto.INT: "kINT32", AttributeProto.FLOAT: "kFLOAT32", AttributeProto.STRING: "kCHAR",
    AttributeProto.INTS: "kINT32", AttributeProto.FLOATS: "kFLOAT32", AttributeProto.STRINGS: "kCHAR",
}
LIST_ATTRIBUTES = frozenset({AttributeProto.INTS, AttributeProto.FLOATS, AttributeProto.STRINGS})

FP16_MAX = float(np.finfo(np.float16).max)
INT32_MAX = int(np.iinfo(np.int32).max)


@dataclass(frozen=True)
class Violation:
    """One broken importer rule: the rule's name, where (node name / graph), and what is wrong (TensorRT's rules here,
    OpenVINO's in ``openvino_rules``)."""

    rule: str
    where: str
    message: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.where}: {self.message}"


def describe(violations: list[Violation], most: int = 8) -> str:
    """The first ``most`` violations on one line, and how many more (an importer rule set's error message)."""
    listed = "; ".join(str(v) for v in violations[:most])
    return listed + (f" (and {len(violations) - most} more)" if len(violations) > most else "")


def _subgraphs(node: onnx.NodeProto) -> dict[str, onnx.GraphProto]:
    return {a.name: a.g for a in node.attribute if a.type == AttributeProto.GRAPH}


def _reads(graph: onnx.GraphProto) -> set[str]:
    """Every value name read by the nodes of ``graph`` and of its nested subgraphs."""
    names = set()
    for node in graph.node:
        names.update(i for i in node.input if i)
        for sub in _subgraphs(node).values():
            names |= _reads(sub)
    return names


class _Checker:
    def __init__(self, model: onnx.ModelProto, plugin_fields):
        self.model = model
        self.fields = {f.name: f for f in plugin_fields}
        self.plugin_fields = {PLUGIN_OP: self.fields, SCORE_OP_TYPE: self.fields,
                              MODEL_OP_TYPE: {f.name: f for f in model_plugin_field_specs()}}
        self.violations: list[Violation] = []

    def add(self, rule: str, where: str, message: str) -> None:
        self.violations.append(Violation(rule, where, message))

    # ------------------------------------------------------------------ model level
    def check_model(self) -> None:
        m = self.model
        opsets = {o.domain or "": o.version for o in m.opset_import}
        version = opsets.get("", opsets.get("ai.onnx"))
        if version is None or not MIN_OPSET <= version <= MAX_OPSET:
            self.add("opset", "model", f"default-domain opset {version} is outside {MIN_OPSET}..{MAX_OPSET} "
                     f"(TensorRT {TENSORRT_VERSION})")
        for domain in sorted(set(opsets) - {"", "ai.onnx", PLUGIN_DOMAIN}):
            self.add("opset", "model", f"operator domain {domain!r} is imported: TensorRT has no importer for it")
        for f in m.functions:
            if f.domain == PLUGIN_DOMAIN and f.name in PLUGIN_OPS:
                self.add("plugin", "model", f"the model carries a {f.name} function body: TensorRT >= 10.15 inlines "
                         "it instead of using the plugin (build from the function-free TensorRT flavour)")
        for value in list(m.graph.input) + list(m.graph.output):
            self.check_value_type(value, "graph")
        for value in m.graph.input:
            dims = value.type.tensor_type.shape.dim
            for axis, dim in enumerate(dims):
                if not dim.HasField("dim_value") and not dim.dim_param:
                    self.add("profile", f"input {value.name}", f"axis {axis} is dynamic without a name")
        constants = {t.name for t in m.graph.initializer}
        for t in m.graph.initializer:
            if t.data_type not in SUPPORTED_TYPES:
                self.add("type", f"initializer {t.name}", f"element type {TensorProto.DataType.Name(t.data_type)}")
        self.check_graph(m.graph, "graph", constants, tainted=None)
        self.check_data_dependent_shapes(m.graph, constants)

    def check_value_type(self, value: onnx.ValueInfoProto, where: str) -> None:
        if value.type.HasField("tensor_type"):
            elem = value.type.tensor_type.elem_type
            if elem and elem not in SUPPORTED_TYPES:
                self.add("type", f"{where} {value.name}", f"element type {TensorProto.DataType.Name(elem)}")
        else:
            self.add("type", f"{where} {value.name}", "not a tensor (sequences, maps and optionals are not imported)")

    # ------------------------------------------------------------------ graph level
    def check_graph(self, graph: onnx.GraphProto, where: str, constants: set[str], tainted: set[str] | None) -> None:
        """``constants``: names known to be constants in scope. ``tainted``: inside a Loop body, the names that
        depend on the iteration number or a loop-carried value (None outside loops)."""
        constants = set(constants) | {t.name for t in graph.initializer}
        for node in graph.node:
            name = f"{where}/{node.name or node.op_type}"
            if node.op_type == "Constant":
                constants.update(node.output)
                self.check_constant(node, name)
            self.check_node(node, name, constants)
            if tainted is not None:
                if node.op_type in SHAPE_INPUTS:
                    for index in SHAPE_INPUTS[node.op_type]:
                        if index < len(node.input) and node.input[index] in tainted:
                            self.add("loop-shape", name, f"input {index} ({node.input[index]}) sets a shape from the "
                                     "loop iteration: TensorRT loop bodies need loop-invariant shapes")
                if any(i in tainted for i in node.input) or any(i in tainted for sub in _subgraphs(node).values()
                                                               for i in _reads(sub)):
                    tainted.update(node.output)

    def check_node(self, node: onnx.NodeProto, name: str, constants: set[str]) -> None:
        domain = node.domain or ""
        if domain == PLUGIN_DOMAIN:
            self.check_plugin(node, name)
            return
        if domain not in ("", "ai.onnx"):
            self.add("opset", name, f"operator {domain}::{node.op_type}: TensorRT imports no {domain!r} operators"
                     + (" (com.microsoft contrib operators are ONNX Runtime's)" if domain == "com.microsoft" else ""))
            return
        if node.op_type not in SUPPORTED_OPS:
            self.add("op", name, f"{node.op_type} has no importer in TensorRT {TENSORRT_VERSION}")
            return
        for index in CONSTANT_INPUTS.get(node.op_type, ()):
            if index < len(node.input) and node.input[index] and node.input[index] not in constants:
                self.add("constant-input", name, f"input {index} ({node.input[index]}) must be a constant")
        if node.op_type == "Cast":
            to = next((a.i for a in node.attribute if a.name == "to"), None)
            if to not in SUPPORTED_TYPES:
                self.add("type", name, f"Cast to {TensorProto.DataType.Name(to) if to else to}")
        handler = {"Loop": self.check_loop, "If": self.check_if, "Scan": self.check_scan}.get(node.op_type)
        if handler:
            handler(node, name, constants)

    def check_constant(self, node: onnx.NodeProto, name: str) -> None:
        for attr in node.attribute:
            if attr.name == "value" and attr.type == AttributeProto.TENSOR:
                if attr.t.data_type not in SUPPORTED_TYPES:
                    self.add("type", name, f"constant of type {TensorProto.DataType.Name(attr.t.data_type)}")
                    continue
                if attr.t.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16):
                    values = numpy_helper.to_array(attr.t).astype(np.float64)
                    if values.size and np.nanmax(np.abs(values)) > FP16_MAX:
                        self.add("fp16-range", name, f"float constant {values.flat[np.argmax(np.abs(values))]:g} is "
                                 "beyond the fp16 range: +-inf in a weakly typed fp16 engine")
            elif attr.name in ("value_float", "value_floats"):
                values = np.asarray(onnx.helper.get_attribute_value(attr), np.float64)
                if values.size and np.max(np.abs(values)) > FP16_MAX:
                    self.add("fp16-range", name, "float constant beyond the fp16 range")
            elif attr.name in ("value_string", "value_strings"):
                self.add("type", name, "string constant")

    def check_data_dependent_shapes(self, graph: onnx.GraphProto, constants: set[str]) -> None:
        """Follow the values of the graph inputs through the nodes (Shape and Size stop them: they read shapes) and
        report every shape input they reach."""
        values = {i.name for i in graph.input} - constants
        for node in graph.node:
            if node.op_type in SHAPE_ONLY_OPS or node.op_type == "Constant":
                continue
            name = f"graph/{node.name or node.op_type}"
            if node.op_type in DATA_SHAPED_OPS and (node.domain or "") in ("", "ai.onnx"):
                self.add("data-dependent-shape", name, f"{node.op_type}'s output shape depends on its input values")
            for index in SHAPE_INPUTS.get(node.op_type, ()):
                if index < len(node.input) and node.input[index] in values:
                    self.add("data-dependent-shape", name, f"input {index} ({node.input[index]}) sets a shape from the "
                             "values of a graph input: TensorRT cannot size it from the input shapes")
            if any(i in values for i in node.input) or any(i in values for sub in _subgraphs(node).values()
                                                            for i in _reads(sub)):
                values.update(node.output)

    # ------------------------------------------------------------------ control flow
    def check_loop(self, node: onnx.NodeProto, name: str, constants: set[str]) -> None:
        body = _subgraphs(node).get("body")
        if body is None:
            self.add("loop", name, "Loop without a body")
            return
        state = len(node.input) - 2
        if len(node.input) < 2:
            self.add("loop", name, "Loop needs its trip-count and condition inputs (either may be empty)")
            return
        if len(body.input) != len(node.input):
            self.add("loop", name, f"the body has {len(body.input)} inputs, the node {len(node.input)} (2 + state)")
            return
        scan_outputs = len(body.output) - 1 - state
        if scan_outputs < 0 or len(node.output) != state + scan_outputs:
            self.add("loop", name, f"body outputs {len(body.output)} do not match 1 + {state} state variables + "
                     f"{len(node.output) - state} scan outputs")
        if not node.input[1] and body.input[1].name in _reads(body):
            # onnxOpImporters.cpp, Loop: `if (inputs[1]) { ... ctx->registerTensor(cond, body.input(1).name()); }`
            self.add("loop", name, f"the body reads its condition input {body.input[1].name!r} but the node has no "
                     "condition input: the importer never registers it (\"Node input was not registered\")")
        if scan_outputs > 0 and not node.input[0]:
            self.add("loop", name, "scan outputs without a trip count: TensorRT cannot infer their length")
        tainted = {i.name for i in body.input}
        self.check_graph(body, name, constants, tainted)

    def check_if(self, node: onnx.NodeProto, name: str, constants: set[str]) -> None:
        branches = _subgraphs(node)
        if not node.input or not node.input[0]:
            self.add("if", name, "If without a condition input")
        for key in ("then_branch", "else_branch"):
            branch = branches.get(key)
            if branch is None:
                self.add("if", name, f"If without {key}")
                continue
            if len(branch.output) != len(node.output):
                self.add("if", name, f"{key} has {len(branch.output)} outputs, the node {len(node.output)}")
            if branch.input:
                self.add("if", name, f"{key} declares inputs: If branches take none")
            self.check_graph(branch, f"{name}/{key}", constants, None)

    def check_scan(self, node: onnx.NodeProto, name: str, constants: set[str]) -> None:
        attrs = {a.name: a for a in node.attribute}
        body = _subgraphs(node).get("body")
        if "num_scan_inputs" not in attrs or body is None:
            self.add("scan", name, "Scan needs a body and num_scan_inputs")
            return
        scan_inputs = attrs["num_scan_inputs"].i
        state = len(node.input) - scan_inputs
        if state < 0 or len(body.input) != len(node.input):
            self.add("scan", name, f"body inputs {len(body.input)} != node inputs {len(node.input)}")
        if len(body.output) != len(node.output) or len(body.output) < state:
            self.add("scan", name, f"body outputs {len(body.output)} != node outputs {len(node.output)}")
        self.check_graph(body, name, constants, {i.name for i in body.input})

    # ------------------------------------------------------------------ plugin node
    def check_plugin(self, node: onnx.NodeProto, name: str) -> None:
        fields = self.plugin_fields.get(node.op_type)
        if fields is None:
            self.add("plugin", name, f"{PLUGIN_DOMAIN}::{node.op_type} is not a registered plugin")
            return
        seen = set()
        for attr in node.attribute:
            seen.add(attr.name)
            field = fields.get(attr.name)
            if field is None:
                self.add("plugin", name, f"attribute {attr.name!r} is not a field of the {node.op_type} creator")
                continue
            got = ATTRIBUTE_FIELD_TYPES.get(attr.type)
            if got is None:
                kind = AttributeProto.AttributeType.Name(attr.type)
                self.add("plugin", name, f"attribute {attr.name!r} of type {kind} has no plugin-field mapping in the importer")
            elif (attr.type in LIST_ATTRIBUTES) != (field.kind == "INTS"):
                shape = "a list" if attr.type in LIST_ATTRIBUTES else "one value"
                self.add("plugin", name, f"attribute {attr.name!r} is {shape}, the field {field.kind} takes "
                         f"{'a list' if field.kind == 'INTS' else 'one value'}")
            elif got != field.trt_type:
                self.add("plugin", name, f"attribute {attr.name!r} reaches the creator as {got}, the field is "
                         f"{field.trt_type}")
            elif attr.type == AttributeProto.INT and not -INT32_MAX - 1 <= attr.i <= INT32_MAX:
                self.add("plugin", name, f"attribute {attr.name!r} = {attr.i} does not fit the kINT32 field")
            elif attr.type == AttributeProto.INTS and any(not -INT32_MAX - 1 <= v <= INT32_MAX for v in attr.ints):
                self.add("plugin", name, f"attribute {attr.name!r} has values that do not fit the kINT32 field")
        missing = [f for f in fields if f not in seen]
        if missing:
            self.add("plugin", name, f"attributes missing (the creator would use its defaults): {', '.join(missing)}")
        if node.op_type == MODEL_OP_TYPE:
            capacities = next((list(a.ints) for a in node.attribute if a.name == "capacities"), [])
            if not capacities or min(capacities) < 1:
                self.add("plugin", name, "capacities must be positive INTS, one per layer (the plugin rejects others)")
            return
        capacity = next((a.i for a in node.attribute if a.name == "capacity"), 0)
        if capacity < 1:
            self.add("plugin", name, "capacity must be a positive INT (0 means unset and the plugin rejects it)")


def check_tensorrt_model(model: onnx.ModelProto, plugin_fields=None) -> list[Violation]:
    """Every violation of the TensorRT importer's rules in ``model`` (empty list: it parses).

    ``plugin_fields``: the CriticalKVSelect creator's fields (default: ``plugin_field_specs()``).
    """
    if plugin_fields is None:
        plugin_fields = plugin_field_specs()
    checker = _Checker(model, plugin_fields)
    checker.check_model()
    return checker.violations


def check_tensorrt_file(path: str | Path) -> list[Violation]:
    """``check_tensorrt_model`` of an ONNX file (external weights are not loaded)."""
    return check_tensorrt_model(onnx.load(str(path), load_external_data=False))


def assert_tensorrt_parsable(path: str | Path) -> None:
    """Raise ValueError listing every violation when ``path`` breaks a TensorRT importer rule."""
    violations = check_tensorrt_file(path)
    if violations:
        raise ValueError(
            f"{Path(path).name}: TensorRT {TENSORRT_VERSION}'s ONNX importer would reject it: {describe(violations)}"
        )
