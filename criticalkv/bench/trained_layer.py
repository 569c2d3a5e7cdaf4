"""A layer's selection inputs with a trained model's structure, at any layer shape (``criticalkv bench gpu``).

A random layer (random weights, random hidden states: ``bench gpu``'s worst case) gives nearly uniform attention, so
CriticalKV's pruned stage 2 cannot prune there: on the Llama-3.1-8B-shaped random layer at 8,192 tokens and budget
512 the PyTorch reference runs 5 candidate rounds and computes 98.5 % of the exact L1 norms, while a trained model's
keys settle in the first round. A time measured there says nothing about a user's prompt. This module makes the
selection's inputs from a trained model's own statistics instead:

* ``measure`` takes them from real states of a model (a few middle layers): per KV head, the pre-RoPE keys' and
  values' and, per query head of the group, the queries' per-channel mean and standard deviation (the outlier
  channels: a few channels whose mean lies many standard deviations from 0) and the eigenvalues of their channel
  correlation (the effective rank); per query head the spread of the window's attention logits (its attention's
  sharpness) and o_proj's singular values; o_proj's row norms (the residual stream's outlier dimensions).
* ``synthetic_inputs`` draws a layer of another shape from them: each channel of a target head takes the statistics
  of the source channel at the same relative place in its RoPE half (an outlier channel keeps its relative
  frequency), the correlation spectrum is stretched over the target head dim, tokens are drawn independently from that
  Gaussian, the target model's RoPE is applied at positions 0..n-1, each query head is scaled so that its window's
  logits spread as its source's do, and W_O^h = diag(row norms) Q_h diag(singular values) U_h^T with random
  orthonormal Q_h [d, d_h] and U_h [d_h, d_h], row norms drawn from the source's.

The bundled model's statistics ship in ``criticalkv/bench/layer_stats/smollm2-135m.npz``; ``python -m
criticalkv.bench.trained_layer --out FILE.npz`` measures them again (the file records the command, the text and the
versions). tests/bench/test_trained_layer.py checks, on the CPU reference, that the synthetic Llama-3.1-8B-shaped layer
settles as the bundled model's real states do and the random layer does not.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

#: The statistics shipped with the package (the bundled model's).
STATS_DIR = Path(__file__).resolve().parent / "layer_stats"
DEFAULT_STATS = STATS_DIR / "smollm2-135m.npz"
FORMAT = 1
#: Arrays of a statistics file, per source KV head S (and per query head of its group G), channel c, hidden row r.
ARRAYS = ("k_mean", "k_std", "k_spectrum", "v_mean", "v_std", "v_spectrum",  # [S, c]
          "q_mean", "q_std", "q_spectrum", "o_singular",                     # [S, G, c]
          "logit_std",                                                       # [S, G]
          "o_row_norms")                                                     # [rows]


# ---------------------------------------------------------------------------------------------- measuring
def channel_stats(x):
    """(mean [c], std [c], correlation eigenvalues [c], descending) of rows x [N, c] (float64 tensors)."""
    import torch

    mean, std = x.mean(0), x.std(0).clamp_min(1e-12)
    z = (x - mean) / std
    corr = z.T @ z / max(x.shape[0] - 1, 1)
    spectrum = torch.linalg.eigvalsh(corr).flip(0).clamp_min(0)
    return mean, std, spectrum


def logit_spread(q, k, window: int, scale: float):
    """Mean over the last ``window`` queries of the standard deviation of their logits over the keys before the
    window: q, k [n, c] post-RoPE (one query head, its KV head)."""
    n = k.shape[0]
    w = min(window, n - 1)
    logits = q[n - w:] @ k[: n - w].T * scale  # [w, n - w]
    return float(logits.std(dim=1).mean())


def measure(model, input_ids, layers: list[int], window: int = 32) -> dict[str, np.ndarray]:
    """The statistics of ``layers`` of a transformers Llama-family ``model`` on the prompt ``input_ids`` [1, n] (its
    first token, a possible attention sink, is left out of the keys' and values' statistics)."""
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    captured: dict = {}

    def hook(idx):
        def pre(module, args, kwargs):
            captured[idx] = (kwargs.get("hidden_states", args[0] if args else None), kwargs["position_embeddings"])
        return pre

    handles = [model.model.layers[i].self_attn.register_forward_pre_hook(hook(i), with_kwargs=True) for i in layers]
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for handle in handles:
            handle.remove()
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    group = heads // kv_heads
    out: dict[str, list] = {name: [] for name in ARRAYS}
    with torch.no_grad():
        for i in layers:
            attn = model.model.layers[i].self_attn
            hidden, (cos, sin) = captured[i]
            x = hidden[0].double()
            n = x.shape[0]
            q = torch.nn.functional.linear(x, attn.q_proj.weight.double(), _double(attn.q_proj.bias))
            k = torch.nn.functional.linear(x, attn.k_proj.weight.double(), _double(attn.k_proj.bias))
            v = torch.nn.functional.linear(x, attn.v_proj.weight.double(), _double(attn.v_proj.bias))
            q, k, v = (t.view(n, -1, head_dim).transpose(0, 1) for t in (q, k, v))  # [heads, n, d_h]
            q_rot, k_rot = apply_rotary_pos_emb(q[None], k[None], cos.double(), sin.double())
            o = attn.o_proj.weight.double()
            out["o_row_norms"].append(o.norm(dim=1))
            for g in range(kv_heads):
                for name, t in (("k", k[g, 1:]), ("v", v[g, 1:])):
                    mean, std, spectrum = channel_stats(t)
                    out[f"{name}_mean"].append(mean)
                    out[f"{name}_std"].append(std)
                    out[f"{name}_spectrum"].append(spectrum)
                per_head = [channel_stats(q[h]) for h in range(g * group, (g + 1) * group)]
                for j, name in enumerate(("q_mean", "q_std", "q_spectrum")):
                    out[name].append(torch.stack([p[j] for p in per_head]))
                out["o_singular"].append(torch.stack([torch.linalg.svdvals(o[:, h * head_dim:(h + 1) * head_dim])
                                                      for h in range(g * group, (g + 1) * group)]))
                out["logit_std"].append(torch.tensor([logit_spread(q_rot[0, h], k_rot[0, g], window, attn.scaling)
                                                      for h in range(g * group, (g + 1) * group)]))
    return {name: (torch.cat(values) if name == "o_row_norms" else torch.stack(values)).float().numpy()
            for name, values in out.items()}


def _double(t):
    return None if t is None else t.double()


def save(path: Path, stats: dict[str, np.ndarray], meta: dict) -> None:
    """``stats`` and ``meta`` (JSON) into one .npz, written atomically."""
    from criticalkv.eval.io import write_atomic

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.savez_compressed(f, format=np.int64(FORMAT), meta=np.array(json.dumps(meta, indent=1)),
                                **{name: stats[name].astype(np.float32) for name in ARRAYS})

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(Path(path), write)


def load(path: Path | str | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """(arrays, meta) of a statistics file (default: the bundled model's)."""
    path = Path(path) if path else DEFAULT_STATS
    with np.load(path, allow_pickle=False) as data:
        if int(data["format"]) != FORMAT:
            raise ValueError(f"{path}: statistics format {int(data['format'])}, this version reads {FORMAT}")
        missing = [name for name in ARRAYS if name not in data]
        if missing:
            raise ValueError(f"{path}: missing {', '.join(missing)}")
        return {name: np.array(data[name]) for name in ARRAYS}, json.loads(str(data["meta"]))


# ---------------------------------------------------------------------------------------------- drawing
def widen(x, channels: int):
    """Per-channel values [..., c] -> [..., channels]: each RoPE half on its own, the source channel at the same
    relative place (nearest), so a channel keeps its relative rotary frequency."""
    c = x.shape[-1]
    half, target = c // 2, channels // 2
    index = (np.arange(target) * half) // target
    return np.concatenate([x[..., index], x[..., half + index]], axis=-1)


def stretch(spectrum, channels: int):
    """A descending spectrum [c] -> [channels] with the same shape over the relative index (the effective rank scales
    with the head dim)."""
    index = (np.arange(channels) * spectrum.shape[-1]) // channels
    return spectrum[..., index]


def draw(torch, mean, std, spectrum, rows: int, generator, device):
    """``rows`` independent draws [rows, c] of N(mean, diag(std) C diag(std)), C a correlation matrix with the
    eigenvalues ``spectrum`` and random eigenvectors."""
    c = mean.shape[-1]
    basis = torch.linalg.qr(torch.randn(c, c, generator=generator, device=device))[0]
    basis = basis * torch.as_tensor(spectrum, device=device).clamp_min(0).sqrt()[None]  # C = basis basis^T
    unit = basis.norm(dim=1).clamp_min(1e-12)  # sqrt(diag C): normalised to a correlation
    z = torch.randn(rows, c, generator=generator, device=device) @ basis.T / unit
    return torch.as_tensor(mean, device=device) + z * torch.as_tensor(std, device=device)


def synthetic_inputs(torch, stats: dict[str, np.ndarray], shape, rotary, n: int, window: int, dtype, device,
                     seed: int = 0) -> dict:
    """The selection's inputs of a layer of ``shape`` (``criticalkv.bench.gpu.LayerShape``) at n tokens drawn from
    ``stats``: {"q": [1, H, w, d_h] post-RoPE window queries, "k": [1, H_kv, n, d_h] post-RoPE keys, "v", "o":
    [d, H d_h]}, in ``dtype`` on ``device``. ``rotary``: the target model's rotary embedding (positions 0..n-1).
    Target KV head g takes source head g mod S (query head j of its group: source query head j mod G_source)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    f32 = torch.float32
    d_h, group = shape.head_dim, shape.heads // shape.kv_heads
    sources, source_group = stats["k_mean"].shape[0], stats["q_mean"].shape[1]
    w = min(window, n)
    positions = torch.arange(n, device=device)[None]
    cos, sin = rotary(torch.zeros(1, dtype=f32, device=device), positions)
    cos, sin = cos[0].to(f32), sin[0].to(f32)  # [n, d_h]

    def rope(x, c, s):
        half = x.shape[-1] // 2
        return x * c + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * s

    rows = stats["o_row_norms"]
    pick = torch.randint(len(rows), (shape.hidden,), generator=generator, device=device).cpu().numpy()
    row_norms = torch.as_tensor(rows[pick] / rows[pick].mean(), device=device)
    keys, values, queries, o_heads = [], [], [], []
    for g in range(shape.kv_heads):
        s = g % sources
        k = rope(draw(torch, widen(stats["k_mean"][s], d_h), widen(stats["k_std"][s], d_h),
                      stretch(stats["k_spectrum"][s], d_h), n, generator, device), cos, sin)
        v = draw(torch, widen(stats["v_mean"][s], d_h), widen(stats["v_std"][s], d_h),
                 stretch(stats["v_spectrum"][s], d_h), n, generator, device)
        keys.append(k), values.append(v)
        for j in range(group):
            t = j % source_group
            q = rope(draw(torch, widen(stats["q_mean"][s, t], d_h), widen(stats["q_std"][s, t], d_h),
                          stretch(stats["q_spectrum"][s, t], d_h), w, generator, device), cos[n - w:], sin[n - w:])
            if n > w:  # the window's logits spread as the source's (the attention's sharpness)
                spread = (q @ k[: n - w].T / d_h ** 0.5).std(dim=1).mean()
                q = q * (float(stats["logit_std"][s, t]) / float(spread.clamp_min(1e-12)))
            queries.append(q)
            singular = torch.as_tensor(stretch(stats["o_singular"][s, t], d_h), device=device)
            mix = torch.linalg.qr(torch.randn(d_h, d_h, generator=generator, device=device))[0]
            out = torch.linalg.qr(torch.randn(shape.hidden, d_h, generator=generator, device=device))[0]
            o_heads.append((row_norms[:, None] * out) * singular[None] @ mix.T)  # W_O^h [d, d_h]
    return {"q": torch.stack(queries)[None].to(dtype), "k": torch.stack(keys)[None].to(dtype),
            "v": torch.stack(values)[None].to(dtype), "o": torch.cat(o_heads, dim=1).to(dtype).contiguous()}


# ---------------------------------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> int:
    """Measure the bundled model's (or --model's) statistics on the evaluations' haystack text."""
    p = argparse.ArgumentParser(prog="python -m criticalkv.bench.trained_layer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Hugging Face checkpoint folder (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--tokens", type=int, default=4096, help="prompt tokens of haystack text (default: 4096)")
    p.add_argument("--layers", help="comma-separated layers (default: the four around the middle)")
    p.add_argument("--window", type=int, default=32, help="window queries of the logit spread (default: 32)")
    p.add_argument("--out", required=True, help="the .npz to write")
    args = p.parse_args(argv)
    import torch

    from criticalkv.bench.machine import header
    from criticalkv.eval.haystack import haystack_sentences
    from criticalkv.hf import load_model

    model, tokenizer = load_model(args.model)
    ids = tokenizer(" ".join(haystack_sentences()))["input_ids"][: args.tokens]
    if len(ids) < args.tokens:
        p.error(f"--tokens {args.tokens}: the haystack text has {len(ids)} tokens")
    layers = ([int(x) for x in args.layers.split(",")] if args.layers else
              list(range(model.config.num_hidden_layers // 2 - 2, model.config.num_hidden_layers // 2 + 2)))
    stats = measure(model, torch.tensor([ids]), layers, args.window)
    meta = header("python -m criticalkv.bench.trained_layer " + " ".join(sys.argv[1:] if argv is None else argv))
    meta.update(model=args.model or "bundled SmolLM2-135M-Instruct", layers=layers, tokens=len(ids),
                text="criticalkv.eval.haystack.haystack_sentences() (the 1911 Britannica article), first tokens",
                window=args.window, config={k: getattr(model.config, k, None) for k in (
                    "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta")})
    save(Path(args.out), stats, meta)
    print(f"wrote {args.out}: {stats['k_mean'].shape[0]} KV heads of layers {layers}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
