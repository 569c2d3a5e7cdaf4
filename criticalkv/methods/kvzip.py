"""``kvzip``: question-agnostic scores from context reconstruction (KVzip, Kim et al. 2025, arXiv 2505.23416).

KVzip scores a context's KV entries before any question is known: the model, holding the context's full cache,
re-reads the context after a "repeat the previous context" prompt (teacher-forced: the context's own tokens are fed
back), and an entry's score is the largest attention it receives during that reconstruction. Entries the model needs
to reproduce its input are the ones any later question may need. kvpress 0.5.5 ships it as ``KVzipPress``; this
module computes the same score (``tests/selection/test_kvzip.py`` checks it against kvpress's ``score_kvzip`` on the
same tensors where kvpress is installed).

The reconstruction (``reconstruction_chunks``): the context of n tokens, after the chat template's opening when it
starts with it (kvpress's ``prefix_length``: the system turn is not re-read and its entries beyond the sinks score 0),
is re-read in chunks of ``kvzip_chunk`` tokens [s, e), each after its own prompt: the first chunk after ``first``
("\\n\\nRepeat the previous context exactly."), a later one after ``later`` ("\\n\\nRepeat the part of the previous
context exactly, starting with")
followed by the previous chunk's last ``overlap`` (8) tokens; then ``suffix`` (the chat template's end of the user
turn and the assistant header, "\\n" without a template) and the chunk's tokens. Every chunk runs through the model
over the context's full cache at positions n, n + 1, ... (its own K/V dropped afterwards). The prompt's token ids
come from the model's tokenizer (``ReconstructionPrompt``); the drivers are ``criticalkv.hf.reconstruct`` (PyTorch)
and the engine's context path (``criticalkv.runtime``: the extend graph's ``present.{l}.scores`` output).

The score of one layer (``chunk_scores``), per KV head g and context entry i of chunk [s, e), with t running over
every token of the chunk's reconstruction input (R of them, the prompt's included) and h over g's query heads:

    S[g, i] = max_{h in g, t} softmax_t(q_{h,t} K_sub^T / sqrt(d_h))[i]

where the softmax runs over K_sub = the first min(sink_tokens, s) context keys (attention sinks), the chunk's keys
[s, e) and the reconstruction's own keys up to t (causal): kvpress's subsampled keys, not the whole cache (the
model's forward itself attends over the whole cache). Post-RoPE queries and keys, fp32.

S is not pooled over positions (kvpress's; measured: SnapKV's max-pool lost the needle, see ``KVzip.pools``).

Selection: the first ``sink_tokens`` tokens are always kept (kvpress gives them the top score), the window too (as
every scored method here; kvpress keeps none), and the rest ranked by S with AdaKV's head-adaptive allocation (the
layer's H_kv * r slots shared across heads, each head keeping its own top ``ada_floor`` share first). ``kvzip-
criticalkv`` adds CriticalKV's two stages inside each head's share: ceil(alpha * r) by S, the rest by
(S + epsilon) * mean_{h in g} ||V_i W_O^h|| (``value_norm``).

Where this differs from kvpress's ``KVzipPress`` (score identical on the same tensors):
* the budget is shared across the heads of each layer (AdaKV's allocation, with its floor) and every layer keeps
  the same average; kvpress ranks all layers and heads together by default (``layerwise=False``, no floor);
* the window is kept (kvpress keeps none);
* the entries are freed (kvpress masks them in attention and keeps the memory).

Without a reconstruction (``select_layer`` given no ``scores``, the one-shot prefill graph: the node's ``scores``
input then has 0 entries), the scoring queries are the window's: S[g, i] = max over g's heads and the window's
queries of the window attention. This keeps the method defined on every path; the question-agnostic context
compression always runs the reconstruction.

C++: native given its scores: the kernels and the torch ops take them (``select_layer(scores=...)``), the TensorRT plugin
as its seventh input (``criticalkv.node.SCORES_INPUT``, [B, H_kv, n] fp32, computed by the graph). Without scores (the
window-attention fallback) it runs on the PyTorch path and on ONNX Runtime only. ``layer-kvzip`` and
``layer-kvzip-criticalkv`` (model-level) are refused by the per-layer plugin (``cpp_refusal``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from criticalkv.methods.adakv import ADA_FLOOR, AdaKV
from criticalkv.methods.base import MODEL_LEVEL_REFUSAL
from criticalkv.methods.defensivekv import HEAD_CAP_RATIO
from criticalkv.methods.knobs import Knob, Knobs
from criticalkv.methods.lazy import torch
from criticalkv.methods.phases import PromptScoring, RereadPass, Stream, reread_scores
from criticalkv.methods.surrogate import mask_opening, surrogate_of
from criticalkv.methods.streamingllm import SINK_TOKENS
from criticalkv.methods.topk import first_valid_mask
from criticalkv.spec.rules import MAX_TOKENS, AtMost, Positive

KVZIP_REREADS = ("context", "chunk")
#: Where a kvzip policy's score comes from: the context's re-read, or its surrogate (``criticalkv.methods.surrogate``).
KVZIP_SCORES = ("reread", "surrogate")


@dataclass(frozen=True)
class KVzipKnobs(Knobs):
    ada_floor: float = ADA_FLOOR.field()
    sink_tokens: int = SINK_TOKENS.field()
    kvzip_chunk: int = Knob(2048, "kvzip: context tokens re-read per reconstruction pass (the context is scored in "
                            "chunks of this many tokens, each after its own repeat prompt), as kvpress's chunk_size",
                            rules=(Positive(), AtMost(MAX_TOKENS))).field()
    kvzip_reread: str = Knob("context", "kvzip: the cache each chunk's re-read attends to: the whole context's (KVzip as "
                             "published; its cost grows with n x n) or the sinks and the chunk's own entries only "
                             "(chunk: linear in n, the keys its score counts)", choices=KVZIP_REREADS).field()
    kvzip_score: str = Knob("reread", "kvzip: the score's source: the context's re-read (KVzip as published: one more "
                            "pass over the context) or a linear surrogate of it on the prefill's hidden states "
                            "(KVzap-style: no re-read; trained once per model by criticalkv train-surrogate, the bundled "
                            "model's shipped)", choices=KVZIP_SCORES).field()


@dataclass(frozen=True)
class LayerKVzipKnobs(KVzipKnobs):
    head_cap_ratio: float = HEAD_CAP_RATIO.field()

#: kvpress's reconstruction prompts (``KVzipPress.prepare``).
FIRST_PROMPT = "\n\nRepeat the previous context exactly."
LATER_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
#: Tokens of the previous chunk repeated after ``LATER_PROMPT`` (kvpress's ``prev_postfix_size``).
OVERLAP = 8


@dataclass(frozen=True)
class ReconstructionPrompt:
    """The token ids around each reconstructed chunk: ``first`` before the first chunk, ``later`` (+ the previous
    chunk's last ``overlap`` tokens) before the others, ``suffix`` between the prompt and the chunk; ``opening``: the
    chat template's opening (system turn, start of the user turn), which a context that starts with it does not
    re-read (kvpress's ``prefix_length``).

    ``ReconstructionPrompt()`` (every part empty) re-reads the context with no instruction: what a model without a
    tokenizer gets (tests' random models)."""

    first: tuple[int, ...] = ()
    later: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()
    overlap: int = OVERLAP
    opening: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("first", "later", "suffix", "opening"):
            object.__setattr__(self, name, tuple(int(t) for t in getattr(self, name)))
        if self.overlap < 0:
            raise ValueError(f"overlap: must be >= 0, got {self.overlap}")

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "ReconstructionPrompt":
        """kvpress's prompts in ``tokenizer``'s ids; the suffix is its chat template's end of the user turn and
        assistant header ("\\n" without a template), as ``KVzipPress`` derives it."""

        def encode(text: str) -> list[int]:
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])

        if not getattr(tokenizer, "chat_template", None):
            opening, suffix = "", "\n"
        else:
            dummy = "dummy context"
            separator = "\n" + "#" * len(dummy)
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}],
                                                     add_generation_prompt=True, tokenize=False)
            before, suffix = rendered.split(separator)
            opening = before.split(dummy)[0]
        return cls(tuple(encode(FIRST_PROMPT)), tuple(encode(LATER_PROMPT)), tuple(encode(suffix)),
                   opening=tuple(encode(opening)) if opening else ())

    def to_dict(self) -> dict:
        return {"first": list(self.first), "later": list(self.later), "suffix": list(self.suffix), "overlap": self.overlap,
                "opening": list(self.opening)}

    @classmethod
    def of_model(cls, model) -> "ReconstructionPrompt":
        """kvpress's prompts in the tokenizer saved beside ``model``'s weights (``config._name_or_path``, as kvpress
        loads it), else ``ReconstructionPrompt()`` (no instruction: a random model's)."""
        return _prompt_of_folder(str(getattr(model.config, "_name_or_path", "") or "")) or cls()

    @classmethod
    def from_dict(cls, data: dict) -> "ReconstructionPrompt":
        return cls(tuple(data["first"]), tuple(data["later"]), tuple(data["suffix"]), int(data.get("overlap", OVERLAP)),
                   tuple(data.get("opening", ())))

    def skipped(self, context_ids) -> int:
        """Leading context tokens not re-read: the chat template's opening when the context starts with it (and holds
        more than it), else none."""
        k = len(self.opening)
        ids = [int(t) for t in context_ids[: k + 1]]
        return k if k and len(ids) > k and tuple(ids[:k]) == self.opening else 0

    def max_tokens(self, chunk: int) -> int:
        """Most tokens one chunk's reconstruction input holds (prompt + suffix + chunk)."""
        return max(len(self.first), len(self.later) + self.overlap) + len(self.suffix) + chunk


