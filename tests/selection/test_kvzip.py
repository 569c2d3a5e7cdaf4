"""KVzip (``kvzip``, ``kvzip-criticalkv``): the context-reconstruction score, its selection, and kvpress's press.

* the reconstruction plan is kvpress's (``KVzipPress.prepare``): prompts, chunks, the previous chunk's last tokens;
* the score equals a float64 loop oracle built from the model's own attention probabilities (eager attention of the
  context followed by one chunk's reconstruction input, each row renormalised over kvpress's subsampled keys), on a
  tiny random model, for one chunk and for several;
* ``prefill_and_compress`` selects with exactly those scores; alpha = 1 is kvzip;
* on the same hidden states and keys, the score equals kvpress's ``KVzipPress.score_kvzip`` (run in kvpress's own
  virtual environment, ``criticalkv bench setup-peers --peers kvpress``; skipped without it).
"""

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from criticalkv import KVPolicy, select_layer
from criticalkv.selection import select_model
from criticalkv.hf import prefill_and_compress
from criticalkv.hf.compress import window_queries
from criticalkv.hf.reconstruct import cache_of, reconstruction_scores
from criticalkv.methods.kvzip import ReconstructionPrompt, chunk_scores, reconstruction_chunks
from hf.conftest import tiny_model
from helpers import random_layer

ROOT = Path(__file__).resolve().parents[2]
KVPRESS_PYTHON = Path(os.environ.get("CRITICALKV_PEERS_DIR") or ROOT / ".peers") / "kvpress" / "bin" / "python"
PROMPT = ReconstructionPrompt(first=(5, 6, 7), later=(9, 10), suffix=(11, 12), overlap=3)


def test_the_plan_is_kvpress_prepare():
    ids = list(range(20, 45))  # 25 tokens in chunks of 10
    chunks = reconstruction_chunks(ids, 10, 4, PROMPT)
    assert [(c.start, c.end, c.sinks) for c in chunks] == [(0, 10, 0), (10, 20, 4), (20, 25, 4)]
    assert chunks[0].input_ids == (5, 6, 7, 11, 12, *range(20, 30))
    assert chunks[1].input_ids == (9, 10, 27, 28, 29, 11, 12, *range(30, 40))
    assert chunks[2].input_ids == (9, 10, 37, 38, 39, 11, 12, *range(40, 45))
    assert PROMPT.max_tokens(10) == 5 + 2 + 10
    assert ReconstructionPrompt.from_dict(PROMPT.to_dict()) == PROMPT
    # a context that starts with the chat template's opening is re-read after it (kvpress's prefix_length)
    opened = ReconstructionPrompt(first=(5,), later=(9,), suffix=(11,), overlap=2, opening=(20, 21, 22))
    chunks = reconstruction_chunks(ids, 10, 4, opened)
    assert [(c.start, c.end, c.sinks) for c in chunks] == [(3, 13, 3), (13, 23, 4), (23, 25, 4)]
    assert chunks[0].input_ids == (5, 11, *range(23, 33)) and chunks[1].input_ids == (9, 31, 32, 11, *range(33, 43))
    assert [c.start for c in reconstruction_chunks([20, 21, 7, 8], 10, 4, opened)] == [0]  # no opening: all re-read
    assert opened.skipped([20, 21, 22]) == 0  # nothing after the opening: re-read whole
    with pytest.raises(ValueError, match="empty"):
        reconstruction_chunks([], 10, 4, PROMPT)


def test_the_prompt_is_kvpress_in_a_real_tokenizer():
    from transformers import AutoTokenizer

    from criticalkv.hf.loading import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model())
    prompt = ReconstructionPrompt.from_tokenizer(tokenizer)
    assert tokenizer.decode(prompt.first) == "\n\nRepeat the previous context exactly."
    assert tokenizer.decode(prompt.later) == "\n\nRepeat the part of the previous context exactly, starting with"
    assert tokenizer.decode(prompt.suffix) == "<|im_end|>\n<|im_start|>assistant\n"  # SmolLM2's chat template
    opening = tokenizer.decode(prompt.opening)
    assert opening.startswith("<|im_start|>system\n") and opening.endswith("<|im_end|>\n<|im_start|>user\n")
    from criticalkv.chat import chat_input_ids

    assert prompt.skipped(chat_input_ids(tokenizer, [{"role": "user", "content": "A document."}])) == len(prompt.opening)


