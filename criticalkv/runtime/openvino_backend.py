"""The OpenVINO backend: the engine's openvino-flavour graphs compiled by OpenVINO's CPU plugin, KV rows in host memory.

Graphs (``criticalkv.graphs``): ``prefill_openvino.onnx`` (the prompt, the selection inside: the nodes' bodies inlined,
since OpenVINO's ONNX frontend converts no model-local function; causal attention in 8 query pieces, each a
MatMul-Where-Softmax-MatMul chain over the keys its queries see, which the CPU plugin fuses into one attention
subgraph), ``decode_openvino.onnx`` (one token per row over each
row's first max(lengths) entries), and at first use
``extend_openvino.onnx`` (chunked prefill, a question after a context; with the engine's streams),
``select_openvino.onnx`` / ``select_context_openvino.onnx`` (the chunked prefill's selection) and ``reread.onnx`` (a
method's re-read passes: the portable graph, whose Loop OpenVINO converts). ``criticalkv.export.openvino_rules`` says
what the flavour avoids and why; a policy the CPU plugin cannot compute (defensivekv's 48-bit integer sums: the plugin
computes int64 as int32) has no openvino graphs, and this backend refuses its engine with that reason.

Precision (``precision``, ``$CRITICALKV_OV_PRECISION``): ``default`` is the CPU plugin's own inference precision
(bf16 on CPUs with AVX-512 BF16 or AMX, f32 elsewhere: the weights and activations of every MatMul in bf16), ``f32`` the
parity setting (the PyTorch path's kept entries). Threads: ``threads`` (``$CRITICALKV_OV_THREADS``; 0 = the plugin's
default). Compiled models are cached (``cache_dir``, ``$CRITICALKV_OV_CACHE``; default ``~/.cache/criticalkv/
openvino``, "" = off) in a folder per engine weights (their sha256 from the manifest: OpenVINO keys its cache by the
graph file, and two engines may share byte-identical graphs over other weights), so a second load skips the compilation.

KV rows: ``criticalkv.runtime.host_buffers`` (the layout of ONNX Runtime's portable graphs): the decode and extend
graphs return the new entries, written at each head's length here. Where the plugin computes in bf16 the rows hold
bfloat16 (the values it would round them to anyway, half the memory): the decode graph takes them as bf16 inputs
(``PrePostProcessor``), so no step converts a whole buffer (measured on the bundled model, budget 256: 9 ms of a 33 ms
step converted the float32 buffers to bf16 before slicing their held entries); an extend over a row runs on a float32
copy of it (the rows' values exactly), whose new entries are rounded back. f32: float32 rows. Inputs are handed to
OpenVINO without a copy (``share_inputs``); the decode request's are tensors over the buffers' first B rows, set once
per batch size B, so a step builds no feeds.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
from openvino.preprocess import PrePostProcessor

from criticalkv import graphs
from criticalkv.runtime.backend import ExtendOutputs, PrefillBuffer, PrefillOutputs, budget_feed
from criticalkv.runtime.host_buffers import HostKVBuffers
from criticalkv.runtime.manifest import EngineError, openvino_cannot_run

PRECISION_ENV = "CRITICALKV_OV_PRECISION"
THREADS_ENV = "CRITICALKV_OV_THREADS"
CACHE_ENV = "CRITICALKV_OV_CACHE"
#: ``default``: the CPU plugin's inference precision (bf16 where the CPU has it); ``f32``: full precision (parity).
PRECISIONS = ("default", "f32")


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest even (as the CPU plugin converts)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(x: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32 (exact)."""
    return (np.asarray(x, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "criticalkv" / "openvino"


class OpenVINOBackend(HostKVBuffers):
    """Runs an engine directory's openvino-flavour graphs on OpenVINO's CPU plugin (module docstring)."""

    name = "openvino"

    def __init__(self, folder: Path, manifest: dict[str, Any], precision: str | None = None, threads: int | None = None,
                 cache_dir: str | os.PathLike | None = None, device: str = "CPU"):
        self.folder = Path(folder)
        self.manifest = manifest
        reason = openvino_cannot_run(manifest)
        if reason:
            raise EngineError(f"{folder}: {reason}")
        info = manifest["onnx"]["openvino"]
        self.read_shapes(manifest)
        self.num_heads = manifest["model"]["spec"]["num_heads"]
        self.window = manifest["policy"]["window"]
        self.files = {**manifest["onnx"]["files"], **{f"{k}_openvino": v for k, v in info.items()
                                                       if k in ("prefill", "extend", "select", "select_context", "decode") and v}}
        precision = precision or os.environ.get(PRECISION_ENV) or "default"
        if precision not in PRECISIONS:
            raise ValueError(f"precision: {precision!r} is not one of {', '.join(PRECISIONS)}")
        threads = int(os.environ.get(THREADS_ENV, "0")) if threads is None else int(threads)
        self.core = ov.Core()
        self.device = device
        self.config: dict[str, Any] = {"PERFORMANCE_HINT": "LATENCY"}
        if precision == "f32":
            self.config["INFERENCE_PRECISION_HINT"] = "f32"
        if threads:
            self.config["INFERENCE_NUM_THREADS"] = threads
        cache = os.environ.get(CACHE_ENV) if cache_dir is None else str(cache_dir)
        cache = str(default_cache_dir()) if cache is None else cache
        if cache:  # one folder per engine weights (the graphs alone do not tell two engines apart)
            weights = (manifest.get("files") or {}).get("weights.bin", {}).get("sha256", "unknown")
            self.config["CACHE_DIR"] = str(Path(cache) / weights[:16])
        self._compiled: dict[str, Any] = {}
        self._requests: dict[str, Any] = {}
        self._decode_batch: int | None = None  # the batch size the decode request's inputs are set for
        self._decode_outputs = None  # the decode graph's output indices: logits, every layer's new K, new V
        start = time.perf_counter()
        self.compiled("prefill_openvino")
        #: the precision the CPU plugin computes in (``bf16`` / ``f32``)
        self.precision = self._compiled["prefill_openvino"].get_property("INFERENCE_PRECISION_HINT").to_string()
        #: bfloat16 rows (uint16 bits) where the plugin computes in bf16, else float32
        self.kv_dtype = np.dtype(np.uint16 if self.precision == "bf16" else np.float32)
        self.compiled("decode_openvino")
        #: seconds to read (or import from the cache) and compile the prefill and decode graphs
        self.load_s = time.perf_counter() - start
        self.has_extend = "extend_openvino" in self.files and "select_openvino" in self.files
        self.accepts_kv_budget = True
        #: the streams extend_openvino.onnx returns for the new entries (``criticalkv.methods.phases.Stream``)
        self.streams = frozenset(manifest.get("streams") or {})
        #: whether the engine's context policy has a select graph here (select_context_openvino.onnx)
        self.context_policies = "select_context_openvino" in self.files or not manifest.get("context_policy")
        self._allocate()
        self._indices: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    # ------------------------------------------------------------------ compiled graphs
    def compiled(self, graph: str):
        """The compiled model of engine graph ``graph`` (compiled at first use; EngineError when the engine lacks it)."""
        if graph not in self._compiled:
            name = self.files.get(graph)
            if name is None:
                raise EngineError(f"{self.folder}: this engine has no {graph} graph for OpenVINO; rebuild it with "
                                  "scripts/build_engine.py")
            try:
                model = str(self.folder / name)
                if graph == "decode_openvino" and self.kv_dtype == np.uint16:  # bf16 rows: bf16 inputs
                    model = PrePostProcessor(self.core.read_model(model))
                    for i in range(self.num_layers):
                        for past in (graphs.past_key(i), graphs.past_value(i)):
                            model.input(past).tensor().set_element_type(ov.Type.bf16)
                    model = model.build()
                self._compiled[graph] = self.core.compile_model(model, self.device, self.config)
            except RuntimeError as err:
                lines = [line for line in str(err).splitlines() if line.strip()]
                raise EngineError(f"{self.folder / name}: OpenVINO cannot compile it: {' '.join(lines[-6:])}") from None
            self._requests[graph] = self._compiled[graph].create_infer_request()
        return self._compiled[graph]

    def run(self, graph: str, inputs: dict[str, np.ndarray], copy: bool = True) -> dict[str, np.ndarray]:
        """Run ``graph`` on ``inputs`` (handed over without a copy); its outputs by name (copies unless ``copy`` is
        False: then views valid until the graph's next run)."""
        self.compiled(graph)
        request = self._requests[graph]
        if graph == "decode_openvino":  # these inputs replace the ones ``_decode_request`` set
            self._decode_batch = None
        request.infer(inputs, share_inputs=True, share_outputs=not copy)
        named = {}
        for out in request.model_outputs:  # an output may carry several names (the graph output's among them)
            data = request.get_tensor(out).data
            data = np.array(data) if copy else data
            named.update({name: data for name in out.names})
        return named

    def kv_budget(self, kv_budget: int | None) -> np.ndarray:
        return budget_feed(self.built_budget if kv_budget is None else kv_budget, "tensor(int64)", 1)

    # ------------------------------------------------------------------ prefill and decode
    def prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                kv_budget: int | None = None) -> PrefillOutputs:
        feeds = {graphs.INPUT_IDS: np.ascontiguousarray(input_ids, dtype=np.int64),
                 graphs.ATTENTION_MASK: np.ascontiguousarray(attention_mask, dtype=np.int64),
                 graphs.POSITION_IDS: np.ascontiguousarray(position_ids, dtype=np.int64),
                 graphs.KV_BUDGET: self.kv_budget(kv_budget)}
        start = time.perf_counter()
        out = self.run("prefill_openvino", feeds)
        return self._selected(out, logits=out[graphs.LOGITS], seconds=time.perf_counter() - start)

    def _selected(self, out: dict[str, np.ndarray], logits, seconds: float) -> PrefillOutputs:
        layers = range(self.num_layers)
        return PrefillOutputs(logits=logits, keys=[out[graphs.present_key(i)] for i in layers],
                              values=[out[graphs.present_value(i)] for i in layers],
                              lengths=[out[graphs.present_lengths(i)] for i in layers],
                              indices=[out[graphs.present_indices(i)] for i in layers], seconds=seconds)

    def _decode_request(self, batch: int):
        """The decode graph's infer request with its inputs set to the first ``batch`` rows of the buffers (tensors
        over their memory: a step writes its tokens there and runs), set again only when the batch size changes, as
        ONNX Runtime's IO binding is; and the output indices of the logits and of every layer's new K and V."""
        compiled = self.compiled("decode_openvino")
        request = self._requests["decode_openvino"]
        if self._decode_batch != batch:
            feeds = {graphs.INPUT_IDS: self.token_ids[:batch], graphs.POSITION_IDS: self.position_ids[:batch]}
            for i in range(self.num_layers):
                feeds[graphs.past_key(i)] = self.kv_input(self.keys[i][:batch])
                feeds[graphs.past_value(i)] = self.kv_input(self.values[i][:batch])
                feeds[graphs.past_lengths(i)] = self.lengths[i][:batch]
            for name, array in feeds.items():
                tensor = array if isinstance(array, ov.Tensor) else ov.Tensor(array, shared_memory=True)
                request.set_tensor(name, tensor)
            self._decode_batch = batch
        if self._decode_outputs is None:
            index = {name: j for j, port in enumerate(compiled.outputs) for name in port.names}
            layers = range(self.num_layers)
            self._decode_outputs = (index[graphs.LOGITS], [index[graphs.present_key(i)] for i in layers],
                                    [index[graphs.present_value(i)] for i in layers])
        return request

    def decode(self, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        batch = len(tokens)
        if not 1 <= batch <= self.max_batch:
            raise EngineError(f"decode over {batch} rows: the engine was built for at most {self.max_batch} "
                              "(rebuild with a larger --max-batch-size)")
        self.token_ids[:batch, 0] = tokens
        self.position_ids[:batch, 0] = positions
        request = self._decode_request(batch)
        request.infer()
        logits, keys, values = self._decode_outputs
        self.logits[:batch] = request.get_output_tensor(logits).data
        for i in range(self.num_layers):
            self.new_keys[i][:batch] = self.to_kv(request.get_output_tensor(keys[i]).data)
            self.new_values[i][:batch] = self.to_kv(request.get_output_tensor(values[i]).data)
        if batch not in self._indices:
            self._indices[batch] = tuple(np.indices((batch, self.kv_heads)))
        self.store_decoded(batch, *self._indices[batch])
        return self.logits[:batch]

    # ------------------------------------------------------------------ extend and select
    def extend(self, keys: list[np.ndarray], values: list[np.ndarray], lengths: list[np.ndarray],
               token_ids: np.ndarray, positions: np.ndarray, score_range: np.ndarray | None = None) -> ExtendOutputs:
        """N tokens per sequence over the buffers ``keys``/``values`` [B, H_kv, cap_l, d_h] and ``lengths`` [B, H_kv]
        (updated in place: the new entries land at each head's length, which grows by N); token_ids, positions [B, N]
        int64. ``score_range``: through the re-read graph (``Backend.reread_buffer``)."""
        graph = "extend_openvino" if score_range is None else "reread"
        if graph not in self.files:
            raise EngineError(f"{self.folder}: this engine has no {'re-read' if score_range is not None else 'extend'} "
                              "graph; rebuild it with the policy that needs it")
        self.check_room(keys, lengths, token_ids.shape[1])
        feeds = {graphs.INPUT_IDS: np.ascontiguousarray(token_ids, dtype=np.int64),
                 graphs.POSITION_IDS: np.ascontiguousarray(positions, dtype=np.int64)}
        if score_range is not None:
            feeds[graphs.SCORE_RANGE] = np.ascontiguousarray(score_range, dtype=np.int64)
        for i in range(self.num_layers):
            feeds[graphs.past_key(i)] = keys[i]
            feeds[graphs.past_value(i)] = values[i]
            feeds[graphs.past_lengths(i)] = lengths[i]
        out = self.run(graph, feeds, copy=False)  # views: the new K/V are copied once, into the buffers
        layers = range(self.num_layers)
        self.store_extended(keys, values, lengths, [out[graphs.present_key(i)] for i in layers],
                            [out[graphs.present_value(i)] for i in layers])
        return ExtendOutputs(  # copies of what outlives the graph's next run
            logits=np.array(out[graphs.LOGITS]), window_queries=[np.array(out[graphs.present_window_queries(i)])
                                                                 for i in layers],
            scores=None if score_range is None else [np.array(out[graphs.present_scores(i)]) for i in layers],
            streams={} if score_range is not None else
            {name: [np.array(out[graphs.present_stream(i, name)]) for i in layers] for name in self.streams})

    def extend_row(self, row: int, token_ids: np.ndarray, positions: np.ndarray) -> ExtendOutputs:
        """``extend`` over decode row ``row``; bf16 rows: over a float32 copy of the row (its values exactly), whose
        entries, the new ones rounded to bf16, are written back."""
        self.check_row(row)
        view = slice(row, row + 1)
        lengths = [n[view] for n in self.lengths]
        if self.kv_dtype == np.float32:
            return self.extend([k[view] for k in self.keys], [v[view] for v in self.values], lengths, token_ids, positions)
        keys = [from_bf16(k[view]) for k in self.keys]
        values = [from_bf16(v[view]) for v in self.values]
        out = self.extend(keys, values, lengths, token_ids, positions)
        for i in range(self.num_layers):
            n = int(lengths[i].max())
            self.keys[i][view, :, :n] = to_bf16(keys[i][:, :, :n])
            self.values[i][view, :, :n] = to_bf16(values[i][:, :, :n])
        return out

    def to_kv(self, x: np.ndarray) -> np.ndarray:
        return to_bf16(x) if self.kv_dtype == np.uint16 else x

    def kv_input(self, rows: np.ndarray):
        """Rows of a K or V buffer as the decode graph's input: bf16 bits as a bf16 tensor over the same memory."""
        return ov.Tensor(rows, rows.shape, ov.Type.bf16) if rows.dtype == np.uint16 else rows

    def extend_buffer(self, buffer: PrefillBuffer, token_ids: np.ndarray, positions: np.ndarray) -> ExtendOutputs:
        return self.extend(buffer.keys, buffer.values, buffer.lengths, token_ids, positions)

    def reread_buffer(self, buffer: PrefillBuffer, token_ids: np.ndarray, positions: np.ndarray,
                      score_range: np.ndarray) -> ExtendOutputs:
        return self.extend(buffer.keys, buffer.values, buffer.lengths, token_ids, positions, score_range)

    def select(self, buffer: PrefillBuffer, window_queries: list[np.ndarray], kv_budget: int | None = None,
               scores: list[np.ndarray] | None = None, context: bool = False) -> PrefillOutputs:
        """The selection over a prompt prefilled into ``buffer`` (``Backend.select``)."""
        graph = "select_context_openvino" if context else "select_openvino"
        compiled = self.compiled(graph)
        wanted = {name for port in compiled.inputs for name in port.names}
        feeds = {graphs.KV_BUDGET: self.kv_budget(kv_budget),
                 **self.select_feeds(buffer, window_queries, wanted, scores)}
        start = time.perf_counter()
        out = self.run(graph, feeds)
        return self._selected(out, logits=None, seconds=time.perf_counter() - start)

    def close(self) -> None:
        self._requests.clear()
        self._compiled.clear()
