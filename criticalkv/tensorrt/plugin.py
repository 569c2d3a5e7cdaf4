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
#: Every plugin of the library: the per-layer selection, and the model-level selection's score and select nodes.
PLUGIN_NAMES = (PLUGIN_NAME, "CriticalKVScore", "CriticalKVSelectModel")
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


#: Handles returned by ``load_library``, by library path: kept for the life of the process.
_HANDLES: dict[Path, Any] = {}


def plugin_registered(registry: Any) -> bool:
    """Whether ``registry`` already holds the CriticalKVSelect creator (in any of PLUGIN_NAMESPACES)."""
    get_creator = getattr(registry, "get_creator", None)
    if get_creator is None:
        return False
    for namespace in PLUGIN_NAMESPACES:
        try:
            if get_creator(PLUGIN_NAME, PLUGIN_VERSION, namespace) is not None:
                return True
        except Exception:  # bindings that raise instead of returning None for an unknown creator
            continue
    return False


def load_plugin_library(path: str | os.PathLike | None = None, registry: Any = None) -> Path:
    """Register the plugin library with TensorRT's plugin registry (``IPluginRegistry::loadLibrary``), once
    per process.

    ``loadLibrary`` returns null when the library's creators are already registered, so a second load in
    one process (build then run, two backends, parametrised tests) would fail: when the CriticalKVSelect
    creator is already in the registry, nothing is loaded again.

    Parameters
    ----------
    path : the library (default: ``find_plugin_library()``)
    registry : a ``tensorrt.IPluginRegistry`` (default: ``tensorrt.get_plugin_registry()``; imports tensorrt)
    """
    path = check_plugin_library(path)
    if registry is None:
        import tensorrt as trt  # lazily: TensorRT is optional

        registry = trt.get_plugin_registry()
    if plugin_registered(registry):
        return path
    handle = registry.load_library(str(path))
    if handle is None:
        raise RuntimeError(f"TensorRT could not load the plugin library {path}")
    _HANDLES[path.resolve()] = handle
    return path


def resolve_plugin_library(
    engine_dir: str | os.PathLike, recorded: str | None, explicit: str | os.PathLike | None = None
) -> Path:
    """The plugin library an engine directory's TensorRT engines run with.

    Search rule, first hit wins: ``explicit``; ``$CRITICALKV_PLUGIN_LIBRARY``; ``recorded`` (the manifest's
    ``tensorrt.plugin_library``) relative to the engine directory (the build copies the library to
    ``tensorrt/libcriticalkv_trt_plugin.so``, so a moved or copied engine directory keeps working); an absolute
    ``recorded`` path (older manifests); ``build/plugins`` of this checkout.

    Raises
    ------
    FileNotFoundError
        Listing every place searched.
    """
    engine_dir = Path(engine_dir)
    candidates = []
    if explicit:
        candidates.append(Path(explicit))
    if os.environ.get(PLUGIN_LIBRARY_ENV):
        candidates.append(Path(os.environ[PLUGIN_LIBRARY_ENV]))
    if recorded:
        recorded_path = Path(recorded)
        candidates.append(recorded_path if recorded_path.is_absolute() else engine_dir / recorded_path)
    candidates.append(REPO_ROOT / "build" / "plugins" / PLUGIN_LIBRARY_NAME)
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{PLUGIN_LIBRARY_NAME} not found for {engine_dir} (searched: {', '.join(str(p) for p in candidates)}); "
        f"build it with `bash scripts/build_plugin.sh` or set {PLUGIN_LIBRARY_ENV}"
    )