def oracle_scores(model, context, policy, prompt):
    """Per layer [H_kv, n] float64 by loops over the model's own eager attention probabilities. ``kvzip_reread="chunk"``:
    the reconstruction tokens' rows of a 4-D attention mask see only the sinks, the chunk and themselves (causal)."""
    n = len(context)
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    group = heads // kv_heads
    out = np.zeros((model.config.num_hidden_layers, kv_heads, n))
    for chunk in reconstruction_chunks(context, policy.kvzip_chunk, policy.sink_tokens, prompt):
        ids = torch.tensor([list(context) + list(chunk.input_ids)])
        r = len(chunk.input_ids)
        options = {}
        if policy.kvzip_reread == "chunk":
            allowed = torch.ones(n + r, n + r).tril().bool()
            hidden = torch.ones(n + r, dtype=torch.bool)
            hidden[: chunk.sinks] = hidden[chunk.start : chunk.end] = hidden[n:] = False
            allowed[n:, hidden] = False
            mask = torch.zeros(n + r, n + r, dtype=model.dtype).masked_fill(~allowed, torch.finfo(model.dtype).min)
            options["attention_mask"] = mask[None, None]
        with torch.no_grad():
            attentions = model(input_ids=ids, output_attentions=True, **options).attentions  # [1, H, n + R, n + R]
        for layer, probs in enumerate(attentions):
            p = probs[0].double().numpy()
            for h in range(heads):
                for t in range(r):
                    row = p[h, n + t]
                    keep = list(range(chunk.sinks)) + list(range(chunk.start, chunk.end)) + list(range(n, n + t + 1))
                    total = row[keep].sum()
                    for i in range(chunk.start, chunk.end):
                        out[layer, h // group, i] = max(out[layer, h // group, i], row[i] / total)
    return out


@pytest.mark.parametrize("chunk, opening, reread", [(64, 0, "context"), (20, 0, "context"), (20, 6, "context"),
                                                    (20, 6, "chunk"), (64, 0, "chunk")])
def test_scores_equal_the_loop_oracle(chunk, opening, reread):
    model = tiny_model("llama", attn="eager", seed=2).double()
    context = torch.randint(1, 128, (50,), generator=torch.Generator().manual_seed(3)).tolist()
    policy = KVPolicy("kvzip", budget=24, window=4, kvzip_chunk=chunk, kvzip_reread=reread)
    prompt = PROMPT if not opening else ReconstructionPrompt(PROMPT.first, PROMPT.later, PROMPT.suffix, PROMPT.overlap,
                                                             opening=tuple(context[:opening]))
    expected = oracle_scores(model, context, policy, prompt)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([context]), use_cache=True)
    cache = out.past_key_values
    ours = reconstruction_scores(model, cache, context, policy, prompt)
    assert cache.get_seq_length(0) == 50  # cut back to the context after every chunk
    got = np.stack([s[0].double().numpy() for s in ours])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
    assert (expected[:, :, opening:] > 0).all() and not expected[:, :, :opening].any()  # the opening is not re-read


def test_a_chunk_reread_ignores_the_other_chunks():
    """kvzip_reread="chunk": a chunk's scores do not change when a later chunk's tokens do (its entries' K/V do not
    either); with the whole context re-read they do."""
    model = tiny_model("llama", attn="eager", seed=2).double()
    context = torch.randint(1, 128, (60,), generator=torch.Generator().manual_seed(4)).tolist()
    changed = context[:40] + [(t % 127) + 1 for t in context[40:]]
    for reread, same in (("chunk", True), ("context", False)):
        policy = KVPolicy("kvzip", budget=24, window=4, kvzip_chunk=20, kvzip_reread=reread)
        got = []
        for ids in (context, changed):
            with torch.no_grad():
                cache = model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
            got.append(np.stack([s[0, :, :40].numpy() for s in reconstruction_scores(model, cache, ids, policy, PROMPT)]))
        assert np.array_equal(got[0], got[1]) == same, reread


