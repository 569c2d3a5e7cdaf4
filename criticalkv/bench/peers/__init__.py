"""Peer implementations in their own virtual environments, and the single-request comparison.

``setup_peers`` creates, under a folder the user chooses (default ``.peers/``, git-ignored):

* ``kvpress/``: ``torch==2.13.0`` first (the CPU build), then ``kvpress==0.5.5`` (it pins
  ``transformers<5.3``, so it cannot share criticalkv's environment);
* ``transformers/``: ``torch==2.13.0`` and the same ``transformers`` version as criticalkv's, plain
  ``generate`` with the full cache;
* ``aiperf/``: ``aiperf==0.13.0`` (NVIDIA's load generator, ~1.2 GB; never part of CI);
* ``onnxruntime-genai/``: ``torch==2.13.0``, then ``onnxruntime-genai==0.18.0`` with what its model builder
  needs (transformers, onnx, onnx-ir, onnxscript, sentencepiece, protobuf), ~1 GB;
* ``openvino/``: ``torch==2.13.0``, then (torch pinned again, with ``torchvision==0.28.0``) OpenVINO GenAI
  2026.4.1 (``openvino``, ``openvino-tokenizers``, ``openvino-genai``) and ``optimum-intel==2.2.0`` /
  ``optimum==2.3.0`` for ``optimum-cli export openvino`` (torchvision uninstalled afterwards), ~1.6 GB. These two are the CPU runtimes of ``criticalkv bench peers`` (``criticalkv/bench/peers/cpu.py``).

``single_request`` then times one request end to end (tokenisation + prefill + selection + decode,
model load excluded, ``--repeats`` after one warm-up, medians): criticalkv's ``Engine.generate`` on
ONNX Runtime in this process, kvpress ``CriticalKVPress(SnapKVPress)`` through its
``kv-press-text-generation`` pipeline and transformers ``generate`` in their environments
(``criticalkv/bench/peers/single_runner.py``, which imports nothing from criticalkv). Every implementation gets
the same text wrapped in the model's chat template, greedy decoding and stop tokens disabled, so each
produces exactly ``--new-tokens`` tokens.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from criticalkv.bench.machine import header_lines
from criticalkv.bench.prompts import corpus_ids, make_prompts
from criticalkv.runtime import Engine
from criticalkv.runtime.manifest import read_manifest

PEER_RUNNER = Path(__file__).with_name("single_runner.py")
TORCH = "torch==2.13.0"
KVPRESS = "kvpress==0.5.5"
AIPERF = "aiperf==0.13.0"
ORT_GENAI = ["onnxruntime-genai==0.18.0", "transformers", "onnx", "onnx-ir", "onnxscript", "sentencepiece", "protobuf"]
# optimum-intel requires torch and torchvision: both pinned with torch==2.13.0 in the same step (otherwise pip
# upgrades torch to a multi-GB CUDA build); the registry's torchvision is a CUDA build whose operators fail to
# register on the CPU torch, and transformers imports it when present, so it is uninstalled afterwards
# (the export does not need it)
OPENVINO = ["torchvision==0.28.0", "openvino==2026.4.1", "openvino-tokenizers==2026.4.1.0", "openvino-genai==2026.4.1.0",
            "optimum-intel==2.2.0", "optimum==2.3.0"]
#: Distributions removed after a peer's install steps (see OPENVINO).
UNINSTALL_AFTER = {"openvino": ["torchvision"]}
PEER_NAMES = ("kvpress", "transformers", "aiperf", "onnxruntime-genai", "openvino")


def peer_requirements(name: str) -> list[list[str]]:
    """pip install steps of one peer environment, in order (torch first: kvpress's range accepts it)."""
    if name == "kvpress":
        return [[TORCH], [KVPRESS]]
    if name == "transformers":
        return [[TORCH], [f"transformers=={metadata.version('transformers')}", "safetensors"]]
    if name == "aiperf":
        return [[AIPERF]]
    if name == "onnxruntime-genai":
        return [[TORCH], [TORCH, *ORT_GENAI]]
    if name == "openvino":
        return [[TORCH], [TORCH, *OPENVINO]]
    raise ValueError(f"unknown peer {name!r} (choose from {', '.join(PEER_NAMES)})")


def peer_python(root: Path, name: str) -> Path:
    return Path(root) / name / "bin" / "python"


def peer_ready(root: Path, name: str) -> bool:
    return (Path(root) / name / ".criticalkv-ready").is_file()


def setup_peers(root: Path, names=PEER_NAMES, log=print) -> None:
    """Create (or complete) each peer's virtual environment under ``root``; a finished one is kept."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for name in names:
        steps = peer_requirements(name)
        if peer_ready(root, name):
            log(f"peer {name}: ready in {root / name}")
            continue
        venv = root / name
        log(f"peer {name}: creating {venv} ({' then '.join(' '.join(s) for s in steps)}) ...")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        py = str(peer_python(root, name))
        subprocess.run([py, "-m", "pip", "install", "--quiet", "--upgrade", "pip"], check=True)
        for step in steps:
            subprocess.run([py, "-m", "pip", "install", "--quiet", *step], check=True)
        if UNINSTALL_AFTER.get(name):
            subprocess.run([py, "-m", "pip", "uninstall", "--yes", "--quiet", *UNINSTALL_AFTER[name]], check=True)
        (venv / ".criticalkv-ready").write_text(" ".join(" ".join(s) for s in steps) + "\n")
        log(f"peer {name}: ready")


def chat_ids(tokenizer, text: str) -> list[int]:
    """``text`` as the user turn of the model's chat template, generation prompt added (token ids)."""
    templated = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return list(tokenizer(templated, add_special_tokens=False)["input_ids"])


def text_for_chat_length(tokenizer, total: int, seed: int = 0) -> str:
    """A haystack text whose chat-wrapped form is exactly ``total`` tokens."""
    ids = corpus_ids(tokenizer)
    overhead = len(chat_ids(tokenizer, "x")) - len(tokenizer("x", add_special_tokens=False)["input_ids"])
    body = total - overhead
    for attempt in range(8):  # the template's boundary may merge differently: try neighbouring windows
        for prompt in make_prompts(tokenizer, body, 4, seed=seed + attempt, ids=ids):
            if len(chat_ids(tokenizer, prompt.text)) == total:
                return prompt.text
    raise ValueError(f"no text gives exactly {total} chat-wrapped tokens")


def time_criticalkv(engine_dir: Path, text: str, new_tokens: int, repeats: int) -> dict:
    """criticalkv on ONNX Runtime in this process: tokenisation + ``Engine.generate`` (stop tokens off)."""
    start = time.perf_counter()
    engine = Engine.load(engine_dir)
    tokenizer = engine.tokenizer
    load_s = time.perf_counter() - start

    def once():
        ids = chat_ids(tokenizer, text)
        out = engine.generate([ids], max_new_tokens=new_tokens, stop_token_ids=[])
        return len(ids), len(out.tokens[0]), out

    once()
    seconds, prefill, decode, out = [], [], [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        n, m, out = once()
        seconds.append(time.perf_counter() - t0)
        prefill.append(out.prefill_s)
        decode.append(out.decode_s_per_token)
    kept = float(sum(int(x.sum()) for x in out.kept_lengths)) / (len(out.kept_lengths) * out.kept_lengths[0].size)
    engine.close()
    return {"impl": "criticalkv", "seconds": seconds, "prompt_tokens": n, "new_tokens": m,
            "kept_tokens_per_head": kept, "load_s": load_s, "prefill_s": prefill, "decode_s_per_token": decode,
            "ort_threads": os.environ.get("CRITICALKV_ORT_THREADS", "default"),
            "policy": engine.policy.to_dict()}


def time_peer(root: Path, name: str, model_dir: Path, text: str, budget: int, new_tokens: int, repeats: int) -> dict:
    if not peer_ready(root, name):
        raise FileNotFoundError(f"{root / name}: peer environment missing: run with --setup-peers first")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as f:
        f.write(text)
        path = f.name
    try:
        run = subprocess.run([str(peer_python(root, name)), str(PEER_RUNNER), "--impl", name, "--model", str(model_dir),
                              "--text-file", path, "--budget", str(budget), "--new-tokens", str(new_tokens),
                              "--repeats", str(repeats)], capture_output=True, text=True)
    finally:
        os.remove(path)
    if run.returncode != 0:
        raise RuntimeError(f"peer {name} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def single_request(engine_dir: Path, root: Path, isl: int, new_tokens: int, repeats: int, model=None, seed: int = 0,
                   peers=("kvpress", "transformers"), log=print) -> dict:
    """Time criticalkv (ONNX Runtime), kvpress and transformers on one chat-wrapped prompt of ``isl``
    tokens; returns each implementation's numbers, medians and the ratios to criticalkv."""
    from transformers import AutoTokenizer  # here: `criticalkv --help` and argument errors do not load torch

    from criticalkv.hf.loading import resolve_model

    model_dir = resolve_model(model)
    manifest = read_manifest(Path(engine_dir), verify=False)
    budget = manifest["policy"]["budget"]

    tokenizer = AutoTokenizer.from_pretrained(Path(engine_dir) / "tokenizer")
    text = text_for_chat_length(tokenizer, isl, seed)
    out = {"isl": isl, "new_tokens": new_tokens, "repeats": repeats, "budget": budget,
           "model": model_dir.name, "engine_dir": os.path.relpath(engine_dir), "impls": {}}
    log(f"criticalkv (ONNX Runtime, {engine_dir}) ...")
    out["impls"]["criticalkv"] = time_criticalkv(Path(engine_dir), text, new_tokens, repeats)
    for name in peers:
        log(f"{name} ({root / name}) ...")
        out["impls"][name] = time_peer(root, name, model_dir, text, budget, new_tokens, repeats)
    for r in out["impls"].values():
        r["median_s"] = statistics.median(r["seconds"])
    base = out["impls"]["criticalkv"]["median_s"]
    out["ratios"] = {f"criticalkv / {name}": base / out["impls"][name]["median_s"] for name in peers}
    return out


def render_single(results: dict) -> str:
    s = results["single"]
    lines = header_lines(results) + [
        "",
        f"## single request: {s['isl']}-token chat prompt, {s['new_tokens']} new tokens, budget {s['budget']}, "
        f"medians of {s['repeats']} (after one warm-up), model load excluded",
        "| implementation | prompt tokens | new tokens | kept tokens / head | median s | runs s | prefill s (median) | "
        "decode ms / token (median) | load s (not timed) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    names = {"criticalkv": "criticalkv, ONNX Runtime Engine.generate",
             "kvpress": "kvpress 0.5.5 CriticalKVPress(SnapKVPress) pipeline",
             "transformers": "transformers generate, full cache"}
    for key, r in s["impls"].items():
        lines.append(f"| {names.get(key, key)} | {r['prompt_tokens']} | {r['new_tokens']} | {r['kept_tokens_per_head']:.0f} | "
                     f"{r['median_s']:.3f} | {', '.join(f'{x:.3f}' for x in r['seconds'])} | "
                     f"{statistics.median(r['prefill_s']):.3f} | {1000 * statistics.median(r['decode_s_per_token']):.1f} | "
                     f"{r['load_s']:.1f} |")
    lines.append("")
    lines.append("prefill: criticalkv = the ONNX Runtime prefill run (selection inside); kvpress and transformers = the "
                 "first call of the decoder stack (kvpress: with the press's compression hooks); decode = the other calls")
    for k, v in s["ratios"].items():
        lines.append(f"{k}: {v:.3f}x")
    return "\n".join(lines) + "\n"
