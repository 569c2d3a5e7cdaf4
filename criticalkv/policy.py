"""``KVPolicy``: the single source of truth for every knob of the KV selection operator.

The command-line flags (``add_arguments``), the JSON form written into manifests
(``to_dict``/``from_dict``), the attributes of the ONNX ``CriticalKVSelect`` node and the
fields of the TensorRT plugin creator are all generated from the dataclass fields below,
so they cannot drift apart (``tests/test_policy.py`` checks that they are one set).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

#: Policy name -> (budget allocation "base method", whether stage 2 (CriticalKV) is on).
POLICIES: dict[str, tuple[str, bool]] = {
    "full": ("full", False),
    "streamingllm": ("streamingllm", False),
    "snapkv": ("snapkv", False),
    "pyramidkv": ("pyramidkv", False),
    "adakv": ("adakv", False),
    "laprox": ("laprox", False),
    "criticalkv": ("snapkv", True),
    "pyramid-criticalkv": ("pyramidkv", True),
    "ada-criticalkv": ("adakv", True),
}

#: One-line description of every policy, used by ``criticalkv policies`` and the README table.
POLICY_DESCRIPTIONS: dict[str, str] = {
    "full": "no eviction (reference)",
    "streamingllm": "sink_tokens first tokens + the most recent budget - sink_tokens",
    "snapkv": "every KV head keeps the window + top (budget - window) by pooled window attention",
    "pyramidkv": "snapkv with per-layer budgets decreasing linearly (ratio pyramid_beta), same average",
    "adakv": "snapkv scores, per-layer budget shared across heads (per-head floor ada_floor)",
    "laprox": "layer-global ‖A col‖₂·‖V W_O^h‖₂ importance, per-head floor ada_floor",
    "criticalkv": "snapkv budgets, two-stage: alpha by attention, rest by attention × ‖V W_O‖",
    "pyramid-criticalkv": "pyramidkv budgets + CriticalKV two-stage selection",
    "ada-criticalkv": "adakv budgets + CriticalKV two-stage selection inside each head's share",
}

VALUE_NORMS = ("l1", "l2")
GQA_REDUCES = ("mean", "kvpress")
STAGE2_SCORES = ("pooled", "raw")

SCHEMA_VERSION = 1


def _knob(default: Any, help: str, flag: str | None = None, choices: tuple | None = None) -> Any:
    """A dataclass field carrying its CLI flag, help text and choices in its metadata."""
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices})


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
    budget: int = _knob(256, "tokens kept per KV head (average over heads and layers), window included")
    window: int = _knob(32, "observation window: the last prompt tokens whose queries score the rest; always kept")
    pool_kernel: int = _knob(7, "odd max-pool kernel over token positions applied to window attention")
    alpha: float = _knob(0.25, "CriticalKV stage-1 fraction of the selectable budget chosen by attention alone")
    epsilon: float = _knob(1e-4, "CriticalKV stage-2 score is (attention + epsilon) × ‖V W_O‖")
    value_norm: str = _knob("l1", "norm of the projected value ‖V_i W_O^h‖", choices=VALUE_NORMS)
    gqa_reduce: str = _knob(
        "mean", "stage-2 GQA reduction: mean of per-head products, or kvpress: mean(P) * mean(N)", choices=GQA_REDUCES
    )
    stage2_scores: str = _knob(
        "pooled", "attention used in stage 2: max-pooled window mean (kvpress) or raw (paper Alg. 2)", choices=STAGE2_SCORES
    )
    ada_floor: float = _knob(0.2, "adakv/laprox: fraction of the per-head share every head keeps by its own scores")
    pyramid_beta: float = _knob(20.0, "pyramidkv: ratio between the first and the last layer's selectable budget")
    sink_tokens: int = _knob(4, "streamingllm: number of leading attention-sink tokens kept")

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
            choices = f.metadata.get("choices")
            if choices and value not in choices:
                raise ValueError(f"{f.name}: {value!r} is not one of {', '.join(map(str, choices))}")
        if self.window <= 0:
            raise ValueError(f"window: must be a positive number of tokens, got {self.window}")
        if self.budget <= 0:
            raise ValueError(f"budget: must be a positive number of tokens, got {self.budget}")
        if self.name != "full" and self.budget < self.window:
            raise ValueError(
                f"budget: {self.budget} is smaller than the window ({self.window}); the window is always kept, "
                "so the budget must be at least the window"
            )
        if self.pool_kernel <= 0 or self.pool_kernel % 2 == 0:
            raise ValueError(f"pool_kernel: must be a positive odd integer, got {self.pool_kernel}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha: must lie in [0, 1], got {self.alpha}")
        if self.epsilon < 0:
            raise ValueError(f"epsilon: must be >= 0, got {self.epsilon}")
        if not 0.0 <= self.ada_floor <= 1.0:
            raise ValueError(f"ada_floor: must lie in [0, 1], got {self.ada_floor}")
        if self.pyramid_beta < 1:
            raise ValueError(f"pyramid_beta: must be >= 1, got {self.pyramid_beta}")
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens: must be >= 0, got {self.sink_tokens}")
        if self.name == "streamingllm" and self.sink_tokens > self.budget:
            raise ValueError(f"sink_tokens: {self.sink_tokens} exceeds the budget {self.budget}")

    # ------------------------------------------------------------------ derived
    @property
    def base(self) -> str:
        """Budget-allocation base method: full, streamingllm, snapkv, pyramidkv, adakv or laprox."""
        return POLICIES[self.name][0]

    @property
    def two_stage(self) -> bool:
        """Whether CriticalKV's stage 2 (attention x projected-value norm) is on."""
        return POLICIES[self.name][1]

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
    @classmethod
    def flag_of(cls, name: str) -> str:
        f = {f.name: f for f in dataclasses.fields(cls)}[name]
        return f.metadata.get("flag") or "--" + name.replace("_", "-")

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, defaults: "KVPolicy | None" = None) -> None:
        """Add one ``--flag`` per knob (dest = the field name) to ``parser``."""
        defaults = defaults or cls()
        group = parser.add_argument_group("KV cache policy")
        for f in dataclasses.fields(cls):
            default = getattr(defaults, f.name)
            kind = {"int": int, "float": float, "str": str}.get(f.type if isinstance(f.type, str) else f.type.__name__)
            group.add_argument(
                cls.flag_of(f.name),
                dest=f.name,
                type=kind,
                default=default,
                choices=f.metadata.get("choices"),
                help=f"{f.metadata['help']} (default: {default})",
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "KVPolicy":
        """Build a policy from a namespace filled by ``add_arguments``."""
        return cls(**{name: getattr(args, name) for name in cls.knob_names()})


def policy_table_markdown() -> str:
    """Markdown table of the policies and every knob's default (used for the README)."""
    rows = ["| policy | base allocation | stage 2 | what it keeps |", "|---|---|---|---|"]
    for name, (base, two_stage) in POLICIES.items():
        rows.append(f"| `{name}` | {base} | {'yes' if two_stage else 'no'} | {POLICY_DESCRIPTIONS[name]} |")
    rows += ["", "| knob | flag | default | meaning |", "|---|---|---|---|"]
    default = KVPolicy()
    for f in dataclasses.fields(KVPolicy):
        choices = f.metadata.get("choices")
        meaning = f.metadata["help"] + (f" ({' / '.join(choices)})" if choices and f.name != "name" else "")
        rows.append(f"| `{f.name}` | `{KVPolicy.flag_of(f.name)}` | `{getattr(default, f.name)}` | {meaning} |")
    return "\n".join(rows)