@functools.lru_cache(maxsize=8)
def _prompt_of_folder(folder: str) -> ReconstructionPrompt | None:
    path = Path(folder)
    if not folder or not path.is_dir() or not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer  # only when a model's own folder is read (a build without a tokenizer)

    return ReconstructionPrompt.from_tokenizer(AutoTokenizer.from_pretrained(path))


@dataclass(frozen=True)
class ReconstructionChunk:
    """One reconstruction pass: context entries [start, end) are re-read; ``input_ids`` the pass's tokens (prompt,
    suffix, then context[start:end]); ``sinks`` = min(sink_tokens, start) context entries every query also sees."""

    start: int
    end: int
    sinks: int
    input_ids: tuple[int, ...]


def reconstruction_chunks(context_ids, chunk: int, sink_tokens: int, prompt: ReconstructionPrompt) -> list[ReconstructionChunk]:
    """kvpress's chunked reconstruction plan of a context (``KVzipPress.prepare``): chunks of ``chunk`` tokens from the
    end of the chat template's opening (``ReconstructionPrompt.skipped``; its entries beyond the sinks are never
    scored: 0, as kvpress's)."""
    ids = [int(t) for t in context_ids]
    if not ids:
        raise ValueError("the context is empty: nothing to reconstruct")
    if chunk < 1:
        raise ValueError(f"kvzip_chunk: must be >= 1, got {chunk}")
    skip = prompt.skipped(ids)
    out = []
    for start in range(skip, len(ids), chunk):
        end = min(start + chunk, len(ids))
        if start == skip:
            head = list(prompt.first)
        else:
            head = list(prompt.later) + (ids[max(start - prompt.overlap, skip):start] if prompt.overlap else [])
        out.append(ReconstructionChunk(start, end, min(sink_tokens, start),
                                       tuple(head + list(prompt.suffix) + ids[start:end])))
    return out


