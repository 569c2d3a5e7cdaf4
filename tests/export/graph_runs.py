"""An engine directory's graphs driven with plain ONNX Runtime sessions, the way a runtime drives them.

KV buffers per layer: keys / values [B, H_kv, capacity, d_h] float32 and lengths [B, H_kv] int32; the new entries
that ``extend.onnx`` and ``decode.onnx`` return are written at each head's length and the lengths advanced (the
in-place write of the runtime's decode). ``chunked_prefill`` is the chunked prefill of issue 19: extend chunks over a
full-size buffer, the last ``window`` queries kept across chunks, then ``select.onnx``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort


def session(folder: Path, name: str, threads: int = 0) -> ort.InferenceSession:
    """A session of one graph (``threads``: intra-op threads, 0 = ONNX Runtime's default)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(str(Path(folder) / name), options, providers=["CPUExecutionProvider"])


def run(sess: ort.InferenceSession, feeds: dict) -> dict[str, np.ndarray]:
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


class KVBuffers:
    """Per-layer buffers of ``batch`` sequences (capacity per layer)."""

    def __init__(self, batch: int, kv_heads: int, capacities: list[int], head_dim: int):
        self.keys = [np.zeros((batch, kv_heads, c, head_dim), np.float32) for c in capacities]
        self.values = [np.zeros((batch, kv_heads, c, head_dim), np.float32) for c in capacities]
        self.lengths = [np.zeros((batch, kv_heads), np.int32) for _ in capacities]

    @classmethod
    def from_prefill(cls, outputs: dict, capacities: list[int]) -> "KVBuffers":
        """Buffers holding a prefill's kept entries (``present.{l}.*`` of prefill.onnx or select.onnx)."""
        first = outputs["present.0.key"]
        buffers = cls(first.shape[0], first.shape[1], capacities, first.shape[3])
        for layer in range(len(capacities)):
            kept = outputs[f"present.{layer}.key"].shape[2]
            buffers.keys[layer][:, :, :kept] = outputs[f"present.{layer}.key"]
            buffers.values[layer][:, :, :kept] = outputs[f"present.{layer}.value"]
            buffers.lengths[layer][:] = outputs[f"present.{layer}.lengths"]
        return buffers

    def copy(self) -> "KVBuffers":
        other = KVBuffers.__new__(KVBuffers)
        other.keys = [k.copy() for k in self.keys]
        other.values = [v.copy() for v in self.values]
        other.lengths = [n.copy() for n in self.lengths]
        return other

    def feeds(self) -> dict[str, np.ndarray]:
        feeds = {}
        for layer, (k, v, n) in enumerate(zip(self.keys, self.values, self.lengths)):
            feeds.update({f"past_key_values.{layer}.key": k, f"past_key_values.{layer}.value": v,
                          f"past_key_values.{layer}.lengths": n})
        return feeds

    def append(self, outputs: dict) -> None:
        """Write ``present.{l}.key`` / ``.value`` [B, H_kv, N, d_h] at each head's length; lengths += N."""
        for layer, lengths in enumerate(self.lengths):
            new_k, new_v = outputs[f"present.{layer}.key"], outputs[f"present.{layer}.value"]
            count = new_k.shape[2]
            if int(lengths.max()) + count > self.keys[layer].shape[2]:
                raise ValueError(f"layer {layer}: the buffer is full")
            for b, h in np.ndindex(lengths.shape):
                at = int(lengths[b, h])
                self.keys[layer][b, h, at:at + count] = new_k[b, h]
                self.values[layer][b, h, at:at + count] = new_v[b, h]
            lengths += count


def prefill(sess, ids: np.ndarray, budget: int) -> dict[str, np.ndarray]:
    """prefill.onnx on unpadded prompts ids [B, n]."""
    n = ids.shape[1]
    return run(sess, {"input_ids": ids, "attention_mask": np.ones_like(ids), "kv_budget": np.array([budget]),
                      "position_ids": np.broadcast_to(np.arange(n), ids.shape).copy()})


def extend(sess, buffers: KVBuffers, ids: np.ndarray, positions: np.ndarray) -> dict[str, np.ndarray]:
    """extend.onnx on ids, positions [B, N]; the new entries are appended to ``buffers``."""
    out = run(sess, {"input_ids": ids, "position_ids": positions, **buffers.feeds()})
    buffers.append(out)
    return out


def decode(sess, buffers: KVBuffers, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """decode.onnx on one token per sequence (tokens, positions [B]); returns logits [B, vocab]."""
    out = run(sess, {"input_ids": tokens[:, None], "position_ids": positions[:, None], **buffers.feeds()})
    buffers.append(out)
    return out["logits"]


def chunked_prefill(extend_sess, select_sess, ids: np.ndarray, chunk: int, capacity: int, num_layers: int,
                    kv_heads: int, head_dim: int, window: int, budget: int):
    """Prompts ids [B, n] through extend chunks of ``chunk`` tokens over an empty full-size buffer, then select.onnx.

    The select graph's ``window_queries.{l}`` are the last min(window, n) queries, concatenated across the last chunks
    (a last chunk shorter than the window). Returns (select outputs, the last chunk's logits, the full buffers)."""
    batch, n = ids.shape
    buffers = KVBuffers(batch, kv_heads, [capacity] * num_layers, head_dim)
    queries = [None] * num_layers
    for start in range(0, n, chunk):
        part = ids[:, start:start + chunk]
        positions = np.broadcast_to(np.arange(start, start + part.shape[1]), part.shape).copy()
        out = extend(extend_sess, buffers, part, positions)
        for layer in range(num_layers):
            new = out[f"present.{layer}.window_queries"]
            queries[layer] = new if queries[layer] is None else np.concatenate([queries[layer], new], axis=2)
            queries[layer] = queries[layer][:, :, -window:]
    feeds = {"kv_budget": np.array([budget]), **buffers.feeds()}
    feeds.update({f"window_queries.{layer}": q for layer, q in enumerate(queries)})
    wanted = {i.name for i in select_sess.get_inputs()}
    for layer in range(num_layers):  # kvzip: no reconstruction scores, the window's fallback (as the prefill graph's)
        if f"scores.{layer}" in wanted:
            feeds[f"scores.{layer}"] = np.zeros((batch, kv_heads, 0), np.float32)
    return run(select_sess, feeds), out["logits"], buffers
