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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from criticalkv.errors import EngineError, RequestError
from criticalkv.padding import left_padded_lengths
from criticalkv.policy import KVPolicy
from criticalkv.request import NO_BUDGET_INPUT, EngineLimits, Request, SamplingParams
from criticalkv.runtime.backend import Backend, create_backend
from criticalkv.runtime.manifest import read_manifest
from criticalkv.sampling import Sampler, decode_loop


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
        self.limits = EngineLimits(
            max_input_len=self.max_input_len, max_new_tokens=self.max_new_tokens, vocab_size=self.spec["vocab_size"],
            policy=self.policy, accepts_kv_budget=bool(getattr(backend, "accepts_kv_budget", False)),
            eos_token_ids=tuple(self.eos_token_ids))
        #: K + V bytes of one entry of one KV head in the backend's buffers (fp32 on ONNX Runtime)
        capacities = manifest["shapes"]["decode_capacity"]
        self.entry_bytes = backend.kv_buffer_bytes() // (self.max_batch_size * self.spec["num_kv_heads"] * sum(capacities))
        #: per layer: most entries a head keeps from a prompt (the decode buffers add max_new_tokens to it)
        self.selection_capacities = [c - self.max_new_tokens for c in capacities]
        self._slots: dict[int, _Slot] = {}
        self._rows: list[int] = []  # rows[r] = the slot whose entries row r holds; rows 0..B-1 are occupied

    @classmethod
    def load(cls, folder: str | os.PathLike, backend: str = "onnxruntime", verify: bool = True, **options: Any) -> "Engine":
        """Open ``folder`` (checks the manifest, its format version and every file; ``verify`` also
        checks sha256). ``options`` go to the backend (ONNX Runtime: ``threads``, ``profile``, ``providers``)."""
        folder = Path(folder)
        manifest = read_manifest(folder, verify=verify)
        return cls(folder, manifest, create_backend(backend, folder, manifest, **options))

    @property
    def tokenizer(self):
        """The tokenizer saved with the engine (transformers ``AutoTokenizer``)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            path = self.folder / "tokenizer"
            if not path.is_dir():
                raise EngineError(f"{self.folder}: no tokenizer folder (the engine was built without one)")
            self._tokenizer = AutoTokenizer.from_pretrained(path)
        return self._tokenizer

    # ------------------------------------------------------------------ requests and slots
    def check(self, request: Request) -> Request:
        """``request`` checked against this engine (``Request.checked``), defaults filled; ``RequestError``
        naming the field otherwise. ``prefill`` checks a request that was not checked here."""
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

    def kv_bytes_bound(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """Most KV bytes a request can hold: its prompt's kept entries at most (min(n, the layer's selection
        capacity) per head) plus ``max_tokens`` new entries per head and layer. Known before its prefill."""
        kept = sum(min(num_prompt_tokens, cap) for cap in self.selection_capacities)
        return (kept + self.spec["num_layers"] * max_tokens) * self.spec["num_kv_heads"] * self.entry_bytes

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

    def prefill(self, slot: int, request: Request) -> PrefillResult:
        """Run ``request``'s prompt alone (batch 1, its selection at its ``kv_budget``) and load the kept K/V
        into the free ``slot``; the slot then decodes from position n (the prompt length)."""
        self._free_slot(slot)
        request = self.check(request)
        ids = np.asarray(request.prompt_token_ids, dtype=np.int64)[None, :]
        n = ids.shape[1]
        pre = self.backend.prefill(ids, np.ones_like(ids), np.arange(n, dtype=np.int64)[None, :],
                                   kv_budget=request.kv_budget)
        row = len(self._rows)
        self.backend.load_row(row, pre, 0)
        self._rows.append(slot)
        self._slots[slot] = _Slot(row=row, position=n)
        kept = sum(int(x.sum()) for x in pre.lengths)
        spec = self.spec
        return PrefillResult(
            logits=np.array(pre.logits[0], dtype=np.float32), num_prompt_tokens=n, kept_entries=kept,
            kv_bytes_kept=kept * self.entry_bytes,
            kv_bytes_full=n * spec["num_kv_heads"] * spec["num_layers"] * self.entry_bytes, seconds=pre.seconds)

    def decode(self, slots: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """One decode step: ``tokens[i]`` is fed to ``slots[i]`` at that slot's next position. ``slots`` are all
        the occupied slots (any order). Returns logits [len(slots), vocab] in the order of ``slots``, valid until
        the next call. Each slot's logits depend on that slot's entries only."""
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
        logits = self.backend.decode(by_row, positions)
        for s in slots:
            self._slots[s].position += 1
        return logits if in_row_order else logits[rows]

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
    ) -> GenerationResult:
        """Prefill (selection inside the graph), then decode up to ``max_new_tokens`` tokens per sequence.

        prompts : lists of token ids (any lengths; left-padded here) or a left-padded [B, n] array with
            ``attention_mask``. stop_token_ids default to the model's EOS ids; ``on_tokens`` receives
            every step's token ids [B] (streaming). The token after prompt b sits at position len_b + t.
        kv_budget : this request's budget, in [policy.min_budget, the built budget] (None: the built budget);
            the selection inside the prefill is exactly ``select_layer`` with ``policy.with_budget(kv_budget)``.
        """
        if self._rows:
            raise EngineError(f"generate runs a static batch over the engine's rows, but slots {sorted(self._rows)} "
                              "hold sequences: release them first")
        sampling = replace(sampling or SamplingParams(), max_tokens=max_new_tokens)
        ids, mask, requests = self._batch(prompts, attention_mask, sampling, kv_budget)
        budget = requests[0].kv_budget
        lengths = mask.sum(1)
        sampler = Sampler(sampling)
        positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None).astype(np.int64)
        pre = self.backend.prefill(ids, mask, positions, kv_budget=budget)
        selection_s = None
        end_profiling = getattr(self.backend, "end_profiling", None)
        if end_profiling is not None:
            trace = end_profiling()
            if trace:
                from criticalkv.runtime.profiling import selection_profile

                selection_s = selection_profile(trace)[-1].selection_s
                os.remove(trace)
        first = sampler(pre.logits)
        self.backend.begin_decode(pre)
        generated, steps, decode_s = decode_loop(
            lambda tokens, t: self.backend.decode(tokens, lengths + t), first, max_new_tokens,
            self.eos_token_ids if stop_token_ids is None else stop_token_ids, sampler, on_tokens,
        )
        full = self.entry_bytes * self.spec["num_kv_heads"] * int(lengths.sum()) * self.spec["num_layers"]
        kept = self.entry_bytes * sum(int(x.sum()) for x in pre.lengths)
        return GenerationResult(
            tokens=generated.tokens,
            prompt_lengths=lengths.tolist(),
            prefill_s=pre.seconds,
            selection_s=selection_s,
            decode_s_per_token=decode_s / steps if steps else 0.0,
            kv_bytes_full=full,
            kv_bytes_kept=kept,
            kept_lengths=pre.lengths,
            kept_indices=pre.indices,
        )

    def close(self) -> None:
        self.backend.close()
