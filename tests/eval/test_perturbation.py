"""The perturbation analysis on a tiny random Llama: zero for the full cache, equal to a direct
computation with the model's own eager attention and per-head masks."""

import numpy as np
import pytest
import torch

from criticalkv import KVPolicy
from criticalkv.eval import perturbation as pert
from criticalkv.eval.engine import ScoreBank, decode, select_all_layers, shared_prefill
from criticalkv.eval.summary import perturbation_summary
from criticalkv.eval.specs import PolicyRun

N = 120


@pytest.fixture(scope="module")
def setup(model):
    ids = torch.randint(2, model.config.vocab_size, (1, N), generator=torch.Generator().manual_seed(21))
    prefill = shared_prefill(model, ids, [8])
    bank = ScoreBank(prefill)
    recorder = pert.FirstStepRecorder(model, attention_inputs=True)
    full = decode(model, prefill, select_all_layers(KVPolicy("full"), bank), 1, first_step=recorder, force_first_step=True)
    return ids, prefill, bank, pert.full_reference(prefill, recorder, full.cache)


def run_policy(model, prefill, bank, policy):
    selections = select_all_layers(policy, bank)
    recorder = pert.FirstStepRecorder(model)
    decode(model, prefill, selections, 1, first_step=recorder, force_first_step=True)
    return selections, recorder


def test_full_cache_has_zero_perturbation(model, setup):
    ids, prefill, bank, ref = setup
    selections, recorder = run_policy(model, prefill, bank, KVPolicy("full"))
    assert np.all(pert.head_perturbation(ref, selections, N) == 0)
    layers = pert.layer_perturbation(ref, recorder)
    assert layers["final_l1"] == 0 and all(x == 0 for x in layers["layer_l1"])
    masks = [pert.keep_with_token(s, N) for s in selections]
    assert np.allclose(pert.attention_mass(ref, masks), 1.0)


def masked_forward(model, seq, layer_masks):
    """Eager full forward over ``seq`` where layer l's last query row sees only ``layer_masks[l]``
    ([1, H_kv, T] bool, None = causal); returns (o_proj input at the last position per layer, final norm)."""
    total = seq.shape[1]
    heads = model.config.num_attention_heads
    group = heads // model.config.num_key_value_heads
    causal = torch.full((1, heads, total, total), float("-inf")).triu(1)
    masks = []
    for keep in layer_masks:
        m = causal.clone()
        if keep is not None:
            m[:, :, -1, :] = torch.where(keep[0].repeat_interleave(group, dim=0), 0.0, float("-inf"))
        masks.append(m)
    captured, handles = {}, []
    for i, layer in enumerate(model.model.layers):
        def pre(module, args, kwargs, i=i):
            kwargs["attention_mask"] = masks[i]
            return args, kwargs

        def o_in(module, args, i=i):
            captured[i] = args[0][0, -1].detach().clone()

        handles.append(layer.self_attn.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(o_in))
    handles.append(model.model.norm.register_forward_hook(lambda m, a, out: captured.__setitem__("final", out[0, -1].clone())))
    previous = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            model(seq, attention_mask=causal)
    finally:
        model.config._attn_implementation = previous
        for h in handles:
            h.remove()
    return captured


def per_head_projection(model, layer, x):
    """x [H * d_h] (o_proj input) -> [H, d]: each head's contribution x_h W_O^h."""
    w = model.model.layers[layer].self_attn.o_proj.weight
    heads = model.config.num_attention_heads
    d_h = x.shape[0] // heads
    with torch.no_grad():
        return torch.stack([w[:, h * d_h : (h + 1) * d_h] @ x[h * d_h : (h + 1) * d_h] for h in range(heads)])


@pytest.mark.parametrize("name", ["snapkv", "criticalkv", "ada-criticalkv", "streamingllm"])
def test_head_and_layer_perturbation_equal_a_direct_computation(model, setup, name):
    ids, prefill, bank, ref = setup
    policy = KVPolicy(name, budget=24, window=8)
    selections, recorder = run_policy(model, prefill, bank, policy)
    heads = pert.head_perturbation(ref, selections, N)
    first = int(prefill.logits.argmax())
    seq = torch.cat([ids, torch.tensor([[first]])], dim=1)
    num_layers = len(model.model.layers)
    full = masked_forward(model, seq, [None] * num_layers)
    keeps = [pert.keep_with_token(s, N) for s in selections]
    for layer in range(num_layers):  # no cascade: only this layer sees the kept entries
        masked = masked_forward(model, seq, [keeps[i] if i == layer else None for i in range(num_layers)])
        want = (per_head_projection(model, layer, masked[layer]) - per_head_projection(model, layer, full[layer])).abs().sum(-1)
        np.testing.assert_allclose(heads[layer], want.numpy(), rtol=2e-4, atol=2e-6)
    assert heads.min() >= 0 and heads.max() > 0
    cascade = masked_forward(model, seq, keeps)  # every layer compressed: the last hidden state
    want_final = float((cascade["final"] - full["final"]).abs().sum())
    assert pert.layer_perturbation(ref, recorder)["final_l1"] == pytest.approx(want_final, rel=1e-3, abs=1e-5)


def test_stage1_mass_is_the_kept_mass_when_alpha_is_one(model, setup):
    ids, prefill, bank, ref = setup
    policy = KVPolicy("criticalkv", budget=40, window=8, alpha=1.0)
    selections = select_all_layers(policy, bank)
    kept = pert.attention_mass(ref, [pert.keep_with_token(s, N) for s in selections])
    sigma = pert.attention_mass(ref, pert.stage1_masks(policy, bank, selections))
    np.testing.assert_allclose(sigma, kept)
    zero = KVPolicy("criticalkv", budget=40, window=8, alpha=0.0)
    masks = pert.stage1_masks(zero, bank, select_all_layers(zero, bank))
    assert all(int(m.sum()) == m.shape[1] * 9 for m in masks)  # window (8) + the token, per KV head
    assert np.all(pert.attention_mass(ref, masks) <= kept + 1e-6)


def test_summary_counts_the_heads_a_variant_lowers():
    base = PolicyRun("snapkv", 64, KVPolicy("snapkv", budget=64))
    variant = PolicyRun("criticalkv", 64, KVPolicy("criticalkv", budget=64))
    b = np.ones((2, 3))
    v = np.array([[0.5, 2.0, 0.5], [0.5, 0.5, 0.5]])  # lower in 5 of 6 heads
    def result(heads, final):
        return {"head_l1": heads, "kept_mass": heads, "layer_l1": [final, final], "layer_rel": [0.1, 0.1],
                "final_l1": final, "final_rel": 0.1, **({"sigma": np.full((2, 3), 0.7)} if heads is v else {})}
    records = [{"length": 10, "results": {base.key: result(b, 2.0), variant.key: result(v, 1.0)}}] * 3
    summary = perturbation_summary(records, [base, variant])
    (pair,) = summary["pairs"]
    assert pair["frac_heads_lower"] == pytest.approx(5 / 6)
    assert pair["final_lower"] == 1.0 and pair["final_l1_ratio"] == 0.5
    assert pair["sigma_above_half"] == 1.0 and pair["frac_lower_where_sigma_above_half"] == pytest.approx(5 / 6)
    assert list(pair["per_layer_frac_lower"]) == pytest.approx([2 / 3, 1.0])
