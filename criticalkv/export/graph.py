"""A small builder for ONNX graphs, subgraphs and function bodies (standard operators only).

``g = GraphBuilder("layer3/")`` then ``y = g.MatMul(x, w)`` appends a node and returns its output name;
``g.op("TopK", x, k, outputs=2, axis=-1)`` for several outputs. Names are unique over a whole model
(subgraphs share their parent's counter), which ONNX requires of subgraphs that read outer-scope values.
Constants are ``Constant`` nodes (function bodies cannot hold initializers), deduplicated per builder.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

#: The standard-operator set the graphs are written against (TensorRT 10 parses opsets up to 22).
OPSET = 21
#: ONNX IR version of the written models (ONNX Runtime >= 1.16 reads it).
IR_VERSION = 10

FLOAT = TensorProto.FLOAT
INT64 = TensorProto.INT64
INT32 = TensorProto.INT32
BOOL = TensorProto.BOOL
DOUBLE = TensorProto.DOUBLE


class GraphBuilder:
    """Accumulates nodes; every ``g.OpType(*inputs, **attributes)`` call adds one node.

    The element types are attributes too (``g.FLOAT``, ...), so that code given a builder (a method's ONNX piece,
    ``criticalkv.methods``) needs nothing else from this module.
    """

    FLOAT = FLOAT
    INT64 = INT64
    INT32 = INT32
    BOOL = BOOL
    DOUBLE = DOUBLE

    def __init__(self, prefix: str = "", parent: "GraphBuilder | None" = None):
        self.prefix = prefix
        self.nodes: list[onnx.NodeProto] = []
        self._counter = parent._counter if parent is not None else itertools.count()
        self._constants: dict[tuple, str] = {}

    def child(self, prefix: str | None = None) -> "GraphBuilder":
        """A builder for a subgraph (Loop/If body) sharing this builder's name counter."""
        return GraphBuilder(self.prefix if prefix is None else prefix, parent=self)

    def fresh(self, hint: str) -> str:
        return f"{self.prefix}{hint}_{next(self._counter)}"

    def op(
        self,
        op_type: str,
        *inputs: str,
        outputs: int | list[str] = 1,
        domain: str = "",
        name: str | None = None,
        hint: str | None = None,
        **attributes: Any,
    ) -> Any:
        """Append one node; returns its output name (or a list of names when it has several)."""
        names = outputs if isinstance(outputs, list) else [self.fresh(hint or op_type.lower()) for _ in range(outputs)]
        node = helper.make_node(op_type, list(inputs), names, name=name or self.fresh(op_type), domain=domain)
        # attributes are added apart from make_node: a KVPolicy knob is called `name`
        node.attribute.extend(helper.make_attribute(k, v) for k, v in attributes.items() if v is not None)
        self.nodes.append(node)
        return names[0] if len(names) == 1 else names

    def __getattr__(self, op_type: str):
        if not op_type[:1].isupper():
            raise AttributeError(op_type)
        return lambda *inputs, **attributes: self.op(op_type, *inputs, **attributes)

    # ------------------------------------------------------------------ constants
    def const(self, value: Any, dtype: Any = None, hint: str = "const") -> str:
        """A ``Constant`` node holding ``np.asarray(value, dtype)``; equal constants are shared."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._constants:
            self._constants[key] = self.op("Constant", value=numpy_helper.from_array(array), hint=hint)
        return self._constants[key]

    def i64(self, *values: int) -> str:
        """1-D int64 constant (shapes, axes, starts/ends)."""
        return self.const(list(values), np.int64, "i64")

    def scalar(self, value: Any, dtype: Any = np.int64) -> str:
        return self.const(value, dtype, "scalar")

    def attribute_const(self, attribute: str, kind: str, hint: str | None = None) -> str:
        """A ``Constant`` whose value is the enclosing function's attribute ``attribute`` (``ref_attr_name``).

        kind: ``"int"`` (an int64 scalar), ``"ints"`` (a 1-D int64 tensor) or ``"float"`` (a float32 scalar).
        """
        out = self.fresh(hint or attribute)
        node = helper.make_node("Constant", [], [out], name=self.fresh("Constant"))
        ref = onnx.AttributeProto()
        ref.name = {"int": "value_int", "ints": "value_ints", "float": "value_float"}[kind]
        ref.type = {"int": onnx.AttributeProto.INT, "ints": onnx.AttributeProto.INTS, "float": onnx.AttributeProto.FLOAT}[kind]
        ref.ref_attr_name = attribute
        node.attribute.append(ref)
        self.nodes.append(node)
        return out

    # ------------------------------------------------------------------ common idioms
    def shape_of(self, x: str, start: int, end: int | None = None) -> str:
        """Dims ``start:end`` of ``x`` as a 1-D int64 tensor."""
        return self.op("Shape", x, start=start, end=end, hint="shape")

    def slice_axis(self, x: str, start: str | int, end: str | int, axis: int) -> str:
        """``x`` sliced along one axis; start/end are ints or 1-D int64 names."""
        start = self.i64(start) if isinstance(start, int) else start
        end = self.i64(end) if isinstance(end, int) else end
        return self.Slice(x, start, end, self.i64(axis))

    def unsqueeze(self, x: str, *axes: int) -> str:
        return self.Unsqueeze(x, self.i64(*axes))

    def squeeze(self, x: str, *axes: int) -> str:
        return self.Squeeze(x, self.i64(*axes))

    def reshape(self, x: str, shape: str | list[int]) -> str:
        return self.Reshape(x, shape if isinstance(shape, str) else self.i64(*shape))

    def concat(self, *xs: str, axis: int = 0) -> str:
        return self.op("Concat", *xs, axis=axis)

    def graph(self, name: str, inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto], initializers=()) -> onnx.GraphProto:
        return helper.make_graph(self.nodes, name, inputs, outputs, initializer=list(initializers))

    @staticmethod
    def value_info(name: str, elem_type: int, shape: list[Any] | None) -> onnx.ValueInfoProto:
        """``value_info`` for code given only a builder (a method's Loop body, ``criticalkv.methods``)."""
        return value_info(name, elem_type, shape)


def value_info(name: str, elem_type: int, shape: list[Any] | None) -> onnx.ValueInfoProto:
    """``make_tensor_value_info`` (shape None: rank unknown)."""
    return helper.make_tensor_value_info(name, elem_type, shape)


def _names_read(node: onnx.NodeProto) -> set[str]:
    """Every value ``node`` reads, its subgraphs' references to the outer scope included."""
    names = {name for name in node.input if name}
    for attribute in node.attribute:
        for graph in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
            for inner in graph.node:
                names |= _names_read(inner)
            names |= {out.name for out in graph.output}
    return names


def live_nodes(nodes: list[onnx.NodeProto], outputs) -> list[onnx.NodeProto]:
    """``nodes`` without those whose outputs nothing reads (ONNX ops have no side effects; ONNX Runtime runs a dead
    node of a function body, e.g. a slice of the window attention that only some methods read). Every function
    body of the export goes through it.."""
    nodes = list(nodes)
    for node in nodes:  # the subgraphs first (an If branch only reads what its own nodes and outputs read)
        for attribute in node.attribute:
            for graph in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                inner = live_nodes(list(graph.node), [out.name for out in graph.output])
                del graph.node[:]
                graph.node.extend(inner)
    while True:
        read = set(outputs).union(*(_names_read(n) for n in nodes))
        kept = [n for n in nodes if any(o in read for o in n.output)]
        if len(kept) == len(nodes):
            return kept
        nodes = kept
