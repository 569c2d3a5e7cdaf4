"""The torch backend: an engine directory run by the model's own transformers layers, on CUDA or on the CPU.

No ONNX graph: the manifest names the checkpoint (``scripts/build_engine.py --backend torch``; any engine directory
whose manifest names a reachable checkpoint loads too), and the backend runs it through ``CompactDecoder``:

* ``prefill``: the prompt layer by layer (SDPA); right after each layer's attention its post-RoPE window queries,
  keys and values go through ``torch.ops.criticalkv.select_layer`` (``criticalkv.selection.op``: the CUDA kernels of
  plugins/ on the current stream; the PyTorch reference where the backend's ``selection`` allows it, said once per
  reason), and the layer's full K/V are dropped: at most one layer's full K/V exists at a time, beside the kept
  entries. No host synchronisation inside the layer loop; the kept lengths and indices come back to the host once,
  after the last layer. A model-level policy (``layer-defensivekv``, ``layer-kvzip``, ``layer-kvzip-criticalkv``) ranks
  each layer right after its attention (``torch.ops.criticalkv.layer_ranking``), keeps the rankings and every layer's
  K/V until the last one, and selects with ``select_model`` (``ModelSelection``).
* KV rows: per layer l, K and V ``[max_batch, H_kv, cap_l, d_h]`` in the model's dtype and the lengths
  ``[L, max_batch, H_kv]`` int64, allocated once (cap_l = the layer's selection capacity + max_question_len +
  max_new_tokens, the manifest's ``decode_capacity``). Each head holds its entries in its first ``lengths`` slots.
* ``decode`` over the first B rows: one static-shape step (RoPE at the absolute positions given, the new K/V at each
  head's length, attention under a length mask over the first ``span`` entries of each head: the batch's longest head
  rounded up by at most 1/8 (``span``), so a step reads about what its rows hold, not their whole capacity); on CUDA the
  first step of a shape runs eagerly and the step is then captured into a CUDA graph for it and replayed (one launch
  per token); B is padded up to 1, 2, 4 or a multiple of 8 (``padded_batch``), so a few graphs cover every batch. The graphs read the buffers at fixed
  addresses, so they stay valid while sequences join, leave and move between rows. Each row's longest head per layer
  is known on the host: the capacity check needs no device sync.
* ``extend_row`` / ``new_prefill_buffer`` / ``extend_buffer`` / ``select``: N tokens over a row or over a prompt's
  full-length buffer, and the selection over such a buffer (the chunked prefill's last step; the same kept set as
  ``prefill``), with the engine's policy or its context policy (the context cache's).
* A method's phases (``criticalkv.methods.phases``), as ONNX Runtime runs them: ``extend_buffer`` returns the engine's
  streams of the new entries, computed in the layer loop from each layer's attention input (no extra pass), and
  ``reread_buffer`` runs a re-read pass through the model's own layers over the buffer, scoring its past entries
  (``reread_scores``); ``select`` takes the scores they gave.

Where it runs: ``device`` (default: CUDA when torch sees a GPU, else the CPU); ``dtype`` (default: the manifest's
build dtype on CUDA, float32 on the CPU, where half precision is emulated). CI runs it on the CPU in float32 against
the ONNX Runtime engine (tests/runtime/test_torch_backend.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from criticalkv.errors import EngineError
from criticalkv.files import sha256_file
from criticalkv.hf.compress import model_rotation
from criticalkv.hf.decoder import CompactDecoder, decoder_shape
from criticalkv.hf.loading import check_supported, no_transformers_bars
from criticalkv.methods.phases import REREAD_PROMPT_ROOM, reread_scores
from criticalkv.policy import KVPolicy
from criticalkv.runtime.backend import (
    BuiltShapes,
    ExtendOutputs,
    PrefillBuffer,
    PrefillOutputs,
    RowSnapshot,
    prefill_buffer_capacity,
)
from criticalkv.selection.op import SELECTION_ENV, ModelSelection, resolve_implementation, select_layer_kv

#: The manifest section a torch engine directory carries instead of ``onnx``.
MANIFEST_KEY = "torch"
#: Checkpoint files whose size (and, for config.json, sha256) a torch engine records: a changed checkpoint is refused.
CHECKPOINT_PATTERNS = ("config.json", "*.safetensors", "*.bin")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def checkpoint_fingerprint(folder: str | os.PathLike) -> dict[str, Any]:
    """What identifies a checkpoint folder cheaply: config.json's sha256 and the size of every weight file."""
    folder = Path(folder)
    sizes = {}
    for pattern in CHECKPOINT_PATTERNS[1:]:
        for path in sorted(folder.glob(pattern)):
            sizes[path.name] = path.stat().st_size
    return {"config_sha256": sha256_file(folder / "config.json"), "weight_bytes": sizes}


