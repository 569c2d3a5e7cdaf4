"""The transformers integration on tiny random Llama-family models (fast)."""

import pytest
import torch

from criticalkv import KVPolicy, select_layer
from criticalkv.hf import generate, prefill_and_compress
from criticalkv.hf.cache import cache_kwargs
from hf.conftest import tiny_model
from model_families import FAMILIES, random_checkpoint, random_prompt
from policies import POLICY_CASES, make_policy

IDS = [c[0] for c in POLICY_CASES]


def prompt(n, seed=1, batch=1):
    return torch.randint(1, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model_type", ["llama", "mistral", "ministral", "qwen2", "qwen3"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_full_policy_is_token_identical_to_model_generate(model_type, attn):
    model = tiny_model(model_type, attn)
    ids = prompt(70)
    ref = model.generate(ids, max_new_tokens=24, do_sample=False)[0, 70:].tolist()
    assert generate(model, ids, KVPolicy("full"), max_new_tokens=24).tokens[0] == ref


def test_budget_covering_the_prompt_is_identical_too(llama):
    ids = prompt(60)
    ref = llama.generate(ids, max_new_tokens=16, do_sample=False)[0, 60:].tolist()
    for name in ("criticalkv", "ada-criticalkv", "laprox", "streamingllm"):
        assert generate(llama, ids, KVPolicy(name, budget=64, window=8), max_new_tokens=16).tokens[0] == ref


def reference_masked_decode(model, ids, selections, steps, question=None):
    """Greedy decoding with the full cache, where every generated token's attention is masked (per
    query head) to the kept prompt entries of its KV head: what eviction must be equivalent to.
    ``question`` [1, q]: tokens after the compressed prompt ``ids`` that attend like generated ones."""
    n = ids.shape[1]
    heads = model.config.num_attention_heads
    group = heads // model.config.num_key_value_heads
    model.config._attn_implementation = "eager"  # eager accepts a per-head 4-D additive mask
    seq, out = (ids if question is None else torch.cat([ids, question], dim=1)), []
    for _ in range(steps):
        total = seq.shape[1]
        mask = torch.full((1, heads, total, total), float("-inf")).triu(1)
        per_layer_logits = None
        # the kept set differs per layer: run layer by layer through a hook that swaps the mask
        masks = []
        for sel in selections:
            m = mask.clone()
            kept = sel.mask(n)[0].repeat_interleave(group, dim=0)  # [H, n]
            m[:, :, n:, :n] = torch.where(kept[:, None, :], 0.0, float("-inf"))
            masks.append(m)
        handles = []
        for i, layer in enumerate(model.model.layers):
            def pre(module, args, kwargs, i=i):
                kwargs["attention_mask"] = masks[i]
                return args, kwargs
            handles.append(layer.self_attn.register_forward_pre_hook(pre, with_kwargs=True))
        try:
            logits = model(seq, attention_mask=mask).logits[0, -1]
        finally:
            for h in handles:
                h.remove()
        nxt = int(logits.argmax())
        out.append(nxt)
        seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    model.config._attn_implementation = "sdpa"
    return out


@pytest.mark.parametrize("name", ["snapkv", "criticalkv", "pyramidkv", "ada-criticalkv", "laprox", "streamingllm"])
def test_compressed_decoding_equals_masked_full_attention(llama, name):
    ids = prompt(120, seed=3)
    policy = KVPolicy(name, budget=40, window=8)
    out = generate(llama, ids, policy, max_new_tokens=8)
    ref = reference_masked_decode(llama, ids, out.prefill.selections, 8)
    assert out.tokens[0] == ref


def test_selection_uses_the_layers_real_post_rope_queries(llama):
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    ids = prompt(90, seed=4)
    policy = KVPolicy("ada-criticalkv", budget=32, window=8)
    pre = prefill_and_compress(llama, ids, policy)
    cache = DynamicCache(config=llama.config)
    with torch.no_grad():
        hidden = llama(ids, use_cache=True, output_hidden_states=True, **cache_kwargs(llama, cache)).hidden_states
        pos = torch.arange(90)[None]
        cos, sin = llama.model.rotary_emb(hidden[0], pos)
        for i, layer in enumerate(llama.model.layers):
            x = layer.input_layernorm(hidden[i])
            q = layer.self_attn.q_proj(x).view(1, 90, 6, 16).transpose(1, 2)
            q, _ = apply_rotary_pos_emb(q, q, cos, sin)
            k, v = cache.layers[i].keys, cache.layers[i].values
            want = select_layer(policy, q[:, :, -8:], k, v, layer.self_attn.o_proj.weight, i, 3)
            assert torch.equal(pre.selections[i].indices, want.indices), f"layer {i}"


@pytest.mark.parametrize("case", POLICY_CASES, ids=IDS)
def test_cache_holds_only_the_kept_entries(llama, case):
    ids = prompt(150, seed=5)
    policy = make_policy(case[1], budget=48, window=8)
    pre = prefill_and_compress(llama, ids, policy)
    itemsize, head_dim = 4, 16
    assert pre.kv_bytes_full == 3 * 2 * 150 * 2 * head_dim * itemsize
    expected = 0
    for layer, sel in zip(pre.cache.layers, pre.selections):
        kept = int(sel.lengths.sum())
        assert layer.prefix_keys.shape == (kept, head_dim) and layer.prefix_values.shape == (kept, head_dim)
        expected += 2 * kept * head_dim * itemsize
    assert pre.kv_bytes_kept == expected == pre.cache.kv_nbytes()
    if policy.name != "full":
        assert pre.kv_bytes_kept < pre.kv_bytes_full / 2
    if policy.base in ("adakv", "laprox"):  # heads keep different counts, stored without padding
        assert any(not layer.uniform for layer in pre.cache.layers)


@pytest.mark.parametrize("name", ["snapkv", "criticalkv", "adakv", "ada-criticalkv", "full"])
def test_left_padded_batch_equals_each_prompt_alone(llama, name):
    a, b = prompt(100, seed=6)[0], prompt(73, seed=7)[0]
    ids = torch.zeros(2, 100, dtype=torch.int64)
    ids[0], ids[1, 27:] = a, b
    mask = torch.zeros(2, 100, dtype=torch.int64)
    mask[0], mask[1, 27:] = 1, 1
    policy = KVPolicy(name, budget=32, window=8)
    batched = generate(llama, ids, policy, max_new_tokens=10, attention_mask=mask)
    for row, single in enumerate((a, b)):
        alone = generate(llama, single[None], policy, max_new_tokens=10)
        assert batched.tokens[row] == alone.tokens[0]


def test_stop_tokens_end_each_sequence(llama):
    ids = prompt(50, seed=8)
    free = generate(llama, ids, KVPolicy("snapkv", budget=16, window=8), max_new_tokens=12).tokens[0]
    stopped = generate(llama, ids, KVPolicy("snapkv", budget=16, window=8), max_new_tokens=12, stop_token_ids=[free[3]])
    assert stopped.tokens[0] == free[: free.index(free[3]) + 1]


def test_bad_inputs_give_clear_errors(llama):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        prefill_and_compress(gpt2, prompt(20), KVPolicy("snapkv", budget=8, window=4))
    with pytest.raises(ValueError, match="left-padded"):
        prefill_and_compress(llama, prompt(20, batch=2), KVPolicy("snapkv", budget=8, window=4),
                             attention_mask=torch.tensor([[1] * 20, [1] * 15 + [0] * 5]))
    with pytest.raises(ValueError, match="non-empty"):
        prefill_and_compress(llama, torch.zeros(1, 0, dtype=torch.int64), KVPolicy("snapkv", budget=8, window=4))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(llama, prompt(20), KVPolicy("snapkv", budget=8, window=4), max_new_tokens=0)


def test_layer_defensivekv_shares_the_budget_across_layers(llama):
    """Memory after prefill = the kept total = L * H_kv * budget; the selection is select_model over every layer's
    real queries, keys and values; layers keep different totals; decoding equals masked full attention."""
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from criticalkv import select_model

    ids = prompt(150, seed=9)
    # stage1_mass 0.2: on this random model's near-uniform attention the default 0.9 fills every head's share
    # in stage 1, and the layers' totals would all be equal
    policy = KVPolicy("layer-defensivekv", budget=40, window=8, stage1_mass=0.2)
    out = generate(llama, ids, policy, max_new_tokens=6)
    pre = out.prefill
    kept = [int(sel.lengths.sum()) for sel in pre.selections]
    assert sum(kept) == 3 * 2 * 40, kept  # 3 layers x 2 KV heads x budget
    assert len(set(kept)) > 1, "the layers' shares should differ on this prompt"
    assert pre.kv_bytes_kept == pre.cache.kv_nbytes() == 2 * sum(kept) * 16 * 4
    cache = DynamicCache(config=llama.config)
    layers = []
    with torch.no_grad():
        hidden = llama(ids, use_cache=True, output_hidden_states=True, **cache_kwargs(llama, cache)).hidden_states
        cos, sin = llama.model.rotary_emb(hidden[0], torch.arange(150)[None])
        for i, layer in enumerate(llama.model.layers):
            q = layer.self_attn.q_proj(layer.input_layernorm(hidden[i])).view(1, 150, 6, 16).transpose(1, 2)
            q, _ = apply_rotary_pos_emb(q, q, cos, sin)
            layers.append((q[:, :, -8:], cache.layers[i].keys, cache.layers[i].values, layer.self_attn.o_proj.weight))
    for i, want in enumerate(select_model(policy, layers)):
        assert torch.equal(pre.selections[i].indices, want.indices), f"layer {i}"
    assert out.tokens[0] == reference_masked_decode(llama, ids, pre.selections, 6)


@pytest.mark.parametrize("fam", FAMILIES, ids=[f.id for f in FAMILIES])
def test_window_queries_are_the_attentions_own_queries(fam):
    """The queries the selection receives are the ones each layer's attention computes (Qwen3: q_norm before RoPE),
    recorded from the attention function transformers calls (an independent oracle of window_queries)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from criticalkv.hf.compress import window_queries

    model = random_checkpoint(fam, seed=3)
    seen, recomputed = [], []

    def record(module, query, key, value, attention_mask, **kwargs):
        seen.append(query[:, :, -8:].detach().clone())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    def hook(module, args, kwargs, output):
        recomputed.append(window_queries(module, kwargs["hidden_states"], kwargs["position_embeddings"], 8))

    AttentionInterface.register("criticalkv_test_record", record)
    model.config._attn_implementation = "criticalkv_test_record"
    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(torch.tensor([random_prompt(60, seed=5)]))
    finally:
        for h in handles:
            h.remove()
        model.config._attn_implementation = "sdpa"
    assert len(seen) == len(recomputed) == model.config.num_hidden_layers
    for layer, (want, got) in enumerate(zip(seen, recomputed)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{fam.id}: layer {layer}")


@pytest.mark.parametrize("name", ["criticalkv", "ada-criticalkv", "defensivekv", "streamingllm"])
def test_qwen3_compressed_decoding_equals_masked_full_attention(name):
    """Qwen3 on the PyTorch path: the compressed cache decodes exactly as full attention masked to the kept entries
    (transformers' own eager attention, q_norm / k_norm included)."""
    from model_families import family

    model = random_checkpoint(family("qwen3"), seed=4)
    ids = torch.tensor([random_prompt(120, seed=6)])
    out = generate(model, ids, KVPolicy(name, budget=40, window=8), max_new_tokens=8)
    assert out.tokens[0] == reference_masked_decode(model, ids, out.prefill.selections, 8)
