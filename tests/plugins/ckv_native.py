"""ctypes bindings of the native test libraries built by scripts/build_plugin.sh (build/plugins).

* ``HostLibrary``: libcriticalkv_host.so, the host C++ version of the operator and the shared helpers;
* ``PluginHarness``: libcriticalkv_plugin_harness.so, which dlopens the TensorRT plugin and drives its creator;
* ``CudaLibrary``: libcriticalkv_cuda_test.so, the CUDA kernels on raw device pointers (GPU tests).
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path
from typing import Any, Mapping

import torch

from criticalkv import KVPolicy
from criticalkv.selection.native import (  # noqa: F401  (the field encoding lives in the package; re-exported here)
    FIELD_TYPES,
    CkvField,
    EncodedFields,
    encode_fields,
    encode_value,
    node_fields,
)

ROOT = Path(__file__).resolve().parents[2]
BUILD_DIR = ROOT / "build" / "plugins"


def _load(name: str) -> ctypes.CDLL:
    path = BUILD_DIR / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `bash scripts/build_plugin.sh`")
    return ctypes.CDLL(str(path))


class HostLibrary:
    """libcriticalkv_host.so."""

    def __init__(self, path: Path | None = None):
        self.lib = ctypes.CDLL(str(path)) if path else _load("libcriticalkv_host.so")
        L = self.lib
        P = ctypes.POINTER
        L.ckv_parse_policy.argtypes = [P(CkvField), ctypes.c_int32, ctypes.c_char_p, ctypes.c_int32]
        L.ckv_describe_policy.argtypes = [P(CkvField), ctypes.c_int32, ctypes.c_char_p, ctypes.c_int32]
        L.ckv_budget_choice.argtypes = [P(CkvField), ctypes.c_int32, P(ctypes.c_int32), P(ctypes.c_int32),
                                        P(ctypes.c_int32), ctypes.c_char_p, ctypes.c_int32]
        L.ckv_max_kept_per_head.argtypes = [P(CkvField), ctypes.c_int32, P(ctypes.c_int32), ctypes.c_int64,
                                            ctypes.c_int64]
        L.ckv_max_kept_per_head.restype = ctypes.c_int64
        L.ckv_stage1_count.argtypes = [ctypes.c_int64, ctypes.c_int64]
        L.ckv_stage1_count.restype = ctypes.c_int64
        L.ckv_head_floor.argtypes = [ctypes.c_int64, ctypes.c_int64]
        L.ckv_head_floor.restype = ctypes.c_int64
        L.ckv_decimal_micros.argtypes = [ctypes.c_double]
        L.ckv_decimal_micros.restype = ctypes.c_int64
        L.ckv_ordered_key.argtypes = [ctypes.c_float]
        L.ckv_ordered_key.restype = ctypes.c_uint32
        L.ckv_widen_float32.argtypes = [ctypes.c_float]
        L.ckv_widen_float32.restype = ctypes.c_double
        L.ckv_select_top_k.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_uint8]
        L.ckv_mass_count.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_float]
        L.ckv_mass_count.restype = ctypes.c_int64
        L.ckv_host_pruned_row.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int32, ctypes.c_int32, ctypes.c_int64,
                                                                  ctypes.c_float]
        L.ckv_host_pruned_row.restype = ctypes.c_int64
        L.ckv_host_l1_bounds.argtypes = [P(ctypes.c_int32)] + [ctypes.c_void_p] * 2 + [ctypes.c_int32, ctypes.c_void_p]
        L.ckv_host_l1_bounds.restype = None
        L.ckv_host_select_layer.argtypes = (
            [P(CkvField), ctypes.c_int32, P(ctypes.c_int32)] + [ctypes.c_void_p] * 10 + [ctypes.c_char_p, ctypes.c_int32]
        )

    # ---------------------------------------------------------------- policy fields
    def parse(self, fields: EncodedFields) -> str:
        """'' when the fields are valid, else the parser's error message."""
        err = ctypes.create_string_buffer(512)
        status = self.lib.ckv_parse_policy(fields.array, fields.count, err, 512)
        return "" if status == 0 else err.value.decode()

    def describe(self, fields: EncodedFields) -> dict[str, str]:
        out = ctypes.create_string_buffer(2048)
        if self.lib.ckv_describe_policy(fields.array, fields.count, out, 2048) != 0:
            raise ValueError(out.value.decode())
        return dict(item.split("=", 1) for item in out.value.decode().split(" "))

    def budget_choice(self, values: Mapping[str, Any], kv_budget: int | None = None) -> tuple[int, int]:
        """(effective budget b, r_l) of the node at the runtime budget kv_budget (None: no kv_budget input)."""
        f = encode_fields(values)
        budget, layer_budget = ctypes.c_int32(), ctypes.c_int32()
        requested = ctypes.byref(ctypes.c_int32(kv_budget)) if kv_budget is not None else None
        err = ctypes.create_string_buffer(512)
        if self.lib.ckv_budget_choice(f.array, f.count, requested, ctypes.byref(budget), ctypes.byref(layer_budget),
                                      err, 512) != 0:
            raise ValueError(err.value.decode())
        return budget.value, layer_budget.value

    def layer_budget(self, values: Mapping[str, Any], kv_budget: int | None = None) -> int:
        return self.budget_choice(values, kv_budget)[1]

    def max_kept_per_head(self, values: Mapping[str, Any], n: int, kv_heads: int, kv_budget: int | None = None) -> int:
        f = encode_fields(values)
        requested = ctypes.byref(ctypes.c_int32(kv_budget)) if kv_budget is not None else None
        return self.lib.ckv_max_kept_per_head(f.array, f.count, requested, n, kv_heads)

    # ---------------------------------------------------------------- shared helpers
    def decimal_micros(self, value: float) -> int:
        return self.lib.ckv_decimal_micros(value)

    def stage1_count(self, alpha: float, r: int) -> int:
        """The kernels' integer stage-1 count, alpha converted to millionths as the plugin does."""
        return self.lib.ckv_stage1_count(self.decimal_micros(alpha), r)

    def head_floor(self, ada_floor: float, r: int) -> int:
        return self.lib.ckv_head_floor(self.decimal_micros(ada_floor), r)

    def ordered_key(self, value: float) -> int:
        return self.lib.ckv_ordered_key(value)

    def widen_float32(self, value: float) -> float:
        return self.lib.ckv_widen_float32(value)

    def select_top_k(self, scores: torch.Tensor, k: int, flags: torch.Tensor | None = None, period: int | None = None,
                     first_valid: int = 0, mark: int = 1) -> torch.Tensor:
        """The kernels' radix select on the host: uint8 flags of the k best candidates (flags == 0)."""
        scores = scores.contiguous().float()
        flags = torch.zeros(scores.numel(), dtype=torch.uint8) if flags is None else flags.clone().contiguous()
        n = scores.numel()
        self.lib.ckv_select_top_k(scores.data_ptr(), flags.data_ptr(), n, period or n, first_valid, k, mark)
        return flags

    def mass_count(self, scores: torch.Tensor, limit: float, flags: torch.Tensor | None = None,
                   first_valid: int = 0) -> int:
        """defensivekv's stage-1 count on the host: candidates (flags == 0, index >= first_valid), best first, whose
        cumulative sum stays below limit (float32)."""
        scores = scores.contiguous().float()
        flags = torch.zeros(scores.numel(), dtype=torch.uint8) if flags is None else flags.contiguous()
        n = scores.numel()
        return int(self.lib.ckv_mass_count(scores.data_ptr(), flags.data_ptr(), n, n, first_valid, limit))

    def pruned_row(self, bound, scores, flags, valid_start: int, k: int, margin: float):
        """(flags after the host driver's pruned stage 2 of one row, exact scores used); CPU tensors."""
        bound, scores = bound.float().contiguous(), scores.float().contiguous()
        flags = flags.to(torch.uint8).contiguous().clone()
        done = self.lib.ckv_host_pruned_row(bound.data_ptr(), scores.data_ptr(), flags.data_ptr(), flags.numel(),
                                            valid_start, k, margin)
        return flags, int(done)

    def l1_bounds(self, values, o_proj, num_heads: int, num_tokens: int | None = None):
        """[B, H, num_tokens] the host driver's L1 upper bounds of the pruned stage 2 (fp32 inputs)."""
        batch, kv_heads, n, head_dim = values.shape
        num_tokens = n if num_tokens is None else num_tokens
        shape = (ctypes.c_int32 * 7)(batch, num_heads, kv_heads, n, 0, head_dim, o_proj.shape[0])
        values, o_proj = values.float().contiguous(), o_proj.float().contiguous()
        out = torch.empty(batch, num_heads, num_tokens, dtype=torch.float32)
        self.lib.ckv_host_l1_bounds(shape, values.data_ptr(), o_proj.data_ptr(), num_tokens, out.data_ptr())
        return out

    # ---------------------------------------------------------------- the operator
    def select_layer(self, policy: KVPolicy, q, k, v, o, layer_idx=0, num_layers=1, capacity=None,
                     prompt_lengths=None, float_kind="float64", kv_budget: int | None = None):
        """(indices [B, H_kv, cap] int64, lengths [B, H_kv] int64, kept keys, kept values) from the host version.

        kv_budget: the node's runtime budget input (None: absent, the policy's budget applies)."""
        batch, heads, query_len, head_dim = q.shape
        _, kv_heads, n, _ = k.shape
        hidden = o.shape[0]
        capacity = capacity or n
        cap = min(n, capacity)
        fields = encode_fields(node_fields(policy, layer_idx, num_layers, capacity), float_kind)
        shape = (ctypes.c_int32 * 7)(batch, heads, kv_heads, n, query_len, head_dim, hidden)
        q, k, v, o = (t.float().contiguous() for t in (q, k, v, o))
        lengths = prompt_lengths.to(torch.int32).contiguous() if prompt_lengths is not None else None
        budget = torch.tensor([kv_budget], dtype=torch.int32) if kv_budget is not None else None
        indices = torch.empty(batch, kv_heads, cap, dtype=torch.int32)
        kept = torch.empty(batch, kv_heads, dtype=torch.int32)
        kk = torch.empty(batch, kv_heads, cap, head_dim)
        vv = torch.empty(batch, kv_heads, cap, head_dim)
        err = ctypes.create_string_buffer(512)
        status = self.lib.ckv_host_select_layer(
            fields.array, fields.count, shape, q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(),
            lengths.data_ptr() if lengths is not None else None, budget.data_ptr() if budget is not None else None,
            indices.data_ptr(), kept.data_ptr(), kk.data_ptr(), vv.data_ptr(), err, 512,
        )
        if status != 0:
            raise ValueError(err.value.decode())
        return indices.long(), kept.long(), kk, vv


