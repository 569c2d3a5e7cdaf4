"""The CriticalKVSelect plugin creator's fields, generated from ``KVPolicy``.

The TensorRT plugin (``plugins/tensorrt``) reads its field table from the C++ header
``plugins/include/criticalkv/policy_fields.h``, which this module renders from the ``KVPolicy``
dataclass and the node's layer attributes (``criticalkv.node.LAYER_ATTRIBUTES``). The header is
committed; ``tests/plugins/test_plugin_fields.py`` fails when it drifts from the dataclass, and

    python -m criticalkv.engine.plugin_fields plugins/include/criticalkv/policy_fields.h

rewrites it.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import NamedTuple

from criticalkv.node import LAYER_ATTRIBUTES
from criticalkv.policy import POLICIES, KVPolicy

#: Python field type -> (kind in the header, TensorRT PluginFieldType the ONNX parser passes for it)
KINDS = {"str": ("STRING", "kCHAR"), "int": ("INT", "kINT32"), "float": ("FLOAT", "kFLOAT32")}

#: Defaults of the layer fields; capacity 0 means "not given" and is rejected by the plugin.
LAYER_DEFAULTS = {"layer_idx": 0, "num_layers": 1, "capacity": 0}

_BASE_ENUM = {
    "full": "kFull",
    "streamingllm": "kStreamingLLM",
    "snapkv": "kSnapKV",
    "pyramidkv": "kPyramidKV",
    "adakv": "kAdaKV",
    "laprox": "kLaProx",
}

HEADER_PATH = Path(__file__).resolve().parents[2] / "plugins" / "include" / "criticalkv" / "policy_fields.h"


class PluginFieldSpec(NamedTuple):
    """One creator field: its name, kind (STRING/INT/FLOAT), TensorRT field type and default."""

    name: str
    kind: str
    trt_type: str
    default: object


def plugin_field_specs() -> list[PluginFieldSpec]:
    """Every creator field in order: the KVPolicy knobs (declaration order), then layer_idx, num_layers, capacity."""
    specs = []
    default = KVPolicy()
    for f in dataclasses.fields(KVPolicy):
        type_name = f.type if isinstance(f.type, str) else f.type.__name__
        kind, trt_type = KINDS[type_name]
        specs.append(PluginFieldSpec(f.name, kind, trt_type, getattr(default, f.name)))
    for name in LAYER_ATTRIBUTES:
        specs.append(PluginFieldSpec(name, "INT", "kINT32", LAYER_DEFAULTS[name]))
    return specs


def _literal(value: object) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, float):
        text = repr(value)
        return text if any(c in text for c in ".e") else text + ".0"
    return str(value)


def render_policy_fields_header() -> str:
    """C++ header text: X-macros of the creator fields, the policy registry and the string choices."""
    lines = [
        "// GENERATED from criticalkv.policy.KVPolicy by criticalkv.engine.plugin_fields; do not edit.",
        "// Regenerate: python -m criticalkv.engine.plugin_fields plugins/include/criticalkv/policy_fields.h",
        "#pragma once",
        "",
        "//! Every field of the CriticalKVSelect plugin creator, in order: the KVPolicy knobs, then the layer",
        "//! fields. CKV_FIELD(kind, name, default) with kind STRING (kCHAR), INT (kINT32) or FLOAT (kFLOAT32).",
        "#define CKV_FOR_EACH_PLUGIN_FIELD(CKV_FIELD) \\",
    ]
    specs = plugin_field_specs()
    for i, spec in enumerate(specs):
        end = " \\" if i + 1 < len(specs) else ""
        lines.append(f"    CKV_FIELD({spec.kind}, {spec.name}, {_literal(spec.default)}){end}")
    lines += ["", "//! CKV_POLICY(name, base method, two-stage) for every policy name.", "#define CKV_FOR_EACH_POLICY(CKV_POLICY) \\"]
    items = list(POLICIES.items())
    for i, (name, (base, two_stage)) in enumerate(items):
        end = " \\" if i + 1 < len(items) else ""
        lines.append(f"    CKV_POLICY({_literal(name)}, {_BASE_ENUM[base]}, {int(two_stage)}){end}")
    lines.append("")
    for f in dataclasses.fields(KVPolicy):
        choices = f.metadata.get("choices")
        if choices and f.name != "name":
            joined = ", ".join(_literal(c) for c in choices)
            lines.append(f"#define CKV_CHOICES_{f.name} {joined}")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    target = Path(argv[0]) if argv else HEADER_PATH
    target.write_text(render_policy_fields_header())
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