def test_prefill_and_compress_selects_with_the_reconstruction_scores():
    model = tiny_model("llama", seed=5)
    ids = torch.randint(1, 128, (1, 90), generator=torch.Generator().manual_seed(6))
    for name in ("kvzip", "kvzip-criticalkv"):
        policy = KVPolicy(name, budget=30, window=6, kvzip_chunk=40)
        pre = prefill_and_compress(model, ids, policy, reconstruction=PROMPT, keep_window_queries=True)
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
        keys = [layer.keys for layer in out.past_key_values.layers]
        values = [layer.values for layer in out.past_key_values.layers]
        scores = reconstruction_scores(model, cache_of(keys, values, model.config), ids[0].tolist(), policy, PROMPT)
        differs = []
        for i, layer in enumerate(model.model.layers):
            ref = select_layer(policy, pre.window_queries[i], keys[i], values[i], layer.self_attn.o_proj.weight, i,
                               len(model.model.layers), scores=scores[i])
            assert torch.equal(pre.selections[i].indices, ref.indices)
            fallback = select_layer(policy, pre.window_queries[i], keys[i], values[i], layer.self_attn.o_proj.weight,
                                    i, len(model.model.layers))
            differs.append(not torch.equal(fallback.indices, ref.indices))
        assert any(differs), "the reconstruction changed no choice: the test would not see it ignored"
        assert pre.scoring_s > 0
    with pytest.raises(ValueError, match="batch 1"):
        prefill_and_compress(model, ids.repeat(2, 1), KVPolicy("kvzip", budget=30, window=6), reconstruction=PROMPT)


@pytest.mark.parametrize("seed", range(3))
def test_alpha_one_is_kvzip_on_reconstruction_scores(seed):
    q, k, v, o = random_layer(batch=1, heads=6, kv_heads=2, n=120, seed=seed)
    scores = torch.rand(1, 2, 120, generator=torch.Generator().manual_seed(seed))
    a = select_layer(KVPolicy("kvzip-criticalkv", budget=40, window=8, alpha=1.0), q, k, v, o, scores=scores)
    b = select_layer(KVPolicy("kvzip", budget=40, window=8), q, k, v, o, scores=scores)
    assert torch.equal(a.indices, b.indices)
    c = select_layer(KVPolicy("kvzip-criticalkv", budget=40, window=8), q, k, v, o, scores=scores)
    assert not torch.equal(c.indices, b.indices)
    # the sinks and the window are always kept; the rest are the top scores under adakv's sharing
    kept = b.indices[0, 0][b.indices[0, 0] >= 0].tolist()
    assert kept[:4] == [0, 1, 2, 3] and kept[-8:] == list(range(112, 120))
    with pytest.raises(ValueError, match=r"scores: expected shape \[1, 2, 120\]"):
        select_layer(KVPolicy("kvzip", budget=40, window=8), q, k, v, o, scores=scores[:, :, :100])


