"""``streamingllm``: the first ``sink_tokens`` tokens (attention sinks) + the most recent ones."""

from __future__ import annotations

from dataclasses import dataclass

from criticalkv.methods.base import BaseMethod
from criticalkv.methods.knobs import Knob, Knobs
from criticalkv.spec.rules import MAX_TOKENS, AtLeast, AtMost, NotAboveField, Scoped
from criticalkv.methods.lazy import torch

SINK_TOKENS = Knob(4, "streamingllm, expected-attention, kvzip: number of leading attention-sink tokens kept",
                   rules=(AtLeast(0), Scoped(NotAboveField("budget"), "reads"), AtMost(MAX_TOKENS)))


@dataclass(frozen=True)
class StreamingLLMKnobs(Knobs):
    sink_tokens: int = SINK_TOKENS.field()


class StreamingLLM(BaseMethod):
    name = "streamingllm"
    cpp_enum = "kStreamingLLM"
    description = "sink_tokens first tokens + the most recent budget - sink_tokens"
    Knobs = StreamingLLMKnobs
    scored = False
    score_knobs = ()

    def unscored_keep(self, policy, valid, valid_start, num_kv_heads):
        batch, n = valid.shape
        pos = torch.arange(n, device=valid.device)
        sinks = pos[None, :] < (valid_start + policy.sink_tokens)[:, None]
        recent = pos >= n - (policy.budget - policy.sink_tokens)
        return (valid & (sinks | recent[None, :]))[:, None, :].expand(batch, num_kv_heads, n)

    def onnx_unscored_keep(self, body, g, ctx):
        p = body.policy
        sinks = g.Less(g.unsqueeze(ctx["pos"], 0), g.unsqueeze(g.Add(ctx["valid_start"], g.scalar(p.sink_tokens)), 1))
        recent = g.GreaterOrEqual(ctx["pos"], g.Sub(g.squeeze(ctx["n"], 0), g.Sub(ctx["budget"], g.scalar(p.sink_tokens))))
        return g.unsqueeze(g.And(ctx["valid"], g.Or(sinks, recent)), 1)  # [B, 1, n]


METHOD = StreamingLLM()
