"""The TensorRT backend: the engines in ``tensorrt/`` of an engine directory (``prefill.engine`` with the
CriticalKVSelect plugin layers, ``decode.engine``, and ``extend.engine`` / ``select.engine`` for chunked prefill and
the context cache), on one CUDA GPU.

Same contract as the ONNX Runtime backend (``criticalkv.runtime.backend.Backend``):

* KV buffers: per layer l, K and V ``[max_batch, H_kv, cap_l, d_h]`` and lengths ``[max_batch, H_kv]``
  int32, allocated once on the GPU (torch tensors, so TensorRT reads them through raw addresses).
* ``prefill`` runs the prompt; the kept K/V stay on the GPU (``begin_decode`` copies them device to device
  into the buffers), only logits, lengths and indices come back to the host.
* ``load_row`` / ``move_row`` (the rows of ``Engine``'s slots) copy one row of the prefill (or select) outputs or
  of the buffers device to device; ``save_row`` / ``restore_row`` copy a row's entries out and back (device tensors).
* ``decode`` over the first B rows: one TensorRT launch, then every layer's new K/V is scattered at slot
  ``lengths[b, g]`` of its head and the lengths are incremented, all on the GPU stream. With
  ``cuda_graphs=True`` (default) that whole step is captured once per batch size B into a CUDA graph and
  replayed: one graph launch per token. The graphs read the buffers at fixed addresses (the first B rows),
  so a graph stays valid while sequences join, leave and move between rows; ``begin_decode`` (a new
  static batch from ``Engine.generate``) drops them.
* ``extend`` (``extend_row`` over a slot's row, ``extend_buffer`` over a prefill buffer): N tokens through the
  extend engine, their K/V written at each head's length on the stream (``append_entries``), lengths += N; the
  capacity is checked on the host (each row's longest head is known there, as in ``decode``: no device sync).
* ``new_prefill_buffer(n)``: a prompt's K/V on the GPU, exactly n entries per head; ``select`` runs the selection
  over it and its outputs feed ``load_row`` like a prefill's. The select engine takes the prompt's K/V as they lie
  in the buffer: no shape in it depends on a tensor's values (docs/gpu.md).

Needs the ``tensorrt`` package (10.x), a CUDA GPU, PyTorch with CUDA, and the plugin library
(``scripts/build_plugin.sh``). Everything that does not need a GPU (dtype mapping, manifest checks, the entry
bookkeeping and the bindings of extend and select) is tested on CPU; ``tests/runtime/test_tensorrt_backend.py -m gpu``
runs the rest on a GPU machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from criticalkv import graphs
from criticalkv.runtime.backend import (
    BuiltShapes,
    ExtendOutputs,
    PrefillBuffer,
    PrefillOutputs,
    RowSnapshot,
    budget_feed,
    prefill_buffer_capacity,
)
from criticalkv.runtime.manifest import EngineError
from criticalkv.tensorrt import load_plugin_library, resolve_plugin_library, tensorrt_unavailable_reason

ENGINE_FOLDER = "tensorrt"
PREFILL_ENGINE = "prefill.engine"
DECODE_ENGINE = "decode.engine"
EXTEND_ENGINE = "extend.engine"
SELECT_ENGINE = "select.engine"
#: The engines of a directory, by graph; prefill and decode are always there, extend and select since chunked prefill.
GRAPHS = ("prefill", "decode", "extend", "select")

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
    name = getattr(trt_dtype, "name", str(trt_dtype).rsplit(".", 1)[-1])
    if name not in TORCH_DTYPES:
        raise EngineError(f"TensorRT tensor type {name} is not supported by the criticalkv runtime")
    return getattr(torch, TORCH_DTYPES[name])


def engine_files(folder: Path, manifest: dict[str, Any]) -> dict[str, Path]:
    """{graph: engine file} of the directory: ``prefill`` and ``decode`` always, ``extend`` and ``select`` when they
    were built (the manifest's ``tensorrt.engines``; a directory built before them has neither). EngineError saying
    why when it has no engines or one is missing."""
    info = manifest.get("tensorrt") or {}
    if not info.get("built"):
        why = f"the TensorRT build failed: {info['error']}" if info.get("failed") else \
            info.get("skipped_reason", "it was built with --backend torch, which exports no graph" if "onnx" not in
                     manifest else "the build did not try")
        raise EngineError(
            f"{folder}: no TensorRT engines in this engine directory ({why}). Rebuild it with "
            "scripts/build_engine.py on a machine with TensorRT 10, a CUDA GPU and the plugin "
            "(bash scripts/build_plugin.sh), or use the onnxruntime backend"
        )
    recorded = info.get("engines") or {"prefill": f"{ENGINE_FOLDER}/{PREFILL_ENGINE}",
                                       "decode": f"{ENGINE_FOLDER}/{DECODE_ENGINE}"}
    files = {}
    for graph in GRAPHS:
        if graph not in recorded:
            if graph in ("prefill", "decode"):
                raise EngineError(f"{folder}: the manifest records no TensorRT {graph} engine; rebuild the engine")
            continue
        path = folder / recorded[graph]
        if not path.is_file():
            raise EngineError(f"{folder}: missing {recorded[graph]}; rebuild the engine")
        files[graph] = path
    if ("extend" in files) != ("select" in files):
        raise EngineError(f"{folder}: the manifest records only one of the extend and select engines; rebuild the engine")
    return files


# ---------------------------------------------------------------------- host bookkeeping (no GPU needed)
def check_room(used: Sequence[int], new: int, capacities: Sequence[int]) -> None:
    """EngineError when ``new`` more entries per head do not fit: ``used[l]`` (layer l's longest head, known on the
    host) + new > ``capacities[l]`` (the ONNX Runtime backend's message)."""
    for layer, (count, capacity) in enumerate(zip(used, capacities)):
        if int(count) + new > capacity:
            raise EngineError(f"layer {layer}: {new} more entries do not fit the KV buffer "
                              f"({capacity} entries per head, {int(count)} used)")


def append_entries(keys, values, lengths, new_keys, new_values) -> None:
    """Write N new entries per head at each head's length, then lengths += N; in place, on the tensors' device and
    current stream (no host sync), views of a buffer included.

    keys, values : [B, H_kv, cap, d_h] torch tensors (a layer's buffer, or rows of it)
    lengths : [B, H_kv] int32 torch tensor, valid entries per head (each + N <= cap: ``check_room``)
    new_keys, new_values : [B, H_kv, N, d_h] the new tokens' entries (converted to the buffer's dtype)
    """
    import torch

    batch, heads, count = new_keys.shape[:3]
    device = keys.device
    slots = lengths.long().unsqueeze(-1) + torch.arange(count, device=device)  # [B, H_kv, N]
    rows = torch.arange(batch, device=device).view(-1, 1, 1).expand_as(slots)
    kv_heads = torch.arange(heads, device=device).view(1, -1, 1).expand_as(slots)
    keys[rows, kv_heads, slots] = new_keys.to(keys.dtype)
    values[rows, kv_heads, slots] = new_values.to(values.dtype)
    lengths += count


def prompt_entries(tensors: Sequence[Any], n: int) -> list[Any]:
    """The first ``n`` entries per head of each layer's prefill buffer [1, H_kv, cap, d_h] as contiguous tensors (what
    the select engine reads): the buffers themselves when they hold exactly n (``new_prefill_buffer(n)``: no copy),
    else contiguous copies."""
    out = []
    for tensor in tensors:
        if tensor.shape[2] < n:
            raise EngineError(f"select: the prefill buffer holds {tensor.shape[2]} entries per head, not {n}")
        out.append(tensor if tensor.shape[2] == n and tensor.is_contiguous() else tensor[:, :, :n].contiguous())
    return out


def extend_inputs(token_ids, position_ids, keys, values, lengths) -> dict[str, Any]:
    """The extend engine's inputs by name (``extend_tensorrt.onnx``): token_ids, position_ids [B, N]; per layer
    keys, values [B, H_kv, cap_l, d_h] and lengths [B, H_kv]."""
    named = {graphs.INPUT_IDS: token_ids, graphs.POSITION_IDS: position_ids}
    for i, (k, v, n) in enumerate(zip(keys, values, lengths)):
        named.update({graphs.past_key(i): k, graphs.past_value(i): v,
                      graphs.past_lengths(i): n})
    return named


def extend_outputs(num_layers: int) -> list[str]:
    """The extend engine's outputs: logits, then per layer the new key, value and window queries."""
    names = [graphs.LOGITS]
    for i in range(num_layers):
        names += [graphs.present_key(i), graphs.present_value(i), graphs.present_window_queries(i)]
    return names


#: Why the TensorRT backend runs no method phases (``criticalkv.methods.phases``: re-reads, streams) and no separate
#: context policy.
PHASES_REFUSAL = ("the TensorRT backend has no context-policy select engine and runs no method phases (re-read passes, "
                  "streams: its extend engine returns none, so it cannot fill the select engine's scores inputs); serve "
                  "this engine on ONNX Runtime or the torch backend, or build it with --context-policy engine")


def select_inputs(window_queries, keys, values, lengths, kv_budget) -> dict[str, Any]:
    """The select engine's inputs by name (``select_tensorrt.onnx``): per layer the window queries [1, H, w, d_h],
    the prompt's keys, values [1, H_kv, n, d_h] and lengths [1, H_kv]; then kv_budget."""
    named = {}
    for i, (q, k, v, n) in enumerate(zip(window_queries, keys, values, lengths)):
        named.update({graphs.window_queries(i): q, graphs.past_key(i): k, graphs.past_value(i): v,
                      graphs.past_lengths(i): n})
    named[graphs.KV_BUDGET] = kv_budget
    return named


def select_outputs(num_layers: int) -> list[str]:
    """The select engine's outputs: per layer the kept key, value, lengths and indices (the prefill's)."""
    return [name(i) for i in range(num_layers) for name in graphs.SELECTED]


@dataclass
class DevicePrefillBuffer(PrefillBuffer):
    """A ``PrefillBuffer`` of device tensors, and ``tokens``: the entries per head written so far (every head of a
    prompt holds the same number), known on the host."""

    tokens: int = 0


class TensorRTBackend(BuiltShapes):
    """Runs the TensorRT engines of an engine directory on ``device``."""

    #: no separate context policy (PHASES_REFUSAL): an engine built with one selects contexts with its own policy here
    context_policies = False
    #: no method phases (PHASES_REFUSAL): no streams, no re-read graph
    streams: frozenset[str] = frozenset()
    #: the extend engine's profile takes at most the build's extend_chunk tokens a run (``Engine.prefill_run``)
    fixed_extend_shapes = True

    name = "tensorrt"

    def __init__(self, folder: Path, manifest: dict[str, Any], device: int = 0, cuda_graphs: bool = True,
                 plugin_library: str | None = None, log_level: str = "WARNING"):
        self.folder = Path(folder)
        files = engine_files(self.folder, manifest)
        reason = tensorrt_unavailable_reason()
        if reason is not None:
            raise EngineError(f"the tensorrt backend cannot run here: {reason}")
        import tensorrt as trt  # optional: only on a GPU machine with TensorRT (checked just above)

        self.trt, self.torch = trt, torch
        self.device = torch.device("cuda", device)
        torch.cuda.set_device(self.device)
        self.logger = trt.Logger(getattr(trt.Logger, log_level))
        # the plugin must be registered before an engine holding its layers is deserialized
        library = resolve_plugin_library(self.folder, manifest["tensorrt"].get("plugin_library"), plugin_library)
        load_plugin_library(library, trt.get_plugin_registry())
        runtime = trt.Runtime(self.logger)
        engines = {graph: runtime.deserialize_cuda_engine(path.read_bytes()) for graph, path in files.items()}
        if any(engine is None for engine in engines.values()):
            raise EngineError(f"{self.folder}: TensorRT could not deserialize the engines (built by another "
                              f"TensorRT version or GPU?); rebuild them here")
        self._start(manifest, engines, torch.cuda.Stream(self.device), cuda_graphs)

    def _start(self, manifest: dict[str, Any], engines: dict[str, Any], stream, cuda_graphs: bool) -> None:
        """Everything once the engines exist (by graph): execution contexts, buffers, checks. Needs ``self.trt``,
        ``self.torch`` and ``self.device``."""
        self.prefill_engine, self.decode_engine = engines["prefill"], engines["decode"]
        # extend (N tokens over a slot's or a prefill buffer's entries) and select (the chunked prefill's last step)
        self.extend_engine, self.select_engine = engines.get("extend"), engines.get("select")
        self.has_extend = self.extend_engine is not None and self.select_engine is not None
        self.prefill_context = self.prefill_engine.create_execution_context()
        self.decode_context = self.decode_engine.create_execution_context()
        self.extend_context = self.extend_engine.create_execution_context() if self.has_extend else None
        self.select_context = self.select_engine.create_execution_context() if self.has_extend else None
        self.stream = stream
        self.read_shapes(manifest)
        self.use_graphs = cuda_graphs
        self._allocate()
        if self.has_extend:
            self._check_extend_engines()
        names = [self.prefill_engine.get_tensor_name(i) for i in range(self.prefill_engine.num_io_tensors)]
        self.accepts_kv_budget = graphs.KV_BUDGET in names
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
        self.keys = [zeros(rows + (c, self.head_dim), graphs.past_key(i)) for i, c in enumerate(self.capacities)]
        self.values = [zeros(rows + (c, self.head_dim), graphs.past_value(i)) for i, c in enumerate(self.capacities)]
        self.lengths = [zeros(rows, graphs.past_lengths(i)) for i in range(self.num_layers)]
        self.new_keys = [zeros(rows + (1, self.head_dim), graphs.present_key(i)) for i in range(self.num_layers)]
        self.new_values = [zeros(rows + (1, self.head_dim), graphs.present_value(i)) for i in range(self.num_layers)]
        self.logits = zeros((self.max_batch, self.vocab), graphs.LOGITS)
        self.token_ids = zeros((self.max_batch, 1), graphs.INPUT_IDS)
        self.position_ids = zeros((self.max_batch, 1), graphs.POSITION_IDS)

    def _check_extend_engines(self) -> None:
        """The extend engine reads the decode buffers and the prefill buffers it allocates, the select engine the
        prefill buffers: the same dtypes everywhere (raw addresses carry no type); and the extend profile's limits."""
        for i in range(self.num_layers):
            for part in graphs.PAST:
                name = part(i)
                types = {graph: self._dtype(engine, name) for graph, engine in
                         (("decode", self.decode_engine), ("extend", self.extend_engine), ("select", self.select_engine))}
                if len(set(types.values())) != 1:
                    raise EngineError(f"{self.folder}: {name} has the types {types} in the decode, extend and select "
                                      "engines; rebuild the engine")
        # the profile's largest [B, N] (the runtime extends one sequence at a time, at most extend_chunk tokens)
        self._extend_max = tuple(self.extend_engine.get_tensor_profile_shape(graphs.INPUT_IDS, 0)[2])

    def kv_buffer_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))

    # ------------------------------------------------------------------ prefill
    def prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                kv_budget: int | None = None) -> PrefillOutputs:
        torch, ctx, eng = self.torch, self.prefill_context, self.prefill_engine
        feeds = {graphs.INPUT_IDS: input_ids, graphs.ATTENTION_MASK: attention_mask, graphs.POSITION_IDS: position_ids}
        if self.accepts_kv_budget:
            budget = self.built_budget if kv_budget is None else kv_budget
            kind = "tensor(int64)" if self._dtype(eng, graphs.KV_BUDGET) == torch.int64 else "tensor(int32)"
            feeds[graphs.KV_BUDGET] = budget_feed(budget, kind, len(eng.get_tensor_shape(graphs.KV_BUDGET)))
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
            logits=host(graphs.LOGITS),
            keys=[empty for _ in layers],
            values=[empty for _ in layers],
            lengths=[host(graphs.present_lengths(i)) for i in layers],
            indices=[host(graphs.present_indices(i)) for i in layers],
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
                kept = out[graphs.present_key(i)].shape[2]
                self.keys[i][target].zero_()
                self.values[i][target].zero_()
                self.keys[i][target, :, :kept] = out[graphs.present_key(i)][row]
                self.values[i][target, :, :kept] = out[graphs.present_value(i)][row]
                self.lengths[i][target] = out[graphs.present_lengths(i)][row]
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
                # as load_row: nothing of the row's previous sequence stays behind its entries (a masked weight
                # times a non-finite leftover would still be NaN)
                self.keys[i][row, :, n:].zero_()
                self.values[i][row, :, n:].zero_()
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
        bindings = {graphs.INPUT_IDS: self.token_ids, graphs.POSITION_IDS: self.position_ids, graphs.LOGITS: self.logits}
        for i in range(self.num_layers):
            bindings.update({
                graphs.past_key(i): self.keys[i], graphs.past_value(i): self.values[i],
                graphs.past_lengths(i): self.lengths[i],
                graphs.present_key(i): self.new_keys[i], graphs.present_value(i): self.new_values[i],
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

    # ------------------------------------------------------------------ extend and select
    def _execute(self, graph: str, context, engine, inputs: dict[str, Any], outputs: list[str]) -> dict[str, Any]:
        """Bind ``inputs`` (contiguous device tensors, by name), allocate ``outputs`` at the shapes TensorRT infers
        from the input shapes, and enqueue ``engine`` on the stream (no sync). Returns the output tensors."""
        torch = self.torch
        for name, tensor in inputs.items():
            if not tensor.is_contiguous():
                raise EngineError(f"{graph}: input {name} is not contiguous")
            shape = tuple(tensor.shape)
            if not context.set_input_shape(name, shape):
                raise EngineError(f"{graph}: input {name} of shape {shape} is outside the engine's optimization profile "
                                  f"(min, opt, max {engine.get_tensor_profile_shape(name, 0)})")
            context.set_tensor_address(name, tensor.data_ptr())
        out = {}
        for name in outputs:
            shape = tuple(context.get_tensor_shape(name))
            if any(d < 0 for d in shape):  # the graphs have no data-dependent shapes (tensorrt_rules)
                raise EngineError(f"{graph}: output {name} has the unresolved shape {shape}")
            out[name] = torch.empty(shape, dtype=self._dtype(engine, name), device=self.device)
            context.set_tensor_address(name, out[name].data_ptr())
        if not context.execute_async_v3(self.stream.cuda_stream):
            raise EngineError(f"TensorRT {graph} failed (see the TensorRT log)")
        return out

    def _upload(self, engine, name: str, array: np.ndarray):
        """A host array as a device tensor of the engine input's dtype (on the stream)."""
        tensor = self.torch.from_numpy(np.ascontiguousarray(array))
        return tensor.to(self.device, self._dtype(engine, name))

    def extend(self, keys: list, values: list, lengths: list, token_ids: np.ndarray, positions: np.ndarray,
               used: np.ndarray | None = None) -> ExtendOutputs:
        """N tokens per sequence over device buffers ``keys``/``values`` [B, H_kv, cap_l, d_h] and ``lengths``
        [B, H_kv] (contiguous views, updated in place: the new entries land at each head's length, which grows by
        N). token_ids, positions: [B, N] int64 (absolute positions). ``used``: per layer the longest head, known on
        the host (updated in place); None reads it from the device (one sync). Returns the last token's logits
        [B, vocab] and per layer the window queries [B, H, min(N, window), d_h], float32 on the host."""
        if not self.has_extend:
            raise EngineError(f"{self.folder}: this engine has no TensorRT extend engine; rebuild it with "
                              "scripts/build_engine.py")
        torch, engine = self.torch, self.extend_engine
        token_ids = np.ascontiguousarray(token_ids, dtype=np.int64)
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        if token_ids.ndim != 2 or positions.shape != token_ids.shape or token_ids.shape[1] < 1:
            raise EngineError(f"extend: token_ids {token_ids.shape} and positions {positions.shape} must be the same "
                              "[B, N], N >= 1")
        batch, n_new = token_ids.shape
        if batch > self._extend_max[0] or n_new > self._extend_max[1]:
            raise EngineError(f"extend: [{batch}, {n_new}] tokens exceed the extend engine's [{self._extend_max[0]}, "
                              f"{self._extend_max[1]}] (one sequence, at most the build's extend_chunk tokens a run)")
        if used is None:
            used = np.array([int(n.max()) for n in lengths], np.int64)
        check_room(used, n_new, [k.shape[2] for k in keys])
        with torch.cuda.stream(self.stream):
            ids, pos = self._upload(engine, graphs.INPUT_IDS, token_ids), self._upload(engine, graphs.POSITION_IDS, positions)
            out = self._execute("extend", self.extend_context, engine, extend_inputs(ids, pos, keys, values, lengths),
                                extend_outputs(self.num_layers))
            for i in range(self.num_layers):
                append_entries(keys[i], values[i], lengths[i], out[graphs.present_key(i)], out[graphs.present_value(i)])
            logits = out[graphs.LOGITS].float().cpu().numpy()  # synchronises the stream
            queries = [out[graphs.present_window_queries(i)].float().cpu().numpy() for i in range(self.num_layers)]
        used += n_new
        return ExtendOutputs(logits=logits, window_queries=queries)

    def extend_row(self, row: int, token_ids: np.ndarray, positions: np.ndarray) -> ExtendOutputs:
        """``extend`` over decode buffer row ``row`` (token_ids, positions: [1, N]); the row's longest head per layer
        is known on the host (``_row_max``), as in ``decode``."""
        self.check_row(row)
        view = slice(row, row + 1)
        return self.extend([k[view] for k in self.keys], [v[view] for v in self.values],
                           [n[view] for n in self.lengths], token_ids, positions, used=self._row_max[row])

    def new_prefill_buffer(self, num_tokens: int | None = None, spare: int = 0) -> DevicePrefillBuffer:
        """Device buffers for one prompt of ``num_tokens`` tokens (default max_input_len) prefilled in chunks: every
        layer's K/V [1, H_kv, num_tokens, d_h] (zeros: entries beyond a head's length are masked, and a masked
        weight times a non-finite value would still be NaN) and lengths [1, H_kv] int32. No ``spare``: a re-read pass
        has no TensorRT graph."""
        if spare:
            raise EngineError(PHASES_REFUSAL)
        if not self.has_extend:
            raise EngineError(f"{self.folder}: this engine has no TensorRT extend engine; rebuild it with "
                              "scripts/build_engine.py")
        torch, engine = self.torch, self.extend_engine
        shape = (1, self.kv_heads, prefill_buffer_capacity(num_tokens, self.max_input_len), self.head_dim)
        with torch.cuda.stream(self.stream):
            zeros = lambda shape, name: torch.zeros(shape, dtype=self._dtype(engine, name), device=self.device)  # noqa: E731
            return DevicePrefillBuffer(
                keys=[zeros(shape, graphs.past_key(i)) for i in range(self.num_layers)],
                values=[zeros(shape, graphs.past_value(i)) for i in range(self.num_layers)],
                lengths=[zeros((1, self.kv_heads), graphs.past_lengths(i)) for i in range(self.num_layers)])

    def extend_buffer(self, buffer: PrefillBuffer, token_ids: np.ndarray, positions: np.ndarray) -> ExtendOutputs:
        """``extend`` over a prefill buffer (token_ids, positions: [1, N]); its filled length is known on the host."""
        known = isinstance(buffer, DevicePrefillBuffer)
        used = np.full(self.num_layers, buffer.tokens, np.int64) if known else None
        out = self.extend(buffer.keys, buffer.values, buffer.lengths, token_ids, positions, used=used)
        if known:
            buffer.tokens = int(used[0])
        return out

    def select(self, buffer: PrefillBuffer, window_queries: list[np.ndarray], kv_budget: int | None = None,
               scores: list | None = None, context: bool = False) -> PrefillOutputs:
        """The selection over a prompt prefilled into ``buffer`` (its last ``window`` queries per layer
        [1, H, w, d_h], host arrays): the same outputs as ``prefill``'s; the kept K/V stay on the GPU for
        ``load_row``. The select engine reads the prompt's n entries per head where they lie when the buffer holds
        exactly n (``new_prefill_buffer(n)``), else a contiguous copy of them. No ``scores`` and no ``context``
        policy: the plugin refuses a policy scored apart, and the context policy's select graph has the ONNX Runtime
        flavour only."""
        if scores is not None or context:
            raise EngineError(PHASES_REFUSAL)
        if not self.has_extend:
            raise EngineError(f"{self.folder}: this engine has no TensorRT select engine; rebuild it with "
                              "scripts/build_engine.py")
        torch, engine = self.torch, self.select_engine
        n = buffer.tokens if isinstance(buffer, DevicePrefillBuffer) else int(buffer.lengths[0].max())
        if n < 1:
            raise EngineError("select: the prefill buffer holds no tokens (extend it first)")
        budget = self.built_budget if kv_budget is None else kv_budget
        kind = "tensor(int64)" if self._dtype(engine, graphs.KV_BUDGET) == torch.int64 else "tensor(int32)"
        with torch.cuda.stream(self.stream):
            queries = [self._upload(engine, graphs.window_queries(i), np.asarray(q, np.float32))
                       for i, q in enumerate(window_queries)]
            budget_tensor = self._upload(engine, graphs.KV_BUDGET,
                                         budget_feed(budget, kind, len(engine.get_tensor_shape(graphs.KV_BUDGET))))
            inputs = select_inputs(queries, prompt_entries(buffer.keys, n), prompt_entries(buffer.values, n),
                                   buffer.lengths, budget_tensor)
            torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            outputs = self._execute("select", self.select_context, engine, inputs, select_outputs(self.num_layers))
            self.stream.synchronize()
            seconds = time.perf_counter() - start
        self._device_prefill = outputs
        layers = range(self.num_layers)
        empty = np.zeros((0,), np.float32)  # kept K/V stay on the GPU (load_row copies them there)
        return PrefillOutputs(
            logits=None,
            keys=[empty for _ in layers],
            values=[empty for _ in layers],
            lengths=[outputs[graphs.present_lengths(i)].cpu().numpy() for i in layers],
            indices=[outputs[graphs.present_indices(i)].cpu().numpy() for i in layers],
            seconds=seconds,
        )

    def close(self) -> None:
        self._graph = None
        self._graphs.clear()
        self._device_prefill = None
        self.prefill_context = self.decode_context = self.extend_context = self.select_context = None
        self.prefill_engine = self.decode_engine = self.extend_engine = self.select_engine = None