def chunk_scores(queries, keys, n: int, chunk: ReconstructionChunk):
    """KVzip's score of one layer for one chunk: [B, H_kv, end - start] fp32, the re-read pass's score
    (``criticalkv.methods.phases.reread_scores``) of the chunk's entries.

    queries : [B, H, R, d_h] post-RoPE queries of the chunk's R reconstruction tokens
    keys : [B, H_kv, n + R, d_h] post-RoPE keys, the context's n then the reconstruction's R
    The softmax of query t runs over the sinks, the chunk's keys and the reconstruction keys <= t (module docstring);
    the maximum is over the G query heads of each KV head and the R queries.
    """
    return reread_scores(queries, keys, n, chunk.sinks, chunk.start, chunk.end)


def window_max_attention(queries, keys, valid_start, m: int):
    """The score without a reconstruction: [B, G, m], every row the max over the G heads and the w window queries of
    the window attention over the older tokens (causal inside the window, left padding masked). queries [B, G, w, d_h],
    keys [B, G, n, d_h] (post-RoPE, the group's KV head expanded)."""
    batch, _, w, d = queries.shape
    n = keys.shape[2]
    logits = queries.float() @ keys.float().transpose(-1, -2) / math.sqrt(d)  # [B, G, w, n]
    pos = torch.arange(n, device=keys.device)
    blocked = pos[None, :] > torch.arange(n - w, n, device=keys.device)[:, None]  # [w, n]
    start = torch.zeros(batch, dtype=torch.int64, device=keys.device) if valid_start is None else valid_start
    blocked = blocked[None] | (pos[None, None, :] < start[:, None, None])  # [B, w, n]
    logits = logits.masked_fill(blocked[:, None], torch.finfo(torch.float32).min)
    best = torch.softmax(logits, dim=-1)[..., :m].amax(dim=(1, 2))  # [B, m]
    return best[:, None].expand(batch, queries.shape[1], m)


