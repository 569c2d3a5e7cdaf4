"""``layer-defensivekv`` on ONNX Runtime (per-layer CriticalKVScore + one CriticalKVSelectModel after the last layer)
against the PyTorch reference (``select_model``), on a tiny random Llama: kept indices, lengths and tokens."""

import numpy as np
import onnx
import pytest
import torch

from criticalkv import KVPolicy
from criticalkv.export.model_select import MODEL_OP, SCORE_OP, tensorrt_refusal
from criticalkv.hf import generate
from criticalkv.runtime import Engine
from criticalkv.methods.budget import head_cap
from export.tiny_engine import export_tiny_engine
from hf.conftest import tiny_model

BUDGET, WINDOW, NEW = 40, 8, 10
#: stage1_mass 0.1: little of a random model's flat attention passes stage 1, so the model-wide ranking decides most
#: slots and heads end with different lengths (with the default 0.9 every head's r tokens are stage-1 tokens)
KNOBS = dict(budget=BUDGET, window=WINDOW, stage1_mass=0.1)
CAPPED = 1.1  # head_cap(1.1, 40) = 44 entries per head: binds on this model (an uncapped head keeps 45)


def prompt(n, seed):
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed))


def kept(selection, row, head):
    return [i for i in selection.indices[row, head].tolist() if i >= 0]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    model = tiny_model("llama")
    root = tmp_path_factory.mktemp("model_select")
    built = {}
    for ratio in (0.0, CAPPED):
        policy = KVPolicy("layer-defensivekv", head_cap_ratio=ratio, **KNOBS)
        folder = export_tiny_engine(model, policy, root / f"cap{ratio}")  # validate_export runs inside
        built[ratio] = (policy, folder, Engine.load(folder))
    yield model, built
    for _, _, engine in built.values():
        engine.close()


def assert_same_as_pytorch(model, engine, policy, seqs, kv_budget=None):
    n = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), n, dtype=torch.int64)
    mask = torch.zeros(len(seqs), n, dtype=torch.int64)
    for row, seq in enumerate(seqs):
        ids[row, n - len(seq):], mask[row, n - len(seq):] = seq, 1
    reference = policy.with_budget(kv_budget)
    ref = generate(model, ids, reference, max_new_tokens=NEW, attention_mask=mask)
    got = engine.generate([s.tolist() for s in seqs], max_new_tokens=NEW, stop_token_ids=[], kv_budget=kv_budget)
    assert got.tokens == ref.tokens
    for layer, selection in enumerate(ref.prefill.selections):
        assert got.kept_lengths[layer].tolist() == selection.lengths.tolist(), f"layer {layer}"
        for row in range(len(seqs)):
            for head in range(selection.lengths.shape[1]):
                assert got.kept(layer, row, head) == kept(selection, row, head), f"layer {layer} row {row} head {head}"
    assert got.kv_bytes_kept == ref.kv_bytes_kept
    return ref


@pytest.mark.parametrize("ratio", [0.0, CAPPED])
def test_onnxruntime_equals_pytorch_and_the_budget_is_shared_across_layers(engines, ratio):
    model, built = engines
    policy, _, engine = built[ratio]
    ref = assert_same_as_pytorch(model, engine, policy, [prompt(150, seed=3)])
    lengths = torch.stack([s.lengths[0] for s in ref.prefill.selections])  # [L, H_kv]
    assert int(lengths.sum()) == lengths.numel() * BUDGET  # the kept total is L * H_kv * budget
    assert len(set(lengths.flatten().tolist())) > 2  # heads of different layers hold different shares
    if ratio:
        cap = head_cap(ratio, BUDGET)
        assert int(lengths.max()) == cap  # the cap binds: without it a head keeps more
        uncapped = generate(model, prompt(150, seed=3)[None], built[0.0][0], max_new_tokens=1)
        assert max(int(s.lengths.max()) for s in uncapped.prefill.selections) > cap


def test_left_padded_batch_and_a_request_budget_equal_pytorch(engines):
    model, built = engines
    for ratio in (0.0, CAPPED):
        policy, _, engine = built[ratio]
        seqs = [prompt(120, seed=6), prompt(75, seed=7), prompt(33, seed=8)]  # the last one is kept whole
        assert_same_as_pytorch(model, engine, policy, seqs)
        assert_same_as_pytorch(model, engine, policy, [prompt(130, seed=9)], kv_budget=24)


