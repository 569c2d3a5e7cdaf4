"""KeyDiff's score against kvpress's KeyDiffPress, its padding, and its independence of the queries (the loop oracle
and every backend's parity run it through tests/policies.py)."""

import json
import subprocess

import numpy as np
import pytest
import torch

from criticalkv import KVPolicy, select_layer
from criticalkv.bench.peers import peer_python, peer_ready, peers_dir
from criticalkv.methods.keydiff import keydiff_scores
from helpers import random_layer

KVPRESS_SCORE = """
import json, sys
import numpy as np, torch
from kvpress import KeyDiffPress
keys = torch.from_numpy(np.load(sys.argv[1]))
print(json.dumps(KeyDiffPress(compression_ratio=0.5).score(None, None, keys, None, None, {}).tolist()))
"""


def test_the_score_is_one_plus_kvpress_keydiffpress_score(tmp_path):
    """kvpress 0.5.5's own ``KeyDiffPress.score`` (-cos(k_i, mean unit key)) on the same keys, run in its environment:
    criticalkv's score is 1 + it, so both rank every head's keys alike."""
    root = peers_dir()
    if not peer_ready(root, "kvpress"):
        pytest.skip(f"no kvpress environment in {root} (criticalkv bench setup-peers --peers kvpress; "
                    "CRITICALKV_PEERS_DIR names the folder)")
    keys = torch.randn(2, 3, 97, 16, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 3, 16)
    path = tmp_path / "keys.npy"
    np.save(path, keys.numpy())
    out = subprocess.run([str(peer_python(root, "kvpress")), "-c", KVPRESS_SCORE, str(path)], check=True,
                         capture_output=True, text=True, timeout=600).stdout
    theirs = torch.tensor(json.loads(out.strip().splitlines()[-1]))
    ours = keydiff_scores(keys, None)
    torch.testing.assert_close(ours, 1.0 + theirs, rtol=0, atol=2e-6)
    assert torch.equal(ours.argsort(dim=-1, stable=True), theirs.argsort(dim=-1, stable=True))


def test_left_padding_neither_scores_nor_moves_the_anchor():
    keys = torch.randn(1, 2, 40, 8, generator=torch.Generator().manual_seed(1))
    padded = torch.cat([torch.randn(1, 2, 7, 8) * 50, keys], dim=2)  # loud garbage in the padding
    alone = keydiff_scores(keys, None)
    both = keydiff_scores(padded, torch.tensor([7]))
    assert (both[..., :7] == 0).all()
    torch.testing.assert_close(both[..., 7:], alone, rtol=0, atol=1e-6)
    assert ((alone >= 0) & (alone <= 2)).all()


def test_the_kept_entries_do_not_depend_on_the_queries():
    """KeyDiff reads no query: the window's queries of two different questions keep the same older entries (every
    scored method that ranks by window attention would differ here)."""
    q, k, v, o = random_layer(heads=6, kv_heads=2, n=120, head_dim=8, hidden=24, window=8, seed=4)
    other = torch.randn_like(q)
    policy = KVPolicy(name="keydiff", budget=40, window=8)
    a, b = select_layer(policy, q, k, v, o, 0, 1), select_layer(policy, other, k, v, o, 0, 1)
    assert torch.equal(a.indices, b.indices)
    snap = KVPolicy(name="snapkv", budget=40, window=8)
    assert not torch.equal(select_layer(snap, q, k, v, o, 0, 1).indices, select_layer(snap, other, k, v, o, 0, 1).indices)
