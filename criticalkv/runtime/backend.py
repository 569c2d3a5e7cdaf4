"""The interface between ``Engine`` (slots, requests, the generation loop) and a backend that runs the
graphs (ONNX Runtime here; TensorRT beside it on GPUs).

A backend owns the KV buffers: it allocates them once for the built maximum batch (one row per sequence),
fills rows from the prefill outputs (``begin_decode`` for a static batch, ``load_row`` one row at a time) and
updates them in place in every ``decode`` step, which runs over the first B rows. Which row holds which
request is ``Engine``'s business: it keeps its occupied slots in the first B rows, loading a new one into row
B and moving the last row into a freed one (``move_row``). Nothing above ``Engine`` calls a backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from criticalkv.errors import EngineError


@dataclass
class PrefillOutputs:
    """What the prefill graph returns (NumPy, host memory).

    logits : [B, vocab] float32, each sequence's last prompt token
    keys, values : per layer [B, H_kv, cap_l, d_h] float32, kept entries, zero padded
    lengths : per layer [B, H_kv] int32, kept entries per head
    indices : per layer [B, H_kv, cap_l] int32, kept positions into the padded prompt, -1 padded
    seconds : wall time of the prefill call
    selection_s : the selection's share of it, when the backend times it (the torch backend: every layer's op)
    """

    logits: np.ndarray
    keys: list[np.ndarray]
    values: list[np.ndarray]
    lengths: list[np.ndarray]
    indices: list[np.ndarray]
    seconds: float
    selection_s: float | None = None


@dataclass
class ExtendOutputs:
    """What the extend graph returns: logits [B, vocab] of each sequence's last new token, and per layer the
    post-RoPE queries [B, H, min(N, window), d_h] of the last new tokens (the chunked prefill's selection needs
    the prompt's last ``window`` queries)."""

    logits: Any
    window_queries: list[Any]
    #: a re-read pass's (``Backend.reread_buffer``): per layer [B, H_kv, P] the score of every past entry
    scores: list[Any] | None = None
    #: the streams of the new entries (``Backend.streams``): name -> per layer [B, H_kv, N] float32 (host arrays)
    streams: dict[str, list[Any]] = field(default_factory=dict)


@dataclass
class PrefillBuffer:
    """One prompt's K/V at full length while it is prefilled in chunks: per layer keys and values
    [1, H_kv, capacity, d_h] (capacity = the prompt's length, ``Backend.new_prefill_buffer``) and lengths [1, H_kv]
    int32 (the tokens prefilled so far)."""

    keys: list[Any]
    values: list[Any]
    lengths: list[Any]

    @property
    def nbytes(self) -> int:
        return sum(int(k.nbytes) + int(v.nbytes) for k, v in zip(self.keys, self.values))


@dataclass
class RowSnapshot:
    """A copy of one buffer row's entries (``Backend.save_row``): per layer keys and values [H_kv, n_l, d_h]
    (n_l = the row's longest head in that layer; NumPy on ONNX Runtime, device tensors on TensorRT) and lengths
    [H_kv] int32."""

    keys: list[Any]
    values: list[Any]
    lengths: list[Any]

    @property
    def nbytes(self) -> int:
        """Bytes the copy holds (every layer's K and V, the padding of shorter heads included)."""
        return sum(int(k.nbytes) + int(v.nbytes) for k, v in zip(self.keys, self.values))


@dataclass
class PromptEntries:
    """The uncompressed entries of consecutive prompt tokens, copied out of a prefill buffer (``Backend.read_prompt``):
    what the serving prefix cache keeps of a prompt's block of tokens.

    keys, values : every layer's [L, H_kv, t, d_h] in one array each (NumPy on the CPU backends, a tensor on the
        backend's device for torch), in the prefill buffer's element type
    streams : the backend's streams of these entries (``Backend.streams``): name -> [L, H_kv, t] float32 (NumPy)
    """

    keys: Any
    values: Any
    streams: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[2])

    @property
    def nbytes(self) -> int:
        """Bytes held: the keys, the values and the streams."""
        size = lambda x: int(x.nbytes) if hasattr(x, "nbytes") else x.numel() * x.element_size()  # noqa: E731
        return size(self.keys) + size(self.values) + sum(size(s) for s in self.streams.values())


