"""The torch custom op ``torch.ops.criticalkv.select_layer``: one layer's KV selection as a single op.

On CUDA tensors it runs the CUDA kernels of plugins/ (``launchCriticalKVSelect``, the TensorRT plugin's own launch
function, through ``libcriticalkv_ops.so``) on torch's current stream, with the workspace from torch's caching
allocator: no host synchronisation, so it can be captured in a CUDA graph (a runtime ``kv_budget`` lives in device
memory and may change between replays). Everywhere else (CPU tensors; a policy the kernels refuse, such as the
Expected Attention pair; fp32 inputs on a machine without the library) it runs the PyTorch reference,
``criticalkv.selection.select_layer``, and returns the same outputs in the same layout.

Signature (a stable contract between the kernels and the torch runtime)::

    select_layer(Tensor queries,            # [B, H, q, d_h] post-RoPE, q >= min(window, n): the last w are used
                 Tensor keys,               # [B, H_kv, n, d_h] post-RoPE
                 Tensor values,             # [B, H_kv, n, d_h]
                 Tensor o_proj,             # [hidden, H * d_h] the layer's o_proj.weight
                 Tensor? prompt_lengths,    # [B] int32/int64, left-padded batches; None: every sequence is n long
                 Tensor? kv_budget,         # [1] int32 on the inputs' device, in [min_budget, budget]; None: built
                 Tensor? rotation,          # RoPE rotation tables (Expected Attention only); None otherwise
                 str policy,                # KVPolicy.to_json()
                 int layer_idx, int num_layers, int capacity)
      -> (Tensor kept_keys,    # [B, H_kv, cap, d_h], cap = min(n, capacity); zero beyond a head's length
          Tensor kept_values,  # [B, H_kv, cap, d_h]
          Tensor kept_lengths, # [B, H_kv] int32
          Tensor kept_indices) # [B, H_kv, cap] int32, ascending positions into the n axis, -1 padded

``capacity`` is the per-head output size the caller allocates for (``criticalkv.node.node_capacity``); a head never
keeps more than it. fp16 / bf16 / fp32 inputs, all of one dtype and on one device.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from criticalkv.policy import KVPolicy
from criticalkv.selection.layer import LayerSelection, gather_kv, select_layer
from criticalkv.selection.native import OPS_LIBRARY_NAME, layer_fields, load_ops_library

OP_NAME = "criticalkv::select_layer"


@functools.lru_cache(maxsize=256)
def _policy(policy_json: str) -> KVPolicy:
    return KVPolicy.from_json(policy_json)


def _output_shapes(keys: torch.Tensor, capacity: int) -> tuple[int, int, int, int]:
    batch, kv_heads, n, head_dim = keys.shape
    if capacity < 1:
        raise ValueError(f"capacity: {capacity} (a head's output holds at least one entry)")
    return batch, kv_heads, min(n, capacity), head_dim


def reference_select(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, o_proj: torch.Tensor,
                     prompt_lengths: Optional[torch.Tensor], kv_budget: Optional[torch.Tensor],
                     rotation: Optional[torch.Tensor], policy: str, layer_idx: int, num_layers: int,
                     capacity: int, scores: Optional[torch.Tensor] = None,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's outputs from the PyTorch reference (any device)."""
    batch, kv_heads, cap, head_dim = _output_shapes(keys, capacity)
    chosen = _policy(policy)
    if kv_budget is not None:
        chosen = chosen.with_budget(int(kv_budget.reshape(-1)[0]))
    lengths = prompt_lengths.to(torch.int64) if prompt_lengths is not None else None
    selection = select_layer(chosen, queries, keys, values, o_proj, layer_idx, num_layers, lengths, rotation=rotation,
                             scores=scores)
    indices = torch.full((batch, kv_heads, cap), -1, dtype=torch.int64, device=keys.device)
    width = min(cap, selection.indices.shape[-1])
    indices[..., :width] = selection.indices[..., :width]
    kept = selection.lengths.clamp(max=cap)
    kept_keys, kept_values = gather_kv(LayerSelection(indices, kept), keys, values)
    return kept_keys, kept_values, kept.to(torch.int32), indices.to(torch.int32)