def test_the_graph_has_one_model_level_node_after_the_last_layer_and_a_tensorrt_flavour_of_plugin_nodes(engines):
    from criticalkv.export.tensorrt_rules import check_tensorrt_model

    model, built = engines
    policy, folder, engine = built[CAPPED]
    graph = onnx.load(str(folder / "prefill.onnx"), load_external_data=False)
    ours = [n.op_type for n in graph.graph.node if n.domain == "ai.criticalkv"]
    assert ours == [SCORE_OP] * 3 + [MODEL_OP]
    assert sorted(f.name for f in graph.functions) == sorted([SCORE_OP, MODEL_OP])
    # the TensorRT flavours: the same nodes without bodies (the CriticalKVScore / CriticalKVSelectModel plugins)
    for name in ("prefill_tensorrt.onnx", "select_tensorrt.onnx"):
        flavour = onnx.load(str(folder / name), load_external_data=False)
        nodes = [n for n in flavour.graph.node if n.domain == "ai.criticalkv"]
        assert [n.op_type for n in nodes] == [SCORE_OP] * 3 + [MODEL_OP], name
        assert list(flavour.functions) == [] and check_tensorrt_model(flavour) == [], name
        assert [a.ints for a in nodes[-1].attribute if a.name == "capacities"] == [[head_cap(CAPPED, BUDGET)] * 3]
    manifest = engine.manifest
    report = manifest["onnx"]["validation"]["prefill_tensorrt"]
    assert "refused" not in report and report["score_nodes"] == 3 and report["functions"] == []
    assert "tensorrt_rules" in report
    assert manifest["onnx"]["files"]["prefill_tensorrt"]
    # the per-layer static capacity is the cap; the decode buffers add max_new_tokens
    cap = head_cap(CAPPED, BUDGET)
    assert manifest["shapes"]["prefill_capacity"] == [cap] * 3
    assert built[0.0][2].manifest["shapes"]["prefill_capacity"] == [256] * 3  # uncapped: max_input_len
    assert tensorrt_refusal(policy, 3) is None


def test_head_cap_ratio_is_a_policy_knob_with_its_rule():
    assert "head_cap_ratio" in KVPolicy("layer-defensivekv").method.knobs
    assert "head_cap_ratio" not in KVPolicy("defensivekv").method.knobs
    with pytest.raises(ValueError, match="head_cap_ratio: must be 0 \\(off\\) or >= 1"):
        KVPolicy("layer-defensivekv", head_cap_ratio=0.5)
    assert [head_cap(r, 40) for r in (0.0, 1.0, 1.1, 2.5)] == [0, 40, 44, 100]


def test_profiled_selection_time_counts_the_score_and_model_level_nodes(engines):
    _, built = engines
    _, folder, _ = built[0.0]
    engine = Engine.load(folder, profile=True)
    try:
        got = engine.generate([prompt(150, seed=3).tolist()], max_new_tokens=2, stop_token_ids=[])
    finally:
        engine.close()
    assert 0 < got.selection_s < got.prefill_s


