"""``Engine``: the runtime's API over a built engine directory.

Serving drives it through slots (``criticalkv.serving.Scheduler`` calls nothing else):

* ``check(request)``: the request checked against the engine's limits (``Request.checked``: the one place);
* ``prefill(slot, request)``: the prompt runs (selection inside the graph) and its kept K/V land in ``slot``;
  returns the last prompt token's logits;
* ``decode(slots, tokens)``: one step of every occupied slot, each at its own position;
* ``release(slot)``: the slot's entries are dropped and the slot is free again.

A slot is a stable handle for one sequence; the backend's decode runs over the first B rows of its buffers, so
the engine keeps the occupied slots in rows 0..B-1 (a new sequence takes row B; a released row is filled by the
last one). ``generate`` is the one-call form for a static batch (the command line, the build's smoke test).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from criticalkv.errors import EngineError, RequestError
from criticalkv.methods.budget import adaptive_budget
from criticalkv.methods.phases import PromptScoring, RereadPass
from criticalkv.padding import left_padded_lengths
from criticalkv.policy import KVPolicy
from criticalkv.request import NO_BUDGET_INPUT, CheckedRequest, Request, SamplingParams
from criticalkv.runtime.backend import Backend, PromptEntries, RowSnapshot
from criticalkv.runtime.manifest import default_backend, engine_limits, load_tokenizer, read_manifest
from criticalkv.runtime.profiling import selection_profile
from criticalkv.runtime.registry import create_backend
from criticalkv.sampling import Sampler, decode_loop

#: most prompt tokens per run of the extend graph in a chunked prefill (``Engine.prefill_run``) where the graph takes
#: any number: a chunk of ``criticalkv serve``'s default 512 in one run. A 2k prompt's four 512-token chunks on the
#: bundled model, OpenVINO: 2,292 ms in one run each against 2,458 ms in two runs of 256 (medians of 4 interleaved
#: rounds; ``python -m benchmarks.chunks --backend openvino --chunks 512:256,512``). A multiple of the attention block
#: (256) keeps ONNX Runtime's prefill bitwise the one-run prefill's
PREFILL_RUN = 1024


def _ids(tokens: np.ndarray) -> np.ndarray:
    """The decode loop's choice when the step already returns the greedy token ids."""
    return tokens


def scored_apart(policy: KVPolicy | None) -> bool:
    """Whether ``policy`` ranks by scores its method's phases compute apart from the layers' selection
    (``criticalkv.methods.phases``): its prompts are selected once they are whole, after those phases ran."""
    return policy is not None and policy.method.scored_apart


@dataclass
class GenerationResult:
    """tokens: generated ids per sequence (the stop token included when hit); timings in seconds.

    kept_lengths[l] [B, H_kv] and kept_indices[l] [B, H_kv, cap_l] (-1 padded, positions into the
    left-padded prompt) are what layer l's selection kept. ``selection_s`` (the selection nodes' time)
    is measured only by the first generation of an engine loaded with ``profile=True`` (ONNX Runtime
    profiles that prefill run and the profiler is then stopped); otherwise it is None.
    """

    tokens: list[list[int]]
    prompt_lengths: list[int]
    prefill_s: float
    selection_s: float | None
    decode_s_per_token: float
    kv_bytes_full: int
    kv_bytes_kept: int
    kept_lengths: list[np.ndarray] = field(repr=False, default_factory=list)
    kept_indices: list[np.ndarray] = field(repr=False, default_factory=list)

    def timings(self) -> dict:
        return {"prefill_s": self.prefill_s, "selection_s": self.selection_s, "decode_s_per_token": self.decode_s_per_token}

    def kept(self, layer: int, row: int, head: int) -> list[int]:
        """Kept prompt positions of one (layer, sequence, KV head), ascending."""
        ids = self.kept_indices[layer][row, head]
        return ids[ids >= 0].tolist()


@dataclass
class PrefillResult:
    """What ``Engine.prefill`` returns for one slot.

    logits : [vocab] float32, the last prompt token's (a copy: the caller samples the first token from it)
    kept_entries : KV entries the selection kept, summed over layers and KV heads
    kv_bytes_kept / kv_bytes_full : the prompt's cache after the selection / without eviction (bytes)
    seconds : wall time of the prefill (selection included)
    """

    logits: np.ndarray
    num_prompt_tokens: int
    kept_entries: int
    kv_bytes_kept: int
    kv_bytes_full: int
    seconds: float
    #: per layer [H_kv] int32 kept lengths and [H_kv, cap_l] int32 kept positions (-1 padded) of the selection
    kept_lengths: list = field(default_factory=list, repr=False)
    kept_indices: list = field(default_factory=list, repr=False)
    #: the method's phases that scored the entries after the prompt (a re-read: ``criticalkv.methods.phases``), seconds
    #: (included in ``seconds``)
    scoring_s: float = 0.0


@dataclass
class SlotSnapshot:
    """A copy of one slot's entries (``Engine.save``): what the serving context cache keeps of a compressed
    context. ``position``: the absolute position of the next token (the context's length)."""

    row: RowSnapshot
    position: int
    kept_entries: int

    @property
    def nbytes(self) -> int:
        return self.row.nbytes