class BuiltShapes:
    """The built shapes a backend sizes its buffers with, read from the engine's manifest."""

    num_layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_batch: int
    max_input_len: int  # the longest prompt: a chunked prefill's buffer holds that many entries per head
    capacities: list[int]  # decode capacity per layer
    built_budget: int  # the policy's budget the engine was built with (the largest per-request budget)

    def read_shapes(self, manifest: dict[str, Any]) -> None:
        spec = manifest["model"]["spec"]
        self.num_layers = spec["num_layers"]
        self.kv_heads = spec["num_kv_heads"]
        self.head_dim = spec["head_dim"]
        self.vocab = spec["vocab_size"]
        self.max_batch = manifest["build"]["max_batch_size"]
        self.max_input_len = manifest["build"]["max_input_len"]
        self.capacities = manifest["shapes"]["decode_capacity"]
        self.built_budget = manifest["policy"]["budget"]

    def check_row(self, row: int) -> None:
        if not 0 <= row < self.max_batch:
            raise EngineError(f"row {row} is outside the engine's {self.max_batch} rows (max batch size)")


def prefill_buffer_capacity(num_tokens: int | None, max_input_len: int) -> int:
    """Entries per head of a prefill buffer for a prompt of ``num_tokens`` tokens (None: the longest prompt).
    Sized to the prompt: the select graph of TensorRT takes the prompt's K/V as they lie in the buffer, and the
    scheduler counts n entries per head for a prompt under prefill."""
    if num_tokens is None:
        return max_input_len
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or not 1 <= num_tokens <= max_input_len:
        raise EngineError(f"a prefill buffer holds 1 to max_input_len = {max_input_len} tokens, not {num_tokens!r}")
    return int(num_tokens)


def budget_feed(kv_budget: int, input_type: str, rank: int) -> np.ndarray:
    """The value fed to a prefill graph's ``kv_budget`` input: its integer type, scalar or [1]."""
    dtype = {"tensor(int32)": np.int32, "tensor(int64)": np.int64}.get(input_type)
    if dtype is None:
        raise EngineError(f"the prefill graph's kv_budget input has type {input_type}; expected int32 or int64")
    value = np.array(kv_budget, dtype=dtype)
    return value.reshape((1,) * rank)



