"""ctypes access to the CUDA selection: ``libcriticalkv_ops.so`` (plugins/ops, built by ``scripts/build_plugin.sh``).

The library is framework-free (raw device pointers, a caller's workspace and stream); the torch op
``criticalkv::select_layer`` (``criticalkv.selection.op``) is its one user in the package. The policy travels as
the CriticalKVSelect node's fields (``criticalkv.node.node_attributes``), parsed by the plugin's own parser, so the
op, the TensorRT plugin and the ONNX node read the same knobs.

Nothing here imports torch: tensors are passed as integer device addresses.
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
from pathlib import Path
from typing import Any, Mapping

from criticalkv.node import node_attributes
from criticalkv.policy import KVPolicy

OPS_LIBRARY_NAME = "libcriticalkv_ops.so"
#: Environment variable naming the library explicitly (takes precedence over the build folder).
OPS_LIBRARY_ENV = "CRITICALKV_OPS_LIBRARY"
#: ckv_ops_version() of the library this binding was written for.
OPS_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parents[2]

#: criticalkv::FieldType values (plugins/host/policy.h)
FIELD_TYPES = {"char": 0, "int32": 1, "int64": 2, "float32": 3, "float64": 4, "other": 5}
#: DType codes of the kernels (plugins/include/criticalkv/common.h), by torch dtype name
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}


class CkvField(ctypes.Structure):
    """plugins/host/ckv_field.h: one named field; ``type`` is a FieldType value, ``length`` counts elements."""

    _fields_ = [("name", ctypes.c_char_p), ("data", ctypes.c_void_p), ("type", ctypes.c_int32), ("length", ctypes.c_int32)]


class EncodedFields:
    """A ctypes array of CkvField and the buffers it points into (kept alive with it)."""

    def __init__(self, items: list[tuple[str | None, bytes | None, str | int, int | None]], trt_codes: bool = False):
        """items: (name, payload, type, length); types are FieldType codes (or names), or nvinfer1::PluginFieldType
        codes when ``trt_codes``; a None length is derived from the payload size."""
        self.buffers = []
        self.array = (CkvField * max(1, len(items)))()
        self.count = len(items)
        for i, (name, payload, kind, length) in enumerate(items):
            buffer = ctypes.create_string_buffer(payload, len(payload)) if payload is not None else None
            self.buffers.append(buffer)
            type_code = FIELD_TYPES[kind] if isinstance(kind, str) else kind
            sizes = {6: 1, 5: 4, 10: 8, 1: 4, 2: 8, 0: 2, 9: 2, 3: 1, 4: 2} if trt_codes else {0: 1, 1: 4, 2: 8, 3: 4, 4: 8}
            element = sizes.get(type_code, 1)
            self.array[i] = CkvField(
                name.encode() if name is not None else None,
                ctypes.cast(buffer, ctypes.c_void_p) if buffer is not None else None,
                type_code,
                length if length is not None else (len(payload) // element if payload is not None else 0),
            )


def encode_value(value: Any, float_kind: str = "float64") -> tuple[bytes, str]:
    """(payload, field kind) of one Python value, as the ONNX parser (float32) or our serialisation (float64) does."""
    if isinstance(value, bool):
        raise TypeError("booleans are not plugin fields")
    if isinstance(value, str):
        return value.encode() + b"\0", "char"
    if isinstance(value, int):
        return struct.pack("<i", value), "int32"
    if isinstance(value, float):
        return (struct.pack("<f", value), "float32") if float_kind == "float32" else (struct.pack("<d", value), "float64")
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return struct.pack(f"<{len(value)}i", *value), "int32"  # an INTS attribute: a kINT32 array
    raise TypeError(f"unsupported field value {value!r}")


def encode_fields(values: Mapping[str, Any], float_kind: str = "float64") -> EncodedFields:
    items = []
    for name, value in values.items():
        payload, kind = encode_value(value, float_kind)
        items.append((name, payload, kind, None))
    return EncodedFields(items)


def node_fields(policy: KVPolicy, layer_idx: int = 0, num_layers: int = 1, capacity: int = 1 << 20) -> dict[str, Any]:
    """Every creator field of one layer's node: the node's attributes as the export writes them (policy knobs,
    layer_idx, num_layers, capacity, layer_budgets)."""
    return {k: list(v) if isinstance(v, tuple) else v
            for k, v in node_attributes(policy, layer_idx, num_layers, capacity).items()}


@functools.lru_cache(maxsize=4096)
def layer_fields(policy_json: str, layer_idx: int, num_layers: int, capacity: int) -> EncodedFields:
    """The encoded fields of one layer's call, cached: a prefill asks for the same few dozen every time."""
    return encode_fields(node_fields(KVPolicy.from_json(policy_json), layer_idx, num_layers, capacity))


