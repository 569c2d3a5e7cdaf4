"""The ONNX Runtime backend: prefill / decode sessions and KV buffers bound with IO binding.

KV buffers: per layer l, K and V ``[max_batch, H_kv, cap_l, d_h]`` float32 and lengths
``[max_batch, H_kv]`` int32, allocated once when the backend is created (cap_l = the layer's selection
capacity + the built max_question_len + max_new_tokens). Each head holds its valid entries in its first
``lengths`` slots, whatever graph wrote them. A decode over B rows binds the first B rows of every buffer
(contiguous views); the binding of each B is made once and kept (the serving scheduler changes B as
sequences join and leave). No per-step allocation and no copy of the cache in either decode form:

* ``decode="fused"`` (the default when the engine has ``decode_ort.onnx``): com.microsoft GroupQueryAttention
  reads each row's first entries only and writes the new token's K/V into the buffers itself (past and present
  are bound to the same memory), at slot ``seqlens_k`` = the row's longest head's length; a shorter head's new
  entry (policies whose heads keep different lengths, masked apart by the graph's attention bias) is then moved
  to that head's own length here, so the layout stays the one above and every other graph (extend, select) and
  row operation reads it unchanged. Its session prepacks its own copy of the weights (MLAS), measured 1.2x
  faster per step; the floats differ from the portable graph's by ~1e-5 (docs/performance.md, section 4).
  With float16 KV buffers (``--kv-dtype float16``) decode_ort.onnx instead casts each row's held entries to
  float32 and returns the new token's entries (float16), stored as the portable form's below; the extend graph
  then runs over a float32 copy of the row (``extend_row``).
* ``decode="portable"``: ``decode.onnx`` (the graph TensorRT parses; float32 buffers only) attends every head's whole capacity under a
  length mask and returns the new token's K/V, which the backend stores at slot ``lengths[b, g]`` of each head;
  with the shared weights and no prepacking it computes the floats of the PyTorch path's tests.

``decode="auto"`` (default; ``$CRITICALKV_ORT_DECODE``) picks fused when the engine has it (the manifest's
``onnx.fused_decode`` says why an engine has none), portable otherwise.

Prompts (``prefill``, the same three forms; ``$CRITICALKV_ORT_PREFILL``):

* ``prefill="fused"`` (the default when the engine has ``prefill_ort.onnx``): one com.microsoft GroupQueryAttention per
  layer over the whole prompt instead of the query-block Loop, the fused norms, the engine's weight format
  (``--weights``). Its graph takes prompts without padding: a left-padded batch of different lengths is prefilled one
  group of equal lengths at a time and the outputs merged into the left-padded layout (the same arrays the portable
  graph returns; kept indices are positions into the padded prompt). ``extend_ort.onnx`` (the chunked prefill's chunks,
  a question after a context) runs the same attention with the new entries written into the buffers in place, for
  one sequence whose heads hold equal lengths in each layer (ONNX Runtime's kernel takes several new tokens over a past
  for batch 1 only); ``extend_heads_ort.onnx`` the same for one sequence whose heads hold different lengths (a cached
  context of a policy that shares its budget across heads: a bias masks each head's hole, the runtime then moves the
  new entries to each head's length); other extends run ``extend.onnx``.
* ``prefill="portable"``: ``prefill.onnx`` and ``extend.onnx`` (fp32 weights, the Loop attention): the floats of the
  PyTorch path's tests; a chunked prefill in multiples of ``attention_chunk`` equals the one-shot prefill bitwise.

Weights (``weights="shared"``, the default): ``weights.bin`` is memory-mapped once and handed to the prefill,
extend and select sessions (and a portable decode session) as pre-allocated initializers
(``SessionOptions.add_initializer``) with MLAS weight prepacking off, so the process holds one copy (measured on
SmolLM2-135M: 0.56 GiB resident after loading instead of 1.6 GiB). The fused decode session loads and prepacks
its own (``prepack``, default on for the fused decode only: +0.6 GiB resident on SmolLM2-135M, docs/performance.md);
so do the fused prefill and extend sessions (``prefill_prepack``, default on for the fused prompt graphs: a packed copy
each, docs/performance.md section 5). ``weights="session"`` lets each session load and prepack its own copy.

Threads: ``threads`` (``$CRITICALKV_ORT_THREADS``; 0 = ONNX Runtime's default) intra-op threads per session, with
spinning off (``session.intra_op.allow_spinning = 0``) unless ``spinning`` (``$CRITICALKV_ORT_SPINNING=1``): a pool
thread that spins waits on a core another process holds, measured 2x slower per decode step on shared cores.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from criticalkv import graphs
from criticalkv.runtime.backend import ExtendOutputs, PrefillBuffer, PrefillOutputs, budget_feed
from criticalkv.runtime.host_buffers import HostKVBuffers
from criticalkv.runtime.manifest import EngineError
from criticalkv.weights import load_external_weights

#: Environment variable overriding ONNX Runtime's intra-op thread count (0 = ORT's default).
THREADS_ENV = "CRITICALKV_ORT_THREADS"
#: Environment variable choosing the decode graph when the caller does not (``DECODE_FORMS``).
DECODE_ENV = "CRITICALKV_ORT_DECODE"
#: Environment variable turning ONNX Runtime's pool-thread spinning back on ("1").
SPINNING_ENV = "CRITICALKV_ORT_SPINNING"
#: Environment variable choosing the prompt graphs (prefill, extend) when the caller does not (``DECODE_FORMS``).
PREFILL_ENV = "CRITICALKV_ORT_PREFILL"
#: The decode (and prompt) forms: ``auto`` (fused when the engine has the graph), ``fused``, ``portable``.
DECODE_FORMS = ("auto", "fused", "portable")


def _external_weights(onnx_path: Path) -> dict[str, np.ndarray]:
    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except Exception as err:  # protobuf DecodeError and friends
        raise EngineError(f"{onnx_path}: not a readable ONNX model ({type(err).__name__}: {err}); rebuild the engine") from None
    return load_external_weights(model, onnx_path.parent)


class OnnxRuntimeBackend(HostKVBuffers):
    """Runs ``prefill.onnx`` and ``decode.onnx`` of an engine directory on ONNX Runtime (CPU by default)."""

    name = "onnxruntime"

    def __init__(
        self,
        folder: Path,
        manifest: dict[str, Any],
        threads: int | None = None,
        profile: bool = False,
        providers: list[str] | None = None,
        weights: str = "shared",
        decode: str | None = None,
        prepack: bool | None = None,
        spinning: bool | None = None,
        prefill: str | None = None,
        prefill_prepack: bool | None = None,
        arena: bool = True,
    ):
        """folder, manifest : the engine directory and its manifest. threads : intra-op threads per session (None:
        ``$CRITICALKV_ORT_THREADS``, else ONNX Runtime's default). profile : profile the first prefill. providers :
        ONNX Runtime execution providers (CPU). weights : ``shared`` or ``session`` (module docstring). decode :
        ``auto`` / ``fused`` / ``portable`` (None: ``$CRITICALKV_ORT_DECODE``, else ``auto``; ``fused`` on an engine
        without decode_ort.onnx raises EngineError with the reason). prepack : MLAS weight prepacking in the decode
        session, which then loads its own weights (None: on for the fused decode, off for the portable one unless
        ``weights="session"``).
        spinning : let idle pool threads spin (None: ``$CRITICALKV_ORT_SPINNING`` == "1").
        prefill : ``auto`` / ``fused`` / ``portable``, the prompt graphs (prefill and extend; None:
        ``$CRITICALKV_ORT_PREFILL``, else ``auto``; ``fused`` on an engine without prefill_ort.onnx raises EngineError
        with the reason). prefill_prepack : MLAS weight prepacking in the fused prefill and extend sessions, which then
        load their own weights (None: on for the fused prompt graphs). arena : ONNX Runtime's CPU memory arena in every
        session (False: each run's tensors are allocated and freed, so a long prompt's peak is not kept afterwards)."""
        self.ort = ort
        self.folder = Path(folder)
        self.manifest = manifest
        if "onnx" not in manifest:
            raise EngineError(f"{folder}: no ONNX graphs in this engine directory (built with --backend torch): run "
                              "it on the torch backend, or rebuild it without --backend torch")
        self.read_shapes(manifest)
        self.num_heads = manifest["model"]["spec"]["num_heads"]
        self.window = manifest["policy"]["window"]  # the extend graph's window queries: the last min(N, window)
        files = manifest["onnx"]["files"]
        if threads is None:
            threads = int(os.environ.get(THREADS_ENV, "0"))
        self.threads = threads
        self.spinning = os.environ.get(SPINNING_ENV, "0") == "1" if spinning is None else bool(spinning)
        self.arena = bool(arena)
        self.providers = providers or ["CPUExecutionProvider"]
        if weights not in ("shared", "session"):
            raise ValueError(f"weights: {weights!r} is not 'shared' or 'session'")
        #: element type of the decode KV buffers (``BuildConfig.kv_dtype``)
        self.kv_dtype = np.dtype(manifest["build"].get("kv_dtype", "float32"))
        self.decode_form, self.decode_fallback = self._decode_form(decode or os.environ.get(DECODE_ENV) or "auto", files)
        self.fused = self.decode_form == "fused"
        fused_info = manifest["onnx"].get("fused_decode") or {}
        #: the decode graph writes the new entries into the buffers itself (GroupQueryAttention, float32 KV)
        self.in_place = self.fused and fused_info.get("attention", "group_query_attention") == "group_query_attention"
        #: fused decode: whether its graph masks heads of different lengths (False: the policy keeps equal lengths)
        self.per_head_lengths = bool(fused_info.get("per_head_lengths", True))
        self.shared_weights = weights == "shared"
        self.prepack = (self.fused or not self.shared_weights) if prepack is None else bool(prepack)
        self._weight_values = {}
        if self.shared_weights:  # one memory-mapped copy of the weights for the sessions that share it
            arrays = {}
            for graph in ("decode", "prefill", "extend", "select", "select_context", "reread"):
                if graph in files:
                    arrays.update(_external_weights(self.folder / files[graph]))
            self._weight_values = {name: ort.OrtValue.ortvalue_from_numpy(np.asarray(a)) for name, a in arrays.items()}
        self.profile = profile
        self.prefill_form, self.prefill_fallback = self._prompt_form(prefill or os.environ.get(PREFILL_ENV) or "auto", files)
        fused_prompt = self.prefill_form == "fused"
        self.prefill_prepack = fused_prompt if prefill_prepack is None else bool(prefill_prepack)
        prompt_prepack = self.prefill_prepack if fused_prompt else None
        self.prefill_path = self.folder / files["prefill_ort" if fused_prompt else "prefill"]
        self.prefill_session = self.session(self.prefill_path, threads, profile, prepack=prompt_prepack)
        #: the decode graph this backend runs (decode_ort.onnx when fused, else decode.onnx)
        self.decode_path = self.folder / files["decode_ort" if self.fused else "decode"]
        self.decode_session = self.session(self.decode_path, threads, False, prepack=self.prepack)
        # extend (N tokens over a slot's or a prefill buffer's entries) and select (the chunked prefill's last
        # step): engines built before these graphs existed have neither
        self.extend_session = self.session(self.folder / files["extend"], threads) if "extend" in files else None
        #: the fused extend (one sequence, equal head lengths, in place); None: every extend runs extend.onnx
        self.extend_fused_session = (self.session(self.folder / files["extend_ort"], threads, prepack=prompt_prepack)
                                     if fused_prompt and self.extend_session is not None else None)
        self.select_session = self.session(self.folder / files["select"], threads) if "select" in files else None
        self.has_extend = self.extend_session is not None and self.select_session is not None
        # the context policy's select graph (an engine with a context policy of its own)
        self.select_context_session = (self.session(self.folder / files["select_context"], threads)
                                       if "select_context" in files else None)
        # the re-read graphs of a policy whose method re-reads prompts (portable; fused: GroupQueryAttention's
        # probabilities), their sessions created at the first re-read (``reread_session``, ``reread_fused_session``):
        # 0.9 s of an 8.3 s load of the bundled model's engine, which most engines never spend (a context policy only
        # re-reads contexts)
        self._lazy = {"reread": (files.get("reread"), threads, None),
                      "reread_ort": (files.get("reread_ort") if fused_prompt else None, threads, prompt_prepack),
                      "extend_heads_ort": (files.get("extend_heads_ort") if fused_prompt else None, threads,
                                           prompt_prepack)}
        self._lazy_sessions: dict[str, Any] = {}
        #: the fused re-read graph's RoPE caches end here (a pass beyond runs the portable re-read graph)
        self.reread_max_positions = int((manifest["onnx"].get("fused_prompt") or {}).get("reread_max_positions", 0))
        #: the streams the extend graphs return for the new entries (``criticalkv.methods.phases.Stream``)
        self.streams = frozenset(manifest.get("streams") or {})
        self._allocate()
        budget_inputs = [i for i in self.prefill_session.get_inputs() if i.name == graphs.KV_BUDGET]
        self._budget_input = budget_inputs[0] if budget_inputs else None
        self.accepts_kv_budget = self._budget_input is not None
        self._bindings: dict[int, Any] = {}  # batch B -> IO binding of the first B rows
        self._binding = None
        self._batch = 0

    def _decode_form(self, decode: str, files: dict[str, str]) -> tuple[str, str | None]:
        """(the decode form to run, why it is not the fused one: None when it is)."""
        if decode not in DECODE_FORMS:
            raise ValueError(f"decode: {decode!r} is not one of {', '.join(DECODE_FORMS)}")
        if decode == "portable":
            if self.kv_dtype != np.float32:
                raise EngineError(f"{self.folder}: the engine's KV buffers are {self.kv_dtype} (built with --kv-dtype "
                                  f"{self.kv_dtype}): decode.onnx reads float32 buffers; only decode='fused' runs it")
            return "portable", "decode='portable' was asked for"
        if "decode_ort" in files:
            return "fused", None
        fused = self.manifest["onnx"].get("fused_decode") or {}
        reason = fused.get("refused") or "the engine was built before decode_ort.onnx existed; rebuild it"
        if decode == "fused":
            raise EngineError(f"{self.folder}: no fused decode graph (decode_ort.onnx): {reason}; use decode='portable'")
        return "portable", reason

    def _prompt_form(self, prefill: str, files: dict[str, str]) -> tuple[str, str | None]:
        """(the prompt graphs to run: fused or portable, why they are not the fused ones: None when they are)."""
        if prefill not in DECODE_FORMS:
            raise ValueError(f"prefill: {prefill!r} is not one of {', '.join(DECODE_FORMS)}")
        if prefill == "portable":
            return "portable", "prefill='portable' was asked for"
        if "prefill_ort" in files:
            return "fused", None
        info = self.manifest["onnx"].get("fused_prompt") or {}
        reason = info.get("refused") or "the engine was built before prefill_ort.onnx existed; rebuild it"
        if prefill == "fused":
            raise EngineError(f"{self.folder}: no fused prefill graph (prefill_ort.onnx): {reason}; use prefill='portable'")
        return "portable", reason

    def _lazy_session(self, graph: str):
        """The session of an engine graph created when first used (None: the engine has no such graph)."""
        if graph not in self._lazy_sessions:
            name, threads, prepack = self._lazy[graph]
            self._lazy_sessions[graph] = None if name is None else self.session(self.folder / name, threads, prepack=prepack)
        return self._lazy_sessions[graph]

    @property
    def reread_session(self):
        """reread.onnx's session (the extend graph that scores the past entries), or None: the engine re-reads nothing."""
        return self._lazy_session("reread")

    @property
    def extend_heads_session(self):
        """extend_heads_ort.onnx's session (the fused extend over heads of different lengths), or None: such extends
        run extend.onnx."""
        return self._lazy_session("extend_heads_ort")

    @property
    def reread_fused_session(self):
        """reread_ort.onnx's session (the re-read on the fused extend graph), or None: ``reread_session``."""
        return self._lazy_session("reread_ort")

    def session(self, path: Path, threads: int, profile: bool = False, prepack: bool | None = None):
        """An InferenceSession of one graph of the engine (shared weights bound, profiling if asked).

        prepack : MLAS weight prepacking; True makes the session load its own weights from weights.bin (prepacking the
        shared memory-mapped copy would add a packed copy per session). None: on with ``weights="session"`` only."""
        ort = self.ort
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = threads
        options.log_severity_level = 3
        options.enable_cpu_mem_arena = self.arena
        if not self.spinning:  # an idle pool thread yields its core at once (measured 2x faster on shared cores)
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        prepack = not self.shared_weights if prepack is None else prepack
        shared = self.shared_weights and not prepack
        if not prepack:
            options.add_session_config_entry("session.disable_prepacking", "1")
        if profile:
            options.enable_profiling = True
            options.profile_file_prefix = str(Path(os.environ.get("TMPDIR", "/tmp")) / f"criticalkv_prefill_{os.getpid()}")

        try:
            names = {t.name for t in onnx.load(str(path), load_external_data=False).graph.initializer}
        except Exception as err:
            raise EngineError(f"{path}: not a readable ONNX model ({type(err).__name__}: {err}); rebuild the engine") from None
        for name in names & set(self._weight_values) if shared else ():
            options.add_initializer(name, self._weight_values[name])
        try:
            return ort.InferenceSession(str(path), options, providers=self.providers)
        except Exception as err:
            raise EngineError(f"{path}: ONNX Runtime cannot load it ({type(err).__name__}: {err})") from None

    # ------------------------------------------------------------------ prefill
    def prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                kv_budget: int | None = None) -> PrefillOutputs:
        if self.prefill_form == "fused" and not np.all(attention_mask):
            return self._prefill_groups(input_ids, attention_mask, position_ids, kv_budget)
        return self._prefill(input_ids, attention_mask, position_ids, kv_budget)

    def _prefill_groups(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                        kv_budget: int | None) -> PrefillOutputs:
        """A left-padded batch through the fused prefill graph, which takes prompts without padding: each group of
        rows of one length runs without its padding, and the outputs are merged into the layout prefill.onnx returns
        for the padded batch (``PrefillOutputs``: [B, H_kv, min(n, capacity_l), ...], zero / -1 padded; kept indices
        are positions into the padded prompt, so a row of length m gets its own indices + n - m)."""
        start = time.perf_counter()
        batch, n = input_ids.shape
        lengths = attention_mask.sum(axis=1).astype(np.int64)
        if np.any(attention_mask != (np.arange(n)[None, :] >= (n - lengths)[:, None])):
            raise EngineError("prefill: attention_mask must be left padding (zeros, then ones) on every row")
        if np.any(lengths < 1):
            raise EngineError("prefill: every row needs at least one token")
        caps = [min(n, c) for c in self.manifest["shapes"]["prefill_capacity"]]
        logits = np.zeros((batch, self.vocab), np.float32)
        keys = [np.zeros((batch, self.kv_heads, c, self.head_dim), np.float32) for c in caps]
        values = [np.zeros_like(k) for k in keys]
        kept = [np.zeros((batch, self.kv_heads), np.int32) for _ in caps]
        indices = [np.full((batch, self.kv_heads, c), -1, np.int32) for c in caps]
        for m in np.unique(lengths):
            rows = np.nonzero(lengths == m)[0]
            ids = np.ascontiguousarray(input_ids[rows, n - m:])
            out = self._prefill(ids, np.ones_like(ids), np.ascontiguousarray(position_ids[rows, n - m:]), kv_budget)
            logits[rows] = out.logits
            for i in range(self.num_layers):
                width = out.keys[i].shape[2]
                keys[i][rows, :, :width] = out.keys[i]
                values[i][rows, :, :width] = out.values[i]
                kept[i][rows] = out.lengths[i]
                indices[i][rows, :, :width] = np.where(out.indices[i] >= 0, out.indices[i] + (n - m), -1)
        return PrefillOutputs(logits=logits, keys=keys, values=values, lengths=kept, indices=indices,
                              seconds=time.perf_counter() - start)

    def _prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                 kv_budget: int | None = None) -> PrefillOutputs:
        feeds = {graphs.INPUT_IDS: input_ids, graphs.ATTENTION_MASK: attention_mask, graphs.POSITION_IDS: position_ids}
        if self._budget_input is not None:
            budget = self.built_budget if kv_budget is None else kv_budget
            feeds[graphs.KV_BUDGET] = budget_feed(budget, self._budget_input.type, len(self._budget_input.shape))
        start = time.perf_counter()
        outputs = self.prefill_session.run(None, feeds)
        seconds = time.perf_counter() - start
        named = dict(zip((o.name for o in self.prefill_session.get_outputs()), outputs))
        layers = range(self.num_layers)
        return PrefillOutputs(
            logits=named[graphs.LOGITS],
            keys=[named[graphs.present_key(i)] for i in layers],
            values=[named[graphs.present_value(i)] for i in layers],
            lengths=[named[graphs.present_lengths(i)] for i in layers],
            indices=[named[graphs.present_indices(i)] for i in layers],
            seconds=seconds,
        )

    # ------------------------------------------------------------------ decode
    def _bind(self, name: str, array: np.ndarray, output: bool = False) -> None:
        element = helper.tensor_dtype_to_np_dtype(helper.np_dtype_to_tensor_dtype(array.dtype))
        bind = self._binding.bind_output if output else self._binding.bind_input
        bind(name, "cpu", 0, element, list(array.shape), array.ctypes.data)

    def _check_equal_lengths(self, lengths: list[np.ndarray], what: str) -> None:
        """A fused decode graph without the per-head mask (built for a policy whose heads keep equal lengths) would
        attend a shorter head's unwritten slots: refuse a row whose heads differ (``lengths``: per layer [H_kv])."""
        if not self.in_place or self.per_head_lengths:
            return
        for i, heads in enumerate(lengths):
            heads = np.asarray(heads)
            if heads.min() != heads.max():
                raise EngineError(f"layer {i}: {what} KV heads hold different lengths ({heads.tolist()}), which this "
                                  "engine's fused decode graph (built for a policy whose heads keep equal lengths) "
                                  "cannot mask; load the engine with decode='portable'")

    def _use_rows(self, batch: int) -> None:
        """Bind the first ``batch`` rows of every buffer (contiguous views), once per batch size."""
        if batch == self._batch:
            return
        if not 1 <= batch <= self.max_batch:
            raise EngineError(f"decode over {batch} rows: the engine was built for at most {self.max_batch} "
                              "(rebuild with a larger --max-batch-size)")
        if batch not in self._bindings:
            self._binding = self.decode_session.io_binding()
            self._bind(graphs.INPUT_IDS, self.token_ids[:batch])
            self._bind(graphs.POSITION_IDS, self.position_ids[:batch])
            for i in range(self.num_layers):
                self._bind(graphs.past_key(i), self.keys[i][:batch])
                self._bind(graphs.past_value(i), self.values[i][:batch])
                self._bind(graphs.past_lengths(i), self.lengths[i][:batch])
                if self.in_place:  # present = past, the same memory: GroupQueryAttention writes the new entry in place
                    self._bind(graphs.present_key(i), self.keys[i][:batch], output=True)
                    self._bind(graphs.present_value(i), self.values[i][:batch], output=True)
                else:
                    self._bind(graphs.present_key(i), self.new_keys[i][:batch], output=True)
                    self._bind(graphs.present_value(i), self.new_values[i][:batch], output=True)
            self._bind(graphs.LOGITS, self.logits[:batch], output=True)
            self._bindings[batch] = (self._binding, *np.indices((batch, self.kv_heads)))
        self._binding, self._rows, self._heads = self._bindings[batch]
        self._batch = batch

    def decode(self, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        self._use_rows(len(tokens))
        batch = self._batch
        self.token_ids[:batch, 0] = tokens
        self.position_ids[:batch, 0] = positions
        if self.in_place:
            return self._decode_fused(batch)
        self.decode_session.run_with_iobinding(self._binding)
        self.store_decoded(batch, self._rows, self._heads)
        return self.logits[:batch]

    def _decode_fused(self, batch: int) -> np.ndarray:
        """One step of decode_ort.onnx over rows 0..batch-1: the graph writes each row's new entry at slot
        ``longest`` (its longest head's length) of every head, in place; a shorter head's entry then moves to its own
        length (a hole between the two is what the graph's attention bias masks) and the written slot is zeroed, so each
        head's entries stay its first ``lengths`` slots and the slots after them hold what the portable decode leaves."""
        lengths = self._length_block[:, :batch]  # [L, B, H_kv]
        longest = lengths.max(axis=2)  # [L, B]: the slot the graph writes (checked before it writes)
        full = longest.max(axis=1) >= self._capacity_array
        if full.any():
            i = int(np.argmax(full))
            raise EngineError(f"layer {i}: the KV buffer ({self.capacities[i]} entries per head) is full")
        self.decode_session.run_with_iobinding(self._binding)
        if self.per_head_lengths:
            for i in range(self.num_layers):
                slots = lengths[i]  # [B, H_kv]
                rows, heads = np.nonzero(slots < longest[i][:, None])
                if rows.size:
                    written = longest[i][rows]
                    for buffer in (self.keys[i], self.values[i]):
                        buffer[rows, heads, slots[rows, heads]] = buffer[rows, heads, written]
                        # the written slot lies beyond that head's length: zero it, as the portable decode leaves it
                        # (a snapshot then holds the same padding whichever decode ran)
                        buffer[rows, heads, written] = 0
        lengths += 1
        return self.logits[:batch]

    # ------------------------------------------------------------------ extend and select
    def _run_bound(self, session, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        """Run ``session`` with every input bound in place (no copy) and the named outputs allocated by ONNX
        Runtime; returns them as NumPy arrays."""
        binding = session.io_binding()
        for name, array in inputs.items():
            binding.bind_cpu_input(name, array)
        for name in outputs:
            binding.bind_output(name, "cpu")
        session.run_with_iobinding(binding)
        return dict(zip(outputs, binding.copy_outputs_to_cpu()))

    def extend(self, keys: list[np.ndarray], values: list[np.ndarray], lengths: list[np.ndarray],
               token_ids: np.ndarray, positions: np.ndarray, score_range: np.ndarray | None = None) -> ExtendOutputs:
        """N tokens per sequence over the buffers ``keys``/``values`` [B, H_kv, cap_l, d_h] and ``lengths``
        [B, H_kv] (views, updated in place: the new entries land at each head's length, which grows by N).
        token_ids, positions: [B, N] int64 (absolute positions). ``score_range`` [4] int64: run the re-read graph
        instead (the past entries' scores in ``ExtendOutputs.scores``; ``Backend.reread_buffer``)."""
        session = self.extend_session
        if score_range is not None:
            session = self.reread_session
            if session is None:
                raise EngineError(f"{self.folder}: this engine has no re-read graph (none of its policies re-reads "
                                  "prompts); rebuild it with the policy that needs it")
        if session is None:
            raise EngineError(f"{self.folder}: this engine has no extend graph; rebuild it with scripts/build_engine.py")
        token_ids = np.ascontiguousarray(token_ids, dtype=np.int64)
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        self.check_room(keys, lengths, token_ids.shape[1])
        if self._fused_extend_fits(keys, values, lengths, score_range is not None) and (
                score_range is None or int(positions.max()) < self.reread_max_positions):
            return self._extend_fused(keys, values, lengths, token_ids, positions, score_range)
        if score_range is None and self._heads_extend_fits(keys, values, lengths):
            return self._extend_heads(keys, values, lengths, token_ids, positions)
        inputs = {graphs.INPUT_IDS: token_ids, graphs.POSITION_IDS: positions}
        names = [graphs.LOGITS]
        if score_range is not None:
            inputs[graphs.SCORE_RANGE] = np.ascontiguousarray(score_range, dtype=np.int64)
        for i in range(self.num_layers):
            inputs[graphs.past_key(i)] = keys[i]
            inputs[graphs.past_value(i)] = values[i]
            inputs[graphs.past_lengths(i)] = lengths[i]
            names += [graphs.present_key(i), graphs.present_value(i), graphs.present_window_queries(i)]
            if score_range is not None:
                names.append(graphs.present_scores(i))
            else:
                names += [graphs.present_stream(i, name) for name in sorted(self.streams)]
        out = self._run_bound(session, inputs, names)
        layers = range(self.num_layers)
        self.store_extended(keys, values, lengths, [out[graphs.present_key(i)] for i in layers],
                            [out[graphs.present_value(i)] for i in layers])
        return ExtendOutputs(logits=out[graphs.LOGITS], window_queries=[out[graphs.present_window_queries(i)]
                                                                   for i in range(self.num_layers)],
                             scores=None if score_range is None else [out[graphs.present_scores(i)]
                                                                      for i in range(self.num_layers)],
                             streams={} if score_range is not None else
                             {name: [out[graphs.present_stream(i, name)] for i in range(self.num_layers)]
                              for name in self.streams})

    def _fused_extend_fits(self, keys: list[np.ndarray], values: list[np.ndarray], lengths: list[np.ndarray],
                           score: bool = False) -> bool:
        """Whether extend_ort.onnx (``score``: reread_ort.onnx) can run this extend: the engine runs the fused
        prompt graphs, one sequence, every head of a layer holding the same length, float32 C-contiguous buffers
        (written in place)."""
        session = self.reread_fused_session if score else self.extend_fused_session
        if session is None or lengths[0].shape[0] != 1:
            return False
        return all(int(n.min()) == int(n.max()) and k.dtype == np.float32 and v.dtype == np.float32
                   and k.flags.c_contiguous and v.flags.c_contiguous for k, v, n in zip(keys, values, lengths))

    def _heads_extend_fits(self, keys: list[np.ndarray], values: list[np.ndarray], lengths: list[np.ndarray]) -> bool:
        """Whether extend_heads_ort.onnx can run this extend: one sequence, float32 C-contiguous buffers (written in
        place), whatever lengths its heads hold; the engine has the graph (a policy of it shares budgets across heads)."""
        if self.prefill_form != "fused" or lengths[0].shape[0] != 1 or self._lazy["extend_heads_ort"][0] is None:
            return False
        return all(k.dtype == np.float32 and v.dtype == np.float32 and k.flags.c_contiguous and v.flags.c_contiguous
                   for k, v in zip(keys, values))

    def _extend_heads(self, keys: list[np.ndarray], values: list[np.ndarray], lengths: list[np.ndarray],
                      token_ids: np.ndarray, positions: np.ndarray) -> ExtendOutputs:
        """``extend`` through extend_heads_ort.onnx: the graph writes the N new entries at slots [longest, longest + N)
        of every head of a layer (longest: the layer's longest head) and masks each head's hole before them; a shorter
        head's new entries then move down to its own length, and the slots they leave are zeroed, so the buffers hold
        what extend.onnx leaves (each head's entries its first ``lengths`` slots)."""
        longest = [int(n.max()) for n in lengths]
        out = self._extend_fused(keys, values, lengths, token_ids, positions, heads=True)
        new = token_ids.shape[1]
        for i, (n, top) in enumerate(zip(lengths, longest)):
            held = n[0] - new  # each head's length before the extend (``_extend_fused`` added N)
            for head in np.nonzero(held < top)[0]:
                start = int(held[head])
                for buffer in (keys[i], values[i]):
                    buffer[0, head, start:start + new] = buffer[0, head, top:top + new]  # overlapping: NumPy copies
                    buffer[0, head, max(top, start + new):top + new] = 0
        return out

    def _extend_fused(self, keys: list[np.ndarray], values: list[np.ndarray], lengths: list[np.ndarray],
                      token_ids: np.ndarray, positions: np.ndarray, score_range: np.ndarray | None = None,
                      heads: bool = False) -> ExtendOutputs:
        """``extend`` through extend_ort.onnx: its GroupQueryAttention writes the new entries into ``keys`` / ``values``
        at each layer's length itself (the present outputs are bound to the same memory); the lengths then grow by N.
        ``score_range``: through reread_ort.onnx, with the scores of the entries it counts (0 elsewhere)."""
        session = self.extend_fused_session if score_range is None else self.reread_fused_session
        if heads:
            session = self.extend_heads_session
        binding = session.io_binding()
        binding.bind_cpu_input(graphs.INPUT_IDS, token_ids)
        binding.bind_cpu_input(graphs.POSITION_IDS, positions)
        scores, streams = [], {}
        if score_range is not None:
            binding.bind_cpu_input(graphs.SCORE_RANGE, np.ascontiguousarray(score_range, dtype=np.int64))
            scores = [np.zeros((1, self.kv_heads, int(n[0, 0])), np.float32) for n in lengths]
        else:
            streams = {name: [np.zeros((1, self.kv_heads, token_ids.shape[1]), np.float32) for _ in lengths]
                       for name in sorted(self.streams)}
        logits = np.zeros((1, self.vocab), np.float32)
        queries = [np.zeros((1, self.num_heads, min(token_ids.shape[1], self.window), self.head_dim), np.float32)
                   for _ in range(self.num_layers)]
        outputs = [(graphs.LOGITS, logits)]
        for i in range(self.num_layers):
            binding.bind_cpu_input(graphs.past_key(i), keys[i])
            binding.bind_cpu_input(graphs.past_value(i), values[i])
            binding.bind_cpu_input(graphs.past_lengths(i), lengths[i])
            outputs += [(graphs.present_key(i), keys[i]), (graphs.present_value(i), values[i]),
                        (graphs.present_window_queries(i), queries[i])]
            if scores:
                outputs.append((graphs.present_scores(i), scores[i]))
            outputs += [(graphs.present_stream(i, name), layers[i]) for name, layers in streams.items()]
        for name, array in outputs:  # every output into memory of ours: the present ones are the buffers themselves
            binding.bind_output(name, "cpu", 0, np.float32, list(array.shape), array.ctypes.data)
        session.run_with_iobinding(binding)
        for n in lengths:
            n += token_ids.shape[1]
        return ExtendOutputs(logits=logits, window_queries=queries, scores=scores or None, streams=streams)

    def extend_row(self, row: int, token_ids: np.ndarray, positions: np.ndarray) -> ExtendOutputs:
        """``extend`` over decode buffer row ``row`` (token_ids, positions: [1, N]). float16 buffers: the extend graph
        reads float32, so it runs over a float32 copy of the row (exact: every float16 is a float32) whose entries,
        the new ones rounded to float16, are then written back."""
        self.check_row(row)
        view = slice(row, row + 1)
        lengths = [n[view] for n in self.lengths]
        if self.kv_dtype == np.float32:
            return self.extend([k[view] for k in self.keys], [v[view] for v in self.values], lengths, token_ids, positions)
        keys = [k[view].astype(np.float32) for k in self.keys]
        values = [v[view].astype(np.float32) for v in self.values]
        out = self.extend(keys, values, lengths, token_ids, positions)
        for i in range(self.num_layers):
            n = int(lengths[i].max())
            self.keys[i][view, :, :n] = keys[i][:, :, :n]
            self.values[i][view, :, :n] = values[i][:, :, :n]
        return out

    def extend_buffer(self, buffer: PrefillBuffer, token_ids: np.ndarray, positions: np.ndarray) -> ExtendOutputs:
        return self.extend(buffer.keys, buffer.values, buffer.lengths, token_ids, positions)

    def reread_buffer(self, buffer: PrefillBuffer, token_ids: np.ndarray, positions: np.ndarray,
                      score_range: np.ndarray) -> ExtendOutputs:
        """``extend_buffer`` through the re-read graph (``Backend.reread_buffer``; the graph:
        ``criticalkv.export.decoder.DecoderGraphBuilder.extend(score=True)``)."""
        return self.extend(buffer.keys, buffer.values, buffer.lengths, token_ids, positions, score_range)

    def select(self, buffer: PrefillBuffer, window_queries: list[np.ndarray], kv_budget: int | None = None,
               scores: list[np.ndarray] | None = None, context: bool = False) -> PrefillOutputs:
        """The selection over a prompt prefilled into ``buffer`` (its last ``window`` queries per layer
        [1, H, w, d_h]): the same outputs as ``prefill``'s, for ``load_row``. ``scores``: per layer [1, H_kv, n], the
        scores of a policy whose method scores prompts apart (None: none given). ``context``: with the engine's
        context policy (``select_context.onnx``) instead of its own."""
        session = self.select_context_session if context else self.select_session
        if session is None:
            raise EngineError(f"{self.folder}: this engine has no {'context ' if context else ''}select graph; rebuild "
                              "it with scripts/build_engine.py")
        budget = self.built_budget if kv_budget is None else kv_budget
        wanted = {i.name for i in session.get_inputs()}
        inputs = {graphs.KV_BUDGET: np.array([budget], np.int64),
                  **self.select_feeds(buffer, window_queries, wanted, scores)}
        names = [name(i) for i in range(self.num_layers) for name in graphs.SELECTED]
        start = time.perf_counter()
        out = self._run_bound(session, inputs, names)
        layers = range(self.num_layers)
        return PrefillOutputs(
            logits=None,
            keys=[out[graphs.present_key(i)] for i in layers],
            values=[out[graphs.present_value(i)] for i in layers],
            lengths=[out[graphs.present_lengths(i)] for i in layers],
            indices=[out[graphs.present_indices(i)] for i in layers],
            seconds=time.perf_counter() - start,
        )

    # ------------------------------------------------------------------ profiling
    def use_decode_session(self, session) -> None:
        """Run the decode steps on ``session`` from now on (a profiled or timed one of ``decode_path``, as the
        benchmarks use); the I/O bindings of the previous session are dropped and made again at the next step."""
        self.decode_session = session
        self._bindings.clear()
        self._batch = 0

    def profile_decode(self) -> None:
        """Profile the decode steps from now on: a new session of the graph this backend runs (the fused one with its
        prepacked weights, or the portable one); ``decode_session.end_profiling()`` returns the trace."""
        self.use_decode_session(self.session(self.decode_path, self.threads, profile=True, prepack=self.prepack))

    def end_profiling(self) -> str | None:
        """Stop the prefill session's profiler and return the trace file (None when not profiling)."""
        if not self.profile:
            return None
        self.profile = False
        return self.prefill_session.end_profiling()

    def close(self) -> None:
        if self.profile and self.prefill_session is not None:  # stop the profiler, drop its trace file
            trace = self.end_profiling()
            if trace and os.path.exists(trace):
                os.remove(trace)
        self._binding = None
        self._bindings.clear()
        self._lazy_sessions.clear()
        self.prefill_session = self.decode_session = None
