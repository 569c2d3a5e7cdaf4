import pytest
import torch

from criticalkv import KVPolicy, select_layer
from helpers import random_layer

P = KVPolicy("criticalkv", budget=24, window=8)


def call(**overrides):
    q, k, v, o = random_layer(n=64, window=8)
    args = dict(policy=P, queries=q, keys=k, values=v, o_proj_weight=o)
    args.update(overrides)
    return select_layer(**args)


def nan_at(t):
    t = t.clone()
    t.view(-1)[3] = float("nan")
    return t


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda q, k, v, o: dict(values=v[:, :, :-1]), "values: shape"),
        (lambda q, k, v, o: dict(queries=q[:, :, :, :-1]), "queries: shape"),
        (lambda q, k, v, o: dict(queries=q[:, :7]), "not a multiple"),
        (lambda q, k, v, o: dict(o_proj_weight=o[:, :-1]), "o_proj_weight: shape"),
        (lambda q, k, v, o: dict(queries=q[:, :, :5]), "window queries"),
        (lambda q, k, v, o: dict(keys=k[:, :, :0], values=v[:, :, :0]), "empty"),
        (lambda q, k, v, o: dict(queries=q[0]), "queries: expected 4 dimensions"),
        (lambda q, k, v, o: dict(keys=k.long(), values=v.long()), "floating-point"),
        (lambda q, k, v, o: dict(queries=nan_at(q)), "queries: contains NaN or Inf"),
        (lambda q, k, v, o: dict(keys=nan_at(k)), "keys: contains NaN or Inf"),
        (lambda q, k, v, o: dict(values=v.index_fill(2, torch.tensor([5]), float("inf"))), "values: contains NaN or Inf"),
        (lambda q, k, v, o: dict(o_proj_weight=nan_at(o)), "o_proj_weight: contains NaN or Inf"),
        (lambda q, k, v, o: dict(layer_idx=4, num_layers=4), "layer_idx"),
        (lambda q, k, v, o: dict(prompt_lengths=torch.tensor([0])), "prompt_lengths"),
        (lambda q, k, v, o: dict(prompt_lengths=torch.tensor([65])), "prompt_lengths"),
        (lambda q, k, v, o: dict(prompt_lengths=torch.tensor([60, 60])), "prompt_lengths"),
        (lambda q, k, v, o: dict(policy="criticalkv"), "policy: expected a KVPolicy"),
    ],
)
def test_bad_inputs_raise_clear_errors(make, message):
    q, k, v, o = random_layer(n=64, window=8)
    with pytest.raises(ValueError, match=message):
        call(**make(q, k, v, o))


def test_short_prompt_is_kept_not_rejected():
    q, k, v, o = random_layer(n=5, window=5)  # shorter than the window: nothing to evict
    sel = select_layer(P, q, k, v, o)
    assert sel.lengths.tolist() == [[5, 5, 5]]
