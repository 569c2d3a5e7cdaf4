"""The TensorRT backend: ``tensorrt/prefill.engine`` (CriticalKVSelect plugin layers) and
``tensorrt/decode.engine`` of an engine directory, on one CUDA GPU.

Same contract as the ONNX Runtime backend (``criticalkv.runtime.backend.Backend``):

* KV buffers: per layer l, K and V ``[max_batch, H_kv, cap_l, d_h]`` and lengths ``[max_batch, H_kv]``
  int32, allocated once on the GPU (torch tensors, so TensorRT reads them through raw addresses).
* ``prefill`` runs the prompt; the kept K/V stay on the GPU (``begin_decode`` copies them device to device
  into the buffers), only logits, lengths and indices come back to the host.
* ``load_row`` / ``move_row`` (the rows of ``Engine``'s slots) copy one row of the prefill outputs or of
  the buffers device to device.
* ``decode`` over the first B rows: one TensorRT launch, then every layer's new K/V is scattered at slot
  ``lengths[b, g]`` of its head and the lengths are incremented, all on the GPU stream. With
  ``cuda_graphs=True`` (default) that whole step is captured once per batch size B into a CUDA graph and
  replayed: one graph launch per token. The graphs read the buffers at fixed addresses (the first B rows),
  so a graph stays valid while sequences join, leave and move between rows; ``begin_decode`` (a new
  static batch from ``Engine.generate``) drops them.

Needs the ``tensorrt`` package (10.x), a CUDA GPU, PyTorch with CUDA, and the plugin library
(``scripts/build_plugin.sh``). Everything that does not need a GPU (dtype mapping, manifest checks) is
tested on CPU; ``tests/runtime/test_tensorrt_backend.py -m gpu`` runs the rest on a GPU machine.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from criticalkv.runtime.backend import NO_BUDGET_INPUT, BuiltShapes, PrefillOutputs, RowSnapshot, budget_feed
from criticalkv.runtime.manifest import EngineError

ENGINE_FOLDER = "tensorrt"
PREFILL_ENGINE = "prefill.engine"
DECODE_ENGINE = "decode.engine"

#: TensorRT DataType name -> torch dtype name.
TORCH_DTYPES = {
    "FLOAT": "float32",
    "HALF": "float16",
    "BF16": "bfloat16",
    "INT32": "int32",
    "INT64": "int64",
    "INT8": "int8",
    "BOOL": "bool",
}


def torch_dtype(trt_dtype: Any):
    """torch dtype of a TensorRT ``DataType`` (by name, so it also works on the enum's string form)."""
    import torch

    name = getattr(trt_dtype, "name", str(trt_dtype).rsplit(".", 1)[-1])
    if name not in TORCH_DTYPES:
        raise EngineError(f"TensorRT tensor type {name} is not supported by the criticalkv runtime")
    return getattr(torch, TORCH_DTYPES[name])


def engine_files(folder: Path, manifest: dict[str, Any]) -> tuple[Path, Path]:
    """Paths of the prefill and decode engines, or EngineError saying why this directory has none."""
    info = manifest.get("tensorrt") or {}
    if not info.get("built"):
        why = f"the TensorRT build failed: {info['error']}" if info.get("failed") else \
            info.get("skipped_reason", "the build did not try")
        raise EngineError(
            f"{folder}: no TensorRT engines in this engine directory ({why}). Rebuild it with "
            "scripts/build_engine.py on a machine with TensorRT 10, a CUDA GPU and the plugin "
            "(bash scripts/build_plugin.sh), or use the onnxruntime backend"
        )
    paths = (folder / ENGINE_FOLDER / PREFILL_ENGINE, folder / ENGINE_FOLDER / DECODE_ENGINE)
    for path in paths:
        if not path.is_file():
            raise EngineError(f"{folder}: missing {path.relative_to(folder)}; rebuild the engine")
    return paths


class TensorRTBackend(BuiltShapes):
    """Runs the TensorRT prefill and decode engines of an engine directory on ``device``."""

    name = "tensorrt"

    def __init__(self, folder: Path, manifest: dict[str, Any], device: int = 0, cuda_graphs: bool = True,
                 plugin_library: str | None = None, log_level: str = "WARNING"):
        from criticalkv.tensorrt import load_plugin_library, resolve_plugin_library, tensorrt_unavailable_reason

        self.folder = Path(folder)
        prefill_path, decode_path = engine_files(self.folder, manifest)
        reason = tensorrt_unavailable_reason()
        if reason is not None:
            raise EngineError(f"the tensorrt backend cannot run here: {reason}")
        import tensorrt as trt
        import torch

        self.trt, self.torch = trt, torch
        self.device = torch.device("cuda", device)
        torch.cuda.set_device(self.device)
        self.logger = trt.Logger(getattr(trt.Logger, log_level))
        # the plugin must be registered before an engine holding its layers is deserialized
        library = resolve_plugin_library(self.folder, manifest["tensorrt"].get("plugin_library"), plugin_library)
        load_plugin_library(library, trt.get_plugin_registry())
        runtime = trt.Runtime(self.logger)
        self.prefill_engine = runtime.deserialize_cuda_engine(prefill_path.read_bytes())
        self.decode_engine = runtime.deserialize_cuda_engine(decode_path.read_bytes())
        if self.prefill_engine is None or self.decode_engine is None:
            raise EngineError(f"{self.folder}: TensorRT could not deserialize the engines (built by another "
                              f"TensorRT version or GPU?); rebuild them here")
        self.prefill_context = self.prefill_engine.create_execution_context()
        self.decode_context = self.decode_engine.create_execution_context()
        self.stream = torch.cuda.Stream(self.device)
        self.read_shapes(manifest)
        self.use_graphs = cuda_graphs
        self._allocate()
        names = [self.prefill_engine.get_tensor_name(i) for i in range(self.prefill_engine.num_io_tensors)]
        self.accepts_kv_budget = "kv_budget" in names
        self._device_prefill: dict[str, Any] | None = None
        self._graphs: dict[int, Any] = {}  # batch B -> CUDA graph of one decode step over the first B rows
        self._graph = None
        self._batch = 0
        # host copy of every row's longest head per layer: the capacity check needs no device sync
        self._row_max = np.zeros((self.max_batch, self.num_layers), np.int64)

    # ------------------------------------------------------------------ buffers
    def _dtype(self, engine, name: str):
        return torch_dtype(engine.get_tensor_dtype(name))

    def _allocate(self) -> None:
        torch, eng = self.torch, self.decode_engine
        rows = (self.max_batch, self.kv_heads)
        zeros = lambda shape, name: torch.zeros(shape, dtype=self._dtype(eng, name), device=self.device)  # noqa: E731
        self.keys = [zeros(rows + (c, self.head_dim), f"past_key_values.{i}.key") for i, c in enumerate(self.capacities)]
        self.values = [zeros(rows + (c, self.head_dim), f"past_key_values.{i}.value") for i, c in enumerate(self.capacities)]
        self.lengths = [zeros(rows, f"past_key_values.{i}.lengths") for i in range(self.num_layers)]
        self.new_keys = [zeros(rows + (1, self.head_dim), f"present.{i}.key") for i in range(self.num_layers)]
        self.new_values = [zeros(rows + (1, self.head_dim), f"present.{i}.value") for i in range(self.num_layers)]
        self.logits = zeros((self.max_batch, self.vocab), "logits")
        self.token_ids = zeros((self.max_batch, 1), "input_ids")
        self.position_ids = zeros((self.max_batch, 1), "position_ids")

    def kv_buffer_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))

    # ------------------------------------------------------------------ prefill
    def prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                kv_budget: int | None = None) -> PrefillOutputs:
        torch, ctx, eng = self.torch, self.prefill_context, self.prefill_engine
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        if self.accepts_kv_budget:
            budget = self.built_budget if kv_budget is None else kv_budget
            kind = "tensor(int64)" if self._dtype(eng, "kv_budget") == torch.int64 else "tensor(int32)"
            feeds["kv_budget"] = budget_feed(budget, kind, len(eng.get_tensor_shape("kv_budget")))
        elif kv_budget is not None and kv_budget != self.built_budget:
            raise EngineError(NO_BUDGET_INPUT)
        keep_alive = []
        with torch.cuda.stream(self.stream):
            for name, array in feeds.items():
                tensor = torch.from_numpy(np.ascontiguousarray(array)).to(self.device, self._dtype(eng, name))
                keep_alive.append(tensor)
                ctx.set_input_shape(name, tuple(tensor.shape))
                ctx.set_tensor_address(name, tensor.data_ptr())
            outputs = {}
            for i in range(eng.num_io_tensors):
                name = eng.get_tensor_name(i)
                if eng.get_tensor_mode(name) != self.trt.TensorIOMode.OUTPUT:
                    continue
                shape = tuple(ctx.get_tensor_shape(name))  # min(n, capacity) is known from the input shapes
                outputs[name] = torch.empty(shape, dtype=self._dtype(eng, name), device=self.device)
                ctx.set_tensor_address(name, outputs[name].data_ptr())
            torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            if not ctx.execute_async_v3(self.stream.cuda_stream):
                raise EngineError("TensorRT prefill failed (see the TensorRT log)")
            self.stream.synchronize()
            seconds = time.perf_counter() - start
        self._device_prefill = outputs
        layers = range(self.num_layers)
        host = lambda name: outputs[name].float().cpu().numpy() if outputs[name].is_floating_point() else outputs[name].cpu().numpy()  # noqa: E731
        empty = np.zeros((0,), np.float32)  # kept K/V stay on the GPU (begin_decode copies them there)
        return PrefillOutputs(
            logits=host("logits"),
            keys=[empty for _ in layers],
            values=[empty for _ in layers],
            lengths=[host(f"present.{i}.lengths") for i in layers],
            indices=[host(f"present.{i}.indices") for i in layers],
            seconds=seconds,
        )

    # ------------------------------------------------------------------ decode
    def begin_decode(self, prefill: PrefillOutputs) -> None:
        self._graphs.clear()  # a new static batch: capture afresh
        self._batch = 0
        for row in range(prefill.logits.shape[0]):
            self.load_row(row, prefill, row)
        self._device_prefill = None  # free the prefill outputs

    def load_row(self, target: int, prefill: PrefillOutputs, row: int = 0) -> None:
        torch = self.torch
        self.check_row(target)
        if self._device_prefill is None:
            raise EngineError("load_row: run prefill on this backend first")
        out = self._device_prefill
        with torch.cuda.stream(self.stream):
            for i in range(self.num_layers):
                kept = out[f"present.{i}.key"].shape[2]
                self.keys[i][target].zero_()
                self.values[i][target].zero_()
                self.keys[i][target, :, :kept] = out[f"present.{i}.key"][row]
                self.values[i][target, :, :kept] = out[f"present.{i}.value"][row]
                self.lengths[i][target] = out[f"present.{i}.lengths"][row]
                self._row_max[target, i] = int(prefill.lengths[i][row].max())

    def save_row(self, row: int) -> RowSnapshot:
        self.check_row(row)
        keys, values, lengths = [], [], []
        with self.torch.cuda.stream(self.stream):
            for i in range(self.num_layers):
                n = int(self._row_max[row, i])  # the host knows each row's longest head: no device sync
                keys.append(self.keys[i][row, :, :n].clone())
                values.append(self.values[i][row, :, :n].clone())
                lengths.append(self.lengths[i][row].clone())
        return RowSnapshot(keys, values, lengths)

    def restore_row(self, row: int, snapshot: RowSnapshot) -> None:
        self.check_row(row)
        with self.torch.cuda.stream(self.stream):
            for i in range(self.num_layers):
                n = snapshot.keys[i].shape[1]
                if n > self.capacities[i]:
                    raise EngineError(f"layer {i}: a snapshot of {n} entries per head does not fit the KV buffer "
                                      f"({self.capacities[i]} entries per head)")
                self.keys[i][row, :, :n].copy_(snapshot.keys[i])
                self.values[i][row, :, :n].copy_(snapshot.values[i])
                self.lengths[i][row].copy_(snapshot.lengths[i])
                self._row_max[row, i] = n

    def move_row(self, source: int, target: int) -> None:
        torch = self.torch
        self.check_row(source)
        self.check_row(target)
        with torch.cuda.stream(self.stream):
            for i in range(self.num_layers):
                self.keys[i][target].copy_(self.keys[i][source])
                self.values[i][target].copy_(self.values[i][source])
                self.lengths[i][target].copy_(self.lengths[i][source])
        self._row_max[target] = self._row_max[source]

    def _use_rows(self, batch: int) -> None:
        """Point the decode context at the first ``batch`` rows (and pick or capture that batch's graph)."""
        torch = self.torch
        if batch == self._batch:
            return
        if not 1 <= batch <= self.max_batch:
            raise EngineError(f"decode over {batch} rows: the engine was built for at most {self.max_batch} "
                              "(rebuild with a larger --max-batch-size)")
        ctx = self.decode_context
        bindings = {"input_ids": self.token_ids, "position_ids": self.position_ids, "logits": self.logits}
        for i in range(self.num_layers):
            bindings.update({
                f"past_key_values.{i}.key": self.keys[i], f"past_key_values.{i}.value": self.values[i],
                f"past_key_values.{i}.lengths": self.lengths[i],
                f"present.{i}.key": self.new_keys[i], f"present.{i}.value": self.new_values[i],
            })
        for name, tensor in bindings.items():  # the first `batch` rows of each buffer are contiguous
            view = tensor[:batch]
            if self.decode_engine.get_tensor_mode(name) == self.trt.TensorIOMode.INPUT:
                ctx.set_input_shape(name, tuple(view.shape))
            ctx.set_tensor_address(name, view.data_ptr())
        self._batch = batch
        self._rows, self._heads = (t.to(self.device) for t in torch.meshgrid(
            torch.arange(batch), torch.arange(self.kv_heads), indexing="ij"))
        self._graph = None
        if self.use_graphs:
            if batch not in self._graphs:
                self._graphs[batch] = (self._capture(), self._rows, self._heads)
            self._graph, self._rows, self._heads = self._graphs[batch]

    def _step(self) -> None:
        """One decode step on self.stream: TensorRT, then the in-place cache update (capturable)."""
        if not self.decode_context.execute_async_v3(self.stream.cuda_stream):
            raise EngineError("TensorRT decode failed (see the TensorRT log)")
        batch, rows, heads = self._batch, self._rows, self._heads
        for i in range(self.num_layers):
            slots = self.lengths[i][:batch].long()
            self.keys[i][:batch][rows, heads, slots] = self.new_keys[i][:batch, :, 0]
            self.values[i][:batch][rows, heads, slots] = self.new_values[i][:batch, :, 0]
            self.lengths[i][:batch] += 1

    def _capture(self):
        torch = self.torch
        with torch.cuda.stream(self.stream):
            # TensorRT defers some setup to the first enqueue after a shape change: flush it outside the
            # capture (this launch only writes logits and present.*, which the first replay overwrites)
            if not self.decode_context.execute_async_v3(self.stream.cuda_stream):
                raise EngineError("TensorRT decode failed (see the TensorRT log)")
            self.stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.stream):
                self._step()
        return graph

    def decode(self, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        torch, batch = self.torch, len(tokens)
        # every head grows by one per step: the host knows each row's longest head
        full = np.nonzero(self._row_max[:batch] >= np.asarray(self.capacities)[None, :])
        if len(full[0]):
            layer = int(full[1][0])
            raise EngineError(f"layer {layer}: the KV buffer ({self.capacities[layer]} entries per head) is full")
        self._use_rows(batch)
        self._row_max[:batch] += 1
        with torch.cuda.stream(self.stream):
            self.token_ids[:batch, 0].copy_(torch.from_numpy(np.asarray(tokens, np.int64)))
            self.position_ids[:batch, 0].copy_(torch.from_numpy(np.asarray(positions, np.int64)))
            if self._graph is not None:
                self._graph.replay()
            else:
                self._step()
            logits = self.logits[:batch].float().cpu().numpy()  # synchronises the stream
        return logits

    def close(self) -> None:
        self._graph = None
        self._graphs.clear()
        self._device_prefill = None
        self.prefill_context = self.decode_context = None
        self.prefill_engine = self.decode_engine = None
