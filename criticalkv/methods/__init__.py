"""Eviction methods as units, and the registry that composes them into the policies users name.

One module per base method (``full``, ``streamingllm``, ``snapkv``, ``pyramidkv``, ``adakv``, ``laprox``,
``defensivekv`` and ``layer-defensivekv``, ``expected-attention``, ``kvzip`` and ``layer-kvzip``, ``keydiff``) holds its scores, how
it shares the budget and its piece of the ONNX function body; ``two_stage`` is CriticalKV's selection applied on top of
any scored base; ``phases`` holds what a method needs beyond one layer's Q/K/V (streams, re-read passes) in a form the
engine, the exporter and the backends run without knowing the method. ``METHODS`` below is the one list of policies:
``POLICIES`` (name -> base, refined) is derived from it, and ``KVPolicy``, the CLI, the generated C++ header, the
plugin YAML and the README table all read it.

What the methods share sits beside them, on the same ground floor (nothing of the package above is imported here):
``budget`` (the integer budget rules), ``topk`` (top-k with the tie rule), ``pruned`` (CriticalKV's exactly pruned
stage 2) and ``lazy`` (torch, imported when a method first runs PyTorch code, so that ``KVPolicy`` and the ONNX
Runtime side load this registry without torch).

Adding a base method: a module here with a ``BaseMethod`` subclass and the dataclass of its knobs (its ``Knobs``:
``criticalkv.methods.knobs``), its entry in ``BASE_METHODS`` (and a composed policy in ``METHODS`` for a two-stage
variant), then ``python -m criticalkv.spec.generate``; or, at run time, ``register(Method(...))``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from criticalkv.methods import (adakv, defensivekv, expected_attention, full, keydiff, kvzip, laprox, pyramidkv, snapkv,
                                streamingllm)
from criticalkv.methods.base import Allocation, BaseMethod, GroupScoreInputs
from criticalkv.methods.knobs import Knob, Knobs, combined
from criticalkv.methods.two_stage import TWO_STAGE, TwoStage

#: Every base method, in the order of the C++ ``BaseMethod`` enum.
BASE_METHODS: dict[str, BaseMethod] = {
    m.name: m
    for m in (full.METHOD, streamingllm.METHOD, snapkv.METHOD, pyramidkv.METHOD, adakv.METHOD, laprox.METHOD,
              defensivekv.METHOD, defensivekv.LAYER_METHOD, expected_attention.METHOD, kvzip.METHOD,
              kvzip.LAYER_METHOD, keydiff.METHOD)
}


@dataclass(frozen=True)
class Method:
    """A policy's method: a base method, optionally refined by CriticalKV's two-stage selection."""

    name: str
    base: BaseMethod
    refine: TwoStage | None = None
    description: str = ""

    @property
    def Knobs(self) -> type[Knobs]:
        """The dataclass of the knobs this policy reads besides name, budget and window: its base method's, then its
        refinement's (``criticalkv.methods.knobs.combined``)."""
        return combined(self.name, (self.base.Knobs, self.refine.Knobs if self.refine else None))

    @property
    def knobs(self) -> tuple[str, ...]:
        """The names of the knobs this policy reads besides name, budget and window (``Knobs``'s fields)."""
        return tuple(f.name for f in dataclasses.fields(self.Knobs))

    @property
    def score_knobs(self) -> tuple[str, ...]:
        """The knobs the layer's scores depend on (everything else only shares the budget)."""
        return self.base.score_knobs + (self.refine.score_knobs if self.refine else ())

    @property
    def score_names(self) -> tuple[str, ...]:
        return ("attention",) + self.base.score_names + (self.refine.score_names if self.refine else ())

    @property
    def scored_apart(self) -> bool:
        """Whether the policy ranks by per-entry scores its method's phases compute apart from the layers' selection
        (``criticalkv.methods.phases``: a re-read of the prompt, streams of the layers' inputs): its prompts are then
        selected after they are whole (the select graph), not inside the one-shot prefill."""
        return self.base.external_scores and self.base.evicts


def _compose(name: str, base: str, two_stage: bool = False, description: str | None = None) -> Method:
    b = BASE_METHODS[base]
    return Method(name, b, TWO_STAGE if two_stage else None, description or b.description)


