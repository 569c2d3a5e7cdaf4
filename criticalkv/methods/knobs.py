"""A method's knobs: a small frozen dataclass declared with the method.

Each method module declares what it reads besides the policy's name, budget and window as a ``Knobs`` subclass,
one field per knob, made by ``Knob.field()``; the method names it (``BaseMethod.Knobs``, ``TwoStage.Knobs``). A knob
several methods read (``pool_kernel``, ``sink_tokens``, ``ada_floor``, ...) is one ``Knob`` constant, in the module
of the method that introduced it, which the others' dataclasses reuse, so that its default, help, choices and rules
are said once. A policy's knobs are its base method's and its refinement's together (``combined``); ``KVPolicy``
holds them as one object of that dataclass and validates them with the rules below (``criticalkv.spec.rules``).

Adding a knob: a field of the method's ``Knobs``. The spec parser, the validation, the manifest, the generated C++
header and validation, the plugin YAML and the docs table read it from there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable

from criticalkv.spec.rules import Rule, Scoped

#: Python type of a knob by the name its annotation spells (the dataclasses here use postponed annotations).
TYPES = {"int": int, "float": float, "str": str}


@dataclass(frozen=True)
class Knob:
    """One knob: default, help, choices and validation rules (checked in order after the type and the choices).

    A ``Scoped(rule, "reads")`` rule holds only for policies whose method reads the knob, ``"evicts"`` only for
    policies that evict. The same rules are generated into the C++ validation.
    """

    default: Any
    help: str
    choices: tuple | None = None
    rules: tuple[Rule | Scoped, ...] = ()

    def field(self) -> Any:
        """A dataclass field carrying this knob (its help, choices and rules in the field's metadata)."""
        return dataclasses.field(default=self.default, metadata={"help": self.help, "choices": self.choices,
                                                                 "rules": tuple(self.rules)})


@dataclass(frozen=True)
class Knobs:
    """The knobs a method reads (none: the base of every method's dataclass)."""


def knob_fields(knobs: type[Knobs] | Knobs) -> tuple[dataclasses.Field, ...]:
    """The fields of a knobs dataclass, in declaration order."""
    return dataclasses.fields(knobs)


def knob_names(knobs: type[Knobs] | Knobs) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(knobs))


def type_name(f: dataclasses.Field) -> str:
    """``"int"``, ``"float"`` or ``"str"``: a knob field's type (a string under postponed annotations)."""
    return f.type if isinstance(f.type, str) else f.type.__name__


def convert(f: dataclasses.Field, value: Any) -> Any:
    """``value`` in the knob's type where JSON changed it (20.0 written as 20), else unchanged."""
    if type_name(f) == "float" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


_COMBINED: dict[tuple[type, ...], type[Knobs]] = {}


def combined(name: str, parts: Iterable[type[Knobs]]) -> type[Knobs]:
    """One frozen dataclass with the fields of ``parts`` in order (a field two parts declare counts once): the knobs
    of a policy whose method is a base refined by another (``kvzip-criticalkv``: KVzip's and two-stage's). A single
    part is returned as it is. The class is kept in this module under ``name`` so that its objects pickle."""
    parts = tuple(p for p in parts if p is not None)
    if len(parts) == 1:
        return parts[0]
    if parts in _COMBINED:
        return _COMBINED[parts]
    seen: dict[str, dataclasses.Field] = {}
    for part in parts:
        for f in dataclasses.fields(part):
            seen.setdefault(f.name, f)
    cls_name = "".join(w.capitalize() for w in name.replace("-", "_").split("_")) + "Knobs"
    cls = dataclasses.make_dataclass(
        cls_name, [(n, f.type, dataclasses.field(default=f.default, metadata=f.metadata)) for n, f in seen.items()],
        bases=(Knobs,), frozen=True)
    cls.__module__, cls.__qualname__ = __name__, cls_name
    cls.__doc__ = f"The knobs of {name}: " + " + ".join(p.__name__ for p in parts) + "."
    globals()[cls_name] = cls
    _COMBINED[parts] = cls
    return cls