#: nvinfer1 enum values used by the harness
TRT_FIELD_TYPES = {"kFLOAT16": 0, "kFLOAT32": 1, "kFLOAT64": 2, "kINT8": 3, "kINT16": 4, "kINT32": 5, "kCHAR": 6,
                   "kDIMS": 7, "kUNKNOWN": 8, "kBF16": 9, "kINT64": 10}
TRT_DATA_TYPES = {"kFLOAT": 0, "kHALF": 1, "kINT8": 2, "kINT32": 3, "kBOOL": 4, "kUINT8": 5, "kFP8": 6, "kBF16": 7,
                  "kINT64": 8}
TRT_FORMAT_LINEAR, TRT_FORMAT_CHW2 = 0, 1
_TO_TRT_FIELD = {0: 6, 1: 5, 2: 10, 3: 1, 4: 2, 5: 8}  # criticalkv::FieldType -> nvinfer1::PluginFieldType
TRT_FIELD_INT64 = 10  # nvinfer1::PluginFieldType::kINT64


def pack_dims(shapes: list[tuple[int, ...]]):
    """Packed (nbDims, d0..d7) int64 rows for the harness."""
    packed = (ctypes.c_int64 * (9 * len(shapes)))()
    for i, shape in enumerate(shapes):
        packed[9 * i] = len(shape)
        for a, d in enumerate(shape):
            packed[9 * i + 1 + a] = d
    return packed


