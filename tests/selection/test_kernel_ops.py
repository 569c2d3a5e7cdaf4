"""The selection's primitives as ops of their own (torch.ops.criticalkv.top_k, value_norms, window_scores), each
against what torch computes (torch.topk, a torch matmul, a softmax), with its fake (meta) kernel and torch's opcheck;
on the CPU (the host version) here, on CUDA (the kernels) in the GPU tests."""

from __future__ import annotations

import pytest
import torch

from criticalkv.methods.topk import topk_mask
from criticalkv.selection.op import kernels_registered, load_torch_ops, top_k, value_norms, window_scores
from criticalkv.selection.scores import value_projection_norms, window_attention

#: torch's opcheck on static shapes (the Meta kernels are written with concrete sizes, as select_layer's)
CHECKS = ("test_schema", "test_faketensor", "test_autograd_registration")


@pytest.fixture(scope="module", autouse=True)
def torch_ops():
    reason = load_torch_ops()
    if reason is not None:
        pytest.skip(reason)


def devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def on(device: str):
    if device == "cuda" and not (torch.cuda.is_available() and kernels_registered("cuda")):
        pytest.skip("no CUDA device, or the library has no CUDA registration")
    return torch.device(device)


# ---------------------------------------------------------------------------------------------------- top_k

@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("rows,length", [(1, 1), (5, 300), (3, 5000), (2, 70000)])
def test_top_k_is_torch_topk_on_distinct_scores(device, rows, length):
    dev = on(device)
    g = torch.Generator().manual_seed(rows * length)
    scores = torch.randn(rows, length, generator=g)
    k = torch.randint(0, length + 1, (rows,), generator=g)
    mask = top_k(scores.to(dev), k.to(dev)).cpu()
    for r in range(rows):
        want = torch.zeros(length, dtype=torch.bool)
        want[torch.topk(scores[r], int(k[r])).indices] = True
        assert torch.equal(mask[r], want), r


@pytest.mark.parametrize("device", devices())
def test_top_k_ties_nan_zeros_and_eligibility_follow_the_operator_rule(device):
    """Ties to the lower index, NaN above +inf, -0 equal to +0, ineligible entries never chosen (topk_mask)."""
    dev = on(device)
    g = torch.Generator().manual_seed(3)
    scores = (torch.randint(0, 4, (4, 3000), generator=g).float() / 4)
    scores[0, 7], scores[0, 9], scores[1, 100] = float("nan"), float("inf"), -0.0
    scores[1, 50] = 0.0
    eligible = torch.rand(4, 3000, generator=g) > 0.2
    for k in (0, 1, 17, 1500, 2999, 5000):
        got = top_k(scores.to(dev), k, eligible.to(dev)).cpu()
        assert torch.equal(got, topk_mask(scores, min(k, 3000), eligible) if k <= 3000 else eligible), k


def test_top_k_fake_kernel_and_opcheck():
    scores = torch.randn(3, 40)
    k = torch.tensor([1, 5, 40])
    out = torch.ops.criticalkv.top_k(scores.to("meta"), k.to("meta"), None)
    assert out.shape == (3, 40) and out.dtype == torch.bool
    torch.library.opcheck(torch.ops.criticalkv.top_k.default, (scores, k, torch.rand(3, 40) > 0.5), test_utils=CHECKS)
    with pytest.raises(TypeError, match="scores: expected float32, got float16"):
        torch.ops.criticalkv.top_k(scores.half(), k, None)
    with pytest.raises(ValueError, match="k: expected one value or shape"):
        torch.ops.criticalkv.top_k(scores, torch.tensor([1, 2]), None)


# ---------------------------------------------------------------------------------------------------- value_norms

