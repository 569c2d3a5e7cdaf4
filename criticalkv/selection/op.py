"""The CriticalKV selection as typed torch ops: ``torch.ops.criticalkv.*`` of ``libcriticalkv_torch.so``.

The ops are registered in C++ with ``TORCH_LIBRARY`` (plugins/torch), like flashinfer's and TensorRT-LLM's: typed
tensors whose dtype, device, shape and contiguity the op checks before any work (a TypeError or ValueError naming the
argument), a CPU registration (the host version of plugins/host: the kernels' logic in fp32), a CUDA registration (the
kernels of plugins/kernels on torch's current stream, the workspace from torch's allocator, no host synchronisation:
CUDA-graph capturable; built where torch has CUDA) and a Meta registration (output shapes for fake tensors and
torch.compile). ``scripts/build_plugin.sh`` builds the library against the environment's torch.

Ops (shapes: docs/torch_backend.md, "The selection ops")::

    select_layer(queries, keys, values, o_proj, prompt_lengths?, kv_budget?, rotation?, str policy, int layer_idx,
                 int num_layers, int capacity, scores?) -> (kept_keys, kept_values, kept_lengths, kept_indices)
    layer_ranking(queries, keys, values, o_proj, prompt_lengths?, kv_budget?, str policy, int layer_idx,
                  int num_layers, scores?) -> (ranking, attention, critical)          # a model-level policy's layer
    select_model(ranking, attention?, critical?, keys[], values[], prompt_lengths?, kv_budget?, str policy,
                 int[] capacities) -> (kept_keys[], kept_values[], kept_lengths[], kept_indices[])
    top_k(scores, k, eligible?) -> mask            # the batched top-k primitive
    value_norms(values, o_proj, int num_heads, str kind) -> [B, H, n]
    window_scores(queries, keys, prompt_lengths?, int window) -> [B, H, n - min(window, n)]

``policy`` is ``KVPolicy.to_json()``. The ops never run the PyTorch reference. This module's functions decide which
implementation runs (``implementation``, default ``$CRITICALKV_SELECTION`` or "native"):

* "native": the ops; a call they cannot run (the library not built, no CUDA registration, a policy with no kernel flow
  such as the Expected Attention pair, a kvzip policy without its scores) raises ``KernelsUnavailable`` with the reason;
* "auto": the ops where they can run, else the PyTorch reference (``criticalkv.selection.select_layer`` /
  ``select_model``) in the ops' output layout, with a warning that names the reason, once per reason;
* "reference": the PyTorch reference, asked for (no warning).
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path
from typing import Optional, Sequence

import torch

from criticalkv.policy import KVPolicy
from criticalkv.selection.layer import LayerSelection, gather_kv, select_layer, select_model

TORCH_OPS_LIBRARY_NAME = "libcriticalkv_torch.so"
#: Environment variable naming the library explicitly (takes precedence over the build folder).
TORCH_OPS_LIBRARY_ENV = "CRITICALKV_TORCH_OPS"
#: Environment variable of the implementation a caller that passes none gets ("native", "auto" or "reference").
SELECTION_ENV = "CRITICALKV_SELECTION"
IMPLEMENTATIONS = ("native", "auto", "reference")
REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_COMMAND = "bash scripts/build_plugin.sh"


class KernelsUnavailable(RuntimeError):
    """The ops cannot run this call (the reason), and the caller asked for them (implementation "native")."""


def torch_ops_candidates() -> list[Path]:
    """Where the library is looked for: $CRITICALKV_TORCH_OPS alone when it is set, else build/plugins of the
    checkout."""
    if os.environ.get(TORCH_OPS_LIBRARY_ENV):
        return [Path(os.environ[TORCH_OPS_LIBRARY_ENV])]
    return [REPO_ROOT / "build" / "plugins" / TORCH_OPS_LIBRARY_NAME]


@functools.lru_cache(maxsize=1)
def load_torch_ops() -> str | None:
    """Load the library into torch (once): None when ``torch.ops.criticalkv`` is there, else why it is not."""
    if _registered("select_layer"):
        return None
    searched = torch_ops_candidates()
    for path in searched:
        if path.is_file():
            try:
                torch.ops.load_library(str(path))
            except (OSError, RuntimeError) as err:  # built against another torch, a missing symbol
                return f"{path} does not load into this torch ({torch.__version__}): {err}; rebuild it: {BUILD_COMMAND}"
            return None
    return f"{TORCH_OPS_LIBRARY_NAME} is not built (searched {', '.join(map(str, searched))}): {BUILD_COMMAND}"


def _registered(op: str, key: str | None = None) -> bool:
    """Whether criticalkv::op has a kernel for the dispatch key (Meta: whether the op is defined at all)."""
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(f"criticalkv::{op}", key or "Meta"))
    except RuntimeError:  # the operator does not exist
        return False


def kernels_registered(device_type: str) -> bool:
    """Whether the loaded library runs the ops on tensors of ``device_type`` ("cpu", "cuda")."""
    return load_torch_ops() is None and _registered("select_layer", {"cpu": "CPU", "cuda": "CUDA"}.get(device_type, ""))


def native_reason(policy: KVPolicy, *tensors: torch.Tensor, scores: torch.Tensor | None = None,
                  num_layers: int = 1) -> str | None:
    """Why the ops cannot run this call (None: they can). ``tensors``: the call's floating inputs (their dtypes and
    device); ``scores``: the external scores given; ``num_layers``: the model's, for a model-level policy (select it
    with ``select_model_kv`` when it spans several layers)."""
    base = policy.method.base
    if base.model_level and num_layers > 1:
        return f"{policy.name} selects over all layers at once: select_model_kv (layer_ranking, select_model)"
    if not base.kernels:
        return f"{policy.name}: {base.kernels_refusal}"
    if base.external_scores and scores is None:
        return (f"{policy.name} ranks by scores computed outside the layer (a context reconstruction's or the "
                "surrogate's); without them its fallback, the window's max attention, is in the PyTorch reference only")
    dtypes = {t.dtype for t in tensors}
    if dtypes and (len(dtypes) != 1 or next(iter(dtypes)) not in (torch.float32, torch.float16, torch.bfloat16)):
        return f"the kernels take one of float32/float16/bfloat16 for every input, got {sorted(map(str, dtypes))}"
    missing = load_torch_ops()
    if missing is not None:
        return missing
    device = tensors[0].device.type if tensors else "cpu"
    if not kernels_registered(device):
        if device == "cuda":
            return (f"{TORCH_OPS_LIBRARY_NAME} has no CUDA registration (built against a torch without CUDA, or "
                    f"without nvcc): {BUILD_COMMAND} with a CUDA build of torch")
        return f"the kernels run on CPU and CUDA tensors, got {device}"
    return None


def resolve_implementation(implementation: str | None) -> str:
    """The implementation a call runs: the argument, else $CRITICALKV_SELECTION, else "native"."""
    chosen = implementation if implementation is not None else os.environ.get(SELECTION_ENV) or "native"
    if chosen not in IMPLEMENTATIONS:
        source = "implementation" if implementation is not None else f"${SELECTION_ENV}"
        raise ValueError(f"{source}: {chosen!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    return chosen


_WARNED: set[str] = set()


def _refused(reason: str, implementation: str) -> None:
    """Raise for "native"; warn once per reason for "auto" (the reference then runs)."""
    if implementation == "native":
        raise KernelsUnavailable(f"{reason} (implementation='auto' or {SELECTION_ENV}=auto runs the PyTorch "
                                 "reference instead)")
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"criticalkv: the PyTorch reference selects in place of the kernels: {reason}", RuntimeWarning,
                      stacklevel=3)


def _output_size(keys: torch.Tensor, capacity: int) -> int:
    if capacity < 1:
        raise ValueError(f"capacity: {capacity} (a head's output holds at least one entry)")
    return min(keys.shape[2], capacity)


def _kernel_layout(selection: LayerSelection, keys: torch.Tensor, values: torch.Tensor, capacity: int):
    """A LayerSelection in the ops' output layout: int32 lengths and indices (-1 padded to min(n, capacity)), the
    kept keys and values (zero beyond a head's length)."""
    batch, kv_heads, n, _ = keys.shape
    cap = _output_size(keys, capacity)
    indices = torch.full((batch, kv_heads, cap), -1, dtype=torch.int64, device=keys.device)
    width = min(cap, selection.indices.shape[-1])
    indices[..., :width] = selection.indices[..., :width]
    kept = selection.lengths.clamp(max=cap)
    kept_keys, kept_values = gather_kv(LayerSelection(indices, kept), keys, values)
    return kept_keys, kept_values, kept.to(torch.int32), indices.to(torch.int32)


def reference_select(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, o_proj: torch.Tensor,
                     prompt_lengths: Optional[torch.Tensor], kv_budget: Optional[torch.Tensor],
                     rotation: Optional[torch.Tensor], policy: str | KVPolicy, layer_idx: int, num_layers: int,
                     capacity: int, scores: Optional[torch.Tensor] = None,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """select_layer's outputs from the PyTorch reference (any device)."""
    _output_size(keys, capacity)
    chosen = policy if isinstance(policy, KVPolicy) else KVPolicy.from_json(policy)
    if kv_budget is not None:
        chosen = chosen.with_budget(int(kv_budget.reshape(-1)[0]))
    lengths = prompt_lengths.to(torch.int64) if prompt_lengths is not None else None
    selection = select_layer(chosen, queries, keys, values, o_proj, layer_idx, num_layers, lengths, rotation=rotation,
                             scores=scores)
    return _kernel_layout(selection, keys, values, capacity)


def select_layer_kv(policy: KVPolicy, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    o_proj: torch.Tensor, layer_idx: int = 0, num_layers: int = 1, capacity: int | None = None,
                    prompt_lengths: torch.Tensor | None = None, kv_budget: torch.Tensor | None = None,
                    rotation: torch.Tensor | None = None, scores: torch.Tensor | None = None,
                    implementation: str | None = None):
    """One layer's kept entries: ``torch.ops.criticalkv.select_layer`` (or the reference, as ``implementation`` says)
    with a KVPolicy. capacity None: n, every entry fits. ``scores`` [B, H_kv, n] fp32: the per-entry scores of a policy
    whose method scores prompts apart (kvzip). Returns (kept_keys, kept_values [B, H_kv, cap, d_h], kept_lengths
    [B, H_kv] int32, kept_indices [B, H_kv, cap] int32 ascending, -1 padded), cap = min(n, capacity)."""
    capacity = keys.shape[2] if capacity is None else capacity
    chosen = resolve_implementation(implementation)
    if chosen != "reference":
        reason = native_reason(policy, queries, keys, values, o_proj, scores=scores, num_layers=num_layers)
        if reason is None:
            return torch.ops.criticalkv.select_layer(queries, keys, values, o_proj, prompt_lengths, kv_budget, rotation,
                                                     policy.to_json(), layer_idx, num_layers, capacity, scores)
        _refused(reason, chosen)
    return reference_select(queries, keys, values, o_proj, prompt_lengths, kv_budget, rotation, policy, layer_idx,
                            num_layers, capacity, scores)


class ModelSelection:
    """A model-level policy's selection (``layer-defensivekv``, ``layer-kvzip``, ``layer-kvzip-criticalkv``), a layer at a
    time: ``add(layer, queries, keys, values, o_proj, scores)`` right after each layer's attention, ``finish()`` after
    the last one. On the ops each layer's ranking (``layer_ranking``) is computed at once and only it, and the layer's
    keys and values, stay on the device until ``select_model``; on the reference (as ``implementation`` says), the
    layers' inputs stay until ``select_model`` of ``criticalkv.selection``."""

    def __init__(self, policy: KVPolicy, num_layers: int, capacities: Sequence[int],
                 prompt_lengths: torch.Tensor | None = None, kv_budget: int | None = None,
                 implementation: str | None = None, rotation=None):
        if len(capacities) != num_layers:
            raise ValueError(f"capacities: {len(capacities)} given for {num_layers} layers")
        self.policy, self.num_layers, self.capacities = policy, num_layers, list(capacities)
        self.prompt_lengths, self.kv_budget, self.rotation = prompt_lengths, kv_budget, rotation
        self.implementation = resolve_implementation(implementation)
        self.native: bool | None = None if self.implementation != "reference" else False
        self.layers: list = []

    def _decide(self, tensors, scores) -> None:
        reason = native_reason(self.policy, *tensors, scores=scores)
        if reason is None and not (self.policy.method.base.model_level and self.num_layers > 1):
            reason = f"{self.policy.name} is not a model-level selection here (one layer, or not model-level)"
        if reason is not None:
            _refused(reason, self.implementation)
        self.native = reason is None

    def _budget(self, device) -> torch.Tensor | None:
        return None if self.kv_budget is None else torch.tensor([int(self.kv_budget)], dtype=torch.int32, device=device)

    def add(self, layer: int, queries, keys, values, o_proj, scores: torch.Tensor | None = None) -> None:
        """Layer ``layer``'s post-RoPE window queries [B, H, >= w, d_h], keys / values [B, H_kv, n, d_h], o_proj and
        its external scores [B, H_kv, n] (the kvzip pair)."""
        if layer != len(self.layers):
            raise ValueError(f"layer {layer} added after {len(self.layers)} layers")
        if self.native is None:
            self._decide((queries, keys, values, o_proj), scores)
        if not self.native:
            self.layers.append((queries, keys, values, o_proj, scores))
            return
        ranking = torch.ops.criticalkv.layer_ranking(queries, keys, values, o_proj, self.prompt_lengths,
                                                     self._budget(keys.device), self.policy.to_json(), layer,
                                                     self.num_layers, scores)
        self.layers.append((ranking, keys, values))

    def finish(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Every layer's (kept_keys, kept_values, kept_lengths, kept_indices), select_layer_kv's layout."""
        if len(self.layers) != self.num_layers:
            raise ValueError(f"{len(self.layers)} of {self.num_layers} layers added")
        if not self.native:
            lengths = None if self.prompt_lengths is None else self.prompt_lengths.to(torch.int64)
            policy = self.policy if self.kv_budget is None else self.policy.with_budget(int(self.kv_budget))
            scores = [layer[4] for layer in self.layers]
            selections = select_model(policy, [layer[:4] for layer in self.layers], lengths, rotation=self.rotation,
                                      scores=None if all(s is None for s in scores) else scores)
            return [_kernel_layout(s, layer[1], layer[2], cap)
                    for s, layer, cap in zip(selections, self.layers, self.capacities)]
        rankings = [layer[0] for layer in self.layers]
        refine = self.policy.method.refine is not None
        ranking = torch.cat([r[0] for r in rankings], dim=1)
        attention = torch.cat([r[1] for r in rankings], dim=1) if refine else None
        critical = torch.cat([r[2] for r in rankings], dim=1) if refine else None
        keys = [layer[1] for layer in self.layers]
        values = [layer[2] for layer in self.layers]
        out = torch.ops.criticalkv.select_model(ranking, attention, critical, keys, values, self.prompt_lengths,
                                                self._budget(keys[0].device), self.policy.to_json(), self.capacities)
        return list(zip(*out))


def select_model_kv(policy: KVPolicy, layers: Sequence[tuple], capacities: Sequence[int] | None = None,
                    prompt_lengths: torch.Tensor | None = None, kv_budget: int | None = None,
                    scores: Sequence[torch.Tensor | None] | None = None, implementation: str | None = None,
                    rotation=None) -> list[tuple]:
    """Every layer of a model-level policy at once (``ModelSelection``): ``layers[l] = (queries, keys, values,
    o_proj)``, ``scores[l]`` layer l's external scores or None; capacities None: n. Returns each layer's
    select_layer_kv outputs."""
    capacities = list(capacities) if capacities is not None else [layer[1].shape[2] for layer in layers]
    selection = ModelSelection(policy, len(layers), capacities, prompt_lengths, kv_budget, implementation, rotation)
    for i, (q, k, v, o) in enumerate(layers):
        selection.add(i, q, k, v, o, None if scores is None else scores[i])
    return selection.finish()


def top_k(scores: torch.Tensor, k, eligible: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.ops.criticalkv.top_k``: [..., L] bool, the k best eligible entries of every row (``k`` an int or one per
    row; ties to the lower index, NaN above +inf, -0 equal to +0: ``criticalkv.methods.topk.topk_mask``'s rule).
    Raises KernelsUnavailable when the library is not loaded."""
    missing = load_torch_ops()
    if missing is not None:
        raise KernelsUnavailable(missing)
    k = torch.as_tensor(k, dtype=torch.int64, device=scores.device)
    return torch.ops.criticalkv.top_k(scores, k, eligible)


def value_norms(values: torch.Tensor, o_proj: torch.Tensor, num_heads: int, kind: str = "l1") -> torch.Tensor:
    """``torch.ops.criticalkv.value_norms``: [B, H, n] fp32, ||V[b, g(h), i] W_O^h|| (``value_projection_norms``)."""
    missing = load_torch_ops()
    if missing is not None:
        raise KernelsUnavailable(missing)
    return torch.ops.criticalkv.value_norms(values, o_proj, num_heads, kind)


def window_scores(queries: torch.Tensor, keys: torch.Tensor, window: int,
                  prompt_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.ops.criticalkv.window_scores``: [B, H, n - min(window, n)] fp32, the window-mean attention of the older
    tokens (causal inside the window, left padding masked; zeros for a sequence of at most ``window`` tokens)."""
    missing = load_torch_ops()
    if missing is not None:
        raise KernelsUnavailable(missing)
    return torch.ops.criticalkv.window_scores(queries, keys, prompt_lengths, window)


load_torch_ops()  # torch.ops.criticalkv.* exist once this module is imported, where the library is built
