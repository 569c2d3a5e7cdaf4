"""An ``onnx.reference`` implementation of ``CriticalKVSelect`` backed by the PyTorch oracle, and a
polygraphy comparison of a runtime's node against it.

``onnx.reference.ReferenceEvaluator(model, new_ops=[CriticalKVSelect])`` evaluates the node by
calling ``criticalkv.selection.select_layer`` (instead of the function body) and lays its result out
exactly as the node contract says (``docs/operator.md``). ``compare_with_reference`` runs a model on
ONNX Runtime (polygraphy ``OnnxrtRunner``, the function body) and on the reference evaluator (a
polygraphy runner around it) and compares every output exactly with polygraphy's ``Comparator``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Iterable

import numpy as np
import onnx
import torch
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun
from polygraphy.backend.base import BaseRunner
from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
from polygraphy.common import TensorMetadata
from polygraphy.comparator import Comparator
from polygraphy.comparator.compare import SimpleCompareFunc
from polygraphy.datatype import DataType

from criticalkv.node import DOMAIN, OP_TYPE, policy_from_attributes
from criticalkv.selection import gather_kv, select_layer


class CriticalKVSelect(OpRun):
    """``ai.criticalkv::CriticalKVSelect`` for ``onnx.reference``, computed by ``select_layer``.

    (``ReferenceEvaluator`` matches ``new_ops`` by class name and ``op_domain``, and prefers them to the
    model-local function of the same name.)
    """

    op_domain = DOMAIN

    def _run(self, queries, keys, values, o_proj_weight, prompt_lengths=None, kv_budget=None, rotation=None, **_):  # noqa: D401
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in self.onnx_node.attribute}
        policy, layer_idx, num_layers, capacity = policy_from_attributes(attributes)
        if kv_budget is not None and policy.method.base.evicts:  # the node clamps the request's budget
            requested = int(np.asarray(kv_budget).reshape(-1)[0])
            policy = policy.with_budget(min(max(requested, policy.min_budget), policy.budget))
        lengths = None if prompt_lengths is None else torch.from_numpy(np.asarray(prompt_lengths, dtype=np.int64))
        q, k, v, o = (torch.from_numpy(np.array(x, copy=True)) for x in (queries, keys, values, o_proj_weight))
        rotation = None if rotation is None else torch.from_numpy(np.array(rotation, copy=True))
        selection = select_layer(policy, q, k, v, o, layer_idx, num_layers, lengths, rotation=rotation)
        kept_keys, kept_values = gather_kv(selection, k, v)
        batch, heads, n, head_dim = keys.shape
        cap = min(n, capacity)
        if selection.indices.shape[-1] > cap:
            raise ValueError(f"a head keeps {selection.indices.shape[-1]} entries, more than the capacity {cap}")
        indices = np.full((batch, heads, cap), -1, np.int32)
        out_k = np.zeros((batch, heads, cap, head_dim), keys.dtype)
        out_v = np.zeros_like(out_k)
        width = selection.indices.shape[-1]
        indices[..., :width] = selection.indices.numpy()
        out_k[:, :, :width] = kept_keys.numpy()
        out_v[:, :, :width] = kept_values.numpy()
        return out_k, out_v, selection.lengths.numpy().astype(np.int32), indices


def reference_evaluator(model: onnx.ModelProto):
    """``ReferenceEvaluator`` that computes every ``CriticalKVSelect`` node with the PyTorch oracle."""
    return ReferenceEvaluator(model, new_ops=[CriticalKVSelect])


def reference_runner(model: onnx.ModelProto, name: str = "onnx-reference-oracle"):
    """A polygraphy runner around ``reference_evaluator(model)``."""
    class ReferenceRunner(BaseRunner):
        def __init__(self):
            super().__init__(name=name, prefix="onnx-reference-runner")

        def activate_impl(self):
            self.evaluator = reference_evaluator(model)

        def get_input_metadata_impl(self):
            meta = TensorMetadata()
            for value in model.graph.input:
                dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
                shape = [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
                meta.add(value.name, dtype=DataType.from_dtype(dtype), shape=shape)
            return meta

        def infer_impl(self, feed_dict):
            start = time.perf_counter()
            outputs = self.evaluator.run(None, dict(feed_dict))
            self.inference_time = time.perf_counter() - start
            return OrderedDict(zip((o.name for o in model.graph.output), outputs))

        def deactivate_impl(self):
            del self.evaluator

    return ReferenceRunner()


def compare_with_reference(model: onnx.ModelProto, feeds: Iterable[dict[str, np.ndarray]]) -> bool:
    """Run ``model`` on ONNX Runtime (its function bodies) and on the reference oracle through
    polygraphy (``OnnxrtRunner``, ``Comparator``); True when every output of every feed is identical."""
    runners = [OnnxrtRunner(SessionFromOnnx(model.SerializeToString())), reference_runner(model)]
    results = Comparator.run(runners, data_loader=list(feeds))
    exact = SimpleCompareFunc(atol=0.0, rtol=0.0, check_shapes=True)
    with np.errstate(divide="ignore", invalid="ignore"):  # polygraphy's relative error of 0 / 0
        return bool(Comparator.compare_accuracy(results, compare_func=exact))


__all__ = ["OP_TYPE", "CriticalKVSelect", "compare_with_reference", "reference_evaluator", "reference_runner"]
