"""What a method needs beyond one layer's Q/K/V, declared as objects that the engine, the exporter and every backend
run without knowing the method.

A method whose ranking needs more than one layer's window (``BaseMethod.external_scores``: kvzip's score of a context
entry is the attention it receives while the model re-reads the context) owns that work here, as kvpress's
``KVzipPress`` owns its re-read in one file. It is made of two primitives, each run the same way for every method:

* **a stream** (``Stream``): a per-entry score every layer computes from its attention input (the layer's hidden
  state after ``input_layernorm``) while the prompt runs, with no extra pass: S[g, i] = exp(h_i . W_l[:, g] + b_l[g]).
  The prompt's graphs return it beside the new K/V (``criticalkv.graphs``: ``present.{l}.stream.{name}``), the torch
  backend computes it in its layer loop; the engine collects it over the prompt's chunks. KVzip's surrogate is one.
* **a re-read** (``RereadPass``): teacher-forced tokens run after the prompt over its cache (positions n, n + 1, ...),
  each scored prompt entry getting the largest attention it receives from them, the softmax renormalised over the
  keys the pass counts (the first ``sinks`` entries, [start, end) and the pass's own earlier tokens); the pass's own
  entries are dropped afterwards. ``local`` runs it over a buffer holding only those keys (linear in n). An entry
  scored by several passes keeps its largest score. KVzip's context reconstruction is a list of such passes.

A method declares, per policy, what an engine built for it needs (``BaseMethod.build_phases`` -> ``BuildPhases``: the
streams' weights, whether it re-reads, its own data for the manifest's ``method_data``) and, per engine, how it scores
a prompt (``BaseMethod.prompt_scoring`` -> ``PromptScoring``: the streams it reads, the passes of a prompt, and
``finish``, which turns their results into the per-layer scores its selection ranks by). Adding such a method is its
module (a ``BaseMethod`` with these two hooks) and one registry line: the engine, the exporter and the backends run
the primitives, never the method.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from criticalkv.methods.lazy import torch

#: Re-read queries scored at a time (rows of the softmax): memory O(ROWS * keys) per head.
ROWS = 256
#: Positions beyond 2 x max_input_len a re-read pass may reach (its own prompt: kvzip's repeat prompt is about 20-40
#: tokens with the chat template's turn markers): the re-read graphs' RoPE tables hold that many
REREAD_PROMPT_ROOM = 256


def layer_linear_maps(weight, bias, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer linear maps checked: weight [L, d, H_kv] and bias [L, H_kv], finite, as contiguous float32."""
    weight = np.ascontiguousarray(np.asarray(weight, dtype=np.float32))
    bias = np.ascontiguousarray(np.asarray(bias, dtype=np.float32))
    if weight.ndim != 3 or bias.shape != (weight.shape[0], weight.shape[2]):
        raise ValueError(f"{what} needs weight [L, d, H_kv] and bias [L, H_kv], got {weight.shape} and {bias.shape}")
    if not (np.isfinite(weight).all() and np.isfinite(bias).all()):
        raise ValueError(f"{what}: the weights must be finite")
    return weight, bias


@dataclass(frozen=True)
class Stream:
    """A per-entry score each layer computes from its attention input h (``d`` wide) as the prompt runs:
    S[g, i] = exp(h_i . weight[l, :, g] + bias[l, g]).

    name : the stream's name (the graph output ``present.{l}.stream.{name}``, ``PromptScoring.streams``)
    weight : [L, d, H_kv] float32; bias : [L, H_kv] float32
    info : what the manifest records of it (where it came from, how it was trained)
    description : what it is, for a build's log ("its KVzip surrogate")
    """

    name: str
    weight: np.ndarray
    bias: np.ndarray
    info: dict = field(default_factory=dict)
    description: str = ""

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ValueError(f"stream name {self.name!r}: letters, digits and underscores only")
        weight, bias = layer_linear_maps(self.weight, self.bias, f"stream {self.name}")
        object.__setattr__(self, "weight", weight)
        object.__setattr__(self, "bias", bias)

    def check_shape(self, num_layers: int, hidden_size: int, kv_heads: int) -> None:
        got = (self.weight.shape[0], self.weight.shape[1], self.weight.shape[2])
        if got != (num_layers, hidden_size, kv_heads):
            raise ValueError(f"stream {self.name}: its (layers, hidden size, KV heads) {got} are not the model's "
                             f"{(num_layers, hidden_size, kv_heads)}")

    def scores(self, layer: int, hidden):
        """The stream of one layer on the PyTorch side: ``hidden`` [B, N, d] (the layer's attention input) ->
        [B, H_kv, N] float32."""
        h = hidden.float()
        w = torch.as_tensor(self.weight[layer], device=h.device)
        b = torch.as_tensor(self.bias[layer], device=h.device)
        return torch.exp(h @ w + b).transpose(1, 2).contiguous()