@pytest.mark.parametrize("ratio", [0.0, 1.25])
@pytest.mark.parametrize("kv_budget", [16, 12])
def test_the_model_level_node_breaks_ties_like_pytorch(ratio, kv_budget):
    """Rankings with many equal values (integers 0..3): the node keeps what ``model_level_mask`` keeps, ties to the
    lower layer, head, then position; a left-padded batch with one sequence kept whole; a request budget below the
    built one."""
    import onnxruntime as ort

    from criticalkv.export.model_select import model_selection_model
    from criticalkv.selection import mask_to_indices
    from criticalkv.selection.layer import model_level_mask

    layers, heads, n, d, window = 3, 2, 50, 4, 4
    policy = KVPolicy("layer-defensivekv", budget=16, window=window, head_cap_ratio=ratio)
    capacity = max(policy.budget, head_cap(ratio, policy.budget)) if ratio else n
    model = model_selection_model(policy, layers, heads, d, [capacity] * layers)
    gen = torch.Generator().manual_seed(int(ratio * 100) + kv_budget)
    lengths = torch.tensor([50, 37, 10])
    m = n - window
    ranking = torch.randint(0, 4, (3, layers * heads, m), generator=gen).float()
    keys = torch.randn(layers, 3, heads, n, d, generator=gen)
    values = torch.randn(layers, 3, heads, n, d, generator=gen)
    feeds = {f"ranking.{i}": ranking[:, i * heads:(i + 1) * heads].numpy() for i in range(layers)}
    feeds.update({f"keys.{i}": keys[i].numpy() for i in range(layers)})
    feeds.update({f"values.{i}": values[i].numpy() for i in range(layers)})
    feeds.update(prompt_lengths=lengths.int().numpy(), kv_budget=np.array([kv_budget], np.int32))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))

    request = policy.with_budget(kv_budget)
    valid = torch.arange(n)[None] >= (n - lengths)[:, None]
    eligible = valid[:, None, :m].expand(3, layers * heads, m)
    r = torch.clamp(eligible[:, 0].sum(-1), max=request.selectable_budget)
    older = model_level_mask(request, ranking, eligible, r)
    chosen = torch.cat([older, torch.ones(3, layers * heads, window, dtype=torch.bool)], dim=-1)
    keep = torch.where((lengths > kv_budget)[:, None, None], chosen, valid[:, None].expand(3, layers * heads, n))
    for i in range(layers):
        indices, kept_lengths = mask_to_indices(keep[:, i * heads:(i + 1) * heads])
        assert got[f"kept_lengths.{i}"].tolist() == kept_lengths.tolist(), f"layer {i}"
        width = got[f"kept_indices.{i}"].shape[2]
        padded = torch.full((3, heads, width), -1, dtype=torch.int64)
        padded[..., :indices.shape[2]] = indices
        assert got[f"kept_indices.{i}"].tolist() == padded.tolist(), f"layer {i}"
        rows = padded.clamp_min(0)[..., None].expand(-1, -1, -1, d)
        want_keys = torch.gather(keys[i], 2, rows).masked_fill((padded < 0)[..., None], 0)
        assert np.array_equal(got[f"kept_keys.{i}"], want_keys.numpy())
    if ratio:
        assert max(int(got[f"kept_lengths.{i}"].max()) for i in range(layers)) <= head_cap(ratio, kv_budget)
    # ties decided something: the keep set differs from the one of a ranking with the ties broken the other way
    flipped = model_level_mask(request, ranking.flip(-1).flip(-2), eligible.flip(-1).flip(-2), r).flip(-1).flip(-2)
    assert not torch.equal(flipped, older)


def test_the_model_level_node_nests_its_capped_allocation_across_request_budgets():
    """Issue 39: on ONNX Runtime as in PyTorch (``nested_capped_mask``), every request budget keeps a superset of what
    a smaller one kept, on rankings where two heads of three outrank the third (where the greedy walk that skips a
    full head kept fewer of the third head's entries at a larger budget)."""
    import onnxruntime as ort

    from criticalkv.export.model_select import model_selection_model
    from criticalkv.selection.layer import model_level_mask

    layers, heads, n, d, window = 3, 1, 40, 4, 4
    policy = KVPolicy("layer-kvzip", budget=16, window=window, ada_floor=0.0, sink_tokens=0, head_cap_ratio=1.25)
    model = model_selection_model(policy, layers, heads, d, [head_cap(1.25, 16)] * layers)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    m = n - window
    steps = torch.arange(m, dtype=torch.float32)
    ranking = torch.stack([0.9 - 0.001 * steps, 0.8 - 0.001 * steps, 0.1 - 0.001 * steps])[None]  # [1, 3, m]
    gen = torch.Generator().manual_seed(0)
    feeds = {f"ranking.{i}": ranking[:, i:i + 1].numpy() for i in range(layers)}
    for i in range(layers):
        feeds[f"keys.{i}"] = torch.randn(1, heads, n, d, generator=gen).numpy()
        feeds[f"values.{i}"] = torch.randn(1, heads, n, d, generator=gen).numpy()
    feeds["prompt_lengths"] = np.array([n], np.int32)
    eligible = torch.ones(1, layers, m, dtype=torch.bool)
    previous = None
    for kv_budget in range(5, 17):
        got = dict(zip([o.name for o in session.get_outputs()],
                       session.run(None, {**feeds, "kv_budget": np.array([kv_budget], np.int32)})))
        kept = [{int(x) for x in got[f"kept_indices.{i}"][0, 0] if 0 <= x < m} for i in range(layers)]
        request = policy.with_budget(kv_budget)
        want = model_level_mask(request, ranking, eligible, torch.tensor([kv_budget - window]))[0]
        assert kept == [set(torch.nonzero(row).flatten().tolist()) for row in want], f"kv_budget {kv_budget}"
        assert max(map(len, kept)) <= head_cap(1.25, kv_budget) - window
        if previous is not None:
            assert all(a <= b for a, b in zip(previous, kept)), f"kv_budget {kv_budget} drops entries"
        previous = kept