class PluginHarness:
    """libcriticalkv_plugin_harness.so driving libcriticalkv_trt_plugin.so through the TensorRT interfaces."""

    def __init__(self, plugin_path: Path | None = None):
        self.lib = _load("libcriticalkv_plugin_harness.so")
        self.plugin_path = Path(plugin_path) if plugin_path else BUILD_DIR / "libcriticalkv_trt_plugin.so"
        L = self.lib
        P = ctypes.POINTER
        L.ckv_harness_open.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int32]
        L.ckv_harness_creators.argtypes = [ctypes.c_char_p, ctypes.c_int32]
        L.ckv_harness_create.argtypes = [ctypes.c_int32, ctypes.c_char_p, P(CkvField)] + [ctypes.c_int32] * 4
        L.ckv_harness_describe.argtypes = [ctypes.c_int32, ctypes.c_char_p, ctypes.c_int32]
        L.ckv_harness_round_trip.argtypes = [ctypes.c_int32, ctypes.c_int32]
        L.ckv_harness_clone.argtypes = [ctypes.c_int32, ctypes.c_int32]
        L.ckv_harness_output_types.argtypes = [ctypes.c_int32, P(ctypes.c_int32), ctypes.c_int32, P(ctypes.c_int32),
                                               ctypes.c_int32]
        L.ckv_harness_output_shapes.argtypes = [ctypes.c_int32, P(ctypes.c_int64), ctypes.c_int32, ctypes.c_int32,
                                                ctypes.c_char_p, ctypes.c_int32]
        L.ckv_harness_supports.argtypes = [ctypes.c_int32, ctypes.c_int32, P(ctypes.c_int32), P(ctypes.c_int32),
                                           ctypes.c_int32, ctypes.c_int32]
        L.ckv_harness_workspace.argtypes = [ctypes.c_int32, P(ctypes.c_int64), ctypes.c_int32, ctypes.c_int32]
        L.ckv_harness_workspace.restype = ctypes.c_int64
        L.ckv_harness_configure.argtypes = [ctypes.c_int32, ctypes.c_int32, P(ctypes.c_int64), ctypes.c_int32,
                                            ctypes.c_int32]
        L.ckv_harness_enqueue.argtypes = [ctypes.c_int32, P(ctypes.c_int64), ctypes.c_int32, ctypes.c_int32]
        L.ckv_harness_logs.argtypes = [ctypes.c_char_p, ctypes.c_int32]
        L.ckv_harness_destroy.argtypes = [ctypes.c_int32]
        err = ctypes.create_string_buffer(1024)
        if L.ckv_harness_open(str(self.plugin_path).encode(), err, 1024) != 0:
            raise RuntimeError(err.value.decode())

    def creators(self) -> list[dict]:
        out = ctypes.create_string_buffer(1 << 16)
        self.lib.ckv_harness_creators(out, 1 << 16)
        return json.loads(out.value.decode())

    def logs(self) -> list[tuple[int, str]]:
        out = ctypes.create_string_buffer(1 << 16)
        self.lib.ckv_harness_logs(out, 1 << 16)
        return [tuple(x) for x in json.loads(out.value.decode())]

    def create(self, fields: EncodedFields | None, creator: int = 0, phase: int = 0, name: str = "layer0",
               claimed_count: int | None = None, null_collection: bool = False, trt_types: bool = False) -> int:
        """createPlugin; handle >= 0 or -1. Field types are criticalkv FieldType codes unless trt_types."""
        if fields is not None and not trt_types:
            for i in range(fields.count):
                fields.array[i].type = _TO_TRT_FIELD.get(fields.array[i].type, 8)
        count = fields.count if fields is not None else 0
        array = fields.array if fields is not None else None
        return self.lib.ckv_harness_create(creator, name.encode(), array, count,
                                           count if claimed_count is None else claimed_count, phase,
                                           int(null_collection))

    def describe(self, handle: int) -> dict:
        """Name, version, ..., and "fields": the serialized policy fields; "workspace_bytes": the serialized size of the
        workspace TensorRT allocated (-1: not known yet), apart from them."""
        out = ctypes.create_string_buffer(1 << 16)
        assert self.lib.ckv_harness_describe(handle, out, 1 << 16) == 0
        described = json.loads(out.value.decode())
        workspace = [f for f in described["fields"] if f["name"] == "workspace_bytes"]
        assert len(workspace) == 1 and workspace[0]["type"] == TRT_FIELD_INT64, "serialized once, as int64"
        described["workspace_bytes"] = workspace[0]["value"]
        described["fields"] = [f for f in described["fields"] if f["name"] != "workspace_bytes"]
        return described

    def round_trip(self, handle: int, creator: int = 0) -> int:
        return self.lib.ckv_harness_round_trip(handle, creator)

    def clone(self, handle: int, attach: bool = False) -> int:
        return self.lib.ckv_harness_clone(handle, int(attach))

    def output_types(self, handle: int, input_types: list[int], nb_outputs: int = 4) -> tuple[int, list[int]]:
        inputs = (ctypes.c_int32 * len(input_types))(*input_types)
        out = (ctypes.c_int32 * nb_outputs)()
        status = self.lib.ckv_harness_output_types(handle, inputs, len(input_types), out, nb_outputs)
        return status, list(out)

    def output_shapes(self, handle: int, shapes: list[tuple[int, ...]], nb_outputs: int = 4) -> dict:
        """Symbolic axes (-1): the layer inputs' names (B, H, Wq, D; B, Hkv, n, D; ...), "in<i>.<axis>" beyond input 4."""
        out = ctypes.create_string_buffer(1 << 16)
        self.lib.ckv_harness_output_shapes(handle, pack_dims(shapes), len(shapes), nb_outputs, out, 1 << 16)
        return json.loads(out.value.decode())

    def supports(self, handle: int, pos: int, types: list[int], formats: list[int], nb_inputs: int) -> bool:
        t = (ctypes.c_int32 * len(types))(*types)
        f = (ctypes.c_int32 * len(formats))(*formats)
        return self.lib.ckv_harness_supports(handle, pos, t, f, nb_inputs, len(types) - nb_inputs) == 1

    def workspace(self, handle: int, max_shapes: list[tuple[int, ...]], nb_outputs: int = 4) -> int:
        return self.lib.ckv_harness_workspace(handle, pack_dims(max_shapes), len(max_shapes), nb_outputs)

    def configure(self, handle: int, shapes: list[tuple[int, ...]], nb_inputs: int, on_shape_change: bool) -> int:
        return self.lib.ckv_harness_configure(handle, int(on_shape_change), pack_dims(shapes), nb_inputs,
                                              len(shapes) - nb_inputs)

    def enqueue_refusal(self, handle: int, shapes: list[tuple[int, ...]], nb_inputs: int) -> int:
        """onShapeChange, then enqueue with null tensors and workspace: the status of what enqueue refuses before it
        launches anything (the workspace's size, then the null workspace)."""
        return self.lib.ckv_harness_enqueue(handle, pack_dims(shapes), nb_inputs, len(shapes) - nb_inputs)

    def destroy(self, handle: int) -> None:
        self.lib.ckv_harness_destroy(handle)


