"""``criticalkv bench gpu``: every policy's selection of one layer against that layer's prefill, on a GPU, one run.

The layer is Llama-3.1-8B's (32 query / 8 KV heads, head_dim 128, hidden 4096, intermediate 14336, bf16, llama3
RoPE), batch 1, window 32, budget 2048, at 8k / 32k / 128k prompt tokens. In one process it measures:

* floors: a bf16 GEMM (8192^3, TFLOP/s) and a device-to-device copy (GB/s, bytes read + written);
* the layer's prefill: a transformers ``LlamaDecoderLayer`` (SDPA, causal, no mask) on random hidden states, its
  rotary embedding computed once outside the timed region (a model computes it once for all layers);
* each policy's selection through ``torch.ops.criticalkv.select_layer`` (``criticalkv.selection.op``: on CUDA the
  plugin's kernels on torch's stream, the PyTorch reference where the library is not built: the ``path`` column
  says which) on keys and values with a trained model's structure: a real checkpoint's layer on a real text
  (``--model``), else a layer drawn from the bundled model's own statistics at the layer's shape
  (``criticalkv.bench.trained_layer``: its outlier channels, effective rank, attention sharpness and o_proj);
  capacity from ``criticalkv.node.node_capacity``; layer ``num_layers // 2`` of 32 (PyramidKV's average budget);
  beside each time the share of exact L1 norms CriticalKV's pruned stage 2 computes on those tensors and its candidate
  rounds (the PyTorch reference on the same tensors: the kernels' rounds follow the same rule);
* the worst case: the policies that prune, also on the random layer's own queries, keys and values (random weights
  and hidden states: nearly uniform attention, so the pruning can hardly prune), at ``--worst-case-lengths``;
* per (policy, n) one call under torch.profiler: each kernel's time, and per stage (window scores, l1 value norms,
  l2 norms through the Gram matrices) its achieved TFLOP/s and GB/s against the floors of this run;
* batch 8 of mixed lengths (4k..32k, left-padded) against the sum of its rows at batch 1;
* kvpress's SnapKV, CriticalKV(SnapKV) and AdaKV(SnapKV) presses (``press.compress`` on the same tensors) when
  kvpress is importable (its wheel carried and installed with ``pip install --no-deps --target``).

Times are CUDA-event medians over repeats after one warm-up call (fewer repeats for a call slower than
``--measure-seconds``); a measurement whose estimated cost exceeds what ``--time-budget`` leaves is skipped and
listed. NAME.json and NAME.md are rewritten after every measurement, so a run cut short keeps what it measured.
The targets are the kernels' goals (the Llama-3.1-8B layer, budget 2048, window 32): the ms goal at 32k, the share of
the prefill at 128k, batch 8 <= 1.2x the sum of its rows.

The verdicts take the trained-structure rows; the worst-case rows have none. ``--dry-run`` (automatic without CUDA)
runs tiny shapes on the CPU through the same code, to test the plumbing; its numbers mean nothing.

    criticalkv bench gpu                          # on a GPU: results/gpu/selection_gpu.{json,md}
    criticalkv bench gpu --dry-run --out /tmp/x   # anywhere
    criticalkv bench gpu --model /path/to/Llama-3.1-8B-Instruct   # a real checkpoint's layer on a real text
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

#: Environment variable the GPU check sets to the seconds this step may run (the default of --time-budget).
TIME_BUDGET_ENV = "CRITICALKV_TIME_BUDGET_S"
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
DEFAULT_POLICIES = ("full", "streamingllm", "snapkv", "pyramidkv", "adakv", "laprox", "criticalkv",
                    "criticalkv:value_norm=l2", "pyramid-criticalkv", "ada-criticalkv", "defensivekv")
DEFAULT_LENGTHS = (32768, 131072, 8192)  # the targets' 32k first: a run cut short still has it
DEFAULT_BATCH_LENGTHS = tuple(4096 * i for i in range(1, 9))
BATCH_TARGET = 1.2
#: CUDA errors after which nothing more can run in the process (the context is lost)
STICKY_CUDA_ERRORS = ("illegal memory access", "unspecified launch failure", "device-side assert", "misaligned address",
                      "illegal instruction", "launch timed out", "uncorrectable ecc")


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer's sizes (query heads H, KV heads H_kv, head dim d_h, hidden d)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    num_layers: int


LLAMA31_8B = LayerShape(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, num_layers=32)
#: --dry-run: small enough for a CPU test, the same code path.
DRY_SHAPE = LayerShape(hidden=256, heads=8, kv_heads=2, head_dim=32, intermediate=512, num_layers=4)
DRY_LENGTHS = (256, 128)
DRY_BATCH_LENGTHS = tuple(32 * i for i in range(1, 9))


@dataclass(frozen=True)
class Target:
    """The goal for a policy: ms per layer at 32k, share of the prefill (%) at 32k and at 128k."""

    ms_32k: float
    share_32k: float | None
    share_128k: float


def target_for(policy) -> Target | None:
    """The goal row for a policy (None: no goal, e.g. ``full``)."""
    name = policy.name
    if name in ("snapkv", "pyramidkv", "streamingllm"):
        return Target(0.25, 0.6, 1.0)
    if name in ("criticalkv", "pyramid-criticalkv", "ada-criticalkv"):
        return Target(0.8, 1.8, 2.0) if policy.value_norm == "l1" else Target(0.5, None, 1.5)
    if name in ("laprox", "adakv"):
        return Target(0.5, None, 1.5)
    if name == "defensivekv":
        return Target(1.3, 3.0, 3.0)
    return None


def judge(policy, n: int, ms: float | None, share: float | None, targets_apply: bool) -> tuple[str, bool | None]:
    """(the goal as text, met?) for one row: the ms goal at 32k, the share goal at 128k, none elsewhere."""
    target = target_for(policy)
    if target is None or n not in (32768, 131072):
        return "-", None
    if n == 32768:
        text = f"<= {target.ms_32k} ms" + (f" ({target.share_32k} %)" if target.share_32k is not None else "")
        value, goal = ms, target.ms_32k
    else:
        text, value, goal = f"<= {target.share_128k} %", share, target.share_128k
    if not targets_apply or value is None:
        return text, None
    return text, value <= goal


# ---------------------------------------------------------------------------------------------- work and floors
def stage_work(shape: LayerShape, n: int, window: int, element_bytes: int) -> dict[str, dict]:
    """FLOPs and fewest bytes of each stage the kernels are judged by (the floors)."""
    h, hkv, dh, d, w = shape.heads, shape.kv_heads, shape.head_dim, shape.hidden, min(window, n)
    kv_bytes = hkv * n * dh * element_bytes
    return {
        "window scores": {"flop": 2.0 * h * w * n * dh, "bytes": kv_bytes + h * w * dh * element_bytes},
        "l1 value norms": {"flop": 2.0 * h * n * dh * d, "bytes": kv_bytes + d * h * dh * element_bytes},
        "l2 norms (Gram)": {"flop": 2.0 * h * n * dh * dh, "bytes": kv_bytes},
        "layer inputs once": {"flop": 0.0, "bytes": 2 * kv_bytes + (h * w * dh + d * h * dh) * element_bytes},
    }


#: kernel-name patterns (lower case, first match wins) -> the stage whose floor judges them
STAGE_PATTERNS = (("window scores", ("window", "softmax")),
                  ("l2 norms (Gram)", ("gram", "bound")),
                  ("l1 value norms", ("valuenorm", "value_norm", "vwnorm", "vw_norm", "l1norm", "normswmma",
                                      "normsmma", "prunedexact", "exactnorm")))


def stage_of(kernel: str) -> str | None:
    low = kernel.lower()
    for stage, needles in STAGE_PATTERNS:
        if any(s in low for s in needles):
            return stage
    return None


def against_floors(ms: float, flop: float, nbytes: float, floors: dict) -> dict:
    """Achieved rates of ``ms`` for that work and the fraction of the floor time (1 = at the floor)."""
    out = {"ms": ms, "flop": flop, "bytes": nbytes}
    if ms <= 0:
        return out
    out["tflops"] = flop / ms / 1e9
    out["gbps"] = nbytes / ms / 1e6
    floor_ms = max(flop / (floors["gemm_tflops"] * 1e9) if floors.get("gemm_tflops") else 0.0,
                   nbytes / (floors["copy_gbps"] * 1e6) if floors.get("copy_gbps") else 0.0)
    out["floor_ms"] = floor_ms
    out["of_floor"] = floor_ms / ms
    return out


# ---------------------------------------------------------------------------------------------- timing
class Clock:
    """Times a callable: CUDA events on a GPU, perf_counter on the CPU (after a synchronize either way)."""

    def __init__(self, torch, device):
        self.torch = torch
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def once(self, fn) -> float:
        """Milliseconds of one call."""
        if self.cuda:
            start = self.torch.cuda.Event(enable_timing=True)
            stop = self.torch.cuda.Event(enable_timing=True)
            self.sync()
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            return start.elapsed_time(stop)
        begin = time.perf_counter()
        fn()
        return (time.perf_counter() - begin) * 1e3

    def measure(self, fn, repeats: int, cap_s: float) -> dict:
        """One warm-up call, then up to ``repeats`` timed calls (fewer when a call takes longer than
        ``cap_s / repeats``); returns {"ms": median, "times_ms": [...], "warmup_ms": ...}."""
        warm = self.once(fn)
        count = max(1, min(repeats, int(cap_s * 1e3 / max(warm, 1e-3))))
        times = [self.once(fn) for _ in range(count)]
        return {"ms": statistics.median(times), "times_ms": times, "warmup_ms": warm}


class Deadline:
    def __init__(self, seconds: float | None):
        self.end = None if seconds is None else time.monotonic() + seconds

    def remaining(self) -> float:
        return math.inf if self.end is None else self.end - time.monotonic()

    def allows(self, estimate_s: float) -> bool:
        return estimate_s <= self.remaining()


def kernel_times(torch, fn, cuda: bool, clock: Clock) -> list[dict]:
    """Per kernel (CUDA) or per operator (CPU) of one call under torch.profiler: name, calls, total ms."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    clock.sync()
    with profile(activities=activities) as prof:
        fn()
        clock.sync()
    rows = []
    for event in prof.key_averages():
        device_type = str(getattr(event, "device_type", ""))
        if cuda:
            us = getattr(event, "self_device_time_total", None)
            if us is None:
                us = getattr(event, "self_cuda_time_total", 0.0)
            if "CUDA" not in device_type or us <= 0:
                continue
        else:
            us = event.self_cpu_time_total
            if us <= 0:
                continue
        rows.append({"name": event.key, "calls": event.count, "ms": us / 1e3})
    rows.sort(key=lambda r: -r["ms"])
    return rows if cuda else rows[:8]


