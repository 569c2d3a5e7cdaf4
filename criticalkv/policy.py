"""``KVPolicy``: the single source of truth for every knob of the KV selection operator.

Each knob is declared once below: type, default, help, choices and validation rules
(``criticalkv.spec.rules``); which methods read it is declared by the methods (``criticalkv.methods``).
The command-line flags (``add_arguments``), the JSON form written into manifests
(``to_dict``/``from_dict``) and the attributes of the ONNX ``CriticalKVSelect`` node follow the
dataclass at run time; the C++ field header and validation, the plugin YAML and the README table
are generated from it by ``python -m criticalkv.spec.generate`` (``tests/test_spec_generated.py``
checks that they are fresh, ``tests/test_policy.py`` that flags, JSON and fields are one set).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import numbers
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

from criticalkv import methods as _methods
from criticalkv.spec.rules import (
    MAX_TOKENS,
    AtLeast,
    AtMost,
    Between,
    Decimals,
    NotAboveField,
    NotBelowField,
    Positive,
    PositiveOdd,
    Rule,
    Scoped,
    ZeroOrAtLeast,
)

#: Policy name -> (base method, whether CriticalKV's two-stage refinement is on): the registry of
#: ``criticalkv.methods``, which composes the method units.
POLICIES: dict[str, tuple[str, bool]] = _methods.POLICIES



VALUE_NORMS = ("l1", "l2")
GQA_REDUCES = ("mean", "kvpress")
STAGE2_SCORES = ("pooled", "raw")
KVZIP_REREADS = ("context", "chunk")
#: Where a kvzip policy's score comes from: the context's re-read, or its surrogate (``criticalkv.methods.surrogate``).
KVZIP_SCORES = ("reread", "surrogate")

SCHEMA_VERSION = 1


def _knob(
    default: Any, help: str, flag: str | None = None, choices: tuple | None = None, rules: tuple[Rule | Scoped, ...] = ()
) -> Any:
    """A dataclass field carrying its CLI flag, help text, choices and validation rules in its metadata.

    ``rules`` are checked in order after the type and the choices (``criticalkv.spec.rules``); a
    ``Scoped(rule, "reads")`` rule holds only for policies whose method reads the knob, ``"evicts"`` only
    for policies that evict. The same rules are generated into the C++ validation.
    """
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices, "rules": tuple(rules)})


_WINDOW_REASON = "; the window is always kept, so the budget must be at least the window"


@dataclass(frozen=True)
class KVPolicy:
    """Every knob of the KV-cache selection operator (see ``criticalkv.selection``).

    Budgets count tokens per KV head, averaged over heads and layers, window included:
    ``r = budget - window`` older tokens are chosen per head, the last ``window`` prompt
    tokens are always kept, and a prompt of at most ``budget`` tokens is kept whole.

    Raises
    ------
    ValueError
        On construction, naming the offending field, when a knob is out of range.
    """

    name: str = _knob("criticalkv", "KV eviction policy", flag="--kv-policy", choices=tuple(POLICIES))
    budget: int = _knob(256, "tokens kept per KV head (average over heads and layers), window included",
                        rules=(Positive(), Scoped(NotBelowField("window", _WINDOW_REASON), "evicts"), AtMost(MAX_TOKENS)))
    window: int = _knob(32, "observation window: the last prompt tokens whose queries score the rest; always kept",
                        rules=(Positive(), AtMost(MAX_TOKENS)))
    pool_kernel: int = _knob(7, "odd max-pool kernel over token positions applied to window attention",
                             rules=(PositiveOdd(), AtMost(MAX_TOKENS)))
    alpha: float = _knob(0.25, "CriticalKV stage-1 fraction of the selectable budget chosen by attention alone",
                         rules=(Between(0.0, 1.0), Decimals(6)))
    epsilon: float = _knob(1e-4, "CriticalKV stage-2 score is (attention + epsilon) × ‖V W_O‖", rules=(AtLeast(0.0),))
    value_norm: str = _knob("l1", "norm of the projected value ‖V_i W_O^h‖", choices=VALUE_NORMS)
    gqa_reduce: str = _knob(
        "mean", "stage-2 GQA reduction: mean of per-head products, or kvpress: mean(P) * mean(N)", choices=GQA_REDUCES
    )
    stage2_scores: str = _knob(
        "pooled", "attention used in stage 2: max-pooled window mean (kvpress) or raw (paper Alg. 2)", choices=STAGE2_SCORES
    )
    ada_floor: float = _knob(0.2, "adakv/laprox: fraction of the per-head share every head keeps by its own scores",
                             rules=(Between(0.0, 1.0), Decimals(6)))
    pyramid_beta: float = _knob(20.0, "pyramidkv: ratio between the first and the last layer's selectable budget",
                                rules=(AtLeast(1.0), Decimals(6)))
    sink_tokens: int = _knob(4, "streamingllm, expected-attention, kvzip: number of leading attention-sink tokens kept",
                             rules=(AtLeast(0), Scoped(NotAboveField("budget"), "reads"), AtMost(MAX_TOKENS)))
    stage1_mass: float = _knob(0.9, "defensivekv: stage 1 keeps each head's most-attended older tokens while their "
                               "attention mass stays below stage1_mass minus the window's own mass (capped at the head's share)",
                               rules=(Between(0.0, 1.0),))
    head_cap_ratio: float = _knob(0.0, "layer-defensivekv, layer-kvzip (the context cache's default context policy): "
                                  "most entries one KV head keeps, as a multiple of the budget "
                                  "(window included; 0 = no cap, a head may keep its whole prompt); an engine's per-layer "
                                  "KV buffers hold min(max_input_len, head_cap_ratio × budget) entries per head",
                                  rules=(ZeroOrAtLeast(1.0), Decimals(6)))
    future_positions: int = _knob(512, "expected-attention: the next positions the window's queries are carried to "
                                  "through RoPE (their rotation averaged over them), as kvpress's n_future_positions",
                                  rules=(Positive(), AtMost(MAX_TOKENS)))
    kvzip_chunk: int = _knob(2048, "kvzip: context tokens re-read per reconstruction pass (the context is scored in "
                             "chunks of this many tokens, each after its own repeat prompt), as kvpress's chunk_size",
                             rules=(Positive(), AtMost(MAX_TOKENS)))
    kvzip_reread: str = _knob("context", "kvzip: the cache each chunk's re-read attends to: the whole context's (KVzip as "
                              "published; its cost grows with n x n) or the sinks and the chunk's own entries only "
                              "(chunk: linear in n, the keys its score counts)", choices=KVZIP_REREADS)
    kvzip_score: str = _knob("reread", "kvzip: the score's source: the context's re-read (KVzip as published: one more pass "
                             "over the context) or a linear surrogate of it on the prefill's hidden states (KVzap-style: "
                             "no re-read; trained once per model by criticalkv train-surrogate, the bundled model's "
                             "shipped)", choices=KVZIP_SCORES)

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"name: unknown KV policy {self.name!r}; choose one of {', '.join(POLICIES)}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int) and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{f.name}: expected an integer, got {value!r}")
            if f.type in ("float", float):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ValueError(f"{f.name}: expected a finite number, got {value!r}")
            choices = f.metadata.get("choices") if f.name != "name" else None  # the name: the live registry, above
            if choices and value not in choices:
                raise ValueError(f"{f.name}: {value!r} is not one of {', '.join(map(str, choices))}")
        for f in dataclasses.fields(self):
            for rule in f.metadata.get("rules", ()):
                if isinstance(rule, Scoped):
                    if not self._rule_applies(rule, f.name):
                        continue
                    rule = rule.rule
                problem = rule.check(self, f.name)
                if problem:
                    raise ValueError(problem)
        sinks = self.method.base.sinks(self)
        if sinks and self.budget < self.window + sinks:
            raise ValueError(f"budget: {self.name} keeps the window ({self.window}) and the first sink_tokens ({sinks}) "
                             f"tokens, so the budget must be at least {self.window + sinks}, got {self.budget}")

    def _rule_applies(self, scoped: Scoped, knob: str) -> bool:
        method = _methods.method_of(self.name)
        return method.base.evicts if scoped.when == "evicts" else knob in method.knobs

    # ------------------------------------------------------------------ derived
    @property
    def method(self) -> "_methods.Method":
        """The policy's method (``criticalkv.methods``): a base method, optionally refined by two-stage."""
        return _methods.method_of(self.name)

    @property
    def base(self) -> str:
        """The name of the policy's base method (its budget allocation and scores: ``snapkv`` for ``criticalkv``,
        ``kvzip`` for ``kvzip-criticalkv``), the "base allocation" column of ``criticalkv policies``."""
        return self.method.base.name

    @property
    def two_stage(self) -> bool:
        """Whether CriticalKV's stage 2 (attention x projected-value norm) is on."""
        return self.method.refine is not None

    @property
    def min_budget(self) -> int:
        """Smallest budget this policy accepts with its other knobs (a per-request budget's lower bound)."""
        low = self.window
        if "sink_tokens" in self.method.knobs:
            low = max(low, self.sink_tokens)
        # a scored method that also keeps its first tokens (expected-attention) keeps them beside the window
        return max(low, self.window + self.method.base.sinks(self))

    def request_budget(self, kv_budget: int | None) -> int | None:
        """A request's ``kv_budget`` checked against this (built) policy: the one owner of that rule.

        Returns None for the built budget (None or equal to it), else the budget, which lies in
        [min_budget, budget]. Raises ValueError naming ``kv_budget`` otherwise, and for a policy that does not
        evict (``full`` keeps every entry: there is no budget to lower).
        """
        if kv_budget is None:
            return None
        integral = isinstance(kv_budget, numbers.Integral) or (isinstance(kv_budget, float) and kv_budget.is_integer())
        if isinstance(kv_budget, bool) or not integral:
            raise ValueError(f"kv_budget: expected an integer, got {kv_budget!r}")
        kv_budget = int(kv_budget)
        if not self.method.base.evicts:
            raise ValueError(f"kv_budget: this engine's policy {self.name!r} keeps every entry (no budget to lower)")
        if not self.min_budget <= kv_budget <= self.budget:
            why = "the window and the engine's built budget"
            if self.min_budget > self.window:
                why = "the window or sink_tokens, whichever is larger, and the engine's built budget"
            raise ValueError(f"kv_budget must lie in [{self.min_budget}, {self.budget}] ({why}), got {kv_budget}")
        return None if kv_budget == self.budget else kv_budget

    def with_budget(self, kv_budget: int | None) -> "KVPolicy":
        """This policy with a per-request budget in [min_budget, budget] (None: the built budget; a policy that
        does not evict is returned unchanged). The range is ``request_budget``'s."""
        if kv_budget is None or kv_budget == self.budget or not self.method.base.evicts:
            return self
        budget = self.request_budget(kv_budget)
        return self if budget is None else self.replace(budget=budget)

    @property
    def selectable_budget(self) -> int:
        """r = budget - window: older tokens chosen per KV head on average."""
        return self.budget - self.window

    def replace(self, **changes: Any) -> "KVPolicy":
        """A copy with some knobs changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ serialisation
    @classmethod
    def knob_names(cls) -> tuple[str, ...]:
        """Names of every knob, in declaration order: JSON keys, ONNX attributes, plugin fields."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (manifests, ONNX node attributes, plugin fields)."""
        return {name: getattr(self, name) for name in self.knob_names()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "KVPolicy":
        """Inverse of ``to_dict``; unknown keys are an error so that typos do not pass silently."""
        unknown = set(data) - set(cls.knob_names())
        if unknown:
            raise ValueError(f"unknown KVPolicy field(s): {', '.join(sorted(unknown))}")
        kwargs = dict(data)
        for f in dataclasses.fields(cls):  # JSON turns 20.0 into 20: give floats back their type
            if f.name in kwargs and f.type in ("float", float) and isinstance(kwargs[f.name], int):
                kwargs[f.name] = float(kwargs[f.name])
        return cls(**kwargs)

    def to_json(self) -> str:
        return json.dumps({"schema_version": SCHEMA_VERSION, **self.to_dict()}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "KVPolicy":
        data = json.loads(text)
        version = data.pop("schema_version", SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            raise ValueError(f"KVPolicy schema_version {version} is not supported (expected {SCHEMA_VERSION})")
        return cls.from_dict(data)

    # ------------------------------------------------------------------ command line
    #: The knobs with a flag of their own (the rest go in ``--kv-policy``'s spec: ``name:knob=value:...``).
    FLAGGED = ("name", "budget", "window")

    @classmethod
    def flag_of(cls, name: str) -> str:
        """The command-line form of knob ``name``: its flag (``--kv-policy``, ``--budget``, ``--window``), else its key
        in ``--kv-policy``'s spec (``:alpha=``)."""
        if name not in cls.knob_names():
            raise KeyError(name)
        if name in cls.FLAGGED:
            f = {f.name: f for f in dataclasses.fields(cls)}[name]
            return f.metadata.get("flag") or "--" + name.replace("_", "-")
        return f":{name}="

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, defaults: "KVPolicy | None" = None,
                      optional: bool = False) -> None:
        """Add ``--kv-policy NAME[:KNOB=VALUE...]`` (dest ``kv_policy``), ``--budget`` and ``--window`` to ``parser``:
        every knob of the policy is reachable, the advanced ones through the spec (``criticalkv policies`` lists them).
        ``optional``: their defaults are None (the command tells a value given from one left out)."""
        defaults = defaults or cls()
        group = parser.add_argument_group("KV cache policy")
        knobs = ", ".join(k for k in cls.knob_names() if k not in cls.FLAGGED)
        group.add_argument("--kv-policy", dest="kv_policy", metavar="NAME[:KNOB=VALUE...]",
                           default=None if optional else policy_spec(defaults),
                           help=f"the KV eviction policy, one of {', '.join(POLICIES)}, optionally with knob overrides "
                                f"(e.g. criticalkv:alpha=0.5:value_norm=l2; the knobs: {knobs}; `criticalkv policies` "
                                f"says what each does) (default: {policy_spec(defaults)})")
        group.add_argument("--budget", type=int, default=None if optional else defaults.budget,
                           help=f"{_help('budget')} (default: {defaults.budget})")
        group.add_argument("--window", type=int, default=None if optional else defaults.window,
                           help=f"{_help('window')} (default: {defaults.window})")

    @classmethod
    def from_args(cls, args: argparse.Namespace, defaults: "KVPolicy | None" = None) -> "KVPolicy":
        """The policy a namespace filled by ``add_arguments`` names (what it leaves out: ``defaults``'s)."""
        defaults = defaults or cls()
        base = defaults.replace(budget=defaults.budget if args.budget is None else args.budget,
                                window=defaults.window if args.window is None else args.window)
        return parse_policy_spec(args.kv_policy or policy_spec(defaults), base, "--kv-policy")


def _help(knob: str) -> str:
    return {f.name: f for f in dataclasses.fields(KVPolicy)}[knob].metadata["help"]


def policy_table_markdown() -> str:
    """Markdown table of the policies and every knob's default (used for the README)."""
    rows = ["| policy | base allocation | stage 2 | what it keeps | knobs it reads (`NAME:KNOB=VALUE`) |",
            "|---|---|---|---|---|"]
    for name, (base, two_stage) in POLICIES.items():
        rows.append(f"| `{name}` | {base} | {'yes' if two_stage else 'no'} | {_methods.METHODS[name].description} | "
                    f"{', '.join(spec_knobs(name)) or '-'} |")
    rows += ["", "| knob | on the command line | default | meaning |", "|---|---|---|---|"]
    default = KVPolicy()
    for f in dataclasses.fields(KVPolicy):
        choices = f.metadata.get("choices")
        meaning = f.metadata["help"] + (f" ({' / '.join(choices)})" if choices and f.name != "name" else "")
        rows.append(f"| `{f.name}` | `{KVPolicy.flag_of(f.name)}` | `{getattr(default, f.name)}` | {meaning} |")
    return "\n".join(rows)


def _convert(knob: str, text: str, flag: str):
    kind = {f.name: f.type for f in dataclasses.fields(KVPolicy)}[knob]
    kind = kind if isinstance(kind, str) else kind.__name__
    try:
        return {"int": int, "float": float, "str": str}[kind](text)
    except ValueError:
        raise ValueError(f"{flag}: {knob}={text!r} is not a valid {kind}") from None


def parse_policy_spec(spec: str, base: KVPolicy, flag: str = "--policies") -> KVPolicy:
    """``name[:knob=value...]`` -> KVPolicy on top of ``base`` (its knobs are the defaults)."""
    name, *overrides = spec.strip().split(":")
    if name not in POLICIES:
        raise ValueError(f"{flag}: unknown KV policy {name!r}; choose from {', '.join(POLICIES)}")
    changes: dict = {"name": name}
    names = [f.name for f in dataclasses.fields(KVPolicy)]
    for item in overrides:
        knob, sep, value = item.partition("=")
        if not sep or not knob:
            raise ValueError(f"{flag}: {item!r} in {spec!r} is not knob=value")
        if knob not in names or knob == "name":
            knobs = ", ".join(k for k in names if k != "name")
            raise ValueError(f"{flag}: unknown knob {knob!r} in {spec!r}; choose from {knobs}")
        if knob == "budget":
            raise ValueError(f"{flag}: give budgets with {'--budgets' if flag == '--policies' else '--budget'}, not in {spec!r}")
        read = spec_knobs(name)
        if knob not in read:  # kept (a policy carries every knob) but said: the spec likely meant another policy
            warnings.warn(f"{flag}: {name} does not read {knob} (in {spec!r}), so it changes nothing; its knobs: "
                          f"{', '.join(read) or 'none'}", UserWarning, stacklevel=2)
        changes[knob] = _convert(knob, value, flag)
    return base.replace(**changes)


def spec_knobs(name: str) -> list[str]:
    """The knobs a ``name:knob=value`` spec may set: those the policy's method reads (``Method.knobs``, declared with
    the method), and the window of a policy that evicts."""
    method = _methods.method_of(name)
    return sorted(set(method.knobs) - {"budget"} | ({"window"} if method.base.evicts else set()))


def policy_spec(policy: KVPolicy) -> str:
    """``name[:knob=value...]`` naming ``policy`` by the knobs of its method that differ from their defaults (budget
    and window aside): the form ``parse_policy_spec`` reads."""
    default = KVPolicy()
    knobs = [k for k in policy.method.knobs if k not in ("budget", "window") and getattr(policy, k) != getattr(default, k)]
    return ":".join([policy.name] + [f"{k}={getattr(policy, k)}" for k in knobs])
