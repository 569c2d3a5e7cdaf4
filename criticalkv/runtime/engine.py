"""``Engine``: load an engine directory and generate from it (prefill -> compressed KV -> decode loop)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from criticalkv.padding import left_padded_lengths
from criticalkv.policy import KVPolicy
from criticalkv.runtime.backend import Backend, create_backend
from criticalkv.runtime.manifest import EngineError, read_manifest
from criticalkv.sampling import Sampler, SamplingConfig, decode_loop


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

    # ------------------------------------------------------------------ inputs
    def _batch(self, prompts, attention_mask) -> tuple[np.ndarray, np.ndarray]:
        """Left-padded [B, n] ids and mask from lists of ids or a 2-D array (+ mask)."""
        if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
            ids = prompts.astype(np.int64)
            mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask, dtype=np.int64)
            if mask.shape != ids.shape:
                raise EngineError(f"attention_mask: shape {mask.shape} differs from the prompts {ids.shape}")
            try:
                lengths = left_padded_lengths(mask)
            except ValueError as e:
                raise EngineError(str(e)) from None
        else:
            seqs = [list(map(int, p)) for p in prompts]
            if not seqs:
                raise EngineError("no prompt given")
            n = max(len(s) for s in seqs)
            ids = np.zeros((len(seqs), n), np.int64)
            mask = np.zeros((len(seqs), n), np.int64)
            for b, s in enumerate(seqs):
                if s:
                    ids[b, n - len(s):] = s
                    mask[b, n - len(s):] = 1
            lengths = mask.sum(1)
        batch, n = ids.shape
        if batch == 0 or n == 0 or lengths.min() < 1:
            raise EngineError("a prompt in the batch is empty")
        if batch > self.max_batch_size:
            raise EngineError(f"batch of {batch} prompts exceeds the engine's max batch size {self.max_batch_size} "
                              "(rebuild with a larger --max-batch-size)")
        if n > self.max_input_len:
            raise EngineError(f"prompt of {n} tokens exceeds the engine's max input length {self.max_input_len} "
                              "(rebuild with a larger --max-input-len)")
        vocab = self.spec["vocab_size"]
        if ids.min() < 0 or ids.max() >= vocab:
            raise EngineError(f"token ids must lie in [0, {vocab})")
        return ids, mask

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: Sequence[Sequence[int]] | np.ndarray,
        max_new_tokens: int = 64,
        sampling: SamplingConfig | None = None,
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
        if not 1 <= max_new_tokens <= self.max_new_tokens:
            raise EngineError(f"max_new_tokens must lie in [1, {self.max_new_tokens}] (the engine's built maximum), "
                              f"got {max_new_tokens}")
        try:
            budget = self.policy.with_budget(kv_budget).budget if kv_budget is not None else None
        except ValueError as e:
            raise EngineError(str(e)) from None
        ids, mask = self._batch(prompts, attention_mask)
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
        itemsize = 4  # fp32 caches
        per_entry = 2 * self.spec["head_dim"] * itemsize
        full = per_entry * self.spec["num_kv_heads"] * int(lengths.sum()) * self.spec["num_layers"]
        kept = per_entry * sum(int(x.sum()) for x in pre.lengths)
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
