"""ONNX Runtime sessions standing in for TensorRT engines, so that ``TensorRTBackend``'s own code (bindings by name,
output allocation, the entries written at each head's length, the host bookkeeping of rows and prefill buffers,
save/restore, select feeding load_row) runs on a machine without TensorRT or a GPU.

Each stand-in runs the graph TensorRT would build the engine from (the TensorRT flavour; the CriticalKVSelect
nodes get their ONNX function body back, which the plugin replaces on a GPU) with the tensors the backend binds, read
and written through their raw addresses as TensorRT does (torch CPU tensors here, CUDA tensors there). Like an
engine, a stand-in refuses input shapes outside the optimization profile the build gives it
(``criticalkv.tensorrt.engine_plan``). What this cannot check: TensorRT itself (parsing, kernels, the plugin, CUDA
streams and graphs); the ``gpu`` tests do.
"""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

#: ONNX Runtime type -> TensorRT DataType name (``criticalkv.runtime.tensorrt_backend.TORCH_DTYPES``)
TRT_TYPES = {"tensor(float)": "FLOAT", "tensor(int64)": "INT64", "tensor(int32)": "INT32"}
NUMPY_TYPES = {"FLOAT": np.float32, "INT64": np.int64, "INT32": np.int32}


class TensorIOMode:
    INPUT, OUTPUT = "INPUT", "OUTPUT"


class StandInTensorRT:
    """The parts of the ``tensorrt`` module the backend touches after loading its engines."""

    TensorIOMode = TensorIOMode


class DataType:
    def __init__(self, name: str):
        self.name = name


def memory(address: int, shape: tuple, dtype) -> np.ndarray:
    """A NumPy view of ``shape`` elements of ``dtype`` at a raw address (a torch CPU tensor's data_ptr())."""
    count = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.ctypeslib.as_array((ctypes.c_char * max(count, 1)).from_address(address))
    return raw[:count].view(dtype).reshape(shape)


class StandInEngine:
    """An ``ICudaEngine`` of one graph: its I/O names, modes and types, and an optimization profile
    {input: (min, opt, max)} (``profile_shapes`` of the build's plan)."""

    def __init__(self, onnx_path: Path, profile: dict):
        self.session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        self.outputs = {o.name: o for o in self.session.get_outputs()}
        self.names = list(self.inputs) + list(self.outputs)
        self.num_io_tensors = len(self.names)
        self.profile = profile

    def get_tensor_name(self, index: int) -> str:
        return self.names[index]

    def get_tensor_mode(self, name: str) -> str:
        return TensorIOMode.INPUT if name in self.inputs else TensorIOMode.OUTPUT

    def _info(self, name: str):
        return self.inputs.get(name) or self.outputs[name]

    def get_tensor_dtype(self, name: str) -> DataType:
        return DataType(TRT_TYPES[self._info(name).type])

    def get_tensor_shape(self, name: str) -> list[int]:
        return [d if isinstance(d, int) else -1 for d in self._info(name).shape]

    def get_tensor_profile_shape(self, name: str, profile_index: int):
        return self.profile[name]

    def create_execution_context(self) -> "StandInContext":
        return StandInContext(self)


class StandInContext:
    """An ``IExecutionContext``: input shapes within the profile, addresses, and ``execute_async_v3`` running the
    session on the bound memory (synchronously)."""

    def __init__(self, engine: StandInEngine):
        self.engine, self.shapes, self.addresses = engine, {}, {}
        self.executions = 0

    def set_input_shape(self, name: str, shape) -> bool:
        assert name in self.engine.inputs, f"{name} is not an input"
        shape = tuple(shape)
        declared = self.engine.get_tensor_shape(name)
        if len(shape) != len(declared) or any(d >= 0 and d != s for d, s in zip(declared, shape)):
            return False
        if name in self.engine.profile:
            low, _, high = self.engine.profile[name]
            if not all(a <= s <= b for a, s, b in zip(low, shape, high)):
                return False
        self.shapes[name] = shape
        return True

    def set_tensor_address(self, name: str, address: int) -> bool:
        assert name in self.engine.names, f"{name} is not an input or output"
        self.addresses[name] = address
        return True

    def _run(self) -> dict[str, np.ndarray]:
        feeds = {}
        for name, info in self.engine.inputs.items():
            shape = self.shapes.get(name, tuple(self.engine.get_tensor_shape(name)))
            feeds[name] = memory(self.addresses[name], shape, NUMPY_TYPES[TRT_TYPES[info.type]]).copy()
        return dict(zip(self.engine.outputs, self.engine.session.run(None, feeds)))

    def get_tensor_shape(self, name: str) -> tuple:
        if name in self.engine.inputs:
            return self.shapes[name]
        return self._run()[name].shape  # the graphs' output shapes follow from the input shapes alone

    def execute_async_v3(self, stream: int) -> bool:
        self.executions += 1
        for name, value in self._run().items():
            memory(self.addresses[name], value.shape, value.dtype)[...] = value
        return True


class Stream:
    cuda_stream = 0

    def synchronize(self) -> None:
        pass


def standin_engines(folder: Path, plan, policy, spec: dict) -> dict[str, StandInEngine]:
    """Stand-ins of the engines ``plan`` (``engine_plan``) builds from the engine directory ``folder``: the TensorRT
    flavours, CriticalKVSelect bodies put back (files ``*_standin.onnx`` beside them, for their external weights)."""
    from criticalkv.export.select_function import selection_function
    from criticalkv.tensorrt import onnx_graph_inputs, profile_shapes

    engines = {}
    for step in plan:
        path = step.onnx_path
        model = onnx.load(str(path), load_external_data=False)
        if any(n.op_type == "CriticalKVSelect" for n in model.graph.node):
            model.functions.append(selection_function(policy, spec["num_layers"], spec["num_heads"],
                                                      spec["num_kv_heads"], spec["head_dim"]))
            path = folder / path.name.replace(".onnx", "_standin.onnx")
            onnx.save(model, str(path))
        engines[step.graph] = StandInEngine(path, profile_shapes(onnx_graph_inputs(step.onnx_path), step.ranges))
    return engines


def standin_backend(folder: Path, monkeypatch):
    """A ``TensorRTBackend`` of the engine directory ``folder`` over stand-ins of its four engines, on the CPU
    (``torch.cuda.stream`` / ``synchronize`` patched to no-ops through ``monkeypatch``)."""
    import torch

    from criticalkv import KVPolicy
    from criticalkv.runtime import read_manifest
    from criticalkv.runtime.tensorrt_backend import TensorRTBackend
    from criticalkv.tensorrt import engine_plan

    manifest = read_manifest(folder, verify=False)
    build, shapes = manifest["build"], manifest["shapes"]
    policy = KVPolicy.from_dict(manifest["policy"])
    plan = engine_plan(
        folder / "prefill_tensorrt.onnx", folder / "decode.onnx", folder / "tensorrt", build["max_batch_size"],
        build["max_input_len"], max(shapes["prefill_capacity"]), onnx_extend_path=folder / "extend_tensorrt.onnx",
        onnx_select_path=folder / "select_tensorrt.onnx", extend_chunk=build["extend_chunk"], window=policy.window,
        extend_capacities=[max(c, build["max_input_len"]) for c in shapes["decode_capacity"]])
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    backend = TensorRTBackend.__new__(TensorRTBackend)
    backend.folder, backend.trt, backend.torch, backend.device = Path(folder), StandInTensorRT, torch, torch.device("cpu")
    backend._start(manifest, standin_engines(folder, plan, policy, manifest["model"]["spec"]), Stream(), cuda_graphs=False)
    return backend, manifest