@dataclass
class PrefillJob:
    """One prompt prefilled in chunks through the extend graph (``Engine.begin_prefill``): its full K/V grow in a
    prefill buffer, its last ``window`` queries are kept, and ``finish_prefill`` runs the selection over the whole
    prompt and loads the kept entries into a slot."""

    request: CheckedRequest
    buffer: Any
    done: int = 0  # prompt tokens prefilled so far
    queries: list | None = None  # per layer the last window queries seen so far [1, H, <= w, d_h]
    logits: np.ndarray | None = None  # [vocab] of the last token prefilled
    seconds: float = 0.0
    context: bool = False  # a context for the context cache: selected with the engine's context policy
    policy: KVPolicy | None = None  # the policy that selects it (``Engine.policy_for``)
    #: how the policy scores the prompt beyond its layers' Q/K/V (``criticalkv.methods.phases``), None: it does not
    scoring: PromptScoring | None = None
    #: the streams the scoring reads: name -> per layer the pieces [1, H_kv, N] of the prompt's entries so far
    streams: dict = field(default_factory=dict)
    #: the prompt's first tokens whose entries were written into the buffer from a cache (``begin_prefill``'s prefix)
    prefix_tokens: int = 0

    @property
    def remaining(self) -> int:
        return self.request.num_prompt_tokens - self.done

    @property
    def nbytes(self) -> int:
        """KV bytes the prompt holds while it is prefilled (its whole buffer)."""
        return self.buffer.nbytes


@dataclass
class _Slot:
    row: int  # the backend row that holds the slot's entries
    position: int  # absolute position of the next token fed to the slot (the prompt length + tokens fed)