def ops_library_candidates() -> list[Path]:
    """Where the library is looked for, in order: $CRITICALKV_OPS_LIBRARY, then build/plugins of the checkout."""
    candidates = []
    if os.environ.get(OPS_LIBRARY_ENV):
        candidates.append(Path(os.environ[OPS_LIBRARY_ENV]))
    candidates.append(REPO_ROOT / "build" / "plugins" / OPS_LIBRARY_NAME)
    return candidates


class OpsLibrary:
    """libcriticalkv_ops.so. ``select_layer`` launches on a stream and returns at once (no synchronisation)."""

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        version = lib.ckv_ops_version()
        if version != OPS_VERSION:
            raise RuntimeError(f"{path}: ckv_ops_version() = {version}, this package expects {OPS_VERSION}: rebuild it "
                               "with `bash scripts/build_plugin.sh`")
        P = ctypes.POINTER
        lib.ckv_ops_device_count.restype = ctypes.c_int32
        lib.ckv_ops_workspace_bytes.restype = ctypes.c_int64
        lib.ckv_ops_workspace_bytes.argtypes = [P(CkvField), ctypes.c_int32, P(ctypes.c_int32), ctypes.c_char_p,
                                                ctypes.c_int32]
        lib.ckv_ops_select_layer.restype = ctypes.c_int32
        lib.ckv_ops_select_layer.argtypes = (
            [P(CkvField), ctypes.c_int32, P(ctypes.c_int32), ctypes.c_int32] + [ctypes.c_void_p] * 10
            + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32]
        )
        self.lib = lib

    def device_count(self) -> int:
        return int(self.lib.ckv_ops_device_count())

    @staticmethod
    def shape(batch: int, heads: int, kv_heads: int, n: int, query_len: int, head_dim: int, hidden: int):
        return (ctypes.c_int32 * 7)(batch, heads, kv_heads, n, query_len, head_dim, hidden)

    def workspace_bytes(self, fields: EncodedFields, shape) -> int:
        err = ctypes.create_string_buffer(512)
        size = self.lib.ckv_ops_workspace_bytes(fields.array, fields.count, shape, err, 512)
        if size < 0:
            raise ValueError(err.value.decode())
        return int(size)

    def select_layer(self, fields: EncodedFields, shape, dtype: str, queries: int, keys: int, values: int, o_proj: int,
                     prompt_lengths: int | None, kv_budget: int | None, kept_keys: int, kept_values: int,
                     kept_lengths: int, kept_indices: int, workspace: int, workspace_bytes: int, stream: int) -> None:
        """Launch the operator (integer device addresses; 0 / None for an absent optional input)."""
        if dtype not in DTYPE_CODES:
            raise ValueError(f"dtype {dtype}: the kernels take {', '.join(DTYPE_CODES)}")
        err = ctypes.create_string_buffer(512)
        status = self.lib.ckv_ops_select_layer(
            fields.array, fields.count, shape, DTYPE_CODES[dtype], queries, keys, values, o_proj, prompt_lengths or None,
            kv_budget or None, kept_keys, kept_values, kept_lengths, kept_indices, workspace or None, workspace_bytes,
            stream or None, err, 512,
        )
        if status != 0:
            raise RuntimeError(f"criticalkv::select_layer: {err.value.decode()}")


@functools.lru_cache(maxsize=1)
def load_ops_library() -> OpsLibrary | None:
    """The library, or None when it has not been built (the op then runs the PyTorch reference)."""
    for path in ops_library_candidates():
        if path.is_file():
            return OpsLibrary(path)
    return None