def torch_norms(values, o_proj, heads, kind):
    """||V W_O^h|| by a plain matmul per head."""
    batch, kv_heads, n, d = values.shape
    group = heads // kv_heads
    out = torch.empty(batch, heads, n)
    for h in range(heads):
        projected = values[:, h // group].double() @ o_proj[:, h * d:(h + 1) * d].double().t()  # [B, n, hidden]
        out[:, h] = (projected.abs().sum(-1) if kind == "l1" else projected.norm(dim=-1)).float()
    return out


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("kind", ["l1", "l2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_value_norms_are_a_torch_matmul(device, kind, dtype):
    dev = on(device)
    g = torch.Generator().manual_seed(4)
    values = torch.randn(2, 2, 70, 32, generator=g).to(dtype)
    o_proj = (torch.randn(96, 4 * 32, generator=g) / 8).to(dtype)
    got = value_norms(values.to(dev), o_proj.to(dev), 4, kind).cpu()
    want = torch_norms(values.float(), o_proj.float(), 4, kind)
    # fp32 sums of d_h and hidden products: relative error of a few ulps per term (the flash-attention rule against
    # the fp64 product: at most twice PyTorch's own fp32 result's distance, plus slack for the l2 Gram form)
    own = value_projection_norms(values.float(), o_proj.float(), 4, kind)
    bound = 2 * (own - want).abs().max() + 1e-5 * want.abs().max()
    assert (got - want).abs().max() <= bound


def test_value_norms_fake_kernel_and_opcheck():
    values, o_proj = torch.randn(1, 2, 10, 16), torch.randn(24, 64)
    out = torch.ops.criticalkv.value_norms(values.to("meta"), o_proj.to("meta"), 4, "l1")
    assert out.shape == (1, 4, 10) and out.dtype == torch.float32
    torch.library.opcheck(torch.ops.criticalkv.value_norms.default, (values, o_proj, 4, "l2"), test_utils=CHECKS)
    with pytest.raises(ValueError, match="kind: 'l3'"):
        torch.ops.criticalkv.value_norms(values, o_proj, 4, "l3")
    with pytest.raises(ValueError, match="o_proj: shape"):
        torch.ops.criticalkv.value_norms(values, o_proj[:, :48], 4, "l1")


# ---------------------------------------------------------------------------------------------------- window_scores

@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_window_scores_are_the_softmax_window_mean(device, dtype):
    dev = on(device)
    g = torch.Generator().manual_seed(5)
    batch, heads, kv_heads, n, d, w = 2, 4, 2, 200, 16, 12
    queries = torch.randn(batch, heads, w + 3, d, generator=g).to(dtype)
    keys = torch.randn(batch, kv_heads, n, d, generator=g).to(dtype)
    lengths = torch.tensor([n, 150])
    got = window_scores(queries.to(dev), keys.to(dev), w, lengths.to(dev)).cpu()
    valid_start = n - lengths
    expanded = keys.float().repeat_interleave(heads // kv_heads, dim=1)
    probs = window_attention(queries[:, :, -w:].float(), expanded, valid_start)  # [B, H, w, n] fp32 softmax
    want = probs.mean(dim=2)[..., :n - w]
    assert got.shape == want.shape
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-6)
    # a sequence of at most the window has no older token: zeros
    short = window_scores(queries.to(dev), keys.to(dev), w, torch.tensor([n, 5]).to(dev)).cpu()
    assert not short[1].any()


def test_window_scores_fake_kernel_and_opcheck():
    queries, keys = torch.randn(1, 2, 8, 16), torch.randn(1, 1, 40, 16)
    out = torch.ops.criticalkv.window_scores(queries.to("meta"), keys.to("meta"), None, 8)
    assert out.shape == (1, 2, 32) and out.dtype == torch.float32
    torch.library.opcheck(torch.ops.criticalkv.window_scores.default, (queries, keys, torch.tensor([30]), 8),
                          test_utils=CHECKS)
    with pytest.raises(ValueError, match="window queries given"):
        torch.ops.criticalkv.window_scores(queries[:, :, :4], keys, None, 8)


def test_the_ops_benchmark_times_each_op_against_torch(tmp_path):
    """python -m benchmarks.ops: every op and its torch counterpart timed in one run, the outputs checked alike."""
    import json

    from benchmarks import ops

    out = tmp_path / "ops.json"
    assert ops.main(["--repeats", "1", "--output", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [row["op"].split()[0] for row in results["rows"]] == ["top_k", "value_norms", "window_scores", "select_model"]
    assert all(row["ops_s"] > 0 and row["torch_s"] > 0 for row in results["rows"])
    assert "DIFFERENT" not in " ".join(row["agree"] for row in results["rows"])
    assert results["machine"]["load_average_end"] and results["device"] == "cpu"