class Engine:
    """A built engine directory (``manifest.json``, ONNX graphs, weights, tokenizer) and its backend."""

    def __init__(self, folder: Path, manifest: dict[str, Any], backend: Backend):
        self.folder = folder
        self.manifest = manifest
        self.backend = backend
        self.policy = KVPolicy.from_dict(manifest["policy"])
        build = manifest["build"]
        self.max_input_len = build["max_input_len"]
        self.max_new_tokens = build["max_new_tokens"]
        self.max_batch_size = build["max_batch_size"]
        self.spec = manifest["model"]["spec"]
        self.eos_token_ids = list(manifest.get("generation", {}).get("eos_token_ids", []))
        self._tokenizer = None
        self.limits = engine_limits(manifest, accepts_kv_budget=bool(getattr(backend, "accepts_kv_budget", False)),
                                    has_extend=bool(getattr(backend, "has_extend", False)))
        #: K + V bytes of one entry of one KV head in the backend's buffers (fp32 on ONNX Runtime)
        capacities = manifest["shapes"]["decode_capacity"]
        self.entry_bytes = backend.kv_buffer_bytes() // (self.max_batch_size * self.spec["num_kv_heads"] * sum(capacities))
        #: per layer: most entries a head keeps from a prompt (the decode buffers add room for the tokens after it)
        self.selection_capacities = list(manifest["shapes"]["prefill_capacity"])
        #: most tokens one run of the extend graph takes (``extend`` and the re-read passes split longer inputs)
        self.extend_chunk = int(build.get("extend_chunk", 256))
        #: most prompt tokens one run of the extend graph takes in ``prefill_step``: ``PREFILL_RUN`` where the graph
        #: takes any number of tokens, the build's ``extend_chunk`` where its shapes are fixed (TensorRT's profiles)
        self.prefill_run = self.extend_chunk if getattr(backend, "fixed_extend_shapes", False) else \
            max(self.extend_chunk, PREFILL_RUN)
        #: the policy the serving context cache compresses contexts with, when the engine has one besides its own
        #: (``select_context.onnx``), and its per-layer selection capacities
        self.context_policy = KVPolicy.from_dict(manifest["context_policy"]) if manifest.get("context_policy") else None
        if self.context_policy is not None and not getattr(backend, "context_policies", True):
            # a backend without a context-policy selection (TensorRT: its PHASES_REFUSAL says why):
            # contexts are selected with the engine's own policy there
            self.context_policy = None
        self.context_capacities = list(manifest["shapes"].get("context_capacity", self.selection_capacities))
        #: the methods' data the engine was built with (``BaseMethod.engine_data``, by ``data_key``) and the streams its
        #: prompt graphs return (``criticalkv.methods.phases``): what a policy's scoring runs on
        self.method_data = dict(manifest.get("method_data") or {})
        self.streams = frozenset(getattr(backend, "streams", ()))
        self._scorings: dict[KVPolicy, PromptScoring | None] = {}
        self._slots: dict[int, _Slot] = {}
        self._rows: list[int] = []  # rows[r] = the slot whose entries row r holds; rows 0..B-1 are occupied

    @classmethod
    def load(cls, folder: str | os.PathLike, backend: str | None = None, verify: bool = True, **options: Any) -> "Engine":
        """Open ``folder`` (checks the manifest, its format version and every file; ``verify`` also
        checks sha256) on ``backend`` (None: ``torch`` for a directory built with ``--backend torch``, else
        ``onnxruntime``). ``options`` go to the backend (torch: ``model``, ``device``, ``dtype``, ``cuda_graphs``,
        ``threads``, ``selection``: see ``criticalkv.runtime.torch_backend``; ONNX Runtime: ``threads``, ``profile``, ``providers``,
        ``weights``, ``decode`` = ``"auto"`` / ``"fused"`` / ``"portable"`` (the decode graph: decode_ort.onnx or
        decode.onnx; default ``$CRITICALKV_ORT_DECODE`` or auto), ``prefill`` (the same for the prompt graphs:
        prefill_ort.onnx and extend_ort.onnx or prefill.onnx and extend.onnx; ``$CRITICALKV_ORT_PREFILL``),
        ``prepack``, ``prefill_prepack``, ``spinning``: see
        ``criticalkv.runtime.onnxruntime_backend``)."""
        folder = Path(folder)
        manifest = read_manifest(folder, verify=verify)
        backend = backend or default_backend(manifest)
        return cls(folder, manifest, create_backend(backend, folder, manifest, **options))

    @property
    def tokenizer(self):
        """The tokenizer saved with the engine: its fast (Rust) tokenizer when the folder has ``tokenizer.json``
        (chat template and special tokens included; this loads no torch), else transformers' ``AutoTokenizer``."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.folder)
        return self._tokenizer

    # ------------------------------------------------------------------ requests and slots
    def check(self, request: Request) -> CheckedRequest:
        """``request`` checked against this engine (``Request.checked``), defaults filled; ``RequestError``
        naming the field otherwise. A ``CheckedRequest`` of this engine comes back as it is: ``prefill`` and
        ``begin_prefill`` check only a request that was not checked here."""
        if not isinstance(request, Request):
            raise RequestError(f"expected a criticalkv.request.Request, got {type(request).__name__}")
        return request.checked(self.limits)

    @property
    def num_slots(self) -> int:
        """Sequences the engine holds at once (its built max batch size)."""
        return self.max_batch_size

    def free_slots(self) -> list[int]:
        return [s for s in range(self.num_slots) if s not in self._slots]

    def occupied_slots(self) -> list[int]:
        """The occupied slots, in the order ``decode`` runs them without reordering its inputs."""
        return list(self._rows)

    def stop_ids(self, request: Request) -> frozenset[int]:
        """The token ids that end ``request``: the model's EOS ids (unless ignore_eos) and its stop_token_ids."""
        return request.sampling.stop_ids(self.eos_token_ids)

    def policy_for(self, context: bool = False) -> KVPolicy:
        """The policy that selects a prompt (``context`` False) or a context of the context cache: the engine's
        context policy when it has one, else its own."""
        return self.context_policy if context and self.context_policy is not None else self.policy

    def kv_bytes_bound(self, num_prompt_tokens: int, max_tokens: int, context: bool = False) -> int:
        """Most KV bytes a request can hold: its prompt's kept entries at most (min(n, the layer's selection
        capacity) per head) plus ``max_tokens`` new entries per head and layer. Known before its prefill.
        ``context``: the prompt is a context, selected by ``policy_for(context=True)``."""
        capacities = self.context_capacities if context and self.context_policy is not None else self.selection_capacities
        kept = sum(min(num_prompt_tokens, cap) for cap in capacities)
        return (kept + self.spec["num_layers"] * max_tokens) * self.spec["num_kv_heads"] * self.entry_bytes

    def kv_bytes_full(self, num_tokens: int) -> int:
        """KV bytes of ``num_tokens`` tokens without eviction (every KV head of every layer)."""
        return num_tokens * self.spec["num_layers"] * self.spec["num_kv_heads"] * self.entry_bytes

    def growth_bytes(self, max_tokens: int) -> int:
        """KV bytes ``max_tokens`` decoded tokens add (one entry per KV head and layer each)."""
        return self.spec["num_layers"] * self.spec["num_kv_heads"] * max_tokens * self.entry_bytes

    def _free_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.num_slots:
            raise EngineError(f"slot {slot!r} is not one of the engine's slots 0..{self.num_slots - 1}")
        if slot in self._slots:
            raise EngineError(f"slot {slot} is occupied; release it first")

    def _slot(self, slot: int) -> _Slot:
        state = self._slots.get(slot)
        if state is None:
            raise EngineError(f"slot {slot!r} holds no sequence (prefill it first)")
        return state

    def _through_select(self, context: bool) -> bool:
        """Whether a prompt (or a context) is selected by the select graph after extend chunks, not inside the prefill
        graph: for the context policy's select graph, and for a policy whose method scores the prompt apart
        (``scored_apart``)."""
        return (context and self.context_policy is not None) or scored_apart(self.policy_for(context))

    def prefill(self, slot: int, request: Request, context: bool = False) -> PrefillResult:
        """Run ``request``'s prompt alone (batch 1, its selection at its ``kv_budget``) and load the kept K/V
        into the free ``slot``; the slot then decodes from position n (the prompt length). ``context``: the prompt is
        a context of the context cache, selected with ``policy_for(context=True)`` (question-agnostic). A policy whose
        method scores the prompt apart prefills it through the extend graph, then scores and selects it
        (``begin_prefill`` ... ``finish_prefill``, in one call)."""
        self._free_slot(slot)
        request = self.check(request)
        if self._through_select(context):
            job = self.begin_prefill(request, context=context)
            self.prefill_step(job, job.remaining)
            return self.finish_prefill(job, slot)
        ids = np.asarray(request.prompt_token_ids, dtype=np.int64)[None, :]
        n = ids.shape[1]
        pre = self.backend.prefill(ids, np.ones_like(ids), np.arange(n, dtype=np.int64)[None, :],
                                   kv_budget=request.budget)
        loaded = time.perf_counter()
        row = len(self._rows)
        self.backend.load_row(row, pre, 0)
        self._synchronize()
        seconds = pre.seconds + (time.perf_counter() - loaded)
        self._rows.append(slot)
        self._slots[slot] = _Slot(row=row, position=n)
        kept = sum(int(x.sum()) for x in pre.lengths)
        spec = self.spec
        return PrefillResult(
            logits=np.array(pre.logits[0], dtype=np.float32), num_prompt_tokens=n, kept_entries=kept,
            kv_bytes_kept=kept * self.entry_bytes,
            kv_bytes_full=n * spec["num_kv_heads"] * spec["num_layers"] * self.entry_bytes, seconds=seconds,
            kept_lengths=[np.asarray(x[0]) for x in pre.lengths], kept_indices=[np.asarray(x[0]) for x in pre.indices])

    def decode(self, slots: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """One decode step: ``tokens[i]`` is fed to ``slots[i]`` at that slot's next position. ``slots`` are all
        the occupied slots (any order). Returns logits [len(slots), vocab] in the order of ``slots``, valid until
        the next call. Each slot's logits depend on that slot's entries only."""
        return self._decode(slots, tokens, self.backend.decode)

    def decode_greedy(self, slots: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """``decode``, returning each slot's greedy next token [len(slots)] int64 (the argmax of its logits, ties to
        the lower id: ``Sampler``'s greedy choice) instead of the logits. A backend that takes the argmax on its
        device (``decode_greedy``: the torch backend) then copies B ids to the host instead of B x vocab floats."""
        step = getattr(self.backend, "decode_greedy", None)
        if step is None:
            return self.decode(slots, tokens).argmax(axis=-1).astype(np.int64)
        return self._decode(slots, tokens, step)

    def _decode(self, slots: Sequence[int], tokens: Sequence[int], step) -> np.ndarray:
        slots = [int(s) for s in slots]
        if sorted(slots) != sorted(self._rows) or len(set(slots)) != len(slots):
            raise EngineError(f"decode runs every occupied slot once: occupied {sorted(self._rows)}, got {slots}")
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if len(tokens) != len(slots):
            raise EngineError(f"decode: {len(tokens)} tokens for {len(slots)} slots")
        rows = np.array([self._slots[s].row for s in slots])
        in_row_order = bool((rows == np.arange(len(rows))).all())
        by_row = tokens if in_row_order else tokens[np.argsort(rows)]
        positions = np.array([self._slots[s].position for s in self._rows], dtype=np.int64)
        out = step(by_row, positions)
        for s in slots:
            self._slots[s].position += 1
        return out if in_row_order else out[rows]

    def save(self, slot: int) -> SlotSnapshot:
        """A copy of ``slot``'s entries and position (the slot is unchanged and stays occupied)."""
        state = self._slot(slot)
        row = self.backend.save_row(state.row)
        kept = sum(int(np.asarray(x.cpu() if hasattr(x, "cpu") else x).sum()) for x in row.lengths)
        return SlotSnapshot(row=row, position=state.position, kept_entries=kept)

    def restore(self, slot: int, snapshot: SlotSnapshot) -> None:
        """Load ``snapshot`` into the free ``slot``: it continues exactly where the saved slot was. ``snapshot`` may
        also be the context cache's packed form (``criticalkv.serving.context_cache.PackedSnapshot``: no ``row``,
        per layer its heads' kept entries joined), written head by head where ``restores_packed``."""
        self._free_slot(slot)
        row = len(self._rows)
        if getattr(snapshot, "row", None) is None:  # packed: each head's kept entries, without padding
            if not self.restores_packed:
                raise EngineError(f"restore: the {self.backend.name} backend takes unpacked snapshots only "
                                  "(ContextCache.get without packed)")
            self.backend.restore_packed(row, snapshot.keys, snapshot.values, snapshot.lengths)
        else:
            self.backend.restore_row(row, snapshot.row)
        self._rows.append(slot)
        self._slots[slot] = _Slot(row=row, position=snapshot.position)

    @property
    def restores_packed(self) -> bool:
        """Whether ``restore`` takes the context cache's packed snapshots (the backend writes each head's kept entries
        into its row: ``HostKVBuffers.restore_packed``), so that a hit makes no padded copy first."""
        return hasattr(self.backend, "restore_packed")

    def extend(self, slot: int, token_ids: Sequence[int]) -> np.ndarray:
        """Feed ``token_ids`` (a question after a cached context, ...) to ``slot`` in chunks of at most the built
        ``extend_chunk``: they attend to the slot's entries and causally to each other, and their K/V join the
        slot. Returns the last token's logits [vocab] (a copy)."""
        state = self._slot(slot)
        ids = np.asarray(list(token_ids), dtype=np.int64)
        if ids.size == 0:
            raise RequestError("extend: no tokens given")
        logits = None
        for start in range(0, ids.size, self.extend_chunk):
            chunk = ids[start:start + self.extend_chunk]
            positions = state.position + np.arange(chunk.size, dtype=np.int64)
            out = self.backend.extend_row(state.row, chunk[None, :], positions[None, :])
            state.position += chunk.size
            logits = out.logits
        return np.array(logits[0], dtype=np.float32)

    # ------------------------------------------------------------------ chunked prefill
    def begin_prefill(self, request: Request, context: bool = False, prefix: Sequence[PromptEntries] = ()) -> PrefillJob:
        """Start prefilling ``request``'s prompt in chunks (``prefill_step``) into a new prefill buffer of the prompt's
        length; no slot is taken until ``finish_prefill``. The buffer holds the prompt's full K/V (``PrefillJob.nbytes``),
        and room for the re-read passes of a policy whose method re-reads the prompt over it.
        ``context``: a context of the context cache (``prefill``).

        ``prefix``: the entries of the prompt's first tokens, kept from an earlier prefill of the same tokens
        (``prompt_entries``; the serving prefix cache), in order: they are written into the buffer and the prefill
        continues after them, so only the rest of the prompt runs; at most ``prefix_limit`` tokens (the selection's
        window queries come from the tokens that run). A chunked prefill's entries do not depend on where its chunks
        end, so the prompt's selection, logits and tokens are those of a prefill without a prefix."""
        request = self.check(request)
        policy = self.policy_for(context)
        scoring = self.scoring(policy)
        if request.context_threshold is not None:  # the budget follows the context's own scores (finish_prefill)
            if not context or scoring is None:
                raise RequestError(f"context_threshold: the context policy {policy.name!r} has no score of its own to "
                                   "threshold (a kvzip policy has: KVzip's score, re-read or surrogate)")
            if not self.limits.accepts_kv_budget:
                raise RequestError(NO_BUDGET_INPUT)
        spare = scoring.spare(request.prompt_token_ids) if scoring is not None else 0
        buffer = self.backend.new_prefill_buffer(request.num_prompt_tokens, spare) if spare else \
            self.backend.new_prefill_buffer(request.num_prompt_tokens)
        job = PrefillJob(request=request, buffer=buffer, context=context, policy=policy, scoring=scoring)
        if prefix:
            self._write_prefix(job, list(prefix))
        return job

    @property
    def caches_prompts(self) -> bool:
        """Whether the backend copies a prefill buffer's entries out and in (``prompt_entries``, ``begin_prefill``'s
        prefix): what the serving prefix cache needs, besides the extend graph."""
        return all(hasattr(self.backend, name) for name in ("read_prompt", "write_prompt")) and \
            bool(getattr(self.backend, "has_extend", False))

    def prefix_limit(self, num_tokens: int, context: bool = False) -> int:
        """Most leading tokens of a prompt of ``num_tokens`` tokens that ``begin_prefill`` takes as a prefix: all but
        the last ``window`` of ``policy_for(context)`` (their queries score the prompt, so they run)."""
        return max(num_tokens - max(self.policy_for(context).window, 1), 0)

    def _write_prefix(self, job: PrefillJob, prefix: list[PromptEntries]) -> None:
        total = sum(p.num_tokens for p in prefix)
        limit = self.prefix_limit(job.request.num_prompt_tokens, job.context)
        if total > limit:
            raise EngineError(f"begin_prefill: a prefix of {total} tokens; a prompt of {job.request.num_prompt_tokens} "
                              f"takes at most {limit} (its last {job.request.num_prompt_tokens - limit} run)")
        if not self.caches_prompts:
            raise EngineError(f"the {self.backend.name} backend takes no prefix entries")
        wanted = job.scoring.streams if job.scoring is not None else ()
        missing = [name for name in wanted if any(name not in p.streams for p in prefix)]
        if missing:
            raise EngineError(f"begin_prefill: the prefix lacks the stream {missing[0]!r} its policy scores by")
        self.backend.write_prompt(job.buffer, [p.keys for p in prefix], [p.values for p in prefix])
        for name in wanted:
            job.streams[name] = [[np.asarray(p.streams[name][i])[None] for p in prefix]
                                 for i in range(self.spec["num_layers"])]
        job.done = job.prefix_tokens = total

    def prompt_entries(self, job: PrefillJob, start: int, end: int) -> PromptEntries:
        """A copy of the entries of ``job``'s prompt tokens [start, end) (every layer and KV head, uncompressed) and of
        the backend's streams of them: what ``begin_prefill`` takes back as a prefix of a later prompt. Only before
        ``finish_prefill`` (which drops the buffer), of tokens already prefilled."""
        if job.buffer is None or not 0 <= start < end <= job.done:
            raise EngineError(f"prompt_entries: tokens [{start}, {end}) are not in the prefill buffer "
                              f"({job.done} prefilled{'' if job.buffer is not None else ', buffer dropped'})")
        keys, values = self.backend.read_prompt(job.buffer, start, end)
        streams = {}
        for name, layers in job.streams.items():
            for pieces in layers:  # joined once, so that reading a prompt block by block stays linear
                if len(pieces) > 1:
                    pieces[:] = [np.concatenate(pieces, axis=2)]
            streams[name] = np.stack([pieces[0][0, :, start:end] for pieces in layers])
        return PromptEntries(keys=keys, values=values, streams=streams)

    def scoring(self, policy: KVPolicy) -> PromptScoring | None:
        """How ``policy`` scores a prompt on this engine (its method's ``prompt_scoring``: None when its layers'
        selection needs nothing more); EngineError when the engine lacks what it needs."""
        if policy not in self._scorings:
            scoring = None
            if scored_apart(policy):
                base = policy.method.base
                try:
                    scoring = base.prompt_scoring(policy, self.method_data.get(base.data_key) or {}, self.streams)
                except ValueError as err:
                    raise EngineError(f"{self.folder}: {err}") from None
                missing = [name for name in (scoring.streams if scoring else ()) if name not in self.streams]
                if missing:
                    reason = (getattr(self.backend, "stream_refusals", None) or {}).get(policy.name)
                    raise EngineError(f"{self.folder}: " + (reason or f"{policy.name} reads the stream {missing[0]!r}, "
                                      f"which the {self.backend.name} backend does not compute here: rebuild the "
                                      "engine with this policy"))
            self._scorings[policy] = scoring
        return self._scorings[policy]

    def prefill_step(self, job: PrefillJob, max_tokens: int) -> bool:
        """Prefill the next ``max_tokens`` prompt tokens of ``job`` (at most; fewer at the end); True when the
        whole prompt is in. A last chunk shorter than the window is fine: the queries of the last window positions
        are kept across chunks."""
        if job.remaining <= 0:
            return True
        if max_tokens < 1:
            raise EngineError(f"prefill_step: max_tokens must be >= 1, got {max_tokens}")
        ids = np.asarray(job.request.prompt_token_ids[job.done:job.done + max_tokens], dtype=np.int64)
        positions = job.done + np.arange(ids.size, dtype=np.int64)
        start = time.perf_counter()
        logits = None
        for at in range(0, ids.size, self.prefill_run):  # the graph takes at most prefill_run tokens per run
            part = slice(at, at + self.prefill_run)
            out = self.backend.extend_buffer(job.buffer, ids[None, part], positions[None, part])
            job.queries = out.window_queries if job.queries is None else self._join_queries(job.queries, out.window_queries)
            for name in job.scoring.streams if job.scoring is not None else ():  # these entries' streams
                pieces = job.streams.setdefault(name, [[] for _ in range(self.spec["num_layers"])])
                for layer, piece in zip(pieces, out.streams[name]):
                    layer.append(piece)
            logits = out.logits
        job.done += ids.size
        job.logits = np.array(logits[0], dtype=np.float32)
        job.seconds += time.perf_counter() - start
        return job.remaining == 0

    def _join_queries(self, old: list, new: list) -> list:
        """Per layer the last ``window`` queries of ``old`` then ``new`` ([1, H, *, d_h]): host arrays here, or the
        backend's own tensors through its ``join_window_queries`` (the torch backend keeps them on its device)."""
        w = self.policy.window
        join = getattr(self.backend, "join_window_queries", None)
        if join is not None:
            return join(old, new, w)
        return [np.concatenate([a, b], axis=2)[:, :, -w:] for a, b in zip(old, new)]

    def finish_prefill(self, job: PrefillJob, slot: int, keep_buffer: bool = False) -> PrefillResult:
        """Select over ``job``'s whole prompt (the same kept entries as ``prefill``'s one run) and load them into
        the free ``slot``, which then decodes from position n; the prefill buffer is dropped, or kept with the job
        (``keep_buffer``: ``prompt_entries`` may still read it) until the caller sets ``job.buffer = None``."""
        if job.remaining:
            raise EngineError(f"finish_prefill: {job.remaining} prompt tokens are not prefilled yet")
        self._free_slot(slot)
        start = time.perf_counter()
        policy = job.policy or self.policy
        scores = self._score(job) if job.scoring is not None else None
        scoring_s = time.perf_counter() - start
        # a context policy may keep sinks beside the window: its own smallest budget
        budget = max(job.request.budget, policy.min_budget)
        if job.context and job.request.context_threshold is not None and scores is not None:
            # what the score ranks at or above the threshold, at most the request's budget (adaptive_budget)
            budget = max(policy.min_budget, adaptive_budget(scores, job.request.context_threshold, policy.window, budget))
        options = {}
        if scores is not None:
            options["scores"] = scores
        if job.context and self.context_policy is not None:
            options["context"] = True
        selected = self.backend.select(job.buffer, job.queries, kv_budget=budget, **options)
        row = len(self._rows)
        self.backend.load_row(row, selected, 0)
        self._synchronize()
        self._rows.append(slot)
        n = job.request.num_prompt_tokens
        self._slots[slot] = _Slot(row=row, position=n)
        if not keep_buffer:
            job.buffer = None
        kept = sum(int(x.sum()) for x in selected.lengths)
        spec = self.spec
        return PrefillResult(
            logits=job.logits, num_prompt_tokens=n, kept_entries=kept, kv_bytes_kept=kept * self.entry_bytes,
            kv_bytes_full=n * spec["num_kv_heads"] * spec["num_layers"] * self.entry_bytes,
            seconds=job.seconds + time.perf_counter() - start,
            kept_lengths=[np.asarray(x[0]) for x in selected.lengths],
            kept_indices=[np.asarray(x[0]) for x in selected.indices], scoring_s=scoring_s)

    def _score(self, job: PrefillJob) -> list[np.ndarray]:
        """The scores [1, H_kv, n] per layer that ``job``'s policy ranks the whole prompt by: its method's scoring
        (``criticalkv.methods.phases.PromptScoring``) from the streams collected over the prefill's chunks and the
        re-read passes run here (``_reread``)."""
        ids = job.request.prompt_token_ids
        streams = {name: [np.concatenate(pieces, axis=2) for pieces in job.streams[name]] for name in job.scoring.streams}
        passes = job.scoring.passes(ids)
        return job.scoring.finish(ids, streams, self._reread(job, passes) if passes else None)

    def _reread(self, job: PrefillJob, passes: list[RereadPass]) -> list[np.ndarray]:
        """Every prompt entry's largest score over the re-read ``passes`` (0 where none scores it), per layer
        [1, H_kv, n] float32. Each pass's tokens run through the re-read graph (``Backend.reread_buffer``) over the
        prompt's full K/V at positions n, n + 1, ... (in runs of equal size, at most ``extend_chunk`` tokens), or, for a
        local pass, over a buffer of the prompt's first ``sinks`` entries and [start, end) only (``_local_buffer``: the
        keys its score counts; the positions stay n, n + 1, ...); the pass's own entries are dropped again."""
        n = job.request.num_prompt_tokens
        kv_heads = self.spec["num_kv_heads"]
        scores = [np.zeros((1, kv_heads, n), np.float32) for _ in range(self.spec["num_layers"])]
        local = None  # one buffer for every local pass
        held, longest = job.scoring.local_size(job.request.prompt_token_ids)
        if held:
            local = self.backend.new_prefill_buffer(min(held, self.max_input_len), longest)
        for one in passes:
            tokens = np.asarray(one.tokens, dtype=np.int64)
            buffer, kept, offset = job.buffer, n, one.start
            score_range = np.array([one.sinks, one.start, one.end, n], np.int64)
            if one.local:
                buffer, kept, offset = self._local_buffer(local, job.buffer, one), one.held, one.sinks
                score_range = np.array([one.sinks, one.sinks, kept, kept], np.int64)
            cut = slice(offset, offset + one.end - one.start)  # the scored entries in ``buffer``
            # runs of equal size, at most extend_chunk tokens (measured on the fused graph, 1 thread: per token, runs
            # of 183 to 274 cost the same; 539 over a chunk re-read 4 % more, ~1,000 over the whole context 40 % more)
            size = -(-tokens.size // -(-tokens.size // self.extend_chunk))
            for at in range(0, tokens.size, size):
                part = tokens[at:at + size]
                positions = n + at + np.arange(part.size, dtype=np.int64)
                out = self.backend.reread_buffer(buffer, part[None, :], positions[None, :], score_range)
                for layer, got in zip(scores, out.scores):
                    got = np.asarray(got)
                    np.maximum(layer[:, :, one.start:one.end], got[:, :, cut], out=layer[:, :, one.start:one.end])
            for lengths in buffer.lengths:  # the pass's entries go: the buffer holds the prompt again
                lengths[...] = kept
        return scores

    @staticmethod
    def _local_buffer(buffer, full, one: RereadPass):
        """``buffer`` (room for the largest local pass) made to hold the prompt's first ``one.sinks`` entries and its
        [start, end) copied from ``full`` (every layer; the keys keep their positions' RoPE). It lives for the re-read
        only, beside the prompt's buffer (``PrefillJob.nbytes`` does not count it: at most the sinks, the scored
        entries and the pass's tokens, where a pass over the whole prompt adds its tokens to the prompt's buffer)."""
        held = one.held
        for dst, src in ((buffer.keys, full.keys), (buffer.values, full.values)):
            for d, f in zip(dst, src):
                d[:, :, :one.sinks] = f[:, :, :one.sinks]
                d[:, :, one.sinks:held] = f[:, :, one.start:one.end]
        for lengths in buffer.lengths:
            lengths[...] = held
        return buffer

    def release(self, slot: int) -> None:
        """Free ``slot`` at once; the last occupied row moves into its row (the decode batch stays rows 0..B-1)."""
        state = self._slot(slot)
        last = len(self._rows) - 1
        if state.row != last:
            moved = self._rows[last]
            self.backend.move_row(last, state.row)
            self._rows[state.row] = moved
            self._slots[moved].row = state.row
        self._rows.pop()
        del self._slots[slot]

    def release_all(self) -> None:
        for slot in list(self._slots):
            self.release(slot)

    # ------------------------------------------------------------------ inputs
    def _batch(self, prompts, attention_mask, sampling: SamplingParams, kv_budget) -> tuple[np.ndarray, np.ndarray, list[Request]]:
        """Left-padded [B, n] ids and mask from lists of ids or a 2-D array (+ mask), and every prompt as a
        checked ``Request`` (the rules of ``Request.checked``)."""
        if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
            ids = prompts.astype(np.int64)
            mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask, dtype=np.int64)
            if mask.shape != ids.shape:
                raise EngineError(f"attention_mask: shape {mask.shape} differs from the prompts {ids.shape}")
            try:
                left_padded_lengths(mask)
            except ValueError as e:
                raise EngineError(str(e)) from None
            seqs = [row[m == 1].tolist() for row, m in zip(ids, mask)]
        else:
            seqs = [list(p) for p in prompts]
            if not seqs:
                raise EngineError("no prompt given")
            n = max(len(s) for s in seqs)
            ids = np.zeros((len(seqs), n), np.int64)
            mask = np.zeros((len(seqs), n), np.int64)
        if any(not s for s in seqs):
            raise RequestError("a prompt in the batch is empty")
        if len(seqs) > self.max_batch_size:
            raise EngineError(f"batch of {len(seqs)} prompts exceeds the engine's max batch size {self.max_batch_size} "
                              "(rebuild with a larger --max-batch-size)")
        requests = [self.check(Request(s, sampling, kv_budget)) for s in seqs]
        if not (isinstance(prompts, np.ndarray) and prompts.ndim == 2):
            n = ids.shape[1]
            for b, s in enumerate(seqs):
                ids[b, n - len(s):] = s
                mask[b, n - len(s):] = 1
        vocab = self.spec["vocab_size"]
        if ids.min() < 0 or ids.max() >= vocab:  # the padding too: it is embedded like any token
            raise RequestError(f"token ids must lie in [0, {vocab})")
        return ids, mask, requests

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: Sequence[Sequence[int]] | np.ndarray,
        max_new_tokens: int = 64,
        sampling: SamplingParams | None = None,
        stop_token_ids: Sequence[int] | None = None,
        on_tokens: Callable[[np.ndarray], None] | None = None,
        attention_mask: np.ndarray | None = None,
        kv_budget: int | None = None,
        questions: Sequence[Sequence[int]] | None = None,
    ) -> GenerationResult:
        """Prefill (selection inside the graph), then decode up to ``max_new_tokens`` tokens per sequence.

        prompts : lists of token ids (any lengths; left-padded here) or a left-padded [B, n] array with
            ``attention_mask``. stop_token_ids default to the model's EOS ids; ``on_tokens`` receives
            every step's token ids [B] (streaming). The token after prompt b sits at position len_b + t.
        kv_budget : this request's budget, in [policy.min_budget, the built budget] (None: the built budget);
            the selection inside the prefill is exactly ``select_layer`` with ``policy.with_budget(kv_budget)``.
        questions : token ids asked after each prompt: the prompt is then a context compressed without its question
            (question-agnostic) and the question runs through the compressed cache (``criticalkv.hf.generate``'s
            ``question_ids``); kept lengths and indices are not returned in this mode
        """
        if self._rows:
            raise EngineError(f"generate runs a static batch over the engine's rows, but slots {sorted(self._rows)} "
                              "hold sequences: release them first")
        sampling = replace(sampling or SamplingParams(), max_tokens=max_new_tokens)
        if questions is not None:
            return self._generate_questions(prompts, questions, sampling, stop_token_ids, on_tokens, kv_budget)
        ids, mask, requests = self._batch(prompts, attention_mask, sampling, kv_budget)
        if scored_apart(self.policy):  # each prompt scored alone by its method's phases: prefilled into its own slot
            return self._generate_slots(requests, sampling, stop_token_ids, on_tokens)
        budget = requests[0].budget
        lengths = mask.sum(1)
        sampler = Sampler(sampling)
        positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None).astype(np.int64)
        start = time.perf_counter()
        pre = self.backend.prefill(ids, mask, positions, kv_budget=budget)
        selection_s = pre.selection_s
        end_profiling = getattr(self.backend, "end_profiling", None)
        if end_profiling is not None:
            trace = end_profiling()
            if trace:
                selection_s = selection_profile(trace)[-1].selection_s
                os.remove(trace)
        first = sampler(pre.logits)
        self.backend.begin_decode(pre)
        self._synchronize()
        prefill_s = time.perf_counter() - start  # the kept entries in the decode rows: the first step can run
        greedy = getattr(self.backend, "decode_greedy", None)
        if sampling.temperature == 0 and greedy is not None:  # the argmax on the device: B ids to the host
            step, choose = (lambda tokens, t: greedy(tokens, lengths + t)), _ids
        else:
            step, choose = (lambda tokens, t: self.backend.decode(tokens, lengths + t)), sampler
        generated, steps, decode_s = decode_loop(
            step, first, max_new_tokens, self.eos_token_ids if stop_token_ids is None else stop_token_ids, choose,
            on_tokens)
        full = self.entry_bytes * self.spec["num_kv_heads"] * int(lengths.sum()) * self.spec["num_layers"]
        kept = self.entry_bytes * sum(int(x.sum()) for x in pre.lengths)
        return GenerationResult(
            tokens=generated.tokens,
            prompt_lengths=lengths.tolist(),
            prefill_s=prefill_s,
            selection_s=selection_s,
            decode_s_per_token=decode_s / steps if steps else 0.0,
            kv_bytes_full=full,
            kv_bytes_kept=kept,
            kept_lengths=pre.lengths,
            kept_indices=pre.indices,
        )

    def _generate_questions(self, contexts, questions, sampling, stop_token_ids, on_tokens, kv_budget) -> GenerationResult:
        """``generate`` with a question after each compressed context: every context is prefilled alone into a slot
        (its selection without the question, with the engine's context policy as the context cache does), the question
        runs through the extend graph, then the slots decode."""
        contexts, questions = [list(c) for c in contexts], [list(q) for q in questions]
        if len(contexts) != len(questions) or not contexts:
            raise EngineError(f"questions: {len(questions)} questions for {len(contexts)} contexts")
        if len(contexts) > self.num_slots:
            raise EngineError(f"batch of {len(contexts)} prompts exceeds the engine's max batch size {self.num_slots} "
                              "(rebuild with a larger --max-batch-size)")
        sampler = Sampler(sampling)
        slots = list(range(len(contexts)))
        first_logits, prefill_s, full, kept = [], 0.0, 0, 0
        try:
            for slot, context, question in zip(slots, contexts, questions):
                if not question:
                    raise RequestError("a question in the batch is empty")
                start = time.perf_counter()
                result = self.prefill(slot, Request(context, sampling, kv_budget), context=True)
                first_logits.append(self.extend(slot, question))
                prefill_s += time.perf_counter() - start
                full, kept = full + result.kv_bytes_full, kept + result.kv_bytes_kept
            first = sampler(np.stack(first_logits))
            step, choose = self._slot_step(slots, sampler)
            generated, steps, decode_s = decode_loop(
                step, first, sampling.max_tokens, self.eos_token_ids if stop_token_ids is None else stop_token_ids,
                choose, on_tokens)
        finally:
            self.release_all()
        return GenerationResult(
            tokens=generated.tokens, prompt_lengths=[len(c) for c in contexts], prefill_s=prefill_s, selection_s=None,
            decode_s_per_token=decode_s / steps if steps else 0.0, kv_bytes_full=full, kv_bytes_kept=kept)

    def _generate_slots(self, requests: list[Request], sampling, stop_token_ids, on_tokens) -> GenerationResult:
        """``generate`` for a policy whose method scores each prompt apart: every prompt is prefilled alone into a
        slot (its scoring and selection), then the slots decode together."""
        sampler = Sampler(sampling)
        slots = list(range(len(requests)))
        results = []
        try:
            for slot, request in zip(slots, requests):
                results.append(self.prefill(slot, request))
            first = sampler(np.stack([r.logits for r in results]))
            step, choose = self._slot_step(slots, sampler)
            generated, steps, decode_s = decode_loop(
                step, first, sampling.max_tokens, self.eos_token_ids if stop_token_ids is None else stop_token_ids,
                choose, on_tokens)
        finally:
            self.release_all()
        kept_lengths, kept_indices = [], []
        for layer in range(self.spec["num_layers"]):
            width = max(r.kept_indices[layer].shape[-1] for r in results)
            kept_lengths.append(np.stack([r.kept_lengths[layer] for r in results]))
            kept_indices.append(np.stack([np.pad(r.kept_indices[layer], ((0, 0), (0, width - r.kept_indices[layer].shape[-1])),
                                                 constant_values=-1) for r in results]))
        return GenerationResult(
            tokens=generated.tokens, prompt_lengths=[r.num_prompt_tokens for r in results],
            prefill_s=sum(r.seconds for r in results), selection_s=None,
            decode_s_per_token=decode_s / steps if steps else 0.0,
            kv_bytes_full=sum(r.kv_bytes_full for r in results), kv_bytes_kept=sum(r.kv_bytes_kept for r in results),
            kept_lengths=kept_lengths, kept_indices=kept_indices)

    def _slot_step(self, slots: list[int], sampler: Sampler):
        """(step, choose) of a decode loop over ``slots``: a greedy loop takes each row's argmax where the backend
        computes it (``decode_greedy``: no B x vocab logits to the host), any other samples the logits."""
        if sampler.config.temperature == 0 and hasattr(self.backend, "decode_greedy"):
            return (lambda tokens, t: self.decode_greedy(slots, tokens)), _ids
        return (lambda tokens, t: self.decode(slots, tokens)), sampler

    def _synchronize(self) -> None:
        """Wait for the backend's queued device work (a GPU backend's copies run asynchronously): a timing's end."""
        synchronize = getattr(self.backend, "synchronize", None)
        if synchronize is not None:
            synchronize()

    def close(self) -> None:
        self.backend.close()
