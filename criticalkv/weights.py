"""One external-data file of weights shared by the prefill and decode graphs.

Both graphs reference the same ``weights.bin`` (ONNX external data: location, offset, length), so an
engine directory stores every weight once. Offsets are 4 KiB aligned (ONNX Runtime can map them).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

WEIGHTS_FILE = "weights.bin"
ALIGNMENT = 4096


class WeightStore:
    """Named arrays (float32; the integer codes and scales of quantized weights), written once to ``weights.bin`` and
    referenced as external initializers.

    ``quantized`` maps the name of a float32 weight to its lower-precision form (``criticalkv.export.quantize``), which
    the ONNX Runtime flavour's fused graphs read instead of it."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}
        self.offsets: dict[str, int] = {}
        self.quantized: dict[str, object] = {}

    def add(self, name: str, array, dtype=np.float32) -> str:
        array = np.ascontiguousarray(np.asarray(array, dtype=dtype))
        if name in self.arrays:
            raise ValueError(f"weight {name!r} added twice")
        self.arrays[name] = array
        return name

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def layout(self) -> int:
        """Assign every array its aligned offset; returns the file size."""
        offset = 0
        for name, array in self.arrays.items():
            offset += -offset % ALIGNMENT
            self.offsets[name] = offset
            offset += array.nbytes
        return offset

    def write(self, folder: Path) -> Path:
        """Write every array to ``folder/weights.bin``; returns the path."""
        path = Path(folder) / WEIGHTS_FILE
        self.layout()
        with open(path, "wb") as f:
            for name, array in self.arrays.items():
                f.write(b"\0" * (self.offsets[name] - f.tell()))
                f.write(array.tobytes())
        return path

    def initializer(self, name: str) -> onnx.TensorProto:
        """TensorProto of ``name`` pointing into weights.bin (call after ``write``)."""
        array = self.arrays[name]
        tensor = TensorProto()
        tensor.name = name
        tensor.data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
        tensor.dims.extend(array.shape)
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", WEIGHTS_FILE), ("offset", str(self.offsets[name])), ("length", str(array.nbytes))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        return tensor


def load_external_weights(model: onnx.ModelProto, folder: Path) -> dict[str, np.ndarray]:
    """Memory-mapped views of a model's external initializers (read-only, no copy)."""
    mapped: dict[str, np.memmap] = {}
    out = {}
    for tensor in model.graph.initializer:
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in tensor.external_data}
        path = Path(folder) / info["location"]
        if path not in mapped:
            mapped[path] = np.memmap(path, dtype=np.uint8, mode="r")
        offset, length = int(info.get("offset", 0)), int(info["length"])
        dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
        out[tensor.name] = mapped[path][offset : offset + length].view(dtype).reshape(tuple(tensor.dims))
    return out
