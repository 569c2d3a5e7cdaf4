"""``torch.ops.criticalkv.select_layer``: the op the torch runtime calls after each layer's attention.

On the CPU it is the PyTorch reference in the kernels' output layout (int32 lengths and indices, -1 padded to
min(n, capacity), zero K/V beyond a head's length); on CUDA it launches the plugin's kernels through
libcriticalkv_ops.so (GPU tests below). The C API of that library loads and validates on any machine.
"""

from __future__ import annotations

import pytest
import torch

from criticalkv import KVPolicy
from criticalkv.node import node_capacity
from criticalkv.selection import select_layer
from criticalkv.selection.layer import gather_kv
from criticalkv.selection.native import layer_fields, load_ops_library, ops_library_candidates
from criticalkv.selection.op import native_reason, select_layer_kv
from policies import POLICY_CASES, make_policy

BATCH, HEADS, KV_HEADS, N, HEAD_DIM, HIDDEN = 2, 4, 2, 150, 16, 48


def layer_tensors(seed: int, dtype=torch.float32, device="cpu", n: int = N):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, HEADS, 32, HEAD_DIM, generator=g)
    k = torch.randn(BATCH, KV_HEADS, n, HEAD_DIM, generator=g)
    v = torch.randn(BATCH, KV_HEADS, n, HEAD_DIM, generator=g)
    o = torch.randn(HIDDEN, HEADS * HEAD_DIM, generator=g) / 8
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v, o))


@pytest.mark.parametrize("case", [c for c in POLICY_CASES], ids=[c[0] for c in POLICY_CASES])
def test_the_op_is_the_reference_in_the_kernels_layout(case):
    policy = make_policy(case[1], budget=48, window=8)
    q, k, v, o = layer_tensors(1)
    lengths = torch.tensor([N, 97])
    capacity = node_capacity(policy, N, KV_HEADS, 1, 3)
    kept_keys, kept_values, kept_lengths, kept_indices = select_layer_kv(
        policy, q, k, v, o, layer_idx=1, num_layers=3, capacity=capacity, prompt_lengths=lengths)
    expected = select_layer(policy, q, k, v, o, layer_idx=1, num_layers=3, prompt_lengths=lengths)
    cap = min(N, capacity)
    assert kept_indices.shape == (BATCH, KV_HEADS, cap) and kept_indices.dtype == torch.int32
    assert kept_lengths.dtype == torch.int32 and kept_keys.shape == (BATCH, KV_HEADS, cap, HEAD_DIM)
    assert torch.equal(kept_lengths.long(), expected.lengths)
    width = expected.indices.shape[-1]
    assert width <= cap
    assert torch.equal(kept_indices[..., :width].long(), expected.indices)
    assert bool((kept_indices[..., width:] == -1).all())
    ref_keys, ref_values = gather_kv(expected, k, v)
    assert torch.equal(kept_keys[..., :width, :], ref_keys) and torch.equal(kept_values[..., :width, :], ref_values)
    assert not kept_keys[..., width:, :].any() and not kept_values[..., width:, :].any()


def test_a_runtime_budget_is_the_policy_at_that_budget():
    policy = KVPolicy("criticalkv", budget=64, window=8)
    q, k, v, o = layer_tensors(2)
    out = select_layer_kv(policy, q, k, v, o, kv_budget=torch.tensor([24], dtype=torch.int32))
    expected = select_layer(policy.with_budget(24), q, k, v, o)
    assert torch.equal(out[2].long(), expected.lengths)
    assert bool((out[2] == 24).all())
    assert torch.equal(out[3][..., :expected.indices.shape[-1]].long(), expected.indices)


def test_capacity_bounds_the_outputs():
    policy = KVPolicy("snapkv", budget=40, window=8)
    q, k, v, o = layer_tensors(3)
    kept_keys, _, kept_lengths, kept_indices = select_layer_kv(policy, q, k, v, o, capacity=40)
    assert kept_indices.shape[-1] == 40 and kept_keys.shape[2] == 40
    assert bool((kept_lengths == 40).all())
    with pytest.raises(ValueError, match="capacity"):
        select_layer_kv(policy, q, k, v, o, capacity=0)


def test_fake_tensors_give_the_output_shapes():
    """The op's fake (meta) implementation: what torch.compile and CUDA-graph tracing see."""
    policy = KVPolicy("criticalkv", budget=40, window=8)
    q, k, v, o = (t.to("meta") for t in layer_tensors(4))
    out = torch.ops.criticalkv.select_layer(q, k, v, o, None, None, None, policy.to_json(), 0, 1, 64)
    assert [tuple(t.shape) for t in out] == [(BATCH, KV_HEADS, 64, HEAD_DIM)] * 2 + [(BATCH, KV_HEADS),
                                                                                      (BATCH, KV_HEADS, 64)]
    assert [t.dtype for t in out[2:]] == [torch.int32, torch.int32]


