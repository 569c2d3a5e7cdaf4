"""``torch.ops.criticalkv.*``: the typed ops of libcriticalkv_torch.so (plugins/torch) and the functions of
``criticalkv.selection.op`` that choose between them and the PyTorch reference.

On the CPU the ops run the host version of plugins/host (the kernels' logic in fp32) in the kernels' output layout
(int32 lengths and indices, -1 padded to min(n, capacity), zero K/V beyond a head's length): it must keep the
reference's entries. The reference runs in place of the ops only when the caller allows it ("auto", with one warning
per reason) or asks for it ("reference"); otherwise a missing library or a policy without a kernel flow raises.
The ops' CUDA registration runs in the GPU tests below."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

from criticalkv import KVPolicy
from criticalkv.node import node_capacity
from criticalkv.selection import select_layer
from criticalkv.selection.layer import gather_kv
from criticalkv.selection.op import (
    KernelsUnavailable,
    load_torch_ops,
    native_reason,
    select_layer_kv,
    select_model_kv,
    ModelSelection,
)
from criticalkv.selection import op as op_module
from policies import POLICY_CASES, make_policy

BATCH, HEADS, KV_HEADS, N, HEAD_DIM, HIDDEN = 2, 4, 2, 150, 16, 48
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module", autouse=True)
def torch_ops():
    """The library (CI builds it with scripts/build_plugin.sh before the tests)."""
    reason = load_torch_ops()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(autouse=True)
def fresh_warnings():
    """The reference's warning is said once per reason and process: every test starts with none said."""
    op_module._WARNED.clear()


def layer_tensors(seed: int, dtype=torch.float32, device="cpu", n: int = N):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, HEADS, 32, HEAD_DIM, generator=g)
    k = torch.randn(BATCH, KV_HEADS, n, HEAD_DIM, generator=g)
    v = torch.randn(BATCH, KV_HEADS, n, HEAD_DIM, generator=g)
    o = torch.randn(HIDDEN, HEADS * HEAD_DIM, generator=g) / 8
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v, o))


def kernels_run(policy: KVPolicy) -> bool:
    """Whether select_layer's op runs the policy alone (no scores given, one of three layers)."""
    return native_reason(policy, torch.empty(0), num_layers=3) is None


