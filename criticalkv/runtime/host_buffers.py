"""KV buffers in host memory (NumPy), shared by the CPU backends (ONNX Runtime, OpenVINO): the rows, their lengths,
and what the portable graphs return written back into them.

Per layer l, K and V ``[max_batch, H_kv, cap_l, d_h]`` and lengths ``[max_batch, H_kv]`` int32 (views of one block
``[L, max_batch, H_kv]``), allocated once (cap_l = the layer's selection capacity + the built max_question_len +
max_new_tokens). Each head holds its valid entries in its first ``lengths`` slots, whatever graph wrote them; a decode
over B rows reads the first B rows of every buffer (contiguous views). A backend runs the graphs; this class moves the
entries (``Backend``'s row operations) and stores the new entries a portable decode or extend returns.
"""

from __future__ import annotations

import numpy as np

from criticalkv import graphs

from criticalkv.runtime.backend import BuiltShapes, PrefillBuffer, PrefillOutputs, RowSnapshot, prefill_buffer_capacity
from criticalkv.runtime.manifest import EngineError


class HostKVBuffers(BuiltShapes):
    """The host-memory KV rows of a CPU backend (module docstring). ``kv_dtype``: the decode buffers' element type."""

    kv_dtype = np.dtype(np.float32)

    def _allocate(self) -> None:
        shape = (self.max_batch, self.kv_heads)
        self.keys = [np.zeros(shape + (cap, self.head_dim), self.kv_dtype) for cap in self.capacities]
        self.values = [np.zeros(shape + (cap, self.head_dim), self.kv_dtype) for cap in self.capacities]
        # one block [L, max_batch, H_kv]: a decode step checks and bumps every layer's lengths in one operation
        self._length_block = np.zeros((self.num_layers,) + shape, np.int32)
        self.lengths = list(self._length_block)  # per layer [max_batch, H_kv] (views of the block)
        self._capacity_array = np.array(self.capacities, np.int64)
        self.new_keys = [np.zeros(shape + (1, self.head_dim), self.kv_dtype) for _ in self.capacities]
        self.new_values = [np.zeros(shape + (1, self.head_dim), self.kv_dtype) for _ in self.capacities]
        self.logits = np.zeros((self.max_batch, self.vocab), np.float32)
        self.token_ids = np.zeros((self.max_batch, 1), np.int64)
        self.position_ids = np.zeros((self.max_batch, 1), np.int64)

    def kv_buffer_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))

    def to_kv(self, x: np.ndarray) -> np.ndarray:
        """A prefill's float32 entries as the decode buffers hold them (``kv_dtype``; the identity here, NumPy's
        assignment converts to float16: a backend that stores another form converts them)."""
        return x

    def _check_equal_lengths(self, lengths: list[np.ndarray], what: str) -> None:
        """A backend whose decode graph needs something of a row's heads checks it here (``lengths``: per layer
        [H_kv] of a row loaded from ``what``); none by default."""

    # ------------------------------------------------------------------ rows
    def begin_decode(self, prefill: PrefillOutputs) -> None:
        for row in range(prefill.logits.shape[0]):
            self.load_row(row, prefill, row)

    def load_row(self, target: int, prefill: PrefillOutputs, row: int = 0) -> None:
        self.check_row(target)
        self._check_equal_lengths([prefill.lengths[i][row] for i in range(self.num_layers)], "the prefill's")
        for i in range(self.num_layers):
            kept = prefill.keys[i].shape[2]
            self.keys[i][target, :, :kept] = self.to_kv(prefill.keys[i][row])
            self.values[i][target, :, :kept] = self.to_kv(prefill.values[i][row])
            self.lengths[i][target] = prefill.lengths[i][row]

    def save_row(self, row: int) -> RowSnapshot:
        self.check_row(row)
        keys, values, lengths = [], [], []
        for i in range(self.num_layers):
            n = int(self.lengths[i][row].max())  # entries beyond every head's length are never read
            keys.append(self.keys[i][row, :, :n].copy())
            values.append(self.values[i][row, :, :n].copy())
            lengths.append(self.lengths[i][row].copy())
        return RowSnapshot(keys, values, lengths)

    def restore_row(self, row: int, snapshot: RowSnapshot) -> None:
        self.check_row(row)
        self._check_equal_lengths(snapshot.lengths, "the snapshot's")
        for i in range(self.num_layers):
            n = snapshot.keys[i].shape[1]
            if n > self.capacities[i]:
                raise EngineError(f"layer {i}: a snapshot of {n} entries per head does not fit the KV buffer "
                                  f"({self.capacities[i]} entries per head)")
            self.keys[i][row, :, :n] = self._widened(snapshot.keys[i])
            self.values[i][row, :, :n] = self._widened(snapshot.values[i])
            self.lengths[i][row] = snapshot.lengths[i]

    def restore_packed(self, row: int, keys: list[np.ndarray], values: list[np.ndarray],
                       lengths: list[np.ndarray]) -> None:
        """``restore_row`` from the packed form (``criticalkv.serving.context_cache.pack``): per layer the kept entries
        of its heads one after the other, keys and values [sum_h n_h, d_h], and the heads' lengths [H_kv]; each head's
        entries are written at the start of its row (no padded snapshot in between)."""
        self.check_row(row)
        self._check_equal_lengths(lengths, "the snapshot's")
        for i in range(self.num_layers):
            counts = [int(n) for n in np.asarray(lengths[i]).reshape(-1)]
            if max(counts, default=0) > self.capacities[i]:
                raise EngineError(f"layer {i}: a snapshot of {max(counts)} entries per head does not fit the KV buffer "
                                  f"({self.capacities[i]} entries per head)")
            if sum(counts) != keys[i].shape[0] or sum(counts) != values[i].shape[0]:
                raise EngineError(f"layer {i}: the packed snapshot holds {keys[i].shape[0]} entries, its lengths "
                                  f"{sum(counts)}")
            at = 0
            for h, n in enumerate(counts):
                self.keys[i][row, h, :n] = self._widened(keys[i][at:at + n])
                self.values[i][row, h, :n] = self._widened(values[i][at:at + n])
                at += n
            self.lengths[i][row] = lengths[i]

    def _widened(self, x: np.ndarray) -> np.ndarray:
        """A snapshot's entries in the buffers' form: as they are when they have ``kv_dtype``, else (float16 from the
        context cache: ``criticalkv.serving.context_cache.narrow``) widened to float32 and through ``to_kv``."""
        return x if x.dtype == self.kv_dtype else self.to_kv(np.asarray(x, np.float32))

    def move_row(self, source: int, target: int) -> None:
        self.check_row(source)
        self.check_row(target)
        for i in range(self.num_layers):
            kept = int(self.lengths[i][source].max())  # entries beyond every head's length are never read
            self.keys[i][target, :, :kept] = self.keys[i][source, :, :kept]
            self.values[i][target, :, :kept] = self.values[i][source, :, :kept]
            self.lengths[i][target] = self.lengths[i][source]

    def new_prefill_buffer(self, num_tokens: int | None = None, spare: int = 0) -> PrefillBuffer:
        """Buffers for one prompt of ``num_tokens`` tokens prefilled in chunks: every layer's K/V for that many
        entries per head (default max_input_len, the longest prompt), + ``spare`` (the tokens a re-read pass appends
        for a while: ``reread_buffer``)."""
        shape = (1, self.kv_heads, prefill_buffer_capacity(num_tokens, self.max_input_len) + spare, self.head_dim)
        return PrefillBuffer(keys=[np.zeros(shape, np.float32) for _ in range(self.num_layers)],
                             values=[np.zeros(shape, np.float32) for _ in range(self.num_layers)],
                             lengths=[np.zeros((1, self.kv_heads), np.int32) for _ in range(self.num_layers)])

    def read_prompt(self, buffer: PrefillBuffer, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the entries [start, end) of every layer of a prefill buffer: keys and values [L, H_kv, t, d_h]."""
        if not 0 <= start < end <= int(buffer.lengths[0].min()):
            raise EngineError(f"read_prompt: entries [{start}, {end}) are not all in the prefill buffer "
                              f"({int(buffer.lengths[0].min())} held)")
        return (np.stack([k[0, :, start:end] for k in buffer.keys]),
                np.stack([v[0, :, start:end] for v in buffer.values]))

    def write_prompt(self, buffer: PrefillBuffer, keys: list[np.ndarray], values: list[np.ndarray]) -> int:
        """Write the pieces ``keys`` / ``values`` ([L, H_kv, t_j, d_h] each) one after the other from entry 0 of every
        layer of an empty prefill buffer; its lengths become their total, which is returned."""
        total = sum(int(k.shape[2]) for k in keys)
        if total > buffer.keys[0].shape[2] or int(buffer.lengths[0].max()) != 0:
            raise EngineError(f"write_prompt: {total} entries into a prefill buffer of {buffer.keys[0].shape[2]} "
                              f"holding {int(buffer.lengths[0].max())}")
        for i in range(self.num_layers):
            for dst, pieces in ((buffer.keys[i], keys), (buffer.values[i], values)):
                np.concatenate([p[i] for p in pieces], axis=1, out=dst[0, :, :total])
            buffer.lengths[i][...] = total
        return total

    # ------------------------------------------------------------------ what the portable graphs return
    def store_decoded(self, batch: int, rows: np.ndarray, heads: np.ndarray) -> None:
        """Write the new token's entries of rows 0..batch-1 (``new_keys`` / ``new_values`` [B, H_kv, 1, d_h], which a
        portable decode graph returned) at slot ``lengths[b, g]`` of each head; the lengths grow by one. ``rows``,
        ``heads``: ``np.indices((batch, H_kv))``."""
        for i in range(self.num_layers):
            slots = self.lengths[i][:batch]
            if int(slots.max()) >= self.capacities[i]:
                raise EngineError(f"layer {i}: the KV buffer ({self.capacities[i]} entries per head) is full")
            self.keys[i][rows, heads, slots] = self.new_keys[i][:batch, :, 0]
            self.values[i][rows, heads, slots] = self.new_values[i][:batch, :, 0]
            slots += 1

    def check_room(self, keys: list[np.ndarray], lengths: list[np.ndarray], n_new: int) -> None:
        """EngineError unless every head of ``lengths`` has room for ``n_new`` more entries in ``keys``."""
        for i in range(self.num_layers):
            if int(lengths[i].max()) + n_new > keys[i].shape[2]:
                raise EngineError(f"layer {i}: {n_new} more entries do not fit the KV buffer "
                                  f"({keys[i].shape[2]} entries per head, {int(lengths[i].max())} used)")

    def store_extended(self, keys: list[np.ndarray], values: list[np.ndarray], lengths: list[np.ndarray],
                       new_keys: list[np.ndarray], new_values: list[np.ndarray]) -> None:
        """Write the N new entries per head that an extend graph returned (per layer [B, H_kv, N, d_h]) at each head's
        length of ``keys`` / ``values`` [B, H_kv, cap, d_h]; ``lengths`` [B, H_kv] grow by N."""
        batch, heads = lengths[0].shape
        for i in range(self.num_layers):
            n_new = new_keys[i].shape[2]
            for b in range(batch):
                for g in range(heads):
                    at = int(lengths[i][b, g])
                    keys[i][b, g, at:at + n_new] = new_keys[i][b, g]
                    values[i][b, g, at:at + n_new] = new_values[i][b, g]
            lengths[i] += n_new

    def select_feeds(self, buffer: PrefillBuffer, window_queries: list[np.ndarray], wanted: set[str],
                     scores: list[np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The per-layer inputs of a select graph over a prompt prefilled into ``buffer`` (every layer's window
        queries, K, V and lengths, and the phases' scores where the graph takes them: ``wanted``, its input names)."""
        feeds = {}
        for i in range(self.num_layers):
            feeds[graphs.window_queries(i)] = np.ascontiguousarray(window_queries[i], dtype=np.float32)
            feeds[graphs.past_key(i)] = buffer.keys[i]
            feeds[graphs.past_value(i)] = buffer.values[i]
            feeds[graphs.past_lengths(i)] = buffer.lengths[i]
            if graphs.scores(i) in wanted:  # the phases' scores, or none ([1, H_kv, 0]: the method's own fallback)
                layer = np.zeros((1, self.kv_heads, 0), np.float32) if scores is None else scores[i]
                feeds[graphs.scores(i)] = np.ascontiguousarray(layer, dtype=np.float32)
        return feeds