@pytest.mark.parametrize("floor", [0.0, 0.2])
def test_layer_kvzip_is_one_ranking_over_every_layer_and_head(floor):
    # kvpress's allocation: the sinks first, then the top L * H_kv * r scores over every layer and head (each head its
    # own top floor first), the window kept: a loop over the flattened ranking
    layers = [random_layer(batch=1, heads=6, kv_heads=2, n=100, seed=s) for s in range(3)]
    scores = [torch.rand(1, 2, 100, generator=torch.Generator().manual_seed(10 + s)) for s in range(3)]
    policy = KVPolicy("layer-kvzip", budget=30, window=8, ada_floor=floor)
    sels = select_model(policy, layers, scores=scores)
    m, r, sinks = 92, 22, 4
    floor_count = int(floor * r)
    chosen = {(l, g): set(range(sinks)) for l in range(3) for g in range(2)}
    for (l, g), kept in chosen.items():  # each head's own top floor after its sinks (which rank first)
        order = sorted(range(sinks, m), key=lambda i: (-scores[l][0, g, i].item(), i))
        kept.update(order[: max(floor_count - sinks, 0)])
    rest = sorted(((l, g, i) for l in range(3) for g in range(2) for i in range(m) if i not in chosen[(l, g)]),
                  key=lambda t: (-scores[t[0]][0, t[1], t[2]].item(), t[0], t[1], t[2]))
    for l, g, i in rest[: 3 * 2 * r - sum(len(v) for v in chosen.values())]:
        chosen[(l, g)].add(i)
    for l, sel in enumerate(sels):
        for g in range(2):
            assert [i for i in sel.indices[0, g].tolist() if i >= 0] == sorted(chosen[(l, g)] | set(range(m, 100)))
    assert sum(int(s.lengths.sum()) for s in sels) == 3 * 2 * 30
    assert len({tuple(s.lengths[0].tolist()) for s in sels}) > 1  # the layers hold different shares


