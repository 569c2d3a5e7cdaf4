"""kvpress on the GPU beside criticalkv (``criticalkv bench gpu-serve``): its CriticalKVPress(SnapKVPress) through
transformers, batch 1, on the same model, prompts and budget.

kvpress 0.5.5 is pure Python (carried as a wheel and installed with ``--no-deps --target``); what it needs beyond
torch and transformers for these two presses is ``cachetools``. Its package imports every press, DuoAttention's
needing ``datasets``: without it the two presses are imported alone, with kvpress's attention patch, as its package
would apply it.
"""

from __future__ import annotations

import functools
import sys
import time


def _synchronize(device) -> None:
    import torch

    if getattr(device, "type", str(device)).startswith("cuda"):
        torch.cuda.synchronize()


def kvpress_run(model, prompts: list[list[int]], budget: int, new_tokens: int) -> dict:
    """kvpress's CriticalKVPress(SnapKVPress) at the budget through transformers, batch 1: TTFT (prefill with the press
    and the first token) and decode tokens/s over the compressed DynamicCache (greedy, as its pipeline decodes)."""
    import torch

    try:
        CriticalKVPress, SnapKVPress, how = kvpress_presses()
    except ImportError as err:
        return {"skipped": f"kvpress is not importable ({err}); see docs/torch_backend.md"}
    n = len(prompts[-1])
    ratio = max(0.0, 1.0 - budget / n)
    press = CriticalKVPress(press=SnapKVPress(compression_ratio=ratio))
    ttft, decode = [], []
    device = model.device
    # kvpress 0.5.5 (transformers < 5.3) reads two keywords of the attention's forward that newer transformers no longer
    # pass: ``past_key_values`` (5.24 calls it ``cache``) and ``cache_position`` (the new tokens' slots in the cache,
    # which kvpress reads to tell the prefill from decoding). Hand them as the transformers it was written for did;
    # where transformers passes them already, nothing changes (the results say which were added)
    aliased: set[str] = set()

    def alias(module, args, kwargs):
        added = {}
        cache = kwargs.get("past_key_values")
        if cache is None and kwargs.get("cache") is not None:
            cache = added["past_key_values"] = kwargs["cache"]
        if kwargs.get("cache_position") is None and cache is not None:
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            held = cache.get_seq_length(module.layer_idx)
            added["cache_position"] = torch.arange(held, held + hidden.shape[1], device=hidden.device)
        if not added:
            return None
        aliased.update(added)
        return args, {**kwargs, **added}

    handles = [layer.self_attn.register_forward_pre_hook(alias, with_kwargs=True) for layer in model.model.layers]
    try:
        result = _kvpress_requests(model, press, prompts, new_tokens, ttft, decode, device)
    finally:
        for handle in handles:
            handle.remove()
    return {"press": f"CriticalKVPress(SnapKVPress(compression_ratio={ratio:.4f}))", "imported": how,
            "keywords_added_for_kvpress": sorted(aliased), "ttft_s": ttft[0], "decode_tokens_per_s": decode[0],
            "kept_tokens_per_head": result}


def _kvpress_requests(model, press, prompts: list[list[int]], new_tokens: int, ttft: list, decode: list, device) -> int:
    """The first prompt a short warm-up, the last one measured (8B at 32k: seconds each); returns the entries kept
    per head."""
    import torch
    from transformers import DynamicCache

    from criticalkv.hf.cache import cache_kwargs

    kept = 0
    for i, prompt in enumerate(prompts):
        last = i == len(prompts) - 1
        steps = new_tokens - 1 if last else min(3, new_tokens - 1)
        n = len(prompt)
        ids = torch.tensor([prompt], device=device)
        cache = DynamicCache()
        _synchronize(device)
        start = time.perf_counter()
        with torch.no_grad(), press(model):
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        _synchronize(device)
        first = time.perf_counter()
        with torch.no_grad():
            for t in range(steps):
                out = model(input_ids=token, use_cache=True, position_ids=torch.tensor([[n + t]], device=device),
                            **cache_kwargs(model, cache))
                token = out.logits[:, -1].argmax(-1, keepdim=True)
        _synchronize(device)
        if last:
            ttft.append(first - start)
            decode.append((new_tokens - 1) / (time.perf_counter() - first))
        kept = int(cache.get_seq_length(0))
        del cache, out
    return kept


@functools.lru_cache(maxsize=1)
def kvpress_presses():
    """(CriticalKVPress, SnapKVPress, how they were imported). ``import kvpress`` imports every press, and some need
    what only their own method uses (DuoAttention: ``datasets``), which a machine without a network may lack: then the
    two presses are imported alone (they need torch and transformers) and kvpress's attention patch applied as its
    package does."""
    import importlib

    from criticalkv.bench.gpu import kvpress_shell

    try:
        from kvpress import CriticalKVPress, SnapKVPress

        return CriticalKVPress, SnapKVPress, "import kvpress"
    except ImportError as err:
        why = str(err)
    for name in [m for m in sys.modules if m == "kvpress" or m.startswith("kvpress.")]:
        del sys.modules[name]  # what the failed import left half-made
    kvpress_shell()  # ImportError when kvpress is not installed at all
    critical = importlib.import_module("kvpress.presses.criticalkv_press").CriticalKVPress
    snap = importlib.import_module("kvpress.presses.snapkv_press").SnapKVPress
    importlib.import_module("kvpress.attention_patch").patch_attention_functions()
    return critical, snap, f"the two presses alone (import kvpress failed: {why})"