@pytest.mark.parametrize("case", [c for c in POLICY_CASES], ids=[c[0] for c in POLICY_CASES])
def test_the_op_is_the_reference_in_the_kernels_layout(case):
    policy = make_policy(case[1], budget=48, window=8)
    q, k, v, o = layer_tensors(1)
    lengths = torch.tensor([N, 97])
    capacity = node_capacity(policy, N, KV_HEADS, 1, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept_keys, kept_values, kept_lengths, kept_indices = select_layer_kv(
            policy, q, k, v, o, layer_idx=1, num_layers=3, capacity=capacity, prompt_lengths=lengths,
            implementation="auto")
    # the host version where the ops run the policy; the reference, with its reason said, where they do not
    said = [str(w.message) for w in caught if "PyTorch reference" in str(w.message)]
    assert len(said) == (0 if kernels_run(policy) else 1), said
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


@pytest.mark.parametrize("name", ["kvzip", "kvzip-criticalkv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kvzip_pair_runs_on_the_ops_with_its_scores(name, dtype):
    """The external scores as an input, the sinks kept before ranking: the reference's entries (bf16 inputs are
    upcast like the reference's .float())."""
    policy = KVPolicy(name, budget=48, window=8, sink_tokens=3, kvzip_chunk=64)
    q, k, v, o = layer_tensors(11, dtype=dtype)
    scores = torch.rand(BATCH, KV_HEADS, N, generator=torch.Generator().manual_seed(12))
    lengths = torch.tensor([N, 97])
    assert native_reason(policy, q, k, v, o, scores=scores) is None
    out = select_layer_kv(policy, q, k, v, o, prompt_lengths=lengths, scores=scores)
    expected = select_layer(policy, q, k, v, o, prompt_lengths=lengths, scores=scores)
    assert torch.equal(out[2].long(), expected.lengths)
    assert torch.equal(out[3][..., :expected.indices.shape[-1]].long(), expected.indices)
    assert bool((out[3][:, :, :3] == torch.tensor([0, 53])[:, None, None] + torch.arange(3)).all())  # the sinks


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
    assert "all layers" in native_reason(KVPolicy("layer-defensivekv"), q, k, v, o, num_layers=3)
    assert native_reason(KVPolicy("layer-defensivekv"), q, k, v, o) is None  # select_model_kv runs it on the ops
    assert "expected-attention" in native_reason(KVPolicy("expected-attention"), q, k, v, o)
    assert "float64" in native_reason(KVPolicy("snapkv"), q.double(), k, v, o)
    assert "scores" in native_reason(KVPolicy("kvzip"), q, k, v, o)
    assert native_reason(KVPolicy("kvzip"), q, k, v, o, scores=torch.zeros(BATCH, KV_HEADS, N)) is None


def test_the_ops_check_their_arguments_before_any_work():
    """Typed errors that name the argument: a dtype is a TypeError, a shape or a policy a ValueError."""
    policy = KVPolicy("criticalkv", budget=64, window=8).to_json()
    q, k, v, o = layer_tensors(7)
    op = torch.ops.criticalkv.select_layer
    with pytest.raises(ValueError, match="not a multiple"):
        op(q[:, :3], k, v, o[:, :48], None, None, None, policy, 0, 1, N)
    with pytest.raises(TypeError, match="float64"):
        op(q.double(), k.double(), v.double(), o.double(), None, None, None, policy, 0, 1, N)
    with pytest.raises(TypeError, match="one dtype"):
        op(q, k.half(), v, o, None, None, None, policy, 0, 1, N)
    with pytest.raises(ValueError, match="scores: expected shape"):
        op(q, k, v, o, None, None, None, KVPolicy("kvzip").to_json(), 0, 1, N, torch.zeros(BATCH, KV_HEADS, N - 1))
    with pytest.raises(ValueError, match="scores"):  # kvzip without them
        op(q, k, v, o, None, None, None, KVPolicy("kvzip").to_json(), 0, 1, N)
    with pytest.raises(ValueError, match="expected-attention reads RoPE.*the kernels do not take"):
        op(q, k, v, o, None, None, None, KVPolicy("expected-attention").to_json(), 0, 1, N)
    with pytest.raises(ValueError, match="budget: 4 is smaller than the window"):
        op(q, k, v, o, None, None, None, policy.replace('"budget": 64', '"budget": 4'), 0, 1, N)
    with pytest.raises(ValueError, match="prompt_lengths"):
        op(q, k, v, o, torch.tensor([N, N + 1]), None, None, policy, 0, 1, N)
    with pytest.raises(ValueError, match="model-level"):
        op(q, k, v, o, None, None, None, KVPolicy("layer-defensivekv").to_json(), 0, 3, N)


def test_no_silent_fallback_for_a_policy_without_a_kernel_flow():
    policy = KVPolicy("expected-attention", budget=48, window=8)
    q, k, v, o = layer_tensors(8)
    with pytest.raises(KernelsUnavailable, match="expected-attention.*implementation='auto'"):
        select_layer_kv(policy, q, k, v, o)
    with pytest.raises(KernelsUnavailable, match="expected-attention"):
        select_layer_kv(policy, q, k, v, o, implementation="native")
    with pytest.warns(RuntimeWarning, match="PyTorch reference selects in place of the kernels: expected-attention"):
        first = select_layer_kv(policy, q, k, v, o, implementation="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per reason: the second call is quiet
        second = select_layer_kv(policy, q, k, v, o, implementation="auto")
        asked = select_layer_kv(policy, q, k, v, o, implementation="reference")  # asked for: no warning
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(first, second, asked))
    with pytest.raises(ValueError, match="implementation: 'fast'"):
        select_layer_kv(policy, q, k, v, o, implementation="fast")


def test_no_silent_fallback_without_the_library(tmp_path):
    """A process whose library is missing: "native" raises with the build command, "auto" warns and selects."""
    script = """
import warnings, torch
from criticalkv import KVPolicy
from criticalkv.selection.op import KernelsUnavailable, select_layer_kv, load_torch_ops
q, k, v = torch.randn(1, 2, 8, 8), torch.randn(1, 1, 40, 8), torch.randn(1, 1, 40, 8)
o = torch.randn(16, 16)
policy = KVPolicy("snapkv", budget=16, window=8)
print("reason:", load_torch_ops())
try:
    select_layer_kv(policy, q, k, v, o)
except KernelsUnavailable as err:
    print("raised:", err)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = select_layer_kv(policy, q, k, v, o, implementation="auto")
    select_layer_kv(policy, q, k, v, o, implementation="auto")
print("warnings:", len(caught), str(caught[0].message))
print("kept:", out[2].tolist())
from criticalkv.selection.op import top_k
try:
    top_k(torch.zeros(1, 3), 1)
except KernelsUnavailable as err:
    print("top_k:", err)
"""
    env = {**os.environ, "CRITICALKV_TORCH_OPS": str(tmp_path / "libcriticalkv_torch.so"), "PYTHONPATH": ROOT}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(": ", 1) for line in result.stdout.strip().splitlines())
    assert "is not built" in lines["reason"] and "bash scripts/build_plugin.sh" in lines["reason"]
    assert "is not built" in lines["raised"] and "implementation='auto'" in lines["raised"]
    assert lines["warnings"].startswith("1 criticalkv: the PyTorch reference selects in place of the kernels")
    assert lines["kept"] == "[[16]]"
    assert "is not built" in lines["top_k"]
    env["CRITICALKV_SELECTION"] = "bogus"
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "$CRITICALKV_SELECTION: 'bogus' is not one of native, auto, reference" in result.stderr


# ---------------------------------------------------------------------------------------------------- model level

MODEL_CASES = [("layer-defensivekv", 0.0), ("layer-defensivekv", 2.0), ("layer-kvzip", 0.0), ("layer-kvzip", 1.5),
               ("layer-kvzip-criticalkv", 0.0), ("layer-kvzip-criticalkv", 2.0)]


@pytest.mark.parametrize("name,cap", MODEL_CASES, ids=[f"{n}-cap{c}" for n, c in MODEL_CASES])
def test_the_model_level_ops_keep_the_reference_entries(name, cap):
    """layer_ranking per layer, select_model after the last: the host version of the kernels' model-level selection
    keeps criticalkv.selection.select_model's entries (the nested cap included), layer by layer, in its layout."""
    policy = KVPolicy(name, budget=40, window=8, head_cap_ratio=cap, sink_tokens=2)
    q, k, v, o = layer_tensors(9)
    g = torch.Generator().manual_seed(10)
    layers = [(q, k * (1 + i / 4), v, o) for i in range(3)]
    scores = [torch.rand(BATCH, KV_HEADS, N, generator=g) for _ in layers] if "kvzip" in name else None
    lengths = torch.tensor([N, 97])
    capacities = [node_capacity(policy, N, KV_HEADS, i, 3) for i in range(3)]
    native = select_model_kv(policy, layers, capacities, lengths, scores=scores)
    reference = select_model_kv(policy, layers, capacities, lengths, scores=scores, implementation="reference")
    for a, b in zip(native, reference):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    # a budget per request, a layer at a time
    selection = ModelSelection(policy, 3, capacities, lengths, kv_budget=24)
    for i, (lq, lk, lv, lo) in enumerate(layers):
        selection.add(i, lq, lk, lv, lo, None if scores is None else scores[i])
    assert selection.native
    budgeted = selection.finish()
    expected = select_model_kv(policy, layers, capacities, lengths, 24, scores, implementation="reference")
    for a, b in zip(budgeted, expected):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    total = sum(int(x[2][0].sum()) for x in budgeted)  # the full sequence keeps L H_kv budget entries
    assert total == 3 * KV_HEADS * 24


def test_the_model_level_ops_have_fake_kernels():
    policy = KVPolicy("layer-kvzip-criticalkv", budget=40, window=8).to_json()
    q, k, v, o = (t.to("meta") for t in layer_tensors(4))
    scores = torch.empty(BATCH, KV_HEADS, N, device="meta")
    ranking, attention, critical = torch.ops.criticalkv.layer_ranking(q, k, v, o, None, None, policy, 0, 2, scores)
    assert ranking.shape == attention.shape == critical.shape == (BATCH, KV_HEADS, N - 8)
    model = torch.empty(BATCH, 2 * KV_HEADS, N - 8, device="meta")
    out = torch.ops.criticalkv.select_model(model, model, model, [k, k], [v, v], None, None, policy, [60, 200])
    assert [tuple(t.shape) for t in out[0]] == [(BATCH, KV_HEADS, 60, HEAD_DIM), (BATCH, KV_HEADS, N, HEAD_DIM)]
    assert [t.dtype for t in out[2] + out[3]] == [torch.int32] * 4
    with pytest.raises(ValueError, match="not a model-level method"):
        torch.ops.criticalkv.layer_ranking(q, k, v, o, None, None, KVPolicy("snapkv").to_json(), 0, 2, None)


# ---------------------------------------------------------------------------------------------------- on a GPU

@pytest.fixture(scope="module")
def cuda_ops():
    from criticalkv.selection.op import kernels_registered

    if not torch.cuda.is_available() or not kernels_registered("cuda"):
        pytest.skip("no CUDA device, or the library has no CUDA registration")


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in POLICY_CASES if c[0] not in ("expected-attention", "expected-criticalkv")],
                         ids=lambda c: c[0])