def test_layer_kvzip_criticalkv_is_the_two_stages_inside_layer_kvzips_shares():
    # each head keeps as many entries as layer-kvzip's model-wide ranking gives it: its sinks, then ceil(alpha * rest)
    # by the score and the others by (score + eps) x mean over the group's heads of ||V_i W_O^h||_1 (a loop oracle)
    layers = [random_layer(batch=1, heads=6, kv_heads=2, n=100, seed=20 + s) for s in range(3)]
    scores = [torch.rand(1, 2, 100, generator=torch.Generator().manual_seed(30 + s)) for s in range(3)]
    base = select_model(KVPolicy("layer-kvzip", budget=30, window=8), layers, scores=scores)
    policy = KVPolicy("layer-kvzip-criticalkv", budget=30, window=8)
    two = select_model(policy, layers, scores=scores)
    one = select_model(KVPolicy("layer-kvzip-criticalkv", budget=30, window=8, alpha=1.0), layers, scores=scores)
    m, sinks = 92, 4
    for l, ((q, k, v, o), a, b, c) in enumerate(zip(layers, base, two, one)):
        assert torch.equal(a.indices, c.indices)  # alpha = 1: layer-kvzip
        assert torch.equal(a.lengths, b.lengths)  # the same shares
        for g in range(2):
            count = int(a.lengths[0, g]) - sinks - (100 - m)
            first = -(-count // 4)  # ceil(0.25 * count)
            order = sorted(range(sinks, m), key=lambda i: (-scores[l][0, g, i].item(), i))
            stage1 = order[:first]
            w = [o[:, h * 16:(h + 1) * 16].double().t() for h in (3 * g, 3 * g + 1, 3 * g + 2)]  # [d_h, d] each
            norm = [sum(float((v[0, g, i].double() @ wh).abs().sum()) for wh in w) / 3 for i in range(m)]
            critical = {i: (scores[l][0, g, i].item() + policy.epsilon) * norm[i] for i in range(sinks, m)}
            rest = sorted((i for i in range(sinks, m) if i not in stage1), key=lambda i: (-critical[i], i))
            expected = sorted(set(range(sinks)) | set(stage1) | set(rest[: count - first]) | set(range(m, 100)))
            assert [i for i in b.indices[0, g].tolist() if i >= 0] == expected, f"layer {l} head {g}"
    assert any(not torch.equal(a.indices, b.indices) for a, b in zip(base, two))


KVPRESS_SCRIPT = r"""
import json, sys
import numpy as np, torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
from kvpress import KVzipPress

data = np.load(sys.argv[1])
cfg = json.loads(sys.argv[2])
config = LlamaConfig(hidden_size=cfg["hidden"], num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"],
                     head_dim=cfg["head_dim"], rope_theta=cfg["theta"], max_position_embeddings=4096, num_hidden_layers=1)
module = LlamaAttention(config, layer_idx=0)
with torch.no_grad():
    module.q_proj.weight.copy_(torch.from_numpy(data["wq"]))
    module.o_proj.weight.copy_(torch.from_numpy(data["wo"]))
rotary = LlamaRotaryEmbedding(config)
hidden = torch.from_numpy(data["hidden"])
r = hidden.shape[1]
n = cfg["n"]
position_embeddings = rotary(hidden, torch.arange(n, n + r)[None])
out = {}
for plus in (False, True):
    press = KVzipPress(compression_ratio=0.5, n_sink=cfg["sink"], kvzip_plus_normalization=plus)
    press.context_length = n
    press.start_idx, press.end_idx = cfg["start"], cfg["end"]
    press.score_val = torch.zeros(1, 1, cfg["kv_heads"], n)
    with torch.no_grad():
        press.score_kvzip(module, hidden, torch.from_numpy(data["keys"]), torch.from_numpy(data["values"]), None,
                          {"position_embeddings": position_embeddings})
    out["plus" if plus else "kvzip"] = press.score_val[0, 0].numpy()
np.savez(sys.argv[3], **out)
"""


@pytest.mark.skipif(not KVPRESS_PYTHON.exists(), reason="kvpress is not installed (criticalkv bench setup-peers --peers kvpress)")
@pytest.mark.parametrize("start, end", [(0, 40), (16, 40)])
def test_equals_kvpress_kvzip_press(tmp_path, start, end):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    gen = torch.Generator().manual_seed(7)
    hidden_size, heads, kv_heads, d, n, r, sink, theta = 48, 6, 2, 16, 40, 30, 4, 10000.0
    hidden = torch.randn(1, r, hidden_size, generator=gen)
    wq = torch.randn(heads * d, hidden_size, generator=gen) / hidden_size**0.5
    wo = torch.randn(hidden_size, heads * d, generator=gen) / (heads * d) ** 0.5
    keys = torch.randn(1, kv_heads, n + r, d, generator=gen)
    values = torch.randn(1, kv_heads, n + r, d, generator=gen)
    np.savez(tmp_path / "in.npz", hidden=hidden.numpy(), wq=wq.numpy(), wo=wo.numpy(), keys=keys.numpy(),
             values=values.numpy())
    cfg = dict(hidden=hidden_size, heads=heads, kv_heads=kv_heads, head_dim=d, theta=theta, sink=sink, n=n,
               start=start, end=end)
    subprocess.run([str(KVPRESS_PYTHON), "-c", KVPRESS_SCRIPT, str(tmp_path / "in.npz"), json.dumps(cfg),
                    str(tmp_path / "out.npz")], check=True, timeout=600)
    theirs = np.load(tmp_path / "out.npz")

    config = LlamaConfig(hidden_size=hidden_size, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=d,
                         rope_theta=theta, num_hidden_layers=1)
    module = LlamaAttention(config, layer_idx=0)
    with torch.no_grad():
        module.q_proj.weight.copy_(wq)
    position_embeddings = LlamaRotaryEmbedding(config)(hidden, torch.arange(n, n + r)[None])
    with torch.no_grad():
        q = window_queries(module, hidden, position_embeddings, r)
    from criticalkv.methods.kvzip import ReconstructionChunk

    chunk = ReconstructionChunk(start, end, min(sink, start), tuple(range(r)))
    ours = chunk_scores(q, keys, n, chunk)[0].numpy()  # [H_kv, end - start]
    np.testing.assert_allclose(ours, theirs["kvzip"][:, start:end], rtol=1e-4, atol=1e-7)
    assert not np.allclose(theirs["plus"][:, start:end], theirs["kvzip"][:, start:end])  # KVzip+ is another score