#: Policy name -> its method (the registry).
METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        *(_compose(name, name) for name in BASE_METHODS),
        _compose("criticalkv", "snapkv", True, "snapkv budgets, two-stage: alpha by attention, rest by attention × ‖V W_O‖"),
        _compose("pyramid-criticalkv", "pyramidkv", True, "pyramidkv budgets + CriticalKV two-stage selection"),
        _compose("ada-criticalkv", "adakv", True, "adakv budgets + CriticalKV two-stage selection inside each head's share"),
        _compose("expected-criticalkv", "expected-attention", True,
                 "CriticalKV's two stages on the expected attention (question-agnostic): alpha by it, the rest by it × ‖V W_O‖"),
        _compose("kvzip-criticalkv", "kvzip", True,
                 "CriticalKV's two stages on the context-reconstruction score (question-agnostic), inside adakv's "
                 "shares: alpha by it, the rest by it × ‖V W_O‖"),
        _compose("layer-kvzip-criticalkv", "layer-kvzip", True,
                 "CriticalKV's two stages on the context-reconstruction score inside layer-kvzip's model-wide shares "
                 "(question-agnostic): alpha by it, the rest by it × ‖V W_O‖"),
    )
}

#: The policy the serving context cache compresses contexts with unless the build says otherwise
#: (``criticalkv.build.context_policy_for``; ``criticalkv.export.config`` names it too; a name or a knob spec): KVzip's
#: score predicted from the prefill by the model's surrogate (no re-read: the scoring costs nothing beside the
#: prefill), CriticalKV's two stages inside one model-wide allocation, a head keeping at most 6x the budget
#: (results/README.md, "KVzip's score without the re-read": needle 90 % of 20 prompts at 256 of 2,048 entries, 100 % at
#: 512; RULER-style 1.14x ``full`` at 512; capped at 3x the surrogate's shares lose the needle, 55 %). A model without
#: a surrogate needs ``criticalkv train-surrogate`` or another ``--context-policy``.
DEFAULT_CONTEXT_POLICY = "layer-kvzip-criticalkv:kvzip_score=surrogate:head_cap_ratio=6"
#: The default's stand-in for a model without a KVzip surrogate (``criticalkv.build``): KVzip's re-read, capped at 3x
#: (needle 85 % of 20 at 256 on the bundled model; the re-read costs about 2.2x the context's prefill, once).
SURROGATE_FALLBACK = "layer-kvzip-criticalkv:head_cap_ratio=3"

for _method in METHODS.values():  # every policy's knobs dataclass exists from import on (its objects unpickle)
    _method.Knobs  # noqa: B018

#: Policy name -> (base method name, whether the two-stage refinement is on).
POLICIES: dict[str, tuple[str, bool]] = {name: (m.base.name, m.refine is not None) for name, m in METHODS.items()}


def knob_fields() -> dict[str, dataclasses.Field]:
    """Every knob some policy reads (name -> its dataclass field), in registry order (each policy's knobs in their
    declaration order): the flat view of a policy (``KVPolicy.attributes``: the ONNX node's attributes, the plugin's
    creator fields, the generated C++ ``PolicyConfig``)."""
    fields: dict[str, dataclasses.Field] = {}
    for method in METHODS.values():
        for f in dataclasses.fields(method.Knobs):
            fields.setdefault(f.name, f)
    return fields


def register(method: Method) -> Method:
    """Add a policy (``method.name``) to the registry at run time: ``KVPolicy`` accepts it, the drivers run it (a
    module of ``criticalkv.methods`` adds its policies to ``METHODS`` above instead, which the generated C++ and docs
    list). Returns ``method``; ``unregister`` takes it back."""
    if method.name in METHODS:
        raise ValueError(f"policy {method.name!r} is already registered")
    method.Knobs  # its knobs dataclass, made now (its objects unpickle)
    METHODS[method.name] = method
    POLICIES[method.name] = (method.base.name, method.refine is not None)
    return method


def unregister(name: str) -> None:
    """Remove a policy ``register`` added."""
    METHODS.pop(name, None)
    POLICIES.pop(name, None)


def method_of(policy) -> Method:
    """The ``Method`` of a ``KVPolicy`` (or of a policy name)."""
    return METHODS[policy if isinstance(policy, str) else policy.name]


def unrefined(policy):
    """The base policy a two-stage policy refines (same knobs), or None when ``policy`` is not refined."""
    method = method_of(policy)
    return None if method.refine is None else policy.replace(name=method.base.name)


def same_selection(a, b) -> bool:
    """Whether two policies select the same entries: same name, budget, window and every knob the method reads."""
    return a.name == b.name and all(getattr(a, k) == getattr(b, k) for k in ("budget", "window") + method_of(a).knobs)


__all__ = [
    "Allocation",
    "Knob",
    "Knobs",
    "BASE_METHODS",
    "BaseMethod",
    "DEFAULT_CONTEXT_POLICY",
    "GroupScoreInputs",
    "METHODS",
    "Method",
    "POLICIES",
    "SURROGATE_FALLBACK",
    "TWO_STAGE",
    "TwoStage",
    "knob_fields",
    "method_of",
    "register",
    "same_selection",
    "unrefined",
    "unregister",
]