def test_the_kernels_through_the_op_keep_the_reference_entries_in_fp32(cuda_ops, case):
    """fp32 on the GPU: the kernels' kept set is the host driver's, which is the reference's (exact scores)."""
    policy = make_policy(case[1], budget=48, window=8)
    q, k, v, o = layer_tensors(7, device="cuda")
    lengths = torch.tensor([N, 97], device="cuda")
    scores = (torch.rand(BATCH, KV_HEADS, N, generator=torch.Generator().manual_seed(3)).cuda()
              if policy.method.base.external_scores else None)
    gpu = select_layer_kv(policy, q, k, v, o, layer_idx=1, num_layers=3, prompt_lengths=lengths, scores=scores)
    cpu = select_layer_kv(policy, *(t.cpu() for t in (q, k, v, o)), layer_idx=1, num_layers=3,
                          prompt_lengths=lengths.cpu(), scores=None if scores is None else scores.cpu())
    assert torch.equal(gpu[2].cpu(), cpu[2]) and torch.equal(gpu[3].cpu(), cpu[3])
    assert torch.equal(gpu[0].cpu(), cpu[0]) and torch.equal(gpu[1].cpu(), cpu[1])


@pytest.mark.gpu
@pytest.mark.parametrize("name,cap", MODEL_CASES, ids=[f"{n}-cap{c}" for n, c in MODEL_CASES])
def test_the_model_level_kernels_keep_the_host_entries_in_fp32(cuda_ops, name, cap):
    policy = KVPolicy(name, budget=40, window=8, head_cap_ratio=cap, sink_tokens=2)
    q, k, v, o = layer_tensors(9)
    layers = [(q, k * (1 + i / 4), v, o) for i in range(3)]
    g = torch.Generator().manual_seed(10)
    scores = [torch.rand(BATCH, KV_HEADS, N, generator=g) for _ in layers] if "kvzip" in name else None
    lengths = torch.tensor([N, 97])
    cpu = select_model_kv(policy, layers, None, lengths, scores=scores)
    gpu = select_model_kv(policy, [tuple(t.cuda() for t in layer) for layer in layers], None, lengths.cuda(),
                          scores=None if scores is None else [s.cuda() for s in scores])
    for a, b in zip(gpu, cpu):
        assert all(torch.equal(x.cpu(), y) for x, y in zip(a, b))


@pytest.mark.gpu
def test_the_op_is_captured_in_a_cuda_graph_and_reads_the_budget_on_the_device(cuda_ops):
    policy = KVPolicy("pyramid-criticalkv", budget=64, window=8)
    q, k, v, o = layer_tensors(8, dtype=torch.float16, device="cuda", n=300)
    budget = torch.tensor([64], dtype=torch.int32, device="cuda")
    capacity = node_capacity(policy, 300, KV_HEADS, 0, 2)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture (allocator)
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
