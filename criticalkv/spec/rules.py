"""Validation rules of the KVPolicy knobs, each written once and rendered in Python and C++.

A rule checks one knob (``field``) of a policy and returns ``"field: reason"`` or None. ``cpp(field, is_float, ref,
when)`` renders the same check as C++ for the generated validation (``plugins/include/criticalkv/policy_config.h``):
``ref(name)`` is the C++ expression of a field (``p.budget`` in a ``PolicyConfig``, ``value`` in a knob's check), ``when``
a C++ condition the rule is scoped to (a ``Scoped`` rule's: ``read``, ``row->evicts``) or None; the message text is the
same as Python's for integers and for the floats the rules print.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

#: Fractions (alpha, ada_floor, pyramid_beta) are exact decimals: value = micros / DECIMAL_SCALE.
DECIMAL_SCALE = 10**6
#: Largest token count a knob may take (budget, window, pool_kernel, sink_tokens).
MAX_TOKENS = 1 << 22


def _cpp_num(value: float) -> str:
    text = repr(float(value)) if isinstance(value, float) else str(value)
    return text


#: The C++ expression of a field, by its name.
Ref = Callable[[str], str]


def _member(name: str) -> str:
    """A field of the ``PolicyConfig`` ``p`` (the default ``ref``)."""
    return f"p.{name}"


def _cpp_str(expr: str, is_float: bool) -> str:
    """C++ expression turning the numeric ``expr`` into a std::string like Python's str()."""
    return f"detail::formatNumber({expr})" if is_float else f"std::to_string({expr})"


@dataclass(frozen=True)
class Rule:
    """Base of the rules (which policies a rule holds for: ``Scoped``)."""

    def check(self, policy: Any, field: str) -> str | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def cpp(self, field: str, is_float: bool, ref: Ref = _member, when: str | None = None) -> str:  # pragma: no cover
        raise NotImplementedError

    def describe(self) -> str:  # pragma: no cover
        raise NotImplementedError


def _when(when: str | None) -> str:
    return "" if when is None else f"{when} && "


@dataclass(frozen=True)
class Positive(Rule):
    """value >= 1 (a count of tokens)."""

    def check(self, policy, field):
        v = getattr(policy, field)
        return None if v > 0 else f"{field}: must be a positive number of tokens, got {v}"

    def cpp(self, field, is_float, ref=_member, when=None):
        v = ref(field)
        return (f"if ({_when(when)}!({v} > 0))\n        return \"{field}: must be a positive number of tokens, got \" + "
                f"{_cpp_str(v, is_float)};")

    def describe(self):
        return ">= 1"


@dataclass(frozen=True)
class PositiveOdd(Rule):
    def check(self, policy, field):
        v = getattr(policy, field)
        return None if v > 0 and v % 2 == 1 else f"{field}: must be a positive odd integer, got {v}"

    def cpp(self, field, is_float, ref=_member, when=None):
        v = ref(field)
        return (f"if ({_when(when)}!({v} > 0 && {v} % 2 == 1))\n        return \"{field}: must be a positive odd integer, got \" + "
                f"{_cpp_str(v, is_float)};")

    def describe(self):
        return "odd, >= 1"


@dataclass(frozen=True)
class AtLeast(Rule):
    """value >= lo."""

    lo: float

    def check(self, policy, field):
        v = getattr(policy, field)
        return None if v >= self.lo else f"{field}: must be >= {self.lo:g}, got {v}"

    def cpp(self, field, is_float, ref=_member, when=None):
        v = ref(field)
        return (f"if ({_when(when)}!({v} >= {_cpp_num(self.lo)}))\n        return \"{field}: must be >= {self.lo:g}, got \" + "
                f"{_cpp_str(v, is_float)};")

    def describe(self):
        return f">= {self.lo:g}"


@dataclass(frozen=True)
class Between(Rule):
    """lo <= value <= hi."""

    lo: float
    hi: float

    def check(self, policy, field):
        v = getattr(policy, field)
        return None if self.lo <= v <= self.hi else f"{field}: must lie in [{self.lo:g}, {self.hi:g}], got {v}"

    def cpp(self, field, is_float, ref=_member, when=None):
        v = ref(field)
        return (f"if ({_when(when)}!({v} >= {_cpp_num(self.lo)} && {v} <= {_cpp_num(self.hi)}))\n"
                f"        return \"{field}: must lie in [{self.lo:g}, {self.hi:g}], got \" + {_cpp_str(v, is_float)};")

    def describe(self):
        return f"in [{self.lo:g}, {self.hi:g}]"


