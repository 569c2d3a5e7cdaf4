"""``KVPolicy``: a policy's name, budget and window, and the knobs of its method.

A method declares the knobs it reads as a small frozen dataclass beside it (``criticalkv.methods.knobs``: type,
default, help, choices and validation rules, ``criticalkv.spec.rules``); a policy holds one object of its method's
dataclass (``KVPolicy.knobs``). The command-line spec (``name:knob=value``), the validation, the JSON form written
into manifests (``to_dict``/``from_dict``: the name, budget, window and the method's knobs) and the attributes of the
ONNX ``CriticalKVSelect`` node (``attributes``: every knob of every method, those the method does not read at their
defaults) follow the methods at run time; the C++ field header and validation, the plugin YAML and the docs table are
generated from them by ``python -m criticalkv.spec.generate`` (``tests/test_spec_generated.py`` checks that they are
fresh, ``tests/test_policy.py`` that flags, JSON and knobs are one set).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import numbers
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

from criticalkv import methods as _methods
from criticalkv.methods.kvzip import KVZIP_REREADS, KVZIP_SCORES  # noqa: F401 - the choices, where they were
from criticalkv.methods.knobs import Knobs, convert, knob_fields, type_name
from criticalkv.methods.two_stage import GQA_REDUCES, STAGE2_SCORES, VALUE_NORMS  # noqa: F401
from criticalkv.spec.rules import MAX_TOKENS, AtMost, NotBelowField, Positive, Scoped

#: Policy name -> (base method, whether CriticalKV's two-stage refinement is on): the registry of
#: ``criticalkv.methods``, which composes the method units.
POLICIES: dict[str, tuple[str, bool]] = _methods.POLICIES

SCHEMA_VERSION = 1


def _field(default: Any, help: str, flag: str | None = None, choices: tuple | None = None, rules: tuple = ()) -> Any:
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices, "rules": tuple(rules)})


_WINDOW_REASON = "; the window is always kept, so the budget must be at least the window"
#: The fields every policy has (the rest are its method's knobs).
OWN = ("name", "budget", "window")


def _check_type(f: dataclasses.Field, value: Any) -> None:
    kind = type_name(f)
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{f.name}: expected an integer, got {value!r}")
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{f.name}: expected a finite number, got {value!r}")
    choices = f.metadata.get("choices") if f.name != "name" else None  # the name: the live registry
    if choices and value not in choices:
        raise ValueError(f"{f.name}: {value!r} is not one of {', '.join(map(str, choices))}")


@dataclass(frozen=True, init=False)
class KVPolicy:
    """A KV-cache selection policy (see ``criticalkv.selection``): its name, budget, window and its method's knobs.

    Budgets count tokens per KV head, averaged over heads and layers, window included:
    ``r = budget - window`` older tokens are chosen per head, the last ``window`` prompt
    tokens are always kept, and a prompt of at most ``budget`` tokens is kept whole.

    ``KVPolicy(name, budget, window, knobs=None, **knob_values)``: ``knobs`` an object of the method's dataclass
    (``policy.method.Knobs``; another method's knobs object gives the values of the knobs both read), ``knob_values``
    single knobs by name (``alpha=0.5``). A knob of another method is checked against its own rules and then
    dropped (the policy does not read it). ``policy.alpha`` reads a knob (the method's value, or its default where
    the method does not read it: the flat view older code reads).

    Raises
    ------
    ValueError
        On construction, naming the offending field, when a knob is out of range.
    """

    name: str = _field("criticalkv", "KV eviction policy", flag="--kv-policy", choices=tuple(POLICIES))
    budget: int = _field(256, "tokens kept per KV head (average over heads and layers), window included",
                         rules=(Positive(), Scoped(NotBelowField("window", _WINDOW_REASON), "evicts"), AtMost(MAX_TOKENS)))
    window: int = _field(32, "observation window: the last prompt tokens whose queries score the rest; always kept",
                         rules=(Positive(), AtMost(MAX_TOKENS)))
    knobs: Knobs = _field(None, "the knobs of the policy's method (an object of its Knobs dataclass)")

    def __init__(self, name: str = "criticalkv", budget: int = 256, window: int = 32, knobs: Knobs | None = None,
                 **knob_values: Any) -> None:
        if name not in POLICIES:
            raise ValueError(f"name: unknown KV policy {name!r}; choose one of {', '.join(POLICIES)}")
        method = _methods.method_of(name)
        cls = method.Knobs
        own = {f.name: f for f in dataclasses.fields(cls)}
        every = _methods.knob_fields()
        unknown = sorted(set(knob_values) - set(every))
        if unknown:
            raise TypeError(f"KVPolicy got unknown knob(s) {', '.join(unknown)}; {name}'s knobs: "
                            f"{', '.join(own) or 'none'}")
        values = {}
        if knobs is not None:
            if not isinstance(knobs, Knobs):
                raise TypeError(f"knobs: expected a Knobs dataclass object, got {knobs!r}")
            values = {f.name: getattr(knobs, f.name) for f in dataclasses.fields(knobs) if f.name in own}
        values.update({k: v for k, v in knob_values.items() if k in own})
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "budget", budget)
        object.__setattr__(self, "window", window)
        for f in (self._field("budget"), self._field("window")):
            _check_type(f, getattr(self, f.name))
        for k, v in values.items():
            _check_type(own[k], v)
        object.__setattr__(self, "knobs", cls(**values))
        self._validate()
        # a knob the method does not read: held to its own rules (a typo'd value is still said), then dropped
        for k, v in knob_values.items():
            if k not in own:
                _check_type(every[k], v)
                view = types.SimpleNamespace(name=name, budget=budget, window=window, **{k: v})
                for rule in every[k].metadata.get("rules", ()):
                    if isinstance(rule, Scoped):
                        continue  # scoped rules hold for the policies that read it, or that evict
                    problem = rule.check(view, k)
                    if problem:
                        raise ValueError(problem)

    @staticmethod
    def _field(name: str) -> dataclasses.Field:
        return {f.name: f for f in dataclasses.fields(KVPolicy)}[name]

    def __getattr__(self, name: str) -> Any:
        """Compatibility: ``policy.alpha`` reads the knob from ``policy.knobs``, or its default where the method does
        not read it (the flat view: ``attributes``)."""
        if name.startswith("__") or "knobs" not in self.__dict__:
            raise AttributeError(name)
        knobs = self.__dict__["knobs"]
        if hasattr(knobs, name) and name in {f.name for f in dataclasses.fields(knobs)}:
            return getattr(knobs, name)
        every = _methods.knob_fields()
        if name in every:
            return every[name].default
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        for f in [self._field("budget"), self._field("window")] + list(dataclasses.fields(self.knobs)):
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
        """A copy with some fields or knobs changed (validated again). A new name keeps the knobs both methods read."""
        name, budget, window = (changes.pop(k, getattr(self, k)) for k in OWN)
        return KVPolicy(name, budget, window, knobs=changes.pop("knobs", self.knobs), **changes)


    # ------------------------------------------------------------------ serialisation
    @classmethod
    def knob_names(cls) -> tuple[str, ...]:
        """Names of every knob of every policy: name, budget, window, then the methods' knobs in registry order
        (``criticalkv.methods.knob_fields``): the ONNX attributes and the plugin's fields (``attributes``)."""
        return OWN + tuple(_methods.knob_fields())

    def attributes(self) -> dict[str, Any]:
        """Every knob (``knob_names``), those the method does not read at their defaults: the ONNX node's attributes
        and the plugin's fields, which are the same for every policy."""
        return {name: getattr(self, name) for name in self.knob_names()}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (manifests): the name, budget, window and the knobs the method reads."""
        return {"name": self.name, "budget": self.budget, "window": self.window, **dataclasses.asdict(self.knobs)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "KVPolicy":
        """Inverse of ``to_dict``, and of ``attributes`` (the form every manifest written before the knobs moved to
        the methods holds: every knob). Unknown keys are an error so that typos do not pass silently."""
        every = _methods.knob_fields()
        unknown = set(data) - set(OWN) - set(every)
        if unknown:
            raise ValueError(f"unknown KVPolicy field(s): {', '.join(sorted(unknown))}")
        kwargs = {k: (convert(every[k], v) if k in every else v) for k, v in data.items()}  # JSON: 20.0 -> 20
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


def _knob_field(knob: str) -> dataclasses.Field:
    """The field of a knob: one of the policy's own (name, budget, window) or a method's."""
    own = {f.name: f for f in dataclasses.fields(KVPolicy) if f.name in OWN}
    return own[knob] if knob in own else _methods.knob_fields()[knob]


def _help(knob: str) -> str:
    return _knob_field(knob).metadata["help"]


def policy_table_markdown() -> str:
    """Markdown tables of the policies and of every knob (its default, and the policies that read it), read from the
    methods (used for docs/policies.md)."""
    rows = ["| policy | base allocation | stage 2 | what it keeps | knobs it reads (`NAME:KNOB=VALUE`) |",
            "|---|---|---|---|---|"]
    for name, (base, two_stage) in POLICIES.items():
        rows.append(f"| `{name}` | {base} | {'yes' if two_stage else 'no'} | {_methods.METHODS[name].description} | "
                    f"{', '.join(spec_knobs(name)) or '-'} |")
    rows += ["", "| knob | on the command line | default | meaning |", "|---|---|---|---|"]
    default = KVPolicy()
    for name in KVPolicy.knob_names():
        f = _knob_field(name)
        choices = f.metadata.get("choices")
        meaning = f.metadata["help"] + (f" ({' / '.join(choices)})" if choices and name != "name" else "")
        rows.append(f"| `{name}` | `{KVPolicy.flag_of(name)}` | `{getattr(default, name)}` | {meaning} |")
    return "\n".join(rows)


def _convert(knob: str, text: str, flag: str):
    kind = type_name(_knob_field(knob))
    try:
        return {"int": int, "float": float, "str": str}[kind](text)
    except ValueError:
        raise ValueError(f"{flag}: {knob}={text!r} is not a valid {kind}") from None


def parse_policy_spec(spec: str, base: KVPolicy, flag: str = "--policies") -> KVPolicy:
    """``name[:knob=value...]`` -> KVPolicy on top of ``base`` (its budget, window and the knobs both methods read
    are the defaults). A knob no method declares is an error naming the method's knobs; one that only other methods
    read is said (a warning) and changes nothing."""
    name, *overrides = spec.strip().split(":")
    if name not in POLICIES:
        raise ValueError(f"{flag}: unknown KV policy {name!r}; choose from {', '.join(POLICIES)}")
    changes: dict = {"name": name}
    read = spec_knobs(name)
    names = set(KVPolicy.knob_names()) - {"name"}
    for item in overrides:
        knob, sep, value = item.partition("=")
        if not sep or not knob:
            raise ValueError(f"{flag}: {item!r} in {spec!r} is not knob=value")
        if knob not in names:
            raise ValueError(f"{flag}: unknown knob {knob!r} in {spec!r}; {name}'s knobs: {', '.join(read) or 'none'}")
        if knob == "budget":
            raise ValueError(f"{flag}: give budgets with {'--budgets' if flag == '--policies' else '--budget'}, not in {spec!r}")
        if knob not in read:  # another method's knob: the spec likely meant another policy
            warnings.warn(f"{flag}: {name} does not read {knob} (in {spec!r}), so it changes nothing; its knobs: "
                          f"{', '.join(read) or 'none'}", UserWarning, stacklevel=2)
        changes[knob] = _convert(knob, value, flag)
    return base.replace(**changes)


def spec_knobs(name: str) -> list[str]:
    """The knobs a ``name:knob=value`` spec may set: those the policy's method reads (its ``Knobs``, declared with
    the method), and the window of a policy that evicts."""
    method = _methods.method_of(name)
    return sorted(set(method.knobs) - {"budget"} | ({"window"} if method.base.evicts else set()))


def policy_spec(policy: KVPolicy) -> str:
    """``name[:knob=value...]`` naming ``policy`` by the knobs of its method that differ from their defaults (budget
    and window aside): the form ``parse_policy_spec`` reads."""
    default = policy.method.Knobs()
    knobs = [k for k in policy.method.knobs if getattr(policy.knobs, k) != getattr(default, k)]
    return ":".join([policy.name] + [f"{k}={getattr(policy.knobs, k)}" for k in knobs])
