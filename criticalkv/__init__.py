"""criticalkv: compressed KV caches for long-context LLM serving (CriticalKV and its base methods).

The names below load on first use (PEP 562), so that ``import criticalkv.cli`` costs milliseconds, not the
seconds of torch: the command line installs its Ctrl-C / SIGTERM handling before anything heavy is imported.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    "POLICIES": "criticalkv.policy",
    "KVPolicy": "criticalkv.policy",
    "LayerSelection": "criticalkv.selection",
    "gather_kv": "criticalkv.selection",
    "select_layer": "criticalkv.selection",
    "select_model": "criticalkv.selection",
}

__all__ = ["POLICIES", "KVPolicy", "LayerSelection", "__version__", "gather_kv", "select_layer", "select_model"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'criticalkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups find it directly
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