_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


class CudaLibrary:
    """libcriticalkv_cuda_test.so: the kernels on torch CUDA tensors (synchronous)."""

    def __init__(self):
        self.lib = _load("libcriticalkv_cuda_test.so")
        L = self.lib
        P = ctypes.POINTER
        L.ckv_cuda_device_count.restype = ctypes.c_int32
        L.ckv_cuda_workspace_bytes.argtypes = [P(CkvField), ctypes.c_int32, P(ctypes.c_int32)]
        L.ckv_cuda_workspace_bytes.restype = ctypes.c_int64
        L.ckv_cuda_select_layer.argtypes = (
            [P(CkvField), ctypes.c_int32, P(ctypes.c_int32), ctypes.c_int32] + [ctypes.c_void_p] * 10
            + [ctypes.c_int32, P(ctypes.c_float), ctypes.c_int32, ctypes.c_char_p, ctypes.c_int32]
        )
        L.ckv_cuda_select_layer_async.argtypes = (
            [P(CkvField), ctypes.c_int32, P(ctypes.c_int32), ctypes.c_int32] + [ctypes.c_void_p] * 11
            + [ctypes.c_int64, ctypes.c_void_p]
        )
        L.ckv_cuda_l1_bounds.argtypes = (
            [P(ctypes.c_int32), ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p,
             ctypes.c_char_p, ctypes.c_int32]
        )
        L.ckv_cuda_value_norms.argtypes = (
            [P(ctypes.c_int32), ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32,
             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32,
             ctypes.c_void_p, ctypes.c_int32, P(ctypes.c_float), ctypes.c_char_p, ctypes.c_int32]
        )
        L.ckv_cuda_window_scores.argtypes = (
            [P(CkvField), ctypes.c_int32, P(ctypes.c_int32), ctypes.c_int32] + [ctypes.c_void_p] * 7
            + [P(ctypes.c_int32), ctypes.c_char_p, ctypes.c_int32]
        )
        L.ckv_cuda_top_k.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int32] * 6
                                     + [P(ctypes.c_float), ctypes.c_char_p, ctypes.c_int32])
        L.ckv_cuda_mass_count.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_int32] * 3
                                          + [ctypes.c_char_p, ctypes.c_int32])
        L.ckv_cuda_top_k_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32,
                                          ctypes.c_int64, ctypes.c_char_p, ctypes.c_int32]
        L.ckv_cuda_pruned_row.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int32, ctypes.c_int32, ctypes.c_int64,
                                          ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_char_p,
                                          ctypes.c_int32])

    def device_count(self) -> int:
        return self.lib.ckv_cuda_device_count()

    @staticmethod
    def _shape(q, k, o):
        batch, heads, query_len, head_dim = q.shape
        return (ctypes.c_int32 * 7)(batch, heads, k.shape[1], k.shape[2], query_len, head_dim, o.shape[0])

    def select_layer(self, policy: KVPolicy, q, k, v, o, layer_idx=0, num_layers=1, capacity=None,
                     prompt_lengths=None, iterations: int = 1, kv_budget: int | None = None, pruned_terms: bool = False):
        """(indices, lengths, kept keys, kept values[, ms per call]) from launchCriticalKVSelect on the GPU;
        kv_budget goes to the device as the node's int32 [1] input; pruned_terms: the pruned stage 2's weights-only
        terms computed beforehand (launchPrunedTerms, outside the timing) and passed in."""
        n = k.shape[2]
        capacity = capacity or n
        cap = min(n, capacity)
        batch, kv_heads, head_dim = k.shape[0], k.shape[1], k.shape[3]
        fields = encode_fields(node_fields(policy, layer_idx, num_layers, capacity))
        q, k, v, o = (t.contiguous() for t in (q, k, v, o))
        lengths = prompt_lengths.to(device=k.device, dtype=torch.int32).contiguous() if prompt_lengths is not None else None
        budget = torch.tensor([kv_budget], dtype=torch.int32, device=k.device) if kv_budget is not None else None
        indices = torch.full((batch, kv_heads, cap), -7, dtype=torch.int32, device=k.device)
        kept = torch.full((batch, kv_heads), -7, dtype=torch.int32, device=k.device)
        kk = torch.full((batch, kv_heads, cap, head_dim), 7.0, dtype=k.dtype, device=k.device)
        vv = torch.full_like(kk, 7.0)
        ms = ctypes.c_float(0.0)
        err = ctypes.create_string_buffer(512)
        status = self.lib.ckv_cuda_select_layer(
            fields.array, fields.count, self._shape(q, k, o), _DTYPE_CODES[k.dtype],
            q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lengths.data_ptr() if lengths is not None else None,
            budget.data_ptr() if budget is not None else None,
            kk.data_ptr(), vv.data_ptr(), kept.data_ptr(), indices.data_ptr(), iterations, ctypes.byref(ms),
            1 if pruned_terms else 0, err, 512,
        )
        if status != 0:
            raise RuntimeError(err.value.decode())
        out = (indices.long(), kept.long(), kk, vv)
        return out + (ms.value,) if iterations > 1 else out

    def workspace_bytes(self, policy: KVPolicy, q, k, o, capacity=None, layer_idx=0, num_layers=1) -> int:
        """Workspace of the node of layer `layer_idx` of `num_layers` (its fields decide the layout)."""
        fields = encode_fields(node_fields(policy, layer_idx, num_layers, capacity or k.shape[2]))
        return self.lib.ckv_cuda_workspace_bytes(fields.array, fields.count, self._shape(q, k, o))

    def select_layer_async(self, policy: KVPolicy, q, k, v, o, prompt_lengths, outputs, workspace, stream,
                           layer_idx=0, num_layers=1, capacity=None, kv_budget=None) -> int:
        """Launch on `stream` (a torch.cuda.Stream) into preallocated outputs (indices, lengths, keys, values);
        kv_budget: None or a device int32 [1] tensor (read by the kernels, so it may change between replays)."""
        indices, kept, kk, vv = outputs
        fields = encode_fields(node_fields(policy, layer_idx, num_layers, capacity or k.shape[2]))
        self._keepalive = fields  # the launch reads the fields synchronously, but keep them for the capture
        return self.lib.ckv_cuda_select_layer_async(
            fields.array, fields.count, self._shape(q, k, o), _DTYPE_CODES[k.dtype], q.data_ptr(), k.data_ptr(),
            v.data_ptr(), o.data_ptr(), prompt_lengths.data_ptr() if prompt_lengths is not None else None,
            kv_budget.data_ptr() if kv_budget is not None else None, kk.data_ptr(), vv.data_ptr(), kept.data_ptr(),
            indices.data_ptr(), workspace.data_ptr(),
            workspace.numel(), stream.cuda_stream,
        )

    def l1_bounds(self, values, o_proj, num_heads: int, num_tokens: int | None = None):
        """[B, H, num_tokens] fp32 L1 upper bounds of the pruned stage 2 from launchL1Bounds (CUDA tensors)."""
        batch, kv_heads, n, head_dim = values.shape
        num_tokens = n if num_tokens is None else num_tokens
        shape = (ctypes.c_int32 * 7)(batch, num_heads, kv_heads, n, 0, head_dim, o_proj.shape[0])
        out = torch.empty(batch, num_heads, num_tokens, dtype=torch.float32, device=values.device)
        err = ctypes.create_string_buffer(512)
        values, o_proj = values.contiguous(), o_proj.contiguous()
        status = self.lib.ckv_cuda_l1_bounds(shape, _DTYPE_CODES[values.dtype], values.data_ptr(), o_proj.data_ptr(),
                                             num_tokens, out.data_ptr(), err, 512)
        if status != 0:
            raise RuntimeError(err.value.decode())
        return out

    def value_norms(self, values, o_proj, num_heads: int, num_tokens: int | None = None, kind: str = "l1",
                    iterations: int = 1, gram: bool = False, rows=None, counts=None, out=None):
        """[B, H, num_tokens] fp32 norms (and ms per call when iterations > 1); gram: l2 through the Gram matrices.
        rows / counts (int32 CUDA [B, H_kv, stride] / [B, H_kv]): only the listed tokens are computed (gathered rows),
        written into `out` (the others keep its values)."""
        batch, kv_heads, n, head_dim = values.shape
        num_tokens = n if num_tokens is None else num_tokens
        shape = (ctypes.c_int32 * 7)(batch, num_heads, kv_heads, n, 0, head_dim, o_proj.shape[0])
        if out is None:
            out = torch.empty(batch, num_heads, num_tokens, dtype=torch.float32, device=values.device)
        ms = ctypes.c_float(0.0)
        err = ctypes.create_string_buffer(512)
        values, o_proj = values.contiguous(), o_proj.contiguous()
        mode = (2 if gram else 1) if kind == "l2" else 0
        stride = max_count = 0
        if rows is not None:
            rows, counts = rows.to(torch.int32).contiguous(), counts.to(torch.int32).contiguous()
            stride, max_count = rows.shape[-1], int(counts.max().item()) if counts.numel() else 0
        status = self.lib.ckv_cuda_value_norms(
            shape, _DTYPE_CODES[values.dtype], values.data_ptr(), o_proj.data_ptr(), num_tokens, mode,
            rows.data_ptr() if rows is not None else None, counts.data_ptr() if rows is not None else None, stride,
            max_count, out.data_ptr(), iterations, ctypes.byref(ms), err, 512)
        if status != 0:
            raise RuntimeError(err.value.decode())
        return (out, ms.value) if iterations > 1 else out

    def window_scores(self, policy: KVPolicy, q, k, o, prompt_lengths=None, rows: bool = False):
        """(raw [B, H, m], squares [B, H, m]) of the compressed sequences; rows: also defensivekv's (worst [B, H, m],
        row_mass [B, H, w, 2] (mass, pooled total)), then a dict with those four and `tensor_cores` (whether
        launchWindowScores took the tensor-core path). Untouched entries (uncompressed sequences) stay NaN."""
        batch, heads = q.shape[:2]
        n = k.shape[2]
        w = min(policy.window, n)
        m = n - w
        fields = encode_fields(node_fields(policy))
        raw = torch.full((batch, heads, m), float("nan"), dtype=torch.float32, device=k.device)
        squares = torch.full_like(raw, float("nan"))
        worst = torch.full_like(raw, float("nan")) if rows else None
        row_mass = torch.full((batch, heads, w, 2), float("nan"), dtype=torch.float32, device=k.device) if rows else None
        lengths = prompt_lengths.to(device=k.device, dtype=torch.int32).contiguous() if prompt_lengths is not None else None
        tensor_cores = ctypes.c_int32(-1)
        err = ctypes.create_string_buffer(512)
        q, k = q.contiguous(), k.contiguous()
        status = self.lib.ckv_cuda_window_scores(
            fields.array, fields.count, self._shape(q, k, o), _DTYPE_CODES[k.dtype], q.data_ptr(), k.data_ptr(),
            lengths.data_ptr() if lengths is not None else None, raw.data_ptr(), squares.data_ptr(),
            row_mass.data_ptr() if rows else None, worst.data_ptr() if rows else None, ctypes.byref(tensor_cores),
            err, 512,
        )
        if status != 0:
            raise RuntimeError(err.value.decode())
        if not rows:
            return raw, squares
        return {"raw": raw, "squares": squares, "worst": worst, "row_mass": row_mass,
                "tensor_cores": tensor_cores.value == 1}

    def pruned_row(self, bound, scores, flags, valid_start: int, k: int, margin: float):
        """(flags after the pruned stage 2, exact scores used) from launchPrunedRow on one row (CUDA tensors)."""
        bound, scores = bound.float().contiguous(), scores.float().contiguous()
        flags = flags.to(torch.uint8).contiguous().clone()
        m = flags.numel()
        eligible = int((flags[valid_start:] == 0).sum())
        exact = torch.empty(m, dtype=torch.float32, device=bound.device)
        done = torch.zeros(1, dtype=torch.int64, device=bound.device)
        err = ctypes.create_string_buffer(512)
        if self.lib.ckv_cuda_pruned_row(bound.data_ptr(), scores.data_ptr(), exact.data_ptr(), flags.data_ptr(), m,
                                        valid_start, k, eligible, margin, done.data_ptr(), err, 512) != 0:
            raise RuntimeError(err.value.decode())
        return flags, int(done.item())

    def top_k(self, scores: torch.Tensor, flags: torch.Tensor, k: torch.Tensor, first_valid: torch.Tensor | None = None,
              period: int | None = None, mark: int = 1, iterations: int = 0) -> tuple[torch.Tensor, float]:
        """launchTopK on CUDA tensors: (flags after marking the k[r] best candidates of every row, mean microseconds
        of `iterations` timed launches or nan). scores float [rows, len]; flags uint8 [rows, len] (0 = eligible);
        k int64 [rows], or [levels, rows] (levels of nested sets: mark + l on the first level holding a candidate);
        first_valid int32 [rows] or None."""
        scores = scores.float().contiguous()
        rows, length = scores.shape
        flags = flags.to(device=scores.device, dtype=torch.uint8).contiguous().clone()
        levels = k.shape[0] if k.dim() == 2 else 1
        k = k.to(device=scores.device, dtype=torch.int64).contiguous()
        fv = None if first_valid is None else first_valid.to(device=scores.device, dtype=torch.int32).contiguous()
        elapsed = ctypes.c_float(float("nan"))
        err = ctypes.create_string_buffer(512)
        status = self.lib.ckv_cuda_top_k(scores.data_ptr(), flags.data_ptr(), k.data_ptr(),
                                         None if fv is None else fv.data_ptr(), rows, length, period or length, mark,
                                         levels, iterations, ctypes.byref(elapsed), err, 512)
        if status != 0:
            raise RuntimeError(err.value.decode())
        return flags, elapsed.value

    def mass_count(self, scores: torch.Tensor, flags: torch.Tensor, limit: torch.Tensor,
                   first_valid: torch.Tensor | None = None, period: int | None = None) -> torch.Tensor:
        """launchMassCount on CUDA tensors: int64 [rows] counts."""
        scores = scores.float().contiguous()
        rows, length = scores.shape
        flags = flags.to(device=scores.device, dtype=torch.uint8).contiguous()
        limit = limit.to(device=scores.device, dtype=torch.float32).contiguous()
        fv = None if first_valid is None else first_valid.to(device=scores.device, dtype=torch.int32).contiguous()
        count = torch.full((rows,), -1, dtype=torch.int64, device=scores.device)
        err = ctypes.create_string_buffer(512)
        status = self.lib.ckv_cuda_mass_count(scores.data_ptr(), flags.data_ptr(), None if fv is None else fv.data_ptr(),
                                              limit.data_ptr(), count.data_ptr(), rows, length, period or length, err,
                                              512)
        if status != 0:
            raise RuntimeError(err.value.decode())
        return count

    def top_k_rows(self, scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """bool [rows, len]: the k[r] best of every row (ties: lower index)."""
        scores = scores.float().contiguous()
        rows, length = scores.shape
        k = k.to(device=scores.device, dtype=torch.int64).contiguous()
        flags = torch.empty(rows, length, dtype=torch.uint8, device=scores.device)
        err = ctypes.create_string_buffer(512)
        if self.lib.ckv_cuda_top_k_rows(scores.data_ptr(), k.data_ptr(), flags.data_ptr(), rows, length, err, 512) != 0:
            raise RuntimeError(err.value.decode())
        return flags.bool()


PRUNED_ROW_KINDS = ("loose", "tight", "score-ties", "equal-bounds", "near-ties", "two-levels")


def pruned_row(kind: str, m: int, seed: int, margin: float):
    """One KV head's row for the pruned stage 2 (CPU tensors): (bound U, exact scores C <= U, flags after stage 1,
    valid start, k). Kinds as in plugins/testing/pruned_row_emulation.cpp: loose bounds, tight (U = C), exact-score
    ties, every bound equal, near-ties within the margin, bounds far from C for half the tokens."""
    g = torch.Generator().manual_seed(seed)
    exact = torch.rand(m, generator=g)
    if kind in ("score-ties", "equal-bounds"):
        exact = torch.randint(0, 4, (m,), generator=g).float() / 3
    bound = {
        "loose": lambda: exact * (1 + 2 * torch.rand(m, generator=g)),
        "tight": lambda: exact.clone(),
        "score-ties": lambda: exact * (1 + 2 * torch.rand(m, generator=g)),
        "equal-bounds": lambda: torch.full((m,), 2.0),
        "near-ties": lambda: exact * (1 + margin * torch.randint(0, 3, (m,), generator=g).float()),
        "two-levels": lambda: exact + 0.25 * torch.randint(0, 2, (m,), generator=g).float(),
    }[kind]().float()
    flags = (torch.rand(m, generator=g) < 0.1).to(torch.uint8)  # chosen by stage 1
    valid_start = m // 7 if seed % 2 else 0
    eligible = int((flags[valid_start:] == 0).sum())
    k = [1, 3, eligible // 5, eligible // 2, eligible - 1][seed % 5]
    return bound, exact.float(), flags, valid_start, max(1, min(k, eligible - 1))
