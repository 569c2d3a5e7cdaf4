"""criticalkv: compressed KV caches for long-context LLM serving (CriticalKV and its base methods)."""

from criticalkv.policy import POLICIES, KVPolicy
from criticalkv.selection import LayerSelection, gather_kv, select_layer, select_model

__version__ = "0.1.0"

__all__ = ["POLICIES", "KVPolicy", "LayerSelection", "__version__", "gather_kv", "select_layer", "select_model"]