@dataclass(frozen=True)
class AtMost(Rule):
    """value <= hi (an implementation limit)."""

    hi: int

    def check(self, policy, field):
        v = getattr(policy, field)
        return None if v <= self.hi else f"{field}: {v} exceeds the supported maximum {self.hi}"

    def cpp(self, field, is_float, ref=_member, when=None):
        v = ref(field)
        return (f"if ({_when(when)}{v} > {self.hi})\n        return \"{field}: \" + {_cpp_str(v, is_float)} + "
                f"\" exceeds the supported maximum {self.hi}\";")

    def describe(self):
        return f"<= {self.hi}"


@dataclass(frozen=True)
class ZeroOrAtLeast(Rule):
    """value == 0 (the knob is off) or value >= lo."""

    lo: float

    def check(self, policy, field):
        v = getattr(policy, field)
        return None if v == 0 or v >= self.lo else f"{field}: must be 0 (off) or >= {self.lo:g}, got {v}"

    def cpp(self, field, is_float, ref=_member, when=None):
        v = ref(field)
        return (f"if ({_when(when)}!({v} == 0 || {v} >= {_cpp_num(self.lo)}))\n        return \"{field}: must be 0 (off) or >= {self.lo:g}, got \" + "
                f"{_cpp_str(v, is_float)};")

    def describe(self):
        return f"0 or >= {self.lo:g}"


@dataclass(frozen=True)
class Decimals(Rule):
    """At most ``places`` decimals, so that integer arithmetic on value * 10^places is exact in every language."""

    places: int = 6

    def check(self, policy, field):
        v = getattr(policy, field)
        scale = 10**self.places
        return None if round(v * scale) / scale == v else f"{field}: must have at most {self.places} decimals, got {v}"

    def cpp(self, field, is_float, ref=_member, when=None):
        v = ref(field)
        scale = f"{10**self.places}.0"
        return (f"if ({_when(when)}static_cast<double>(std::llround({v} * {scale})) / {scale} != {v})\n"
                f"        return \"{field}: must have at most {self.places} decimals, got \" + {_cpp_str(v, is_float)};")

    def describe(self):
        return f"<= {self.places} decimals"


@dataclass(frozen=True)
class NotBelowField(Rule):
    """value >= another knob (``other``)."""

    other: str
    reason: str = ""

    def check(self, policy, field):
        v, o = getattr(policy, field), getattr(policy, self.other)
        if v >= o:
            return None
        return f"{field}: {v} is smaller than the {self.other} ({o}){self.reason}"

    def cpp(self, field, is_float, ref=_member, when=None):
        v = ref(field)
        return (f"if ({_when(when)}{v} < {ref(self.other)})\n        return \"{field}: \" + {_cpp_str(v, is_float)} + "
                f"\" is smaller than the {self.other} (\" + {_cpp_str(ref(self.other), is_float)} + \"){self.reason}\";")

    def describe(self):
        return f">= {self.other}"


@dataclass(frozen=True)
class NotAboveField(Rule):
    """value <= another knob (``other``)."""

    other: str

    def check(self, policy, field):
        v, o = getattr(policy, field), getattr(policy, self.other)
        return None if v <= o else f"{field}: {v} exceeds the {self.other} {o}"

    def cpp(self, field, is_float, ref=_member, when=None):
        v = ref(field)
        return (f"if ({_when(when)}{v} > {ref(self.other)})\n        return \"{field}: \" + {_cpp_str(v, is_float)} + "
                f"\" exceeds the {self.other} \" + {_cpp_str(ref(self.other), is_float)};")

    def describe(self):
        return f"<= {self.other}"


@dataclass(frozen=True)
class Scoped:
    """A rule that holds only for the policies whose method reads the knob (``when="reads"``) or evicts."""

    rule: Rule
    when: str  # "reads" | "evicts"


def micros(value: float) -> int:
    """The exact integer value * 10^6 of a fraction with at most 6 decimals (``Decimals`` holds)."""
    return round(value * DECIMAL_SCALE)