def floors(torch, device, dry: bool, clock: Clock) -> dict:
    """bf16 GEMM TFLOP/s (8192^3; fp32 256^3 in a dry run) and device copy GB/s (1 GiB; 64 MiB), random data."""
    size, dtype = (256, torch.float32) if dry else (8192, torch.bfloat16)
    nbytes = (64 if dry else 1024) * 2**20

    def gemm_times():
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        return clock.measure(lambda: torch.mm(a, b), repeats=10, cap_s=2.0)

    def copy_times():
        src = torch.randn(nbytes // 4, device=device)
        dst = torch.empty_like(src)
        return clock.measure(lambda: dst.copy_(src), repeats=10, cap_s=2.0)

    gemm, copy = gemm_times(), copy_times()
    return {"gemm": {"m_n_k": size, "dtype": str(dtype).removeprefix("torch."), **gemm},
            "gemm_tflops": 2.0 * size**3 / gemm["ms"] / 1e9,
            "copy": {"bytes_read_and_written": 2 * nbytes, **copy},
            "copy_gbps": 2 * nbytes / copy["ms"] / 1e6}


# ---------------------------------------------------------------------------------------------- the layer
def make_layer(torch, shape: LayerShape, dtype, device, layer_idx: int):
    """A random transformers LlamaDecoderLayer (SDPA) and its rotary embedding, on ``device`` in ``dtype``."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                         num_hidden_layers=shape.num_layers, max_position_embeddings=131072,
                         rope_parameters=dict(LLAMA3_ROPE), rms_norm_eps=1e-5)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        layer = LlamaDecoderLayer(config, layer_idx=layer_idx).to(dtype).eval()
        rotary = LlamaRotaryEmbedding(config)
    return layer, rotary


def layer_inputs(torch, layer, rotary, n: int, batch: int, window: int, dtype, device, seed: int):
    """Random hidden states [batch, n, d], their position embeddings, and the selection's inputs computed by the
    layer itself: post-RoPE queries of the last window [B, H, w, d_h], keys and values [B, H_kv, n, d_h]."""
    generator = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(batch, n, layer.hidden_size, device=device, dtype=dtype, generator=generator)
    positions = torch.arange(n, device=device)[None].expand(batch, n)
    cos, sin = rotary(hidden, positions)
    return inputs_from_hidden(torch, layer, hidden, positions, cos, sin, window)


def inputs_from_hidden(torch, layer, hidden, positions, cos, sin, window: int) -> dict:
    """The selection's inputs the layer computes from its input hidden states [B, n, d] (position embeddings cos,
    sin [B, n, d_h]): post-RoPE window queries [B, H, w, d_h], keys and values [B, H_kv, n, d_h], o_proj."""
    from transformers.models.llama.modeling_llama import rotate_half

    batch, n = hidden.shape[:2]
    attn = layer.self_attn
    heads, kv_heads, head_dim = attn.config.num_attention_heads, attn.config.num_key_value_heads, attn.head_dim
    w = min(window, n)

    def rope(x, c, s):
        return x * c.unsqueeze(1) + rotate_half(x) * s.unsqueeze(1)

    normed = layer.input_layernorm(hidden)
    q = attn.q_proj(normed[:, -w:]).view(batch, w, heads, head_dim)
    k = attn.k_proj(normed).view(batch, n, kv_heads, head_dim)
    if getattr(attn, "q_norm", None) is not None:  # Qwen3: RMSNorm over d_h of every head before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    q = rope(q.transpose(1, 2), cos[:, -w:], sin[:, -w:]).contiguous()
    k = rope(k.transpose(1, 2), cos, sin).contiguous()
    v = attn.v_proj(normed).view(batch, n, kv_heads, head_dim).transpose(1, 2).contiguous()
    return {"hidden": hidden, "normed": normed, "positions": positions, "cos": cos, "sin": sin,
            "q": q, "k": k, "v": v, "o": attn.o_proj.weight}


class TrainedData:
    """Where the trained-structure rows' queries, keys and values come from: a checkpoint's layer on a real text
    (``--model``: the model runs up to that layer), else ``criticalkv.bench.trained_layer``'s synthetic layer of the
    bench's shape drawn from a model's statistics (default: the bundled model's)."""

    def __init__(self, torch, args, shape: LayerShape, rotary, dtype, device, layer_idx: int, model=None,
                 tokenizer=None):
        from criticalkv.bench import trained_layer

        self.torch, self.args, self.shape, self.rotary = torch, args, shape, rotary
        self.dtype, self.device, self.layer_idx = dtype, device, layer_idx
        self.model, self.tokenizer = model, tokenizer
        self.ids = None
        if model is None:
            self.stats, meta = trained_layer.load(args.layer_stats)
            self.description = {"kind": "synthetic", "stats": str(args.layer_stats or trained_layer.DEFAULT_STATS.name),
                                "measured_on": {k: meta.get(k) for k in ("model", "layers", "tokens", "text")}}
            self.label = f"trained: drawn from {meta.get('model')}'s statistics"
        else:
            self.text, self.text_source = prompt_text(args.prompt_file)
            self.description = {"kind": "checkpoint", "model": args.model, "layer": layer_idx,
                                "text": self.text_source}
            self.label = f"trained: {Path(args.model).name} layer {layer_idx}"

    def inputs(self, n: int, seed: int) -> dict:
        """{"q", "k", "v", "o"} (and a checkpoint's own "hidden", "positions", "cos", "sin") at n tokens."""
        torch = self.torch
        if self.model is None:
            from criticalkv.bench.trained_layer import synthetic_inputs

            return synthetic_inputs(torch, self.stats, self.shape, self.rotary, n, self.args.window, self.dtype,
                                    self.device, seed)
        ids = self.token_ids(n)
        captured = {}

        class Reached(Exception):
            pass

        def stop(module, args, kwargs):
            captured["hidden"] = kwargs.get("hidden_states", args[0] if args else None)
            captured["cos"], captured["sin"] = kwargs["position_embeddings"]
            raise Reached

        layer = self.model.model.layers[self.layer_idx]
        handle = layer.register_forward_pre_hook(stop, with_kwargs=True)
        try:
            self.model.model(torch.tensor([ids], device=self.device), use_cache=False)
        except Reached:
            pass
        finally:
            handle.remove()
        hidden = captured["hidden"]
        positions = torch.arange(n, device=self.device)[None]
        return inputs_from_hidden(torch, layer, hidden, positions, captured["cos"], captured["sin"], self.args.window)

    def token_ids(self, n: int) -> list[int]:
        """The text's first n tokens (the text repeated when it is shorter: said in the results)."""
        if self.ids is None or len(self.ids) < n:
            ids = self.tokenizer(self.text)["input_ids"]
            repeats = -(-n // max(len(ids), 1))
            if repeats > 1:
                self.description["text_repeated"] = repeats
            self.ids = (ids * repeats)[:max(n, len(ids))]
        return self.ids[:n]


def prompt_text(path: str | None) -> tuple[str, str]:
    """(the text a checkpoint's layer reads, where it came from): --prompt-file, else the evaluations' haystack text
    (the 1911 Britannica article) when its data package is installed, else the repository's example texts."""
    if path:
        return Path(path).read_text(errors="replace"), path
    try:
        from criticalkv.eval.haystack import haystack_sentences

        return " ".join(haystack_sentences()), "criticalkv.eval.haystack (the 1911 Britannica article)"
    except Exception:  # noqa: BLE001 (the data package absent: a bare GPU machine)
        root = Path(__file__).resolve().parents[2] / "examples"
        files = sorted(root.glob("*.txt"))
        if not files:
            raise FileNotFoundError("no text for the checkpoint's layer: give --prompt-file") from None
        return "\n\n".join(f.read_text() for f in files), "examples/*.txt of the repository"


def load_checkpoint_layer(torch, path: str, dtype, device):
    """(model, its tokenizer, its LayerShape) of a checkpoint folder, on ``device`` in ``dtype``."""
    from transformers import AutoTokenizer

    from criticalkv.runtime.torch_backend import load_checkpoint

    model = load_checkpoint(Path(path), dtype, torch.device(device))
    config = model.config
    heads = config.num_attention_heads
    shape = LayerShape(hidden=config.hidden_size, heads=heads,
                       kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                       head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                       intermediate=config.intermediate_size, num_layers=config.num_hidden_layers)
    return model, AutoTokenizer.from_pretrained(path), shape


def prunes(policy) -> bool:
    """Whether the policy's stage 2 is CriticalKV's pruned one (l1 value norms, a second stage)."""
    return policy.method.refine is not None and policy.value_norm == "l1"


def pruning_of(run: "Run", policy, tensors: dict, n: int) -> dict | None:
    """The exact L1 norms the pruned stage 2 computes on these tensors, as a share of the older tokens' (what the
    unpruned stage 2 computes), and its most candidate rounds over the heads: the PyTorch reference on the same tensors
    (the kernels' rounds follow the same rule: 2k candidates, doubled until the best bound left out is below the k-th
    exact score). None for a policy without a pruned stage 2."""
    if not prunes(policy):
        return None
    from criticalkv.methods import pruned
    from criticalkv.node import node_capacity
    from criticalkv.selection.op import reference_select

    shape = run.results["shape_used"]
    capacity = node_capacity(policy, n, tensors["k"].shape[1], shape["layer_idx"], shape["num_layers"])
    pruned.STATS.reset()
    reference_select(tensors["q"], tensors["k"], tensors["v"], tensors["o"], None, None, None, policy,
                     shape["layer_idx"], shape["num_layers"], capacity)
    if not pruned.STATS.calls:
        return None
    return {"exact_norms_percent": 100.0 * pruned.STATS.fraction(),
            "rounds": max(c["rounds"] for c in pruned.STATS.calls)}


# ---------------------------------------------------------------------------------------------- kvpress
def kvpress_shell() -> None:
    """Make ``kvpress.presses.*`` importable without running kvpress's package face (``kvpress/__init__.py``): an
    empty ``kvpress`` module over its folder, unless kvpress is imported already. ImportError when it is not
    installed."""
    spec = importlib.util.find_spec("kvpress")  # finds the package without executing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("kvpress is not installed (carry its wheel: pip download --no-deps kvpress==0.5.5)")
    if "kvpress" not in sys.modules:
        package = types.ModuleType("kvpress")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        sys.modules["kvpress"] = package


def load_kvpress():
    """kvpress's SnapKVPress, CriticalKVPress, AdaKVPress and its version, or raise ImportError with the reason.

    The presses are loaded from kvpress's folder without running its package face (``kvpress/__init__.py``): the face
    imports every press, some of which need packages a bare GPU machine lacks (datasets, cachetools, fire), and it
    patches transformers' attention functions to apply AdaKV's key masks, which would then run inside the prefill
    timed here (and apply one length's masks to the next). The three presses need only torch and transformers."""
    kvpress_shell()
    snapkv = importlib.import_module("kvpress.presses.snapkv_press").SnapKVPress
    critical = importlib.import_module("kvpress.presses.criticalkv_press").CriticalKVPress
    adakv = importlib.import_module("kvpress.presses.adakv_press").AdaKVPress
    from importlib import metadata

    try:
        version = metadata.version("kvpress")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {"SnapKV": snapkv, "CriticalKV": critical, "AdaKV": adakv, "version": version,
            "note": "presses loaded from its folder without its package face (no attention patch)"}


def kvpress_presses(kv, budget: int, n: int, window: int) -> dict:
    """The timed presses at the same kept fraction as ``budget`` of ``n`` (window as ours; other settings kvpress's
    defaults)."""
    ratio = max(0.0, 1.0 - budget / n)

    def snap():
        return kv["SnapKV"](compression_ratio=ratio, window_size=window, kernel_size=7)

    return {"SnapKVPress": snap(), "CriticalKVPress(SnapKV)": kv["CriticalKV"](snap()),
            "AdaKVPress(SnapKV)": kv["AdaKV"](snap())}


# ---------------------------------------------------------------------------------------------- the run
def device_info(torch, device) -> dict:
    info = {"device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1))
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            info["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
        except (OSError, subprocess.TimeoutExpired):
            info["driver"] = None
    else:
        info["name"] = "CPU (dry run)"
    return info


class Run:
    """One benchmark run: holds the results and rewrites NAME.json / NAME.md after every measurement."""

    def __init__(self, args, torch, device, shape: LayerShape, results: dict):
        self.args, self.torch, self.device, self.shape, self.results = args, torch, device, shape, results
        self.cuda = device.type == "cuda"
        self.clock = Clock(torch, device)
        self.deadline = Deadline(args.time_budget)
        self.stem = Path(args.out) / args.name
        self.per_policy_cost: dict[str, tuple[int, float]] = {}  # label -> (n, seconds of its measurement)
        self.broken: str | None = None  # the sticky CUDA error after which nothing more is tried

    def save(self):
        from criticalkv.bench.report import write_atomic

        write_atomic(self.stem.with_suffix(".json"), json.dumps(self.results, indent=1) + "\n")
        write_atomic(self.stem.with_suffix(".md"), render(self.results))

    def skip(self, what: str, reason: str):
        self.results["not_measured"].append({"what": what, "reason": reason})
        print(f"  skipped {what}: {reason}", flush=True)
        self.save()

    def estimate(self, label: str, n: int) -> float:
        """Seconds a measurement of ``label`` at ``n`` should take, scaled linearly from its last one (0: unknown)."""
        if label not in self.per_policy_cost:
            return 0.0
        n0, seconds = self.per_policy_cost[label]
        return seconds * n / n0

    def refusal(self, estimate_s: float) -> str | None:
        """Why a measurement estimated at ``estimate_s`` seconds is not started (None: start it)."""
        if self.broken:
            return f"the CUDA context was lost earlier ({self.broken})"
        if not self.deadline.allows(estimate_s):
            return f"time budget ({max(self.deadline.remaining(), 0):.0f} s left, estimated {estimate_s:.1f} s)"
        return None

    def error(self, what: str, err: BaseException):
        text = f"{type(err).__name__}: {err}"
        self.results["errors"].append({"what": what, "error": text})
        print(f"  ERROR {what}: {text}", flush=True)
        if self.cuda and any(s in text.lower() for s in STICKY_CUDA_ERRORS):
            self.broken = f"{what}: {text.splitlines()[0][:200]}"
        self.save()


def select_call(run: Run, policy, tensors: dict, n: int, prompt_lengths=None):
    from criticalkv.node import node_capacity
    from criticalkv.selection.op import select_layer_kv

    shape = run.results["shape_used"]
    layer_idx, num_layers = shape["layer_idx"], shape["num_layers"]
    capacity = node_capacity(policy, n, tensors["k"].shape[1], layer_idx, num_layers)
    q, k, v, o = tensors["q"], tensors["k"], tensors["v"], tensors["o"]
    # "auto": a policy without a kernel flow is timed on the PyTorch reference, which path_of names in the results
    return lambda: select_layer_kv(policy, q, k, v, o, layer_idx, num_layers, capacity, prompt_lengths=prompt_lengths,
                                   implementation="auto")


def path_of(run: Run, policy, tensors: dict) -> str:
    from criticalkv.selection.op import native_reason

    if not run.cuda:
        return "reference (CPU)"
    reason = native_reason(policy, tensors["q"], tensors["k"], tensors["v"], tensors["o"])
    return "kernels" if reason is None else f"reference: {reason}"


def measure_length(run: Run, layer, rotary, policies: list, n: int, kvpress, data: TrainedData) -> None:
    """At n tokens: the layer's prefill, every policy's selection on the trained-structure tensors (``data``), the
    worst-case rows (the policies that prune, on the random layer's tensors) where n is one of
    --worst-case-lengths, and kvpress's presses (on the random layer's tensors: they read its hidden states)."""
    torch, args = run.torch, run.args
    dtype = getattr(torch, args.dtype)
    print(f"n = {n}", flush=True)
    with torch.inference_mode():
        trained = data.inputs(n, seed=n)
        worst = n in args.worst_case_lengths and any(prunes(policy) for _, policy in policies)
        # the random layer's tensors: the prefill's input unless a checkpoint gave real ones, the worst-case rows,
        # kvpress's presses
        t = (layer_inputs(torch, layer, rotary, n, 1, args.window, dtype, run.device, seed=n)
             if "hidden" not in trained or worst or kvpress is not None else None)
        timed = trained if "hidden" in trained else t
        prefill = None
        reason = run.refusal(run.estimate("prefill", n))
        if reason is None:
            try:
                begin = time.monotonic()
                fn = lambda: layer(timed["hidden"], attention_mask=None, position_ids=timed["positions"],  # noqa: E731
                                   position_embeddings=(timed["cos"], timed["sin"]))
                prefill = run.clock.measure(fn, args.repeats, args.measure_seconds)
                run.per_policy_cost["prefill"] = (n, time.monotonic() - begin)
                run.results["prefill"][str(n)] = prefill
                print(f"  prefill (one layer, SDPA): {prefill['ms']:.3f} ms", flush=True)
                run.save()
            except Exception as err:  # noqa: BLE001 (recorded; the policies still run)
                run.error(f"prefill n={n}", err)
        else:
            run.skip(f"prefill n={n}", reason)
        for tensors in (trained, t):
            if tensors is not None:
                tensors.pop("hidden", None)
        for label, policy in policies:
            measure_row(run, label, policy, trained, n, prefill, "trained")
        if worst:
            for label, policy in policies:
                if prunes(policy):
                    measure_row(run, label, policy, t, n, prefill, "random")
        if kvpress is not None:
            measure_kvpress(run, layer, t, n, kvpress)
        trained.clear()  # this length's tensors go before the next length's are made
        if t is not None:
            t.clear()
    if run.cuda:
        torch.cuda.empty_cache()


def measure_row(run: Run, label: str, policy, tensors: dict, n: int, prefill: dict | None, data: str) -> None:
    """One policy's selection at n on ``tensors`` (``data``: "trained" or "random", the worst case): its time, its
    kernels, its pruning, its share of the prefill and, on the trained tensors, the verdict."""
    torch, args = run.torch, run.args
    work = stage_work(run.shape, n, args.window, torch.finfo(getattr(torch, args.dtype)).bits // 8)
    key = label if data == "trained" else f"{label} (random)"
    what = f"{key} n={n}"
    reason = run.refusal(run.estimate(key, n))
    if reason is not None:
        run.skip(what, reason)
        return
    row = {"policy": label, "n": n, "batch": 1, "data": data, "path": path_of(run, policy, tensors)}
    try:
        begin = time.monotonic()
        fn = select_call(run, policy, tensors, n)
        row.update(run.clock.measure(fn, args.repeats, args.measure_seconds))
        if args.profile:
            row["kernels"] = kernel_times(torch, fn, run.cuda, run.clock)
            row["kernels_ms"] = sum(k["ms"] for k in row["kernels"]) if run.cuda else None
            row["stages"] = stages(row["kernels"], work, run.results["floors"]) if run.cuda else {}
        row["pruning"] = pruning_of(run, policy, tensors, n)
        run.per_policy_cost[key] = (n, time.monotonic() - begin)
    except Exception as err:  # noqa: BLE001
        run.error(what, err)
        return
    # the verdict takes the GPU's time (the profiled kernels) when there is one: in a prefill the op's Python and
    # launch overhead overlaps the previous layer's work; the event time is reported beside it
    row["judged_by"] = "kernels" if row.get("kernels_ms") else "events"
    judged = row["kernels_ms"] if row.get("kernels_ms") else row["ms"]
    row["judged_ms"] = judged
    whole = work["layer inputs once"]
    row["vs_memory_floor"] = against_floors(judged, 0.0, whole["bytes"], run.results["floors"])
    if prefill is not None:
        row["prefill_ms"] = prefill["ms"]
        row["share_percent"] = 100.0 * judged / prefill["ms"]
    row["target"], row["met"] = judge(policy, n, judged, row.get("share_percent"), run.results["targets_apply"])
    if data != "trained":  # the worst case is reported, not judged
        row["target"], row["met"] = "worst case: no verdict", None
    run.results["selection"].append(row)
    pruning = row["pruning"]
    print(f"  {key:36s} {row['ms']:9.3f} ms (kernels {_f(row.get('kernels_ms'))})  {row['path']}"
          + (f"  {row['share_percent']:.2f} % of the prefill" if "share_percent" in row else "")
          + (f"  exact norms {pruning['exact_norms_percent']:.1f} %, {pruning['rounds']} rounds" if pruning else ""),
          flush=True)
    run.save()


def device_ms(run: Run, fn) -> float | None:
    """The summed kernel time of one profiled call (None on the CPU or when the profiler saw no kernel)."""
    if not run.cuda:
        return None
    return sum(k["ms"] for k in kernel_times(run.torch, fn, True, run.clock)) or None


def stages(kernels: list[dict], work: dict, floor: dict) -> dict:
    """The profiled kernels grouped by the stage whose floor judges them (unmatched kernels: no floor)."""
    out: dict[str, dict] = {}
    for k in kernels:
        stage = stage_of(k["name"])
        if stage is None:
            continue
        entry = out.setdefault(stage, {"kernels": [], "ms": 0.0})
        entry["kernels"].append(k["name"])
        entry["ms"] += k["ms"]
    for stage, entry in out.items():
        entry.update(against_floors(entry["ms"], work[stage]["flop"], work[stage]["bytes"], floor))
    return out


def measure_kvpress(run: Run, layer, t: dict, n: int, kv) -> None:
    args = run.args
    if n <= args.window:
        return
    kwargs = {"position_embeddings": (t["cos"], t["sin"])}
    for label, press in kvpress_presses(kv, args.budget, n, args.window).items():
        what = f"kvpress {label} n={n}"
        reason = run.refusal(run.estimate(label, n))
        if reason is not None:
            run.skip(what, reason)
            continue
        try:
            begin = time.monotonic()
            fn = lambda: press.compress(layer.self_attn, t["normed"], t["k"], t["v"], None, kwargs)  # noqa: E731
            kept = fn()[0].shape[2]  # AdaKV masks instead of gathering: it keeps all n
            row = {"press": label, "n": n, "kept_per_head": kept,
                   **run.clock.measure(fn, args.repeats, args.measure_seconds)}
            run.per_policy_cost[label] = (n, time.monotonic() - begin)
            if hasattr(layer.self_attn, "masked_key_indices"):  # AdaKV's masks: nothing here reads them
                del layer.self_attn.masked_key_indices
        except Exception as err:  # noqa: BLE001
            run.error(what, err)
            continue
        prefill = run.results["prefill"].get(str(n))
        if prefill:
            row["share_percent"] = 100.0 * row["ms"] / prefill["ms"]
        run.results["kvpress"]["rows"].append(row)
        print(f"  kvpress {label:26s} {row['ms']:9.3f} ms", flush=True)
        run.save()


def measure_batch(run: Run, policies: list, lengths: list[int], data: TrainedData) -> None:
    """Batch of len(lengths) left-padded rows (row i's prompt = the last lengths[i] tokens of the trained-structure
    tensors) vs each row alone."""
    torch, args = run.torch, run.args
    n = max(lengths)
    batch = len(lengths)
    print(f"batch {batch} of lengths {lengths}", flush=True)
    with torch.inference_mode():
        one = data.inputs(n, seed=7)
        for name in ("hidden", "normed"):
            one.pop(name, None)
        padded = {"q": one["q"].expand(batch, -1, -1, -1).contiguous(),
                  "k": one["k"].expand(batch, -1, -1, -1).contiguous(),
                  "v": one["v"].expand(batch, -1, -1, -1).contiguous(), "o": one["o"]}
        prompt_lengths = torch.tensor(lengths, dtype=torch.int32, device=run.device)
        rows = {length: {"q": one["q"], "k": one["k"][:, :, n - length:].contiguous(),
                         "v": one["v"][:, :, n - length:].contiguous(), "o": one["o"]} for length in lengths}
        for label, policy in policies:
            what = f"batch {label}"
            reason = run.refusal(run.estimate(label, n) * (1 + sum(lengths) / n))
            if reason is not None:
                run.skip(what, reason)
                continue
            profiled = run.cuda and args.profile
            try:
                together_fn = select_call(run, policy, padded, n, prompt_lengths)
                together = run.clock.measure(together_fn, args.repeats, args.measure_seconds)
                alone_fns = {length: select_call(run, policy, rows[length], length) for length in lengths}
                alone = {length: run.clock.measure(fn, args.repeats, args.measure_seconds)["ms"]
                         for length, fn in alone_fns.items()}
                if profiled:  # the GPU's time of one call each, as the single-row verdicts take it
                    kernels_together = device_ms(run, together_fn)
                    kernels_alone = {length: device_ms(run, fn) for length, fn in alone_fns.items()}
            except Exception as err:  # noqa: BLE001
                run.error(what, err)
                continue
            total = sum(alone.values())
            row = {"policy": label, "lengths": lengths, "path": path_of(run, policy, padded),
                   "batch_ms": together["ms"],
                   "batch_times_ms": together["times_ms"], "rows_ms": {str(k): v for k, v in alone.items()},
                   "sum_of_rows_ms": total, "ratio_events": together["ms"] / total, "target": f"<= {BATCH_TARGET}x"}
            if profiled and kernels_together and all(kernels_alone.values()):
                row.update(batch_kernels_ms=kernels_together,
                           rows_kernels_ms={str(k): v for k, v in kernels_alone.items()},
                           sum_of_rows_kernels_ms=sum(kernels_alone.values()), judged_by="kernels")
                row["ratio"] = kernels_together / row["sum_of_rows_kernels_ms"]
            else:
                row.update(judged_by="events", ratio=row["ratio_events"])
            row["met"] = (row["ratio"] <= BATCH_TARGET) if run.results["targets_apply"] else None
            run.results["batch"].append(row)
            print(f"  {label:28s} batch {together['ms']:9.3f} ms, rows alone {total:9.3f} ms: {row['ratio']:.2f}x "
                  f"({row['judged_by']})", flush=True)
            run.save()
        del padded, rows, one
    if run.cuda:
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- rendering
def _f(x, digits=3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _met(x) -> str:
    return "-" if x is None else ("yes" if x else "**no**")


def render(results: dict) -> str:
    """The markdown of a run (also what the command prints)."""
    dev = results.get("device", {})
    s = results["settings"]
    lines = ["# The selection per layer against the layer's prefill (`criticalkv bench gpu`)", "",
             f"- command: `{results['command']}`",
             f"- device: {dev.get('name')} (compute {dev.get('capability', '-')}, {dev.get('sms', '-')} SMs, "
             f"{dev.get('memory_gib', '-')} GiB), driver {dev.get('driver', '-')}, CUDA {dev.get('cuda')}, "
             f"torch {dev.get('torch')}",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in results.get("versions", {}).items()),
             f"- commit: {results.get('commit')}; status: {results.get('status')}",
             f"- layer: {results['shape_used']}; {s['dtype']}, window {s['window']}, budget {s['budget']}, batch 1; "
             f"medians of up to {s['repeats']} timed calls after a warm-up (CUDA events)"]
    data = results.get("data") or {}
    if data.get("kind") == "synthetic":
        source = data.get("measured_on") or {}
        lines.append(f"- selection inputs (`trained` rows): a layer of this shape drawn from {source.get('model')}'s "
                     f"statistics (layers {source.get('layers')}, {source.get('tokens')} tokens; {data.get('stats')}: "
                     "outlier channels, effective rank, attention sharpness, o_proj); `random` rows: the random "
                     "layer's own tensors (the pruning's worst case, no verdict)")
    elif data.get("kind") == "checkpoint":
        lines.append(f"- selection inputs (`trained` rows): {data.get('model')} layer {data.get('layer')} on "
                     f"{data.get('text')}" + (f" (repeated {data['text_repeated']}x)" if data.get("text_repeated")
                                              else "") + "; `random` rows: a random layer's (the worst case)")
    if results.get("dry_run"):
        lines.append("- **dry run** (tiny shapes on the CPU): the numbers test the plumbing and mean nothing")
    fl = results.get("floors") or {}
    if fl:
        lines += ["", "## Floors (this run)", "", "| floor | value |", "|---|---:|",
                  f"| GEMM {fl['gemm']['m_n_k']}^3 {fl['gemm']['dtype']} | {fl['gemm_tflops']:.2f} TFLOP/s |",
                  f"| device copy (read + write) | {fl['copy_gbps']:.0f} GB/s |"]
    lines += ["", "## Selection vs prefill", "",
              "Selection ms: CUDA events around the op (its Python and launch overhead included); kernels ms: the "
              "GPU's time of one profiled call, which the share and the verdict take when there is one. Exact norms: "
              "the L1 norms CriticalKV's pruned stage 2 computes, as a share of the older tokens', and its candidate "
              "rounds (1: the first 2k candidates settled every head), by the PyTorch reference on the same tensors.",
              "",
              "| policy | n | data | path | selection ms | kernels ms | exact norms % | rounds | prefill ms | share % "
              "| target | met |",
              "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in sorted(results["selection"], key=lambda r: (r["n"], r.get("data", "trained") != "trained",
                                                         results["policy_order"].index(r["policy"]))):
        pruning = r.get("pruning") or {}
        lines.append(f"| {r['policy']} | {r['n']} | {r.get('data', 'trained')} | {r['path']} | {_f(r['ms'])} | "
                     f"{_f(r.get('kernels_ms'))} | {_f(pruning.get('exact_norms_percent'), 1)} | "
                     f"{pruning.get('rounds', '-')} | {_f(r.get('prefill_ms'))} | {_f(r.get('share_percent'), 2)} | "
                     f"{r['target']} | {_met(r['met'])} |")
    stage_rows = [(r, name, st) for r in results["selection"] for name, st in (r.get("stages") or {}).items()]
    if stage_rows:
        lines += ["", "## Stages against the floors (torch.profiler kernel times of one call)", "",
                  "| policy | n | data | stage | ms | GFLOP | MB | TFLOP/s | GB/s | floor ms | floor / time "
                  "| kernels |",
                  "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r, name, st in sorted(stage_rows, key=lambda x: (x[0]["n"], x[0]["policy"], x[0].get("data", ""), x[1])):
            lines.append(f"| {r['policy']} | {r['n']} | {r.get('data', 'trained')} | {name} | {_f(st['ms'])} | "
                         f"{st['flop'] / 1e9:.1f} | "
                         f"{st['bytes'] / 1e6:.1f} | {_f(st.get('tflops'), 1)} | {_f(st.get('gbps'), 0)} | "
                         f"{_f(st.get('floor_ms'))} | {_f(st.get('of_floor'), 3)} | {', '.join(st['kernels'])} |")
    kernel_rows = [r for r in results["selection"] if r.get("kernels")]
    if kernel_rows:
        lines += ["", "## Where the time goes (one profiled call)", "", "| policy | n | data | kernels (ms, calls) |",
                  "|---|---:|---|---|"]
        for r in sorted(kernel_rows, key=lambda r: (r["n"], r.get("data", "trained") != "trained",
                                                    results["policy_order"].index(r["policy"]))):
            top = "; ".join(f"{k['name'][:60]} {k['ms']:.3f} x{k['calls']}" for k in r["kernels"][:6])
            lines.append(f"| {r['policy']} | {r['n']} | {r.get('data', 'trained')} | {top} |")
    if results["batch"]:
        lines += ["", "## Batch of mixed lengths vs its rows at batch 1", "",
                  "| policy | lengths | path | batch ms | sum of rows ms | batch kernels ms | rows kernels ms | ratio "
                  "| target | met |", "|---|---|---|---:|---:|---:|---:|---:|---|---|"]
        for r in results["batch"]:
            lines.append(f"| {r['policy']} | {min(r['lengths'])}..{max(r['lengths'])} ({len(r['lengths'])}) | "
                         f"{r['path']} | {_f(r['batch_ms'])} | {_f(r['sum_of_rows_ms'])} | "
                         f"{_f(r.get('batch_kernels_ms'))} | {_f(r.get('sum_of_rows_kernels_ms'))} | "
                         f"{r['ratio']:.2f}x ({r['judged_by']}) | {r['target']} | {_met(r['met'])} |")
    kv = results["kvpress"]
    lines += ["", "## kvpress presses on the same tensors", ""]
    if kv.get("rows"):
        lines += [f"kvpress {kv.get('version')} ({kv.get('note')}); `press.compress` (scores, top-k, gather or mask)",
                  "on the random layer's hidden states and K/V (the presses project their own window queries from "
                  "hidden states, which the synthetic layer has none of: compare with the `random` rows);",
                  "CUDA events around the call (its host synchronisations included).", "",
                  "| press | n | kept per head | ms | share % |", "|---|---:|---:|---:|---:|"]
        for r in sorted(kv["rows"], key=lambda r: (r["n"], r["press"])):
            lines.append(f"| {r['press']} | {r['n']} | {r['kept_per_head']} | {_f(r['ms'])} | "
                         f"{_f(r.get('share_percent'), 2)} |")
    else:
        lines.append(f"not measured: {kv.get('skipped', 'no rows')}")
    if results["not_measured"] or results["errors"]:
        lines += ["", "## Not measured", ""]
        lines += [f"- {x['what']}: {x['reason']}" for x in results["not_measured"]]
        lines += [f"- {x['what']}: ERROR {x['error']}" for x in results["errors"]]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- command line
def parse_args(argv):
    from criticalkv.eval.specs import parse_list

    p = argparse.ArgumentParser(prog="criticalkv bench gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help="comma-separated policy specs name[:knob=value...] (default: every policy the kernels run, "
                        "and criticalkv with value_norm=l2)")
    p.add_argument("--lengths", help="prompt lengths, measured in this order (default: 32768,131072,8192; dry run "
                                     "256,128)")
    p.add_argument("--batch-lengths", help="row lengths of the mixed batch (default: 4096,8192,...,32768; dry run "
                                          "32,64,...,256); 'none' skips the batch")
    p.add_argument("--budget", type=int, help="entries per KV head (default: 2048; dry run 64)")
    p.add_argument("--window", type=int, help="window queries (default: 32; dry run 8)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                   help="default: bfloat16 (float32 in a dry run)")
    p.add_argument("--repeats", type=int, help="timed calls per measurement after a warm-up (default: 5; dry run 2)")
    p.add_argument("--measure-seconds", type=float, default=3.0,
                   help="fewer repeats when a measurement would take longer than this (default: 3)")
    p.add_argument("--time-budget", type=float, default=None,
                   help=f"seconds for the whole run: measurements that would not fit are skipped and listed "
                        f"(default: ${TIME_BUDGET_ENV}, else none)")
    p.add_argument("--model", help="a Hugging Face checkpoint folder: its middle layer's own queries, keys and values "
                                   "on a real text (the model runs up to that layer), its shape instead of "
                                   "Llama-3.1-8B's (default: a layer drawn from --layer-stats at Llama-3.1-8B's shape)")
    p.add_argument("--prompt-file", help="the text --model's layer reads, repeated up to each length when shorter "
                                         "(default: the evaluations' haystack text, else the repository's examples)")
    p.add_argument("--layer-stats", help="a statistics file of criticalkv.bench.trained_layer the synthetic layer is "
                                         "drawn from (default: the bundled SmolLM2-135M's, shipped with the package)")
    p.add_argument("--worst-case-lengths", help="lengths at which the policies that prune are also timed on the random "
                                                "layer (nearly uniform attention: the pruning's worst case; default: "
                                                "the first of --lengths; 'none' skips them)")
    p.add_argument("--no-profile", dest="profile", action="store_false", help="skip the per-kernel profile")
    p.add_argument("--no-kvpress", dest="kvpress", action="store_false", help="skip kvpress's presses")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (automatic without CUDA)")
    p.add_argument("--device", default="cuda", help="torch device when CUDA is used (default: cuda)")
    p.add_argument("--out", default="results/gpu", help="results folder (default: results/gpu)")
    p.add_argument("--name", default="selection_gpu", help="file stem (default: selection_gpu)")
    args = p.parse_args(argv)
    if args.time_budget is None and os.environ.get(TIME_BUDGET_ENV):
        try:
            args.time_budget = float(os.environ[TIME_BUDGET_ENV])
        except ValueError:
            p.error(f"${TIME_BUDGET_ENV}={os.environ[TIME_BUDGET_ENV]!r} is not a number of seconds")
    if ((args.repeats is not None and args.repeats < 1) or args.measure_seconds <= 0
            or (args.time_budget is not None and args.time_budget <= 0)):
        p.error("--repeats must be >= 1, --measure-seconds and --time-budget > 0")
    try:
        args.lengths = parse_list(args.lengths, "--lengths") if args.lengths else None
        if args.batch_lengths and args.batch_lengths.strip().lower() == "none":
            args.batch_lengths = []
        elif args.batch_lengths:
            args.batch_lengths = parse_list(args.batch_lengths, "--batch-lengths")
        if args.worst_case_lengths and args.worst_case_lengths.strip().lower() == "none":
            args.worst_case_lengths = []
        elif args.worst_case_lengths:
            args.worst_case_lengths = parse_list(args.worst_case_lengths, "--worst-case-lengths")
    except ValueError as err:
        p.error(str(err))
    return p, args


def main(argv: list[str] | None = None) -> int:
    parser, args = parse_args(argv)
    import torch

    from criticalkv.bench.machine import header
    from criticalkv.eval.specs import parse_policy_spec
    from criticalkv.policy import KVPolicy

    dry = args.dry_run or not torch.cuda.is_available()
    auto_dry = dry and not args.dry_run
    args.dry_run = dry
    device = torch.device("cpu") if dry else torch.device(args.device)
    shape = DRY_SHAPE if dry else LLAMA31_8B
    args.lengths = args.lengths or list(DRY_LENGTHS if dry else DEFAULT_LENGTHS)
    if args.worst_case_lengths is None:
        args.worst_case_lengths = args.lengths[:1]
    if args.batch_lengths is None:
        args.batch_lengths = list(DRY_BATCH_LENGTHS if dry else DEFAULT_BATCH_LENGTHS)
    args.budget = args.budget or (64 if dry else 2048)
    args.window = args.window or (8 if dry else 32)
    args.dtype = args.dtype or ("float32" if dry else "bfloat16")
    args.repeats = args.repeats or (2 if dry else 5)
    if min(args.lengths + (args.batch_lengths or [args.window])) < args.window or args.budget < args.window:
        parser.error(f"--lengths, --batch-lengths and --budget must be >= the window ({args.window})")
    base = KVPolicy("full").replace(budget=args.budget, window=args.window)
    try:
        policies = [(spec, parse_policy_spec(spec, base)) for spec in args.policies.split(",") if spec.strip()]
    except ValueError as err:
        parser.error(str(err))
    if not policies:
        parser.error("--policies: give at least one policy")
    if args.model and not Path(args.model, "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there (a Hugging Face checkpoint folder)")
    if args.layer_stats and not Path(args.layer_stats).is_file():
        parser.error(f"--layer-stats {args.layer_stats}: no such file")
    checkpoint = tokenizer = None
    if args.model:
        checkpoint, tokenizer, shape = load_checkpoint_layer(torch, args.model, getattr(torch, args.dtype), device)
    command = "criticalkv bench gpu " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv))
    results = header(command)
    layer_idx = shape.num_layers // 2
    results.update({
        "dry_run": dry, "device": device_info(torch, device), "status": "running",
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "name")},
        "shape_used": {**dataclasses.asdict(shape), "layer_idx": layer_idx},
        "policy_order": [label for label, _ in policies],
        # the goals are for the Llama-3.1-8B layer at budget 2048, window 32, on a GPU
        "targets_apply": (not dry and shape == LLAMA31_8B and args.budget == 2048 and args.window == 32
                          and args.dtype == "bfloat16"),
        "floors": None, "prefill": {}, "selection": [], "batch": [], "kvpress": {"rows": []},
        "not_measured": [], "errors": [],
    })
    if auto_dry:
        print("no CUDA device: dry run (tiny shapes on the CPU)", flush=True)
    run = Run(args, torch, device, shape, results)
    try:
        print(f"# {command}\n# {results['device'].get('name')}, torch {torch.__version__}", flush=True)
        run.save()
        try:
            results["floors"] = floors(torch, device, dry, run.clock)
            print(f"floors: GEMM {results['floors']['gemm_tflops']:.2f} TFLOP/s, copy "
                  f"{results['floors']['copy_gbps']:.0f} GB/s", flush=True)
        except Exception as err:  # noqa: BLE001
            run.error("floors", err)
            results["floors"] = {}
        kvpress = None
        if args.kvpress:
            try:
                kvpress = load_kvpress()
                results["kvpress"].update(version=kvpress["version"], note=kvpress["note"])
            except Exception as err:  # noqa: BLE001 (absent or broken: the rest of the run goes on)
                results["kvpress"]["skipped"] = f"{type(err).__name__}: {err}"
                print(f"kvpress: skipped ({results['kvpress']['skipped']})", flush=True)
        else:
            results["kvpress"]["skipped"] = "--no-kvpress"
        if checkpoint is None:
            layer, rotary = make_layer(torch, shape, getattr(torch, args.dtype), device, layer_idx)
        else:
            layer, rotary = checkpoint.model.layers[layer_idx], checkpoint.model.rotary_emb
        data = TrainedData(torch, args, shape, rotary, getattr(torch, args.dtype), device, layer_idx, checkpoint,
                           tokenizer)
        results["data"] = data.description
        print(f"selection inputs: {data.label}; worst case (random layer) at {args.worst_case_lengths or 'no length'}",
              flush=True)
        for n in args.lengths:
            reason = run.refusal(0.0)
            if reason is not None:
                run.skip(f"n={n}", reason)
                continue
            try:
                measure_length(run, layer, rotary, policies, n, kvpress, data)
            except Exception as err:  # noqa: BLE001 (the layer's inputs could not be made: the next length may)
                run.error(f"n={n}", err)
        if args.batch_lengths:
            reason = run.refusal(0.0)
            try:
                if reason is None:
                    measure_batch(run, policies, args.batch_lengths, data)
                else:
                    run.skip("batch", reason)
            except Exception as err:  # noqa: BLE001
                run.error("batch", err)
        results["status"] = "complete" if not results["not_measured"] and not results["errors"] else "partial"
    finally:
        if results["status"] == "running":
            results["status"] = "interrupted"
        run.save()
    print(render(results))
    return 0 if not results["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