class Backend(Protocol):
    """What ``Engine`` needs of a backend."""

    name: str

    #: True when the prefill graph takes the budget as a runtime input (``kv_budget``).
    accepts_kv_budget: bool

    def prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                kv_budget: int | None = None) -> PrefillOutputs:
        """Run the prompt ([B, n] int64 each, left-padded) with the budget ``kv_budget`` (tokens per KV head: a
        ``CheckedRequest``'s ``budget``, which the backend trusts: ``Request.checked`` is the one place that checks
        its range, and that an engine whose prefill graph has no ``kv_budget`` input gets only the built budget).
        None keeps the built budget."""

    def begin_decode(self, prefill: PrefillOutputs) -> None:
        """Copy the kept K/V and lengths of the last prefill into rows 0..B-1 (B = prefill's batch)."""

    def load_row(self, target: int, prefill: PrefillOutputs, row: int = 0) -> None:
        """Copy row ``row`` of the last prefill's kept K/V and lengths into buffer row ``target``."""

    def save_row(self, row: int) -> RowSnapshot:
        """A copy of row ``row``'s valid entries and lengths (the row is unchanged)."""

    def restore_row(self, row: int, snapshot: RowSnapshot) -> None:
        """Write ``snapshot`` into row ``row`` (entries and lengths), as ``load_row`` does a prefill's; entries of
        another floating type than the buffers' (float16 from the context cache) are converted to it."""

    def move_row(self, source: int, target: int) -> None:
        """Copy buffer row ``source`` (K, V, lengths) into row ``target``."""

    def decode(self, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """One step over the first B = len(tokens) rows: tokens and absolute positions [B] int64 (one per
        row) -> logits [B, vocab] (valid until the next call). Each row is computed from that row's inputs only
        (bitwise only for one batch size: ONNX Runtime's CPU GEMM rounds M = 1 and M > 1 differently, ~1e-7)."""

    #: True when the engine has the extend and select graphs (chunked prefill, a question after a cached context).
    has_extend: bool

    #: (optional, default False) True when the extend graph takes at most the build's ``extend_chunk`` tokens a run
    #: (TensorRT's optimization profiles); the CPU runtimes' graphs take any number (``Engine.prefill_run``)
    fixed_extend_shapes: bool

    def extend_row(self, row: int, token_ids: np.ndarray, positions: np.ndarray) -> ExtendOutputs:
        """N tokens ([1, N] int64 ids and absolute positions) through the extend graph over buffer row ``row``: they
        attend to its entries and causally to each other, their K/V join the row at each head's length."""

    def new_prefill_buffer(self, num_tokens: int | None = None) -> PrefillBuffer:
        """Empty buffers for one prompt of ``num_tokens`` tokens (None: max_input_len) prefilled in chunks."""

    def extend_buffer(self, buffer: PrefillBuffer, token_ids: np.ndarray, positions: np.ndarray) -> ExtendOutputs:
        """``extend_row`` over a prefill buffer: the prompt's next N tokens (with the backend's ``streams`` of them)."""

    # optional (the serving prefix cache; a backend without them serves without it): ``read_prompt(buffer, start, end)
    # -> (keys, values)``, copies of every layer's entries [start, end) of a prefill buffer ([L, H_kv, t, d_h] each), and
    # ``write_prompt(buffer, keys, values)``: lists of such pieces written one after the other from entry 0, the
    # buffer's lengths set to their total (a prompt's first tokens, as if prefilled into it)

    #: the streams (``criticalkv.methods.phases.Stream``) ``extend_buffer`` returns for the new entries, by name
    streams: frozenset[str]

    def reread_buffer(self, buffer: PrefillBuffer, token_ids: np.ndarray, positions: np.ndarray,
                      score_range: np.ndarray) -> ExtendOutputs:
        """``extend_buffer`` through the re-read graph (a method's re-read pass, ``criticalkv.methods.phases``): the
        new tokens join the buffer and ``ExtendOutputs.scores`` holds per layer [1, H_kv, P] every past entry's score
        over them: its largest attention from the new queries, the softmax renormalised over the keys ``score_range``
        = (sinks, start, end, n) counts (< sinks, in [start, end), >= n); 0 outside [start, end). The caller cuts the
        buffer back afterwards (``buffer.lengths``)."""

    def select(self, buffer: PrefillBuffer, window_queries: list, kv_budget: int | None = None,
               scores: list | None = None, context: bool = False) -> PrefillOutputs:
        """The selection over the prompt in ``buffer`` (per layer its last min(window, n) queries [1, H, w, d_h]),
        the outputs of ``prefill`` for ``load_row`` (no logits: the last chunk's extend gave them). ``scores``: per layer
        [1, H_kv, n], the scores a policy whose method scores prompts apart ranks by; ``context``: with the engine's
        context policy."""

    def kv_buffer_bytes(self) -> int:
        """Bytes of the K and V buffers (all max_batch rows)."""

    # optional: ``decode_greedy(tokens, positions) -> [B] int64`` (``decode``'s argmax taken on the device, so a greedy
    # loop copies B ids, not B x vocab logits, to the host: ``Engine.generate`` uses it when present) and
    # ``synchronize()`` (wait for the device's queued work; a timing that ends after asynchronous copies calls it)

    def close(self) -> None:
        """Release sessions and buffers."""
