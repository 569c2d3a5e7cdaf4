"""The CriticalKVSelect node's fields in the C form the plugin's parser reads (plugins/host/ckv_field.h): what the
ctypes test libraries (libcriticalkv_host.so, libcriticalkv_cuda_test.so; tests/plugins/ckv_native.py) pass, so the
tests, the TensorRT plugin and the ONNX node read the same knobs. The torch ops (``criticalkv.selection.op``) take
the policy as ``KVPolicy.to_json()`` instead, parsed by the same parser (plugins/host/policy_json.h).

Nothing here imports torch.
"""

from __future__ import annotations

import ctypes
import struct
from typing import Any, Mapping

from criticalkv.node import node_attributes
from criticalkv.policy import KVPolicy


#: criticalkv::FieldType values (plugins/host/policy.h)
FIELD_TYPES = {"char": 0, "int32": 1, "int64": 2, "float32": 3, "float64": 4, "other": 5}


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
