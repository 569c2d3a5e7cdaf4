"""Finding and loading the CriticalKVSelect TensorRT plugin library (``libcriticalkv_trt_plugin.so``).

The library is built by ``bash scripts/build_plugin.sh`` into ``build/plugins``. It exports
``getCreators`` and ``setLoggerFinder`` (like NVIDIA/TensorRT ``plugin/vc``), so TensorRT loads it with
``IPluginRegistry::loadLibrary`` (``trt.get_plugin_registry().load_library(path)``) or
``trtexec --dynamicPlugins=path``. Nothing here imports ``tensorrt`` unless asked to register the library.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

PLUGIN_LIBRARY_NAME = "libcriticalkv_trt_plugin.so"
#: Environment variable naming the plugin library explicitly (takes precedence over the build folder).
PLUGIN_LIBRARY_ENV = "CRITICALKV_PLUGIN_LIBRARY"
PLUGIN_NAME = "CriticalKVSelect"
PLUGIN_VERSION = "1"
#: The creator is registered twice: namespace "" (the ONNX parser's default) and the node's domain.
PLUGIN_NAMESPACES = ("", "ai.criticalkv")

REPO_ROOT = Path(__file__).resolve().parents[2]


def plugin_library_candidates() -> list[Path]:
    """Where the library is looked for, in order: $CRITICALKV_PLUGIN_LIBRARY, then build/plugins of the checkout."""
    candidates = []
    if os.environ.get(PLUGIN_LIBRARY_ENV):
        candidates.append(Path(os.environ[PLUGIN_LIBRARY_ENV]))
    candidates.append(REPO_ROOT / "build" / "plugins" / PLUGIN_LIBRARY_NAME)
    return candidates


def find_plugin_library(required: bool = True) -> Path | None:
    """Path of the plugin library, or None (``required=False``) when it has not been built.

    Raises
    ------
    FileNotFoundError
        With the places searched and the command that builds it, when ``required`` and nothing is found.
    """
    candidates = plugin_library_candidates()
    for path in candidates:
        if path.is_file():
            return path
    if not required:
        return None
    searched = ", ".join(str(p) for p in candidates)
    raise FileNotFoundError(
        f"{PLUGIN_LIBRARY_NAME} not found (searched: {searched}); build it with `bash scripts/build_plugin.sh` "
        f"or set {PLUGIN_LIBRARY_ENV}"
    )


def check_plugin_library(path: str | os.PathLike | None = None) -> Path:
    """dlopen the library with ctypes and check it exports getCreators and setLoggerFinder (no TensorRT needed)."""
    path = Path(path) if path is not None else find_plugin_library()
    library = ctypes.CDLL(str(path))
    for symbol in ("getCreators", "setLoggerFinder"):
        if not hasattr(library, symbol):
            raise RuntimeError(f"{path} does not export {symbol}: not a TensorRT plugin library")
    return path


def load_plugin_library(path: str | os.PathLike | None = None, registry: Any = None) -> Path:
    """Register the plugin library with TensorRT's plugin registry (``IPluginRegistry::loadLibrary``).

    Parameters
    ----------
    path : the library (default: ``find_plugin_library()``)
    registry : a ``tensorrt.IPluginRegistry`` (default: ``tensorrt.get_plugin_registry()``; imports tensorrt)
    """
    path = check_plugin_library(path)
    if registry is None:
        import tensorrt as trt  # lazily: TensorRT is optional

        registry = trt.get_plugin_registry()
    handle = registry.load_library(str(path))
    if handle is None:
        raise RuntimeError(f"TensorRT could not load the plugin library {path}")
    return path