#: The stream of a surrogate-scored kvzip policy (``kvzip_score=surrogate``): S_hat of every entry, from its layer input.
SURROGATE_STREAM = "kvzip_score"


class KVzipScoring(PromptScoring):
    """KVzip's scoring of a prompt (``criticalkv.methods.phases``): the surrogate's stream, or the context
    reconstruction as re-read passes (one per chunk, ``reconstruction_chunks``; ``kvzip_reread=chunk``: each over a
    buffer of the context's sinks and the chunk's own entries); the chat template's opening beyond the sinks scores 0
    either way (``mask_opening``)."""

    def __init__(self, policy, prompt: ReconstructionPrompt):
        self.policy = policy
        self.prompt = prompt
        self.streams = (SURROGATE_STREAM,) if policy.kvzip_score == "surrogate" else ()

    def passes(self, ids):
        if self.streams:
            return []
        local = self.policy.kvzip_reread == "chunk"
        return [RereadPass(c.input_ids, c.sinks, c.start, c.end, local)
                for c in reconstruction_chunks(ids, self.policy.kvzip_chunk, self.policy.sink_tokens, self.prompt)]

    def finish(self, ids, streams, reread):
        scores = streams[SURROGATE_STREAM] if self.streams else reread
        return mask_opening(scores, self.prompt, ids, self.policy.sink_tokens)


class KVzip(AdaKV):
    name = "kvzip"
    cpp_enum = "kKVzip"
    description = ("question-agnostic: the largest attention an entry receives while the model re-reads the context "
                   "(context reconstruction), adakv sharing, sink_tokens first tokens kept")
    Knobs = KVzipKnobs
    score_knobs = ("sink_tokens", "kvzip_chunk", "kvzip_reread", "kvzip_score")
    #: not pooled, as kvpress's: max-pooling the score (SnapKV's kernel 7) lost the needle at 256 entries on 2,048-token
    #: contexts where the unpooled score kept it (results/README.md, "Compress once, answer later")
    pools = False
    external_scores = True
    #: the plugin takes the graph's per-entry scores as its seventh input (``criticalkv.node.SCORES_INPUT``)
    native = True

    def sinks(self, policy) -> int:
        return policy.sink_tokens

    # ------------------------------------------------------------------ phases
    data_key = "kvzip"

    def streams(self, policy, model):
        """``kvzip_score=surrogate``: the model's KVzip surrogate as a stream (``SURROGATE_STREAM``)."""
        if policy.kvzip_score != "surrogate":
            return ()
        found = surrogate_of(model)
        return (Stream(SURROGATE_STREAM, found.weight, found.bias, {"model": found.model, "info": found.info},
                       "its KVzip surrogate"),)

    def rereads(self, policy):
        return policy.kvzip_score == "reread"

    def engine_data(self, policy, model, tokenizer=None):
        """The reconstruction prompt in the engine's tokenizer's ids (the chat template's opening, which a score skips,
        included): the PyTorch path's prompt for this model, so both keep the same entries."""
        prompt = ReconstructionPrompt.from_tokenizer(tokenizer) if tokenizer is not None else \
            ReconstructionPrompt.of_model(model)
        return {"prompt": prompt.to_dict()}

    def prompt_scoring(self, policy, data, streams):
        if "prompt" not in data:
            raise ValueError(f"{policy.name} scores with KVzip's context reconstruction, but the engine has no "
                             "reconstruction prompt: rebuild it with this policy")
        if policy.kvzip_score == "surrogate" and SURROGATE_STREAM not in streams:
            raise ValueError(f"{policy.name}:kvzip_score=surrogate scores with the model's KVzip surrogate, which this "
                             "engine was not built with: rebuild it with this policy")
        return KVzipScoring(policy, ReconstructionPrompt.from_dict(data["prompt"]))

    def graph_stream(self, policy):
        """``kvzip_score=surrogate``: the surrogate's stream, which the graphs compute from each layer's input (unlike
        ``KVzipScoring.finish`` they do not zero the chat template's opening: they do not know the tokenizer)."""
        return SURROGATE_STREAM if policy.kvzip_score == "surrogate" else None

    def graph_refusal(self, policy):
        return (f"{policy.name} (kvzip_score={policy.kvzip_score}) ranks by the attention of a context reconstruction "
                "pass through the whole model, which the TensorRT graphs do not run; kvzip_score=surrogate computes its "
                "scores in the graph")

    # ------------------------------------------------------------------ PyTorch
    def attention_rows(self, policy, queries, keys, valid_start, rotation, m):
        best = window_max_attention(queries, keys, valid_start, m)  # no reconstruction: the window's queries
        return best[:, :, None], best

    # ------------------------------------------------------------------ ONNX function body
    def onnx_attention_rows(self, body, g, q, keys, ctx, w, m):
        """The node's ``scores`` input [B, H_kv, n] (the reconstruction's), or the window's max attention when it has
        0 entries: (probs [B, H_kv, G, 1, m], raw [B, H_kv, G, m])."""
        probs, _ = body.window_attention(g, g.reshape(q, [0, body.heads, -1, body.head_dim]), ctx, w, m)
        window = g.ReduceMax(probs, g.i64(2, 3), keepdims=0)  # [B, H_kv, m]: max over the heads and the window
        # scores has n >= m entries or none: the first m of (scores, window) are the scores when given, else the window's
        best = g.slice_axis(g.concat(ctx["scores"], window, axis=2), 0, m, axis=2)
        raw = g.Expand(g.unsqueeze(best, 2), g.concat(g.shape_of(best, 0, 2), g.i64(body.group), m))
        return g.unsqueeze(raw, 3), raw