@torch.library.custom_op(OP_NAME, mutates_args=())
def select_layer_op(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, o_proj: torch.Tensor,
                    prompt_lengths: Optional[torch.Tensor], kv_budget: Optional[torch.Tensor],
                    rotation: Optional[torch.Tensor], policy: str, layer_idx: int, num_layers: int,
                    capacity: int, scores: Optional[torch.Tensor] = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return reference_select(queries, keys, values, o_proj, prompt_lengths, kv_budget, rotation, policy, layer_idx,
                            num_layers, capacity, scores)


@select_layer_op.register_fake
def _(queries, keys, values, o_proj, prompt_lengths, kv_budget, rotation, policy, layer_idx, num_layers, capacity,
      scores=None):
    batch, kv_heads, cap, head_dim = _output_shapes(keys, capacity)
    return (keys.new_empty(batch, kv_heads, cap, head_dim), values.new_empty(batch, kv_heads, cap, head_dim),
            keys.new_empty(batch, kv_heads, dtype=torch.int32), keys.new_empty(batch, kv_heads, cap, dtype=torch.int32))


def native_reason(policy: KVPolicy, *tensors: torch.Tensor) -> str | None:
    """Why a call cannot run on the CUDA kernels (None: it can)."""
    if not policy.method.base.native:
        return f"{policy.name}: {policy.method.base.cpp_refusal}"
    if policy.method.base.model_level:
        return f"{policy.name} selects over all layers at once (select_model)"
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1 or next(iter(dtypes)) not in (torch.float32, torch.float16, torch.bfloat16):
        return f"the kernels take one of float32/float16/bfloat16 for every input, got {sorted(map(str, dtypes))}"
    if load_ops_library() is None:
        return f"{OPS_LIBRARY_NAME} is not built (bash scripts/build_plugin.sh)"
    return None


@select_layer_op.register_kernel("cuda")
def _(queries, keys, values, o_proj, prompt_lengths, kv_budget, rotation, policy, layer_idx, num_layers, capacity,
      scores=None):
    chosen = _policy(policy)
    if scores is not None or native_reason(chosen, queries, keys, values, o_proj) is not None:
        return reference_select(queries, keys, values, o_proj, prompt_lengths, kv_budget, rotation, policy, layer_idx,
                                num_layers, capacity, scores)
    library = load_ops_library()
    batch, kv_heads, cap, head_dim = _output_shapes(keys, capacity)
    device = keys.device
    queries, keys, values, o_proj = (t.contiguous() for t in (queries, keys, values, o_proj))
    if prompt_lengths is not None:
        prompt_lengths = prompt_lengths.to(device=device, dtype=torch.int32).contiguous()
    if kv_budget is not None:
        kv_budget = kv_budget.to(device=device, dtype=torch.int32).reshape(1).contiguous()
    fields = layer_fields(policy, layer_idx, num_layers, capacity)
    shape = library.shape(batch, queries.shape[1], kv_heads, keys.shape[2], queries.shape[2], head_dim, o_proj.shape[0])
    workspace_bytes = library.workspace_bytes(fields, shape)
    workspace = torch.empty(max(workspace_bytes, 1), dtype=torch.uint8, device=device)
    kept_keys = keys.new_empty(batch, kv_heads, cap, head_dim)
    kept_values = values.new_empty(batch, kv_heads, cap, head_dim)
    kept_lengths = torch.empty(batch, kv_heads, dtype=torch.int32, device=device)
    kept_indices = torch.empty(batch, kv_heads, cap, dtype=torch.int32, device=device)
    library.select_layer(
        fields, shape, str(keys.dtype).removeprefix("torch."), queries.data_ptr(), keys.data_ptr(), values.data_ptr(),
        o_proj.data_ptr(), prompt_lengths.data_ptr() if prompt_lengths is not None else None,
        kv_budget.data_ptr() if kv_budget is not None else None, kept_keys.data_ptr(), kept_values.data_ptr(),
        kept_lengths.data_ptr(), kept_indices.data_ptr(), workspace.data_ptr(), workspace_bytes,
        torch.cuda.current_stream(device).cuda_stream,
    )
    return kept_keys, kept_values, kept_lengths, kept_indices


def select_layer_kv(policy: KVPolicy, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    o_proj: torch.Tensor, layer_idx: int = 0, num_layers: int = 1, capacity: int | None = None,
                    prompt_lengths: torch.Tensor | None = None, kv_budget: torch.Tensor | None = None,
                    rotation: torch.Tensor | None = None, scores: torch.Tensor | None = None):
    """``torch.ops.criticalkv.select_layer`` with a KVPolicy (capacity None: n, every entry fits). ``scores``
    [B, H_kv, n]: the per-entry scores of a policy whose method scores prompts apart (``select_layer``'s)."""
    capacity = keys.shape[2] if capacity is None else capacity
    return torch.ops.criticalkv.select_layer(queries, keys, values, o_proj, prompt_lengths, kv_budget, rotation,
                                             policy.to_json(), layer_idx, num_layers, capacity, scores)