def check_checkpoint(folder: Path, recorded: dict[str, Any] | None) -> None:
    """EngineError when the checkpoint ``folder`` is missing or differs from the one the engine was built from."""
    if not (folder / "config.json").is_file():
        raise EngineError(f"the engine's checkpoint {folder} is not there (no config.json): the torch backend loads "
                          "the model from it; rebuild the engine, or pass the model (model=...)")
    if recorded and checkpoint_fingerprint(folder) != recorded:
        raise EngineError(f"the checkpoint {folder} changed since the engine was built (config.json or the weight "
                          "files differ): rebuild it with scripts/build_engine.py --backend torch")


def load_checkpoint(folder: Path, dtype: torch.dtype, device: torch.device):
    """The transformers causal LM of ``folder`` in ``dtype`` on ``device`` (SDPA, eval mode, no gradients).

    With ``accelerate`` installed, transformers places each weight on a GPU as it reads it (``device_map``); without it
    (transformers refuses a ``device_map``, a device context or a default device then; a bare GPU image has no
    accelerate) the weights are read into host memory (safetensors are memory-mapped) and the model moves to the device
    once. On the CPU they are read where they run."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import is_accelerate_available

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    check_supported(AutoConfig.from_pretrained(folder))
    placement = {"device_map": str(device)} if device.type != "cpu" and is_accelerate_available() else {}
    with no_transformers_bars():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa", **placement)
    return model.to(device)  # without a device_map the move itself; with one a no-op unless a module was left elsewhere


class SelectionClock:
    """Time spent in the selection calls of one prefill, without a host sync between layers: CUDA events around
    each call on a GPU (read after the prefill's last sync), the wall clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.events: list = []
        self.seconds = 0.0

    def __call__(self, run):
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            out = run()
            end.record()
            self.events.append((begin, end))
            return out
        start = time.perf_counter()
        out = run()
        self.seconds += time.perf_counter() - start
        return out

    def total(self) -> float:
        """Seconds in the selection (after the stream has synchronised)."""
        return self.seconds + sum(begin.elapsed_time(end) for begin, end in self.events) / 1000.0


@dataclass
class TorchPrefillBuffer(PrefillBuffer):
    """A ``PrefillBuffer`` of device tensors (lengths int64), and ``tokens``: the entries per head written so far
    (every head of a prompt holds as many), known on the host."""

    tokens: int = 0


class TorchBackend(BuiltShapes):
    """Runs an engine directory with the model's own layers (module docstring)."""

    name = "torch"
    accepts_kv_budget = True
    has_extend = True

    def __init__(self, folder: Path, manifest: dict[str, Any], model=None, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None, cuda_graphs: bool = True, threads: int | None = None,
                 selection: str | None = None):
        """folder, manifest : the engine directory and its manifest. model : the transformers model to run (None:
        load the manifest's checkpoint; an in-memory model must be the one the engine was built for, its weights are
        used as they are, where they are). device : default the given model's device, else CUDA when available, else
        the CPU. dtype : the model's and the KV rows' dtype (default: the given model's; else the manifest's build dtype
        on CUDA, float32 on the CPU). cuda_graphs : capture decode steps (CUDA only). threads : torch's intra-op
        threads (process-wide; None leaves them). selection : which implementation selects
        (``criticalkv.selection.op``): "native" (the ops, refusing what they cannot run), "auto" (the ops where they
        run, the PyTorch reference elsewhere, said once per reason) or "reference"; default $CRITICALKV_SELECTION, else
        "auto" on CUDA and "reference" on the CPU (the ops' CPU registration is the host version, a check of the
        kernels' logic, not a fast path)."""
        self.folder = Path(folder)
        self.manifest = manifest
        self.read_shapes(manifest)
        self.policy = KVPolicy.from_dict(manifest["policy"])
        build = manifest["build"]
        if threads:
            torch.set_num_threads(int(threads))
        if device is None:
            device = model.device if model is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(device)
        if dtype is None and model is not None:
            dtype = model.dtype
        elif dtype is None:
            dtype = build.get("dtype", "float32") if self.device.type == "cuda" else "float32"
        self.selection = resolve_implementation(
            selection or os.environ.get(SELECTION_ENV) or ("auto" if self.device.type == "cuda" else "reference"))
        self.dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        if self.dtype not in DTYPES.values():
            raise EngineError(f"dtype {dtype}: the torch backend runs float32, float16 or bfloat16")
        if model is None:
            model = self._load(manifest)
        else:
            model = model.to(device=self.device, dtype=self.dtype)
        self.model = model.eval().requires_grad_(False)
        self._check_model()
        self.max_question_len = int(build.get("max_question_len", 0))
        self.max_positions = self.max_input_len + self.max_question_len + int(build["max_new_tokens"])
        context = KVPolicy.from_dict(manifest["context_policy"]) if manifest.get("context_policy") else None
        rereads = any(p is not None and p.method.scored_apart and p.method.base.rereads(p) for p in (self.policy, context))
        #: a re-read pass runs after the prompt (positions n, n + 1, ...): the RoPE tables cover twice the longest
        #: prompt and its own prompt's room then (the fused re-read graph's bound on ONNX Runtime)
        self.reread_positions = max(self.max_positions, 2 * self.max_input_len + REREAD_PROMPT_ROOM) if rereads else 0
        with torch.no_grad():
            self.decoder = CompactDecoder(self.model, max(self.max_positions, self.reread_positions))
        self.selection_capacities = list(manifest["shapes"]["prefill_capacity"])
        #: the policy the context cache's contexts are selected with, when the engine has one besides its own
        self.context_policy = KVPolicy.from_dict(manifest["context_policy"]) if manifest.get("context_policy") else None
        self.context_capacities = list(manifest["shapes"].get("context_capacity", self.selection_capacities))
        self.model_level = self._model_level(self.policy)
        self.equal_heads = bool(self.policy.method.base.equal_head_lengths)
        self._rotations: dict = {}
        self.rotation = self._rotation(self.policy)
        #: the streams its policies' methods read (``criticalkv.methods.phases.Stream``), computed in the layer loop;
        #: why one could not be (a model without the weights a stream needs): the engine refuses the policy that needs it
        self._streams, self.stream_refusals = {}, {}
        for policy in (self.policy, self.context_policy):
            if policy is not None and policy.method.scored_apart:
                try:
                    self._streams.update({s.name: s for s in policy.method.base.streams(policy, self.model)})
                except ValueError as err:
                    self.stream_refusals[policy.name] = str(err)
        self.streams = frozenset(self._streams)
        self.o_proj = [layer.self_attn.o_proj.weight for layer in self.decoder.layers]
        self._allocate()
        self.use_graphs = cuda_graphs and self.device.type == "cuda"
        self._graphs: dict[tuple, Any] = {}  # (padded batch P, span) -> CUDA graph of a step over rows 0..P-1
        self._pool = None
        self._capture_stream = None

    # ------------------------------------------------------------------ setup
    def _model_level(self, policy: KVPolicy) -> bool:
        return policy.method.base.model_level and self.num_layers > 1

    def _rotation(self, policy: KVPolicy):
        """RoPE's rotation tables of a policy that reads them (expected attention), on this backend's device."""
        if policy not in self._rotations:
            rotation = model_rotation(self.model, policy)
            self._rotations[policy] = None if rotation is None else rotation.to(self.device)
        return self._rotations[policy]

    def _load(self, manifest: dict[str, Any]):
        recorded = manifest.get(MANIFEST_KEY) or {}
        path = recorded.get("checkpoint") or manifest["model"].get("path")
        if not path:
            raise EngineError(f"{self.folder}: the manifest names no checkpoint (the engine was built from an "
                              "in-memory model): pass the model to the torch backend (model=...)")
        folder = Path(path)
        check_checkpoint(folder, recorded.get("fingerprint"))
        return load_checkpoint(folder, self.dtype, self.device)

    def _check_model(self) -> None:
        shape = decoder_shape(self.model)
        spec = self.manifest["model"]["spec"]
        want = {"num_layers": spec["num_layers"], "num_heads": spec["num_heads"],
                "num_kv_heads": spec["num_kv_heads"], "head_dim": spec["head_dim"], "vocab_size": spec["vocab_size"]}
        got = {key: getattr(shape, key) for key in want}
        if got != want:
            raise EngineError(f"the model does not match the engine's manifest: model {got}, manifest {want}")

    def _allocate(self) -> None:
        rows = (self.max_batch, self.kv_heads)
        options = dict(dtype=self.dtype, device=self.device)
        need = 2 * self.max_batch * self.kv_heads * self.head_dim * self.dtype.itemsize * sum(self.capacities)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            if need > free:
                raise EngineError(f"the KV rows need {need / 2**30:.1f} GiB ({self.max_batch} rows of "
                                  f"{need / self.max_batch / 2**30:.2f} GiB), {free / 2**30:.1f} GiB of {self.device} are "
                                  "free: rebuild with a smaller --max-batch-size, --max-input-len or budget")
        self.keys = [torch.zeros(rows + (cap, self.head_dim), **options) for cap in self.capacities]
        self.values = [torch.zeros(rows + (cap, self.head_dim), **options) for cap in self.capacities]
        self.length_block = torch.zeros((self.num_layers,) + rows, dtype=torch.int64, device=self.device)
        self.slots = [torch.arange(cap, device=self.device) for cap in self.capacities]
        self.last_slots = torch.tensor([cap - 1 for cap in self.capacities], device=self.device)[:, None, None]
        grid = torch.meshgrid(torch.arange(self.max_batch), torch.arange(self.kv_heads), indexing="ij")
        self.row_grid, self.head_grid = (t.to(self.device).contiguous() for t in grid)
        self.token_ids = torch.zeros(self.max_batch, dtype=torch.int64, device=self.device)
        self.position_ids = torch.zeros(self.max_batch, dtype=torch.int64, device=self.device)
        self.logits = torch.zeros(self.max_batch, self.vocab, dtype=torch.float32, device=self.device)
        self.greedy = torch.zeros(self.max_batch, dtype=torch.int64, device=self.device)  # each row's argmax
        self.host_greedy = torch.zeros(self.max_batch, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        # the host copy a decode step returns: page-locked on a GPU, so the copy runs at the bus's speed
        self.host_logits = torch.zeros(self.max_batch, self.vocab, dtype=torch.float32,
                                       pin_memory=self.device.type == "cuda")
        # host copy of every row's longest head per layer: capacity checks and copies need no device sync
        self._row_max = np.zeros((self.max_batch, self.num_layers), np.int64)

    def kv_buffer_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))

    # ------------------------------------------------------------------ prefill and selection
    def _budget(self, kv_budget: int | None) -> torch.Tensor | None:
        """The op's runtime budget (a checked request's, ``Request.checked``; None: the built budget)."""
        if kv_budget is None or kv_budget == self.built_budget:
            return None
        return torch.tensor([int(kv_budget)], dtype=torch.int32, device=self.device)

    def _select(self, i: int, queries, keys, values, prompt_lengths, budget, policy: KVPolicy | None = None,
                capacities: list[int] | None = None, scores=None):
        """Layer i's kept (keys, values, lengths, indices) from its post-RoPE window queries and full K/V (``policy``:
        default the engine's; ``scores`` [1, H_kv, n]: its method's phases' scores)."""
        policy = policy or self.policy
        capacity = (capacities or self.selection_capacities)[i]
        return select_layer_kv(policy, queries, keys, values, self.o_proj[i], i, self.num_layers, capacity,
                               prompt_lengths, budget, self._rotation(policy), scores, self.selection)

    def _model_selection(self, prompt_lengths, kv_budget: int | None, policy: KVPolicy | None = None,
                         capacities: list[int] | None = None) -> ModelSelection:
        """A model-level policy's selection, fed a layer at a time (``ModelSelection``): on the ops each layer's ranking
        is computed right after its attention and only it, and the layer's K/V, stay until the last layer."""
        policy = policy or self.policy
        lengths = None if prompt_lengths is None else prompt_lengths.to(torch.int64)
        return ModelSelection(policy, self.num_layers, capacities or self.selection_capacities, lengths, kv_budget,
                              self.selection, self._rotation(policy))

    def _outputs(self, logits, selected: list[tuple], start: float, clock: SelectionClock) -> PrefillOutputs:
        """PrefillOutputs from per-layer (keys, values, lengths, indices): K/V stay on the device, lengths and indices
        come to the host in one transfer."""
        keys = [s[0] for s in selected]
        values = [s[1] for s in selected]
        lengths = torch.stack([s[2] for s in selected]).cpu().numpy()
        indices = [s[3].cpu().numpy() for s in selected]
        logits = None if logits is None else logits.cpu().numpy()
        return PrefillOutputs(logits=logits, keys=keys, values=values, lengths=list(lengths.astype(np.int32)),
                              indices=indices, seconds=time.perf_counter() - start, selection_s=clock.total())

    @torch.no_grad()
    def prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                kv_budget: int | None = None) -> PrefillOutputs:
        """The prompt ([B, n] int64, left-padded) with the budget ``kv_budget`` (a checked request's: tokens per KV
        head in [min_budget, the built budget]; None: the built budget)."""
        start = time.perf_counter()
        mask = np.asarray(attention_mask)
        padded = not bool(mask.all())
        ids = torch.from_numpy(np.ascontiguousarray(input_ids, dtype=np.int64)).to(self.device)
        positions = torch.from_numpy(np.ascontiguousarray(position_ids, dtype=np.int64)).to(self.device)
        lengths = torch.from_numpy(mask.sum(1).astype(np.int32)).to(self.device) if padded else None
        window = min(self.policy.window, ids.shape[1])
        budget = self._budget(kv_budget)
        clock = SelectionClock(self.device)
        selected: list = []
        model = self._model_selection(lengths, kv_budget) if self.model_level else None

        def after_attention(i, q, k, v):
            if model is not None:  # every layer's K/V (and its ranking) stays until the last one: the budget spans layers
                clock(lambda: model.add(i, q[:, :, -window:].clone(), k, v, self.o_proj[i]))  # a copy: q goes now
                return
            selected.append(clock(lambda: self._select(i, q[:, :, -window:], k, v, lengths, budget)))

        logits = self.decoder.prefill_layers(ids, positions, lengths, after_attention)
        if model is not None:
            selected = clock(model.finish)
        return self._outputs(logits, selected, start, clock)

    # ------------------------------------------------------------------ rows
    def _write_row(self, target: int, keys: list, values: list, lengths: list) -> None:
        """Row ``target`` := per layer keys, values [H_kv, n_l, d_h] and lengths [H_kv] (host or device)."""
        for i in range(self.num_layers):
            n = keys[i].shape[1]
            if n > self.capacities[i]:
                raise EngineError(f"layer {i}: {n} entries per head do not fit the KV buffer "
                                  f"({self.capacities[i]} entries per head)")
            self.keys[i][target, :, :n].copy_(keys[i])
            self.values[i][target, :, :n].copy_(values[i])
            count = torch.as_tensor(np.asarray(lengths[i]) if isinstance(lengths[i], np.ndarray) else lengths[i])
            self.length_block[i, target].copy_(count)
            self._row_max[target, i] = n

    def begin_decode(self, prefill: PrefillOutputs) -> None:
        for row in range(prefill.lengths[0].shape[0]):
            self.load_row(row, prefill, row)

    def load_row(self, target: int, prefill: PrefillOutputs, row: int = 0) -> None:
        self.check_row(target)
        with torch.no_grad():
            self._write_row(target, [k[row] for k in prefill.keys], [v[row] for v in prefill.values],
                            [n[row] for n in prefill.lengths])
            # the longest head, not the output width: a left-padded batch's shorter prompts keep fewer entries
            self._row_max[target] = [int(n[row].max()) for n in prefill.lengths]

    def save_row(self, row: int) -> RowSnapshot:
        self.check_row(row)
        keys, values, lengths = [], [], []
        for i in range(self.num_layers):
            n = int(self._row_max[row, i])  # entries beyond every head's length are never read
            keys.append(self.keys[i][row, :, :n].clone())
            values.append(self.values[i][row, :, :n].clone())
            lengths.append(self.length_block[i, row].to(torch.int32))
        return RowSnapshot(keys, values, lengths)

    def restore_row(self, row: int, snapshot: RowSnapshot) -> None:
        self.check_row(row)
        with torch.no_grad():
            self._write_row(row, snapshot.keys, snapshot.values, snapshot.lengths)

    def move_row(self, source: int, target: int) -> None:
        self.check_row(source)
        self.check_row(target)
        with torch.no_grad():
            for i in range(self.num_layers):
                n = int(self._row_max[source, i])
                self.keys[i][target, :, :n].copy_(self.keys[i][source, :, :n])
                self.values[i][target, :, :n].copy_(self.values[i][source, :, :n])
            self.length_block[:, target].copy_(self.length_block[:, source])
        self._row_max[target] = self._row_max[source]

    # ------------------------------------------------------------------ decode
    def padded_batch(self, batch: int) -> int:
        """The rows a step over ``batch`` rows runs when captured: the next of 1, 2, 4, 8, then multiples of 8 (at most
        max_batch), so a server whose batch moves between 1 and 64 captures 11 graphs, not 64. The extra rows are free
        rows (the engine keeps its sequences in rows 0..B-1): what the step writes there is never read (their next
        sequence's load overwrites the lengths), and their slot index is clamped into the buffer."""
        if not self.use_graphs:
            return batch
        padded = batch if batch <= 2 else (4 if batch <= 4 else -(-batch // 8) * 8)
        return min(padded, self.max_batch)

    @staticmethod
    def span(longest: int) -> int:
        """The entries per head a step's attention reads when the batch's longest head holds ``longest`` (the new
        entry included): 256, then ``longest`` rounded up to a multiple of 1/8 of its power-of-two octave (2,049 ->
        2,304; a layer reads at most its capacity), so a step reads at most 1/8 more than its rows hold, with 8 CUDA
        graphs per doubling as the rows grow. (A power of two read 4,096 entries for a head of 2,049: 2x.)"""
        n = max(int(longest), 1)
        if n <= 256:
            return 256
        granule = 1 << ((n - 1).bit_length() - 4)  # n in (2^k, 2^(k+1)]: steps of 2^(k-3)
        return -(-n // granule) * granule

    def _step(self, batch: int, span: int) -> None:
        logits = self.decoder.decode_step(
            self.token_ids[:batch], self.position_ids[:batch], [k[:batch] for k in self.keys],
            [v[:batch] for v in self.values], self.length_block[:, :batch], self.row_grid[:batch],
            self.head_grid[:batch], self.slots, [min(span, cap) for cap in self.capacities], self.last_slots)
        self.logits[:batch].copy_(logits)
        torch.argmax(logits, dim=-1, out=self.greedy[:batch])  # the first maximum, as the host Sampler's argmax

    def _capture(self, batch: int, span: int):
        """A CUDA graph of one decode step over rows 0..batch-1 reading ``span`` entries per head (recording runs
        nothing: the buffers are untouched),
        on a side stream; every graph shares one memory pool (they never run at once, and no tensor of the pool
        outlives a step: its logits are copied into ``self.logits``)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._capture_stream = torch.cuda.Stream(self.device)
        graph = torch.cuda.CUDAGraph()
        stream = self._capture_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                self._step(batch, span)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return graph

    @torch.no_grad()
    def capture_graphs(self, max_rows: int | None = None, lengths: tuple[int, int] | None = None) -> list[tuple]:
        """Warm up and capture now, rather than at the first step of each, the decode graphs of every padded batch
        size up to ``max_rows`` (default max_batch) for rows whose longest head will hold ``lengths`` = (fewest, most)
        entries (default: up to the capacity). Only while no row holds a sequence (right after loading, or once every
        slot is released): the warm-up steps write into the free rows, which the next load overwrites. Returns the
        (rows, span) captured."""
        if not self.use_graphs:
            return []
        sizes = sorted({self.padded_batch(b) for b in range(1, (max_rows or self.max_batch) + 1)})
        low, high = lengths or (1, max(self.capacities))
        spans = sorted({min(self.span(n), self.span(max(self.capacities))) for n in range(low, high + 1)})
        done = []
        for size in sizes:
            for span in spans:
                if (size, span) not in self._graphs:
                    self._step(size, span)
                    self._graphs[(size, span)] = self._capture(size, span)
                done.append((size, span))
        self.length_block.zero_()
        self._row_max[:] = 0
        torch.cuda.synchronize(self.device)
        return done

    def decode(self, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        return self._decode(tokens, positions, self.logits, self.host_logits)

    def decode_greedy(self, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """``decode``, returning each row's argmax [B] int64 (taken on the device) instead of the logits."""
        return self._decode(tokens, positions, self.greedy, self.host_greedy)

    @torch.no_grad()
    def _decode(self, tokens: np.ndarray, positions: np.ndarray, result: torch.Tensor, host: torch.Tensor) -> np.ndarray:
        batch = len(tokens)
        if not 1 <= batch <= self.max_batch:
            raise EngineError(f"decode over {batch} rows: the engine was built for at most {self.max_batch} "
                              "(rebuild with a larger --max-batch-size)")
        full = np.nonzero(self._row_max[:batch] >= np.asarray(self.capacities)[None, :])
        if len(full[0]):
            layer = int(full[1][0])
            raise EngineError(f"layer {layer}: the KV buffer ({self.capacities[layer]} entries per head) is full")
        positions = np.asarray(positions, np.int64)
        if int(positions.max()) >= self.max_positions:
            raise EngineError(f"position {int(positions.max())} is beyond the engine's {self.max_positions} "
                              "(max_input_len + max_question_len + max_new_tokens)")
        self._row_max[:batch] += 1
        self.token_ids[:batch].copy_(torch.from_numpy(np.asarray(tokens, np.int64)))
        self.position_ids[:batch].copy_(torch.from_numpy(positions))
        padded = self.padded_batch(batch)
        span = min(self.span(int(self._row_max[:batch].max())), self.span(max(self.capacities)))
        graph = self._graphs.get((padded, span))
        if graph is not None:
            graph.replay()
        else:
            self._step(padded, span)
            if self.use_graphs:  # the eager step warmed this shape up; the next one replays its graph
                self._graphs[(padded, span)] = self._capture(padded, span)
        out = host[:batch]
        out.copy_(result[:batch], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return out.numpy()

    # ------------------------------------------------------------------ extend and select
    def _extend(self, keys, values, lengths, used: np.ndarray, token_ids, positions, equal_heads: bool,
                streams: bool = False, after_attention=None, max_positions: int | None = None) -> ExtendOutputs:
        token_ids = np.ascontiguousarray(token_ids, dtype=np.int64)
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        if token_ids.ndim != 2 or token_ids.shape[0] != 1 or positions.shape != token_ids.shape or token_ids.shape[1] < 1:
            raise EngineError(f"extend: token_ids {token_ids.shape} and positions {positions.shape} must be the same "
                              "[1, N], N >= 1")
        n_new = token_ids.shape[1]
        for i, (count, k) in enumerate(zip(used, keys)):
            if int(count) + n_new > k.shape[2]:
                raise EngineError(f"layer {i}: {n_new} more entries do not fit the KV buffer "
                                  f"({k.shape[2]} entries per head, {int(count)} used)")
        limit = max_positions or self.max_positions
        if int(positions.max()) >= limit:
            raise EngineError(f"position {int(positions.max())} is beyond the engine's {limit} " + (
                "(max_input_len + max_question_len + max_new_tokens)" if max_positions is None else
                "(2 x max_input_len + the room of a re-read's own prompt)"))
        ids = torch.from_numpy(token_ids).to(self.device)
        pos = torch.from_numpy(positions).to(self.device)
        computed: dict[str, list] = {name: [] for name in self._streams} if streams else {}

        def layer_input(i, h):  # the streams of the new entries, from the layer's attention input (no extra pass)
            for name, stream in self._streams.items():
                computed[name].append(stream.scores(i, h).cpu().numpy())

        logits, queries = self.decoder.extend(ids, pos, keys, values, lengths, [int(u) for u in used],
                                              self.policy.window, equal_heads, layer_input if computed else None,
                                              after_attention)
        used += n_new
        return ExtendOutputs(logits=logits.cpu().numpy(), window_queries=queries, streams=computed)

    @torch.no_grad()
    def extend_row(self, row: int, token_ids: np.ndarray, positions: np.ndarray) -> ExtendOutputs:
        self.check_row(row)
        view = slice(row, row + 1)
        # one mask for all heads only when the row's heads do hold equal counts: a context compressed by a context
        # policy of unequal heads (layer-kvzip-criticalkv) sits in the rows of an equal-heads engine policy, and the
        # slots between a short head's length and the longest's hold another sequence's entries
        held = self.length_block[:, row]
        equal = self.equal_heads and bool((held == held[:, :1]).all())
        return self._extend([k[view] for k in self.keys], [v[view] for v in self.values],
                            [self.length_block[i, view] for i in range(self.num_layers)], self._row_max[row],
                            token_ids, positions, equal)

    def new_prefill_buffer(self, num_tokens: int | None = None, spare: int = 0) -> TorchPrefillBuffer:
        """Device buffers for one prompt of ``num_tokens`` tokens (default max_input_len) prefilled in chunks, + ``spare``
        entries (the tokens a re-read pass appends for a while: ``reread_buffer``)."""
        shape = (1, self.kv_heads, prefill_buffer_capacity(num_tokens, self.max_input_len) + spare, self.head_dim)
        options = dict(dtype=self.dtype, device=self.device)
        return TorchPrefillBuffer(
            keys=[torch.zeros(shape, **options) for _ in range(self.num_layers)],
            values=[torch.zeros(shape, **options) for _ in range(self.num_layers)],
            lengths=[torch.zeros((1, self.kv_heads), dtype=torch.int64, device=self.device)
                     for _ in range(self.num_layers)])

    @torch.no_grad()
    def read_prompt(self, buffer: PrefillBuffer, start: int, end: int):
        """Copies of the entries [start, end) of every layer of a prefill buffer: keys and values [L, H_kv, t, d_h]
        (tensors on the backend's device)."""
        if not isinstance(buffer, TorchPrefillBuffer) or not 0 <= start < end <= buffer.tokens:
            raise EngineError(f"read_prompt: entries [{start}, {end}) are not all in the prefill buffer")
        return (torch.stack([k[0, :, start:end] for k in buffer.keys]),
                torch.stack([v[0, :, start:end] for v in buffer.values]))

    @torch.no_grad()
    def write_prompt(self, buffer: PrefillBuffer, keys: list, values: list) -> int:
        """Write the pieces ``keys`` / ``values`` ([L, H_kv, t_j, d_h] each) one after the other from entry 0 of an
        empty prefill buffer; its lengths become their total, which is returned."""
        total = sum(int(k.shape[2]) for k in keys)
        if not isinstance(buffer, TorchPrefillBuffer) or buffer.tokens or total > buffer.keys[0].shape[2]:
            raise EngineError(f"write_prompt: {total} entries into a prefill buffer that does not take them")
        for i in range(self.num_layers):
            for dst, pieces in ((buffer.keys[i], keys), (buffer.values[i], values)):
                dst[0, :, :total].copy_(torch.cat([p[i] for p in pieces], dim=1))
            buffer.lengths[i].fill_(total)
        buffer.tokens = total
        return total

    @torch.no_grad()
    def extend_buffer(self, buffer: PrefillBuffer, token_ids: np.ndarray, positions: np.ndarray) -> ExtendOutputs:
        if not isinstance(buffer, TorchPrefillBuffer):
            raise EngineError("extend_buffer: not a prefill buffer of the torch backend (new_prefill_buffer)")
        used = np.full(self.num_layers, buffer.tokens, np.int64)
        out = self._extend(buffer.keys, buffer.values, buffer.lengths, used, token_ids, positions, True, streams=True)
        buffer.tokens = int(used[0])
        return out

    @torch.no_grad()
    def reread_buffer(self, buffer: PrefillBuffer, token_ids: np.ndarray, positions: np.ndarray,
                      score_range: np.ndarray) -> ExtendOutputs:
        """A re-read pass through the model's own layers (``Backend.reread_buffer``): the tokens run over the buffer's
        entries (the prompt's ``score_range[3]``, then the pass's earlier runs'), and each layer's queries score the entries
        [start, end) (``criticalkv.methods.phases.reread_scores``, the re-read graph's math) right after its attention;
        ``ExtendOutputs.scores`` per layer [1, H_kv, P] float32 (host), 0 outside [start, end). The buffer's count of
        tokens is left as it was: the caller cuts the pass's entries off again (``buffer.lengths``)."""
        if not isinstance(buffer, TorchPrefillBuffer):
            raise EngineError("reread_buffer: not a prefill buffer of the torch backend (new_prefill_buffer)")
        sinks, start, end, context = (int(x) for x in np.asarray(score_range).reshape(-1))
        past = int(buffer.lengths[0].max())  # the prompt's entries, then the pass's earlier runs' (every head alike)
        scores = []

        def score(i, q, keys):
            layer = torch.zeros(1, self.kv_heads, past, dtype=torch.float32, device=self.device)
            layer[:, :, start:end] = reread_scores(q, keys, past, sinks, start, end, self.decoder.scaling[i], context)
            scores.append(layer.cpu().numpy())

        used = np.full(self.num_layers, past, np.int64)
        if not self.reread_positions:
            raise EngineError(f"{self.folder}: none of the engine's policies re-reads prompts (reread_buffer)")
        out = self._extend(buffer.keys, buffer.values, buffer.lengths, used, token_ids, positions, True,
                           after_attention=score, max_positions=self.reread_positions)
        out.scores = scores
        return out

    def join_window_queries(self, old: list, new: list, window: int) -> list:
        """The last ``window`` queries of a prompt prefilled in chunks: per layer [1, H, <= window, d_h] (device)."""
        return [torch.cat([a, b], dim=2)[:, :, -window:] for a, b in zip(old, new)]

    @torch.no_grad()
    def select(self, buffer: PrefillBuffer, window_queries: list, kv_budget: int | None = None,
               scores: list | None = None, context: bool = False) -> PrefillOutputs:
        """The selection over the prompt in ``buffer`` (per layer its last min(window, n) queries [1, H, w, d_h]):
        the outputs of ``prefill`` for ``load_row`` (no logits: the last chunk's extend gave them). ``scores``: per layer
        [1, H_kv, n], the scores of a policy whose method scores prompts apart; ``context``: with the engine's context
        policy (its capacities) instead of its own."""
        policy, capacities = self.policy, self.selection_capacities
        if context:
            if self.context_policy is None:
                raise EngineError(f"{self.folder}: the engine has no context policy of its own (select with context=False)")
            policy, capacities = self.context_policy, self.context_capacities
        if not isinstance(buffer, TorchPrefillBuffer):
            raise EngineError("select: not a prefill buffer of the torch backend (new_prefill_buffer)")
        n = buffer.tokens
        if n < 1:
            raise EngineError("select: the prefill buffer holds no tokens (extend it first)")
        start = time.perf_counter()
        window = min(policy.window, n)
        queries = [torch.as_tensor(q, device=self.device).to(self.dtype)[:, :, -window:] for q in window_queries]
        layers = [(q, k[:, :, :n], v[:, :, :n]) for q, k, v in zip(queries, buffer.keys, buffer.values)]
        given = None if scores is None else [torch.as_tensor(np.asarray(x), device=self.device).float() for x in scores]
        clock = SelectionClock(self.device)
        if self._model_level(policy):
            model = self._model_selection(None, kv_budget, policy, capacities)
            for i, (q, k, v) in enumerate(layers):
                clock(lambda: model.add(i, q, k, v, self.o_proj[i], None if given is None else given[i]))
            selected = clock(model.finish)
        else:
            budget = self._budget(kv_budget)
            selected = [clock(lambda: self._select(i, q, k, v, None, budget, policy, capacities,
                                                   None if given is None else given[i]))
                        for i, (q, k, v) in enumerate(layers)]
        return self._outputs(None, selected, start, clock)

    def synchronize(self) -> None:
        """Wait for the work queued on this backend's device (a no-op on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self._graphs.clear()
        self._pool = self._capture_stream = None
        self.keys = self.values = []
        self.decoder = self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def torch_manifest_section(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """The manifest's ``torch`` section for a checkpoint folder (``build_engine --backend torch``)."""
    folder = Path(checkpoint).resolve()
    return {"checkpoint": str(folder), "fingerprint": checkpoint_fingerprint(folder)}