class LayerKVzip(KVzip):
    """``layer-kvzip``: kvpress's own allocation of the KVzip score (``KVzipPress``'s default, ``layerwise=False``): one
    ranking over every layer's and head's entries after the last layer, the first ``sink_tokens`` tokens first, each head
    its own top ``ada_floor`` share (0: none, as kvpress), at most ``head_cap_ratio`` x budget per head (0: no cap); the
    window kept. Measured: on the same scores it answers needles that ``kvzip``'s per-layer sharing loses at 12.5 % of
    the cache (results/kvzip_allocation_check.md)."""

    name = "layer-kvzip"
    cpp_enum = "kLayerKVzip"
    description = ("kvzip scores, the budget shared across all layers and heads as kvpress's KVzipPress "
                   "(per-head floor ada_floor, cap head_cap_ratio)")
    Knobs = LayerKVzipKnobs
    model_level = True
    #: the CriticalKVSelect plugin is one node per layer: a budget shared by every layer needs every layer's ranking
    #: in one node, the CriticalKVScore / CriticalKVSelectModel plugins' (plugins/README.md)
    native = False
    cpp_refusal = MODEL_LEVEL_REFUSAL

    def max_older_per_head(self, policy, r, m, num_kv_heads):
        from criticalkv.methods.defensivekv import older_cap

        return m if policy.head_cap_ratio == 0 else min(m, older_cap(policy))

    # ------------------------------------------------------------------ PyTorch
    def priority(self, policy, scores, eligible, r):
        """The KVzip score, the first ``sink_tokens`` valid tokens above every other (scores lie in [0, 1])."""
        sink = first_valid_mask(eligible, policy.sink_tokens)
        return scores["attention"] + sink.to(torch.float32) * SINK_OFFSET

    def model_allocate(self, policy, ranking, eligible, r):
        from criticalkv.methods.defensivekv import LAYER_METHOD

        return LAYER_METHOD.model_allocate(policy, ranking, eligible, r)

    # ------------------------------------------------------------------ ONNX function body
    def onnx_priority(self, body, g, scores, eligible, r):
        sink = body.sink if body.sink is not None else g.Not(g.Expand(g.const(True, np.bool_), g.Shape(eligible)))
        return g.Add(scores["attention"], g.Mul(g.Cast(sink, to=g.FLOAT), g.const(SINK_OFFSET, np.float32)))

    def onnx_model_allocate(self, body, g, ranking, eligible, r, budget):
        from criticalkv.methods.defensivekv import LAYER_METHOD

        return LAYER_METHOD.onnx_model_allocate(body, g, ranking, eligible, r, budget)


#: Offset that ranks the sink tokens above every other entry of a model-level ranking (KVzip scores are at most 1).
SINK_OFFSET = 2.0

METHOD = KVzip()
LAYER_METHOD = LayerKVzip()


def empty_scores(batch: int, kv_heads: int) -> np.ndarray:
    """A node's ``scores`` input with no entries [B, H_kv, 0] (no reconstruction: the window's score)."""
    return np.zeros((batch, kv_heads, 0), np.float32)
