"""Expected Attention (``expected-attention``, ``expected-criticalkv``): its math, its selection, and kvpress's press.

* carrying a post-RoPE window query through the rotation tables equals rotating its pre-RoPE query to every next
  position and averaging (the identity the tables rest on);
* the closed form: for q ~ N(mu, Sigma), E[exp(q.k / sqrt(d))] = exp(mu.k / sqrt(d) + k^T Sigma k / (2 d))
  (Monte Carlo);
* on the same queries, keys and values, the scores equal kvpress's ``ExpectedAttentionPress`` (run in kvpress's
  own virtual environment, ``criticalkv bench setup-peers --peers kvpress``; skipped without it).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from criticalkv import KVPolicy, select_layer
from criticalkv.methods.expected_attention import default_inv_freq, expected_attention, rotation_tables
from helpers import random_layer

ROOT = Path(__file__).resolve().parents[2]
KVPRESS_PYTHON = Path(os.environ.get("CRITICALKV_PEERS_DIR") or ROOT / ".peers") / "kvpress" / "bin" / "python"


def rope(x, positions, inv_freq):
    """transformers' RoPE of x [..., s, d] at ``positions`` [s]: x cos + rotate_half(x) sin."""
    freqs = positions[:, None].double() * torch.as_tensor(inv_freq, dtype=torch.float64)[None, :]
    emb = torch.cat([freqs, freqs], -1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * emb.cos() + rotated * emb.sin()


def test_the_tables_carry_a_window_query_to_the_next_positions():
    d, n, w, future = 16, 90, 8, 40
    inv_freq = default_inv_freq(d)
    pre = torch.randn(3, w, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))  # pre-RoPE queries
    positions = torch.arange(n - w, n)
    post = rope(pre, positions, inv_freq)  # what the model's window queries are
    table = torch.as_tensor(rotation_tables(inv_freq, w, future), dtype=torch.float64)
    rows = torch.arange(w - 1, -1, -1)  # query j sits e = w - j positions before n: table row e - 1
    cos, sin = table[0, rows], table[1, rows]
    carried = post * cos + torch.cat([-post[..., d // 2:], post[..., : d // 2]], -1) * sin
    # kvpress's way: the pre-RoPE query rotated to each of the next positions n .. n + future - 1, averaged
    direct = torch.stack([rope(pre, torch.full((w,), f), inv_freq) for f in range(n, n + future)]).mean(0)
    np.testing.assert_allclose(carried.numpy(), direct.numpy(), rtol=0, atol=1e-6)


def test_the_closed_form_is_the_gaussian_expectation():
    # log E[exp(q.k / sqrt d)] over q ~ N(mu, Sigma) = mu.k / sqrt d + k^T Sigma k / (2 d): the scores' logits
    gen = torch.Generator().manual_seed(2)
    d = 8
    mu = torch.randn(d, generator=gen, dtype=torch.float64) * 0.5
    a = torch.randn(d, d, generator=gen, dtype=torch.float64) * 0.3
    sigma = a @ a.T
    k = torch.randn(5, d, generator=gen, dtype=torch.float64)
    samples = torch.distributions.MultivariateNormal(mu, sigma).sample((400_000,))
    empirical = torch.exp(samples @ k.T / math.sqrt(d)).mean(0).log()
    closed = k @ mu / math.sqrt(d) + ((k @ sigma) * k).sum(-1) / (2 * d)
    np.testing.assert_allclose(empirical.numpy(), closed.numpy(), rtol=0, atol=0.02)


def test_sinks_window_and_budget():
    q, k, v, o = random_layer(batch=2, heads=6, kv_heads=2, n=140, head_dim=16, hidden=48, window=8, seed=3)
    lengths = torch.tensor([140, 100])
    for name in ("expected-attention", "expected-criticalkv"):
        policy = KVPolicy(name, budget=40, window=8, sink_tokens=4)
        sel = select_layer(policy, q, k, v, o, prompt_lengths=lengths)
        assert (sel.lengths == 40).all()
        for b, start in enumerate((0, 40)):  # the second sequence is left-padded by 40
            for h in range(2):
                kept = sel.indices[b, h][sel.indices[b, h] >= 0].tolist()
                assert kept[:4] == list(range(start, start + 4)) and kept[-8:] == list(range(132, 140))
    with pytest.raises(ValueError, match="budget must be at least 12"):
        KVPolicy("expected-attention", budget=11, window=8, sink_tokens=4)
    assert KVPolicy("expected-attention", budget=40, window=8).min_budget == 12


def test_the_scores_follow_the_rotation_given():
    # the model's own RoPE angles (here: another base) change the scores; without them select_layer assumes base 10000
    q, k, v, o = random_layer(batch=1, heads=4, kv_heads=2, n=120, head_dim=16, hidden=32, window=8, seed=4)
    policy = KVPolicy("expected-attention", budget=30, window=8)
    default = select_layer(policy, q, k, v, o)
    same = select_layer(policy, q, k, v, o, rotation=torch.from_numpy(rotation_tables(default_inv_freq(16), 8, 512)))
    other = select_layer(policy, q, k, v, o, rotation=torch.from_numpy(rotation_tables(default_inv_freq(16, 500.0), 8, 512)))
    assert torch.equal(default.indices, same.indices) and not torch.equal(default.indices, other.indices)
    with pytest.raises(ValueError, match=r"rotation: expected shape \[2, >= window 8, 16\]"):
        select_layer(policy, q, k, v, o, rotation=torch.zeros(2, 4, 16))


KVPRESS_SCRIPT = r"""
import json, sys
import numpy as np, torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
from kvpress import ExpectedAttentionPress

data = np.load(sys.argv[1])
cfg = json.loads(sys.argv[2])
config = LlamaConfig(hidden_size=cfg["hidden"], num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"],
                     head_dim=cfg["head_dim"], rope_theta=cfg["theta"], max_position_embeddings=4096)
module = LlamaAttention(config, layer_idx=0)
with torch.no_grad():
    module.q_proj.weight.copy_(torch.from_numpy(data["wq"]))
module.rotary_emb = LlamaRotaryEmbedding(config)
press = ExpectedAttentionPress(n_future_positions=cfg["future"], n_sink=cfg["sink"])
with torch.no_grad():
    scores = press.score(module, torch.from_numpy(data["hidden"]), torch.from_numpy(data["keys"]),
                         torch.from_numpy(data["values"]), None, {})
np.save(sys.argv[3], scores.numpy())
"""


@pytest.mark.skipif(not KVPRESS_PYTHON.exists(), reason="kvpress is not installed (criticalkv bench setup-peers --peers kvpress)")
def test_equals_kvpress_expected_attention_press(tmp_path):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    gen = torch.Generator().manual_seed(5)
    hidden, heads, kv_heads, d, n, sink, future, theta = 48, 6, 2, 16, 70, 4, 64, 10000.0
    h = torch.randn(1, n, hidden, generator=gen)
    wq = torch.randn(heads * d, hidden, generator=gen) / math.sqrt(hidden)
    keys = torch.randn(1, kv_heads, n, d, generator=gen)
    values = torch.randn(1, kv_heads, n, d, generator=gen)
    np.savez(tmp_path / "in.npz", hidden=h.numpy(), wq=wq.numpy(), keys=keys.numpy(), values=values.numpy())
    cfg = dict(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=d, theta=theta, future=future, sink=sink)
    subprocess.run([str(KVPRESS_PYTHON), "-c", KVPRESS_SCRIPT, str(tmp_path / "in.npz"), json.dumps(cfg),
                    str(tmp_path / "out.npy")], check=True, timeout=600)
    theirs = np.load(tmp_path / "out.npy")[0, :, sink:]  # [H_kv, n - sink]; the sinks get kvpress's max score

    # the same statistics here: the queries after the sinks as the "window" (kvpress uses every one of them)
    config = LlamaConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=d,
                         rope_theta=theta)
    inv_freq = LlamaRotaryEmbedding(config).inv_freq.numpy()
    pre = (h @ wq.T).view(1, n, heads, d).transpose(1, 2)[:, :, sink:]  # [1, H, n - sink, d]
    post = rope(pre.double(), torch.arange(sink, n), inv_freq).float()
    w = n - sink
    table = rotation_tables(inv_freq, w, future)
    group = heads // kv_heads
    probs = expected_attention(post, keys.repeat_interleave(group, dim=1), table, None, sink)  # [1, H, n]
    ours = probs.view(1, kv_heads, group, n).mean(2)[0, :, sink:] * values[0, :, sink:].norm(dim=-1)
    np.testing.assert_allclose(ours.numpy(), theirs, rtol=2e-4, atol=1e-7)