def test_opcheck():
    """torch's own checks of a custom op: schema, fake tensor, dispatch registrations."""
    policy = KVPolicy("ada-criticalkv", budget=40, window=8)
    q, k, v, o = layer_tensors(5)
    args = (q, k, v, o, torch.tensor([N, 120]), torch.tensor([32], dtype=torch.int32), None, policy.to_json(), 0, 1, N)
    torch.library.opcheck(torch.ops.criticalkv.select_layer.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_which_calls_the_kernels_refuse():
    q, k, v, o = layer_tensors(6)
    assert "all layers" in native_reason(KVPolicy("layer-defensivekv"), q, k, v, o)
    assert "expected-attention" in native_reason(KVPolicy("expected-attention"), q, k, v, o)
    assert "float64" in native_reason(KVPolicy("snapkv"), q.double(), k, v, o)


@pytest.fixture(scope="module")
def ops_library():
    library = load_ops_library()
    if library is None:
        pytest.skip(f"libcriticalkv_ops.so is not built (searched {[str(p) for p in ops_library_candidates()]})")
    return library


def test_the_ops_library_loads_and_checks_its_arguments(ops_library):
    """The C API dlopens without a GPU and refuses bad input with a reason, before any CUDA call."""
    policy = KVPolicy("criticalkv", budget=64, window=8)
    fields = layer_fields(policy.to_json(), 0, 1, N)
    shape = ops_library.shape(BATCH, HEADS, KV_HEADS, N, 32, HEAD_DIM, HIDDEN)
    assert ops_library.workspace_bytes(fields, shape) > 0
    assert ops_library.workspace_bytes(layer_fields(KVPolicy("full").to_json(), 0, 1, N), shape) == 0
    with pytest.raises(ValueError, match="not a multiple"):
        ops_library.workspace_bytes(fields, ops_library.shape(BATCH, 5, KV_HEADS, N, 32, HEAD_DIM, HIDDEN))
    with pytest.raises(RuntimeError, match="workspace"):
        ops_library.select_layer(fields, shape, "float32", *([1] * 4), None, None, *([1] * 4), 1, 1, 0)
    with pytest.raises(ValueError, match="float64"):
        ops_library.select_layer(fields, shape, "float64", *([1] * 4), None, None, *([1] * 4), 1, 1, 0)
    if not torch.cuda.is_available():
        assert ops_library.device_count() == 0


# ---------------------------------------------------------------------------------------------------- on a GPU

@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in POLICY_CASES if c[0] not in ("expected-attention", "expected-criticalkv")],
                         ids=lambda c: c[0])
def test_the_kernels_through_the_op_keep_the_reference_entries_in_fp32(ops_library, case):
    """fp32 on the GPU: the kernels' kept set is the host driver's, which is the reference's (exact scores)."""
    policy = make_policy(case[1], budget=48, window=8)
    q, k, v, o = layer_tensors(7, device="cuda")
    lengths = torch.tensor([N, 97], device="cuda")
    gpu = select_layer_kv(policy, q, k, v, o, layer_idx=1, num_layers=3, prompt_lengths=lengths)
    cpu = select_layer_kv(policy, *(t.cpu() for t in (q, k, v, o)), layer_idx=1, num_layers=3,
                          prompt_lengths=lengths.cpu())
    assert torch.equal(gpu[2].cpu(), cpu[2]) and torch.equal(gpu[3].cpu(), cpu[3])
    assert torch.equal(gpu[0].cpu(), cpu[0]) and torch.equal(gpu[1].cpu(), cpu[1])


@pytest.mark.gpu
def test_the_op_is_captured_in_a_cuda_graph_and_reads_the_budget_on_the_device(ops_library):
    policy = KVPolicy("pyramid-criticalkv", budget=64, window=8)
    q, k, v, o = layer_tensors(8, dtype=torch.float16, device="cuda", n=300)
    budget = torch.tensor([64], dtype=torch.int32, device="cuda")
    capacity = node_capacity(policy, 300, KV_HEADS, 0, 2)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture (lazy library load, allocator)
        select_layer_kv(policy, q, k, v, o, 0, 2, capacity, kv_budget=budget)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = select_layer_kv(policy, q, k, v, o, 0, 2, capacity, kv_budget=budget)
    for b in (64, 24, 40):
        budget.fill_(b)
        graph.replay()
        torch.cuda.synchronize()
        eager = select_layer_kv(policy, q, k, v, o, 0, 2, capacity, kv_budget=budget)
        assert torch.equal(out[2], eager[2]) and torch.equal(out[3], eager[3]), b