@dataclass(frozen=True)
class RereadPass:
    """One re-read pass over a prompt's cache (module docstring).

    tokens : the pass's input ids, teacher-forced at positions n, n + 1, ...
    sinks, start, end : the keys its softmax counts among the prompt's entries are [0, sinks) and [start, end) (and the
        pass's own earlier tokens); the entries [start, end) are scored
    local : over a buffer of those keys only (their RoPE as at their positions), not the whole prompt's cache
    """

    tokens: tuple[int, ...]
    sinks: int
    start: int
    end: int
    local: bool = False

    def __post_init__(self):
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        if not self.tokens:
            raise ValueError("a re-read pass has at least one token")
        if not 0 <= self.sinks <= self.start < self.end:
            raise ValueError(f"a re-read pass needs 0 <= sinks <= start < end, got {self.sinks}, {self.start}, {self.end}")

    @property
    def held(self) -> int:
        """Prompt entries a local pass's buffer holds (the sinks and the scored entries)."""
        return self.sinks + self.end - self.start


@dataclass(frozen=True)
class BuildPhases:
    """What an engine built for one policy needs for its method's phases: the streams its prompt graphs return (their
    weights go into the engine), whether it re-reads prompts (the re-read graphs are written), and the method's own
    data (token ids of its prompts, ...) kept in the manifest's ``method_data`` under ``data_key``."""

    streams: tuple[Stream, ...] = ()
    rereads: bool = False
    data_key: str = ""
    data: dict = field(default_factory=dict)

    def merged(self, other: "BuildPhases | None") -> "BuildPhases":
        """Both policies' needs (an engine's own policy and its context policy)."""
        if other is None:
            return self
        streams = {s.name: s for s in self.streams}
        for s in other.streams:
            streams.setdefault(s.name, s)
        if self.data_key and other.data_key == self.data_key and other.data != self.data:
            raise ValueError(f"two policies of one engine need different {self.data_key} data")
        return BuildPhases(tuple(streams.values()), self.rereads or other.rereads, self.data_key or other.data_key,
                           self.data or other.data)


class PromptScoring:
    """How one policy scores a prompt beyond its layers' Q/K/V on an engine (``BaseMethod.prompt_scoring``).

    ``streams``: the streams it reads (every layer's, over the whole prompt); ``passes(ids)``: the re-read passes of a
    prompt (none: the streams suffice); ``finish``: the per-layer scores [1, H_kv, n] float32 its selection ranks by,
    from the streams (name -> per layer [1, H_kv, n]) and the passes' scores (per layer [1, H_kv, n], the largest each
    entry received, 0 where no pass scored it; None without passes)."""

    streams: tuple[str, ...] = ()

    def passes(self, ids: Sequence[int]) -> list[RereadPass]:
        return []

    def finish(self, ids: Sequence[int], streams: dict[str, list[np.ndarray]],
               reread: list[np.ndarray] | None) -> list[np.ndarray]:
        raise NotImplementedError

    def spare(self, ids: Sequence[int]) -> int:
        """Entries a prompt's own buffer needs beyond the prompt for its passes over the whole prompt."""
        return max((len(p.tokens) for p in self.passes(ids) if not p.local), default=0)

    def local_size(self, ids: Sequence[int]) -> tuple[int, int]:
        """(most prompt entries, most pass tokens) of a local pass's buffer; (0, 0) without local passes."""
        local = [p for p in self.passes(ids) if p.local]
        return (max((p.held for p in local), default=0), max((len(p.tokens) for p in local), default=0))


def reread_scores(queries, keys, past: int, sinks: int, start: int, end: int, scale: float | None = None,
                  context: int | None = None):
    """A re-read pass's scores of one layer on the PyTorch side (the re-read graph's, ``RereadPass``): [B, H_kv, e - s]
    fp32, the entries [start, end) of the past.

    queries : [B, H, R, d_h] post-RoPE queries of R of the pass's tokens (one run of it)
    keys : [B, H_kv, past + R, d_h] post-RoPE keys, the past's then the R new ones
    context : where the pass's own entries begin in the past (None: ``past``; a pass run in several runs has the
        earlier runs' entries at [context, past))
    The softmax of query t runs over the first ``sinks`` keys, the keys [start, end), the pass's earlier entries
    [context, past) and the run's keys <= t (causal); the score is its largest value over the G query heads of each KV
    head and the R queries (``ROWS`` rows at a time). ``scale``: the attention's (default 1 / sqrt(d_h)).
    """
    batch, heads, r, d = queries.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    context = past if context is None else context
    sub = torch.cat([keys[:, :, :sinks], keys[:, :, start:end], keys[:, :, context:past + r]], dim=2).float()
    q = queries.float().reshape(batch, kv_heads, group * r, d)  # head h = g * G + j: rows (j, t)
    t_of_row = torch.arange(r, device=keys.device).repeat(group)  # [G * R]
    own = torch.arange(r, device=keys.device)
    counted = sinks + (end - start) + (past - context)  # every key before the run's own
    best = torch.zeros(batch, kv_heads, end - start, dtype=torch.float32, device=keys.device)
    for at in range(0, group * r, ROWS):
        rows = slice(at, at + ROWS)
        logits = q[:, :, rows] @ sub.transpose(-1, -2) * scale  # [B, H_kv, rows, k]
        blocked = own[None, :] > t_of_row[rows, None]  # the run's later keys
        logits[..., counted:] = logits[..., counted:].masked_fill(blocked, -torch.inf)
        probs = torch.softmax(logits, dim=-1)[..., sinks:sinks + end - start]
        best = torch.maximum(best, probs.amax(dim=2))
    return best
