"""The decode forms of one ONNX Runtime engine side by side: ms per decode step after a long chat prompt, interleaved in
one process, and each form's resident memory.

    python research/decode_forms.py --engine-dir engines/ckv256 --engine-dir engines/full \\
        --threads 1 --output results/decode_forms.json

Forms (``FORMS``): the portable ``decode.onnx`` (shared memory-mapped weights, MLAS prepacking off: the engine's decode
before the fused graph), the same with prepacking, the fused ``decode_ort.onnx`` without and with prepacking (the
default). Each engine prefills one chat prompt of ``--prompt-tokens`` tokens once; every (engine, form) loads its kept
entries into row 0 and, round after round (all of them in a rotated order), restores that row and times ``--steps`` steps of
``OnnxRuntimeBackend.decode`` (the whole call: the graph, the in-place KV writes or moves, the length updates), wall
time and process CPU time. On cores other jobs share, compare forms by CPU time with one thread (``--threads 1``): the
other jobs disturb it far less than wall time (docs/performance.md). ``--rss`` also loads each form in a fresh process
and reports its resident memory after loading, after a short prefill (which touches every page of the shared
weights, as a server's first request does) and after two decode steps. The first step's logits of each form are
compared with the portable form's (largest absolute difference, same greedy token).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's criticalkv, installed or not

from criticalkv.bench.machine import finish, header, header_lines  # noqa: E402

#: form name -> OnnxRuntimeBackend options
FORMS = {
    "portable": {"decode": "portable", "prepack": False},
    "portable+prepack": {"decode": "portable", "prepack": True},
    "fused-no-prepack": {"decode": "fused", "prepack": False},
    "fused": {"decode": "fused", "prepack": True},
}


def resident_mib() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MiB."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields.get("VmRSS", 0.0), fields.get("VmHWM", 0.0)


def prompt_ids(engine_dir: Path, tokens: int) -> list[int]:
    from criticalkv.bench.prompts import chat_ids, text_for_chat_length
    from criticalkv.runtime import Engine

    engine = Engine.load(engine_dir, verify=False, decode="portable", prepack=False, threads=1)
    try:
        return chat_ids(engine.tokenizer, text_for_chat_length(engine.tokenizer, tokens))
    finally:
        engine.close()


def measure(engine_dirs: list[Path], forms: list[str], prompt_tokens: int, rounds: int, steps: int, threads: int) -> list[dict]:
    """Median ms per step (wall and CPU) of every (engine, form) over ``rounds`` x ``steps`` steps after the prompt, all
    interleaved in one loop. A form an engine cannot run (the portable graph of a float16-KV engine, the fused graph of a
    model it refuses) is recorded with the reason. Speedups are against the first available entry of the engines
    with the same policy and budget (a float16-KV engine against its float32 twin's portable form)."""
    from criticalkv.errors import EngineError
    from criticalkv.runtime.manifest import read_manifest
    from criticalkv.runtime.onnxruntime_backend import OnnxRuntimeBackend

    ids = prompt_ids(engine_dirs[0], prompt_tokens)
    n = len(ids)
    entries, prefills = [], {}
    for engine_dir in engine_dirs:
        manifest = read_manifest(engine_dir, verify=False)
        entry = {"engine": str(engine_dir), "policy": manifest["policy"]["name"], "budget": manifest["policy"]["budget"],
                 "kv_dtype": manifest["build"].get("kv_dtype", "float32"), "prompt_tokens": n,
                 "capacity_layer0": manifest["shapes"]["decode_capacity"][0], "forms": {}}
        for form in forms:
            try:
                backend = OnnxRuntimeBackend(engine_dir, manifest, threads=threads, **FORMS[form])
            except EngineError as err:
                entry["forms"][form] = {"unavailable": str(err)}
                continue
            if engine_dir not in prefills:
                prefills[engine_dir] = backend.prefill(np.array([ids]), np.ones((1, n), np.int64), np.arange(n)[None])
            pre = prefills[engine_dir]
            backend.load_row(0, pre, 0)
            entry["kept_per_head_layer0"] = int(pre.lengths[0].max())
            entry["forms"][form] = {"backend": backend, "snapshot": backend.save_row(0), "wall": [], "cpu": []}
        entries.append(entry)
    runs = [(e, f) for e in entries for f, r in e["forms"].items() if "backend" in r]
    token = np.array([int(prefills[Path(entries[0]["engine"])].logits[0].argmax())])
    for entry, form in runs:  # warm-up (the first run allocates and, with prepacking, packs) and the first logits
        r = entry["forms"][form]
        r["backend"].restore_row(0, r["snapshot"])
        r["first_logits"] = r["backend"].decode(token, np.array([n])).copy()
        r["backend"].decode(token, np.array([n + 1]))
    for k in range(rounds):
        for entry, form in runs[k % len(runs):] + runs[:k % len(runs)]:
            r = entry["forms"][form]
            r["backend"].restore_row(0, r["snapshot"])
            for t in range(steps):
                start, start_cpu = time.perf_counter(), time.process_time()
                r["backend"].decode(token, np.array([n + t]))  # the same token every step: the cost does not depend on it
                r["wall"].append(time.perf_counter() - start)
                r["cpu"].append(time.process_time() - start_cpu)
    baselines = {}
    for entry, form in runs:
        baselines.setdefault((entry["policy"], entry["budget"]), (entry, form))
    for entry, form in runs:
        base_entry, base_form = baselines[(entry["policy"], entry["budget"])]
        b, r = base_entry["forms"][base_form], entry["forms"][form]
        ms, cpu_ms = 1e3 * statistics.median(r["wall"]), 1e3 * statistics.median(r["cpu"])
        r.update({
            "baseline": f"{base_entry['engine']}: {base_form}",
            "wall_ms": round(ms, 2), "cpu_ms": round(cpu_ms, 2),
            "wall_speedup": round(1e3 * statistics.median(b["wall"]) / ms, 3),
            "cpu_speedup": round(1e3 * statistics.median(b["cpu"]) / cpu_ms, 3),
            "max_abs_logit_diff": float(np.abs(r["first_logits"] - b["first_logits"]).max()),
            "same_greedy_token": bool(r["first_logits"].argmax() == b["first_logits"].argmax()),
        })
    for entry, form in runs:
        r = entry["forms"][form]
        r["backend"].close()
        for key in ("backend", "snapshot", "first_logits", "wall", "cpu"):
            r.pop(key)
    return entries


def rss_child(engine_dir: Path, form: str, threads: int, prompt_tokens: int = 300) -> dict:
    """Resident memory of a fresh process that loads the engine with ``form``, prefills a ``prompt_tokens``-token
    prompt (which touches every shared weight page: a server's steady state) and decodes two steps."""
    before = resident_mib()[0]
    from criticalkv.runtime.manifest import read_manifest
    from criticalkv.runtime.onnxruntime_backend import OnnxRuntimeBackend

    manifest = read_manifest(engine_dir, verify=False)
    imported = resident_mib()[0]
    backend = OnnxRuntimeBackend(engine_dir, manifest, threads=threads, **FORMS[form])
    loaded = resident_mib()[0]
    ids = np.arange(1, prompt_tokens + 1, dtype=np.int64)[None] % manifest["model"]["spec"]["vocab_size"]
    pre = backend.prefill(ids, np.ones_like(ids), np.arange(prompt_tokens)[None])
    prefilled = resident_mib()[0]
    backend.load_row(0, pre, 0)
    backend.decode(np.array([1]), np.array([prompt_tokens]))
    backend.decode(np.array([1]), np.array([prompt_tokens + 1]))
    rss, peak = resident_mib()
    return {"form": form, "rss_start_mib": round(before, 1), "rss_imported_mib": round(imported, 1),
            "rss_loaded_mib": round(loaded, 1), "rss_prefilled_mib": round(prefilled, 1),
            "rss_after_decode_mib": round(rss, 1), "peak_mib": round(peak, 1)}


def measure_rss(engine_dir: Path, forms: list[str], threads: int) -> list[dict]:
    out = []
    for form in forms:
        run = subprocess.run([sys.executable, __file__, "--rss-child", form, "--threads",
                              str(threads), "--engine-dir", str(engine_dir)], capture_output=True, text=True, check=True)
        out.append(json.loads(run.stdout.strip().splitlines()[-1]))
    return out


def render(info: dict) -> str:
    lines = header_lines(info)
    for engine in info["engines"]:
        lines += ["", f"## {engine['engine']} ({engine['policy']}, budget {engine['budget']}, {engine['kv_dtype']} KV): "
                  f"{engine['prompt_tokens']}-token prompt, {engine.get('kept_per_head_layer0')} entries per head kept "
                  f"(layer 0), capacity {engine['capacity_layer0']}", "",
                  "| decode form | wall ms | speedup | CPU ms | speedup | max abs logit diff | same token | baseline |",
                  "|---|---|---|---|---|---|---|---|"]
        for form, r in engine["forms"].items():
            if "unavailable" in r:
                lines.append(f"| {form} | unavailable: {r['unavailable']} | | | | | | |")
                continue
            lines.append(f"| {form} | {r['wall_ms']} | {r['wall_speedup']} | {r['cpu_ms']} | {r['cpu_speedup']} | "
                         f"{r['max_abs_logit_diff']:.1e} | {r['same_greedy_token']} | {r['baseline']} |")
        if engine.get("rss"):
            lines += ["", "| decode form | resident MiB: imported | loaded | + a 300-token prefill | + 2 decode steps | peak |",
                      "|---|---|---|---|---|---|"]
            for r in engine["rss"]:
                lines.append(f"| {r['form']} | {r['rss_imported_mib']} | {r['rss_loaded_mib']} | {r['rss_prefilled_mib']} | "
                             f"{r['rss_after_decode_mib']} | {r['peak_mib']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-dir", type=Path, action="append", required=True, help="an engine directory (repeatable)")
    p.add_argument("--forms", default=",".join(FORMS), help=f"comma-separated forms, the first is the baseline "
                   f"(default: {','.join(FORMS)})")
    p.add_argument("--prompt-tokens", type=int, default=2025, help="chat prompt length (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=8, help="rounds, forms rotated each round (default: %(default)s)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per form and round (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (default: %(default)s)")
    p.add_argument("--rss", action="store_true", help="also measure each form's resident memory in a fresh process")
    p.add_argument("--output", type=Path, help="write the results as JSON here (and the table beside it as .md)")
    p.add_argument("--rss-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rss_child:
        print(json.dumps(rss_child(args.engine_dir[0], args.rss_child, args.threads)))
        return 0
    forms = args.forms.split(",")
    unknown = [f for f in forms if f not in FORMS]
    if unknown:
        p.error(f"unknown forms {unknown}; choose from {list(FORMS)}")
    info = header("python research/decode_forms.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    info["engines"] = measure(args.engine_dir, forms, args.prompt_tokens, args.rounds, args.steps, args.threads)
    finish(info)
    if args.rss:  # after the timing: fresh processes, one form at a time
        for engine_dir, entry in zip(args.engine_dir, info["engines"]):
            entry["rss"] = measure_rss(engine_dir, [f for f in forms if "unavailable" not in entry["forms"][f]], args.threads)
    table = render(info)
    print(table)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(info, indent=1) + "\n")
        args.output.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
