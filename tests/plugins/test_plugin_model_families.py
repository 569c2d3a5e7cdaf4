"""The host C++ selection (plugins/host) on every supported architecture's real layer inputs.

Each random checkpoint of tests/model_families.py (Qwen3 included: its queries and keys are normalised per head before
RoPE, which the selection receives already done) is prefilled on the PyTorch path with a left-padded batch; every layer's
inputs of ``select_layer`` (window queries, keys, values, o_proj) are recorded, and the host version must keep exactly
the entries the PyTorch reference keeps, for every policy of tests/policies.py that has a C++ flow (at budget 40 or 17,
alternately by family: the runtime budgets themselves are covered by test_plugin_host_select.py).
"""

import pytest
import torch

from criticalkv import select_layer
from model_families import FAMILIES, random_checkpoint, random_prompt, recorded_layers
from policies import POLICY_CASES, make_policy
from test_plugin_host_select import assert_same_selection

WINDOW = 8


@pytest.mark.parametrize("fam", FAMILIES, ids=[f.id for f in FAMILIES])
def test_host_selection_equals_the_reference_on_real_layers(host_lib, fam, monkeypatch):
    seed = FAMILIES.index(fam)
    model = random_checkpoint(fam, seed=seed)
    prompts = [random_prompt(n, seed=100 * seed + n + 2) for n in (140, 90)]
    ids = torch.zeros(2, 140, dtype=torch.int64)
    mask = torch.zeros(2, 140, dtype=torch.int64)
    for row, p in enumerate(prompts):
        ids[row, 140 - len(p):], mask[row, 140 - len(p):] = torch.tensor(p), 1
    # the layers' inputs do not depend on the policy: record them once (snapkv selects in every layer)
    layers = recorded_layers(model, ids, mask, make_policy(dict(name="snapkv"), 40, WINDOW), monkeypatch)
    assert len(layers) == model.config.num_hidden_layers
    budget = (40, 17)[seed % 2]
    for case_id, kwargs in POLICY_CASES:
        policy = make_policy(kwargs, budget=budget, window=WINDOW)
        if not policy.method.base.native or policy.method.base.external_scores:  # refused, or needs its scores input
            continue
        for q, k, v, o, layer_idx, num_layers, lengths, _ in layers:
            ref = select_layer(policy, q, k, v, o, layer_idx, num_layers, lengths)
            got = host_lib.select_layer(policy, q, k, v, o, layer_idx, num_layers, prompt_lengths=lengths)
            assert_same_selection(got, ref, (fam.id, case_id, budget, layer_idx))
