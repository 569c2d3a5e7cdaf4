"""The needle grid on built engines: what float16 KV buffers (``--kv-dtype float16``) or lower-precision weights
(``--weights int8|int4``) cost in answers.

``criticalkv eval`` runs the PyTorch path, whose cache is float32. The KV precision is an engine option (ONNX Runtime's
decode buffers), so this runs the committed needle grid's prompts (same generator, seed and chat template as
``criticalkv eval needle``) through each ``--engine-dir`` with ``Engine.generate`` (greedy), scores the answer the
same way (``digits``), and counts, against the first engine, how many prompts give the same tokens. Engines built
from one policy and budget with ``--kv-dtype float32`` and ``float16`` isolate the precision:

    python research/kv_precision.py --engine-dir engines/ckv256 --engine-dir engines/ckv256-fp16 \\
        --lengths 2048 --samples 2 --out results/kv_precision

Engines built with ``--weights fp32``, ``int8`` and ``int4`` isolate the weights the same way:

    python research/kv_precision.py --engine-dir engines/ckv256-fp32 --engine-dir engines/ckv256-int8 \
        --engine-dir engines/ckv256-int4 --lengths 2048 --samples 2 --out results/weight_precision --name weight_precision

Beside the answers, the perturbation against the first engine at the first generated token (each engine's own prompt
logits): the KL divergence of the next-token distribution KL(first || engine) and the largest logit change, and the
share of the first engine's kept entries (per layer and KV head) that the engine's selection keeps too: the
selection runs in float32 on each engine's own activations, so a kept set moves only as far as the activations do.

Writes ``NAME.json`` (every prompt's tokens, scores and perturbation, the command, the load average) and ``NAME.md``
(``--name``, default ``kv_precision``).
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's criticalkv, installed or not

from criticalkv.eval.io import write_json, write_text  # noqa: E402
from criticalkv.eval.needle import DEFAULT_DEPTHS, needle_prompts  # noqa: E402
from criticalkv.eval.scoring import score  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python research/kv_precision.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", action="append", required=True, type=Path,
                    help="an engine folder (repeat; the first is the reference the others' tokens are compared with)")
    ap.add_argument("--lengths", default="2048", help="comma-separated prompt lengths (each <= the engines' input)")
    ap.add_argument("--samples", type=int, default=2, help="needle instances per length (default: 2)")
    ap.add_argument("--depths", default=",".join(f"{d:g}" for d in DEFAULT_DEPTHS), help="needle depths in percent")
    ap.add_argument("--seed", type=int, default=0, help="the prompt generator's seed (0: the committed grid's)")
    ap.add_argument("--out", type=Path, required=True, help="folder for kv_precision.json and .md")
    ap.add_argument("--name", default="kv_precision", help="file stem of the results (default: kv_precision)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap.parse_args(argv)


def describe(engine) -> str:
    m = engine.manifest
    policy = m.get("policy", {})
    kv = m.get("build", {}).get("kv_dtype", "float32")
    weights = m.get("build", {}).get("weights", "fp32")
    return f"{policy.get('name', '?')} b={policy.get('budget', '?')}, KV {kv}, weights {weights}"


def capture_prompt_logits(engine) -> dict:
    """Keep the prompt's last logits [vocab] and kept indices of every prefill the engine's backend runs (batch 1)."""
    seen = {}
    prefill = engine.backend.prefill

    def recording(*args, **kwargs):
        out = prefill(*args, **kwargs)
        seen["logits"] = np.asarray(out.logits[0], np.float64)
        seen["indices"] = [x[0] for x in out.indices]
        return out

    engine.backend.prefill = recording
    return seen


def perturbation(reference: dict, other: dict) -> dict:
    """KL(reference || other) of the next-token distributions, the largest logit change, and the share of the
    reference's kept entries that ``other`` keeps (over every layer and KV head)."""
    def log_softmax(x):
        x = x - x.max()
        return x - math.log(np.exp(x).sum())

    p, q = log_softmax(reference["logits"]), log_softmax(other["logits"])
    kl = float((np.exp(p) * (p - q)).sum())
    common = total = 0
    for a, b in zip(reference["indices"], other["indices"]):
        for head_a, head_b in zip(a, b):
            kept = set(head_a[head_a >= 0].tolist())
            common += len(kept & set(head_b[head_b >= 0].tolist()))
            total += len(kept)
    return {"kl": max(kl, 0.0), "max_logit_change": float(np.abs(reference["logits"] - other["logits"]).max()),
            "kept_overlap": common / total if total else 1.0,
            "same_first_token": int(reference["logits"].argmax()) == int(other["logits"].argmax())}


def run(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    from criticalkv.runtime import Engine

    engines = [Engine.load(d) for d in args.engine_dir]
    captured = [capture_prompt_logits(e) for e in engines]
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    prompts = needle_prompts(engines[0].tokenizer, lengths, depths, samples=args.samples, seed=args.seed)
    for d, e in zip(args.engine_dir, engines):
        cap = e.limits.max_input_len
        too_long = [p.length for p in prompts if p.length > cap]
        if too_long:
            raise SystemExit(f"{d}: prompts of {max(too_long)} tokens exceed the engine's --max-input-len {cap}")
    rows = []
    bar = tqdm(total=len(prompts) * len(engines), disable=args.no_progress, desc="needle on engines")
    for p in prompts:  # interleaved: every engine answers a prompt before the next prompt
        row = {"key": p.key, "answer": p.answers[0], "engines": []}
        for e, seen in zip(engines, captured):
            start = time.perf_counter()
            out = e.generate([list(p.input_ids)], max_new_tokens=p.max_new_tokens)
            tokens = [int(t) for t in out.tokens[0]]
            text = e.tokenizer.decode(tokens, skip_special_tokens=True)
            row["engines"].append({"tokens": tokens, "text": text, "score": score(p.metric, text, p.answers),
                                   "seconds": time.perf_counter() - start,
                                   "perturbation": perturbation(captured[0], seen)})
            bar.update()
        rows.append(row)
    bar.close()
    names = [describe(e) for e in engines]
    summary = []
    for i, name in enumerate(names):
        scores = [r["engines"][i]["score"] for r in rows]
        same = sum(r["engines"][i]["tokens"] == r["engines"][0]["tokens"] for r in rows)
        moved = [r["engines"][i]["perturbation"] for r in rows]
        summary.append({"engine": str(args.engine_dir[i]), "name": name, "accuracy": 100 * sum(scores) / len(scores),
                        "same_tokens_as_first": same, "prompts": len(rows),
                        "kl_median": float(np.median([m["kl"] for m in moved])), "kl_max": max(m["kl"] for m in moved),
                        "max_logit_change": max(m["max_logit_change"] for m in moved),
                        "kept_overlap_mean": float(np.mean([m["kept_overlap"] for m in moved])),
                        "kept_overlap_min": min(m["kept_overlap"] for m in moved),
                        "same_first_token": sum(m["same_first_token"] for m in moved)})
    return {"command": "python research/kv_precision.py " + shlex.join(sys.argv[1:]),
            "loadavg_before": os.getloadavg(), "summary": summary, "prompts": rows}


def markdown(result: dict) -> str:
    lines = [f"`{result['command']}`", "", f"load average at the start: {result['loadavg_before'][0]:.2f}", "",
             "| engine | policy, KV dtype, weights | needle accuracy % | same greedy tokens as the first engine |",
             "|---|---|---:|---:|"]
    for s in result["summary"]:
        lines.append(f"| `{s['engine']}` | {s['name']} | {s['accuracy']:.1f} | {s['same_tokens_as_first']} of "
                     f"{s['prompts']} |")
    if all("kl_median" in s for s in result["summary"]):
        lines += ["", "Perturbation against the first engine at the first generated token (every prompt):", "",
                  "| engine | KL(first \\|\\| engine), median / max | largest logit change | kept entries shared with the "
                  "first, mean / min | same first token |", "|---|---:|---:|---:|---:|"]
        for s in result["summary"][1:]:
            lines.append(f"| `{s['engine']}` | {s['kl_median']:.2e} / {s['kl_max']:.2e} | {s['max_logit_change']:.3f} | "
                         f"{100 * s['kept_overlap_mean']:.1f} % / {100 * s['kept_overlap_min']:.1f} % | "
                         f"{s['same_first_token']} of {s['prompts']} |")
    differ = [r for r in result["prompts"] if any(e["tokens"] != r["engines"][0]["tokens"] for e in r["engines"])]
    if differ:
        lines += ["", "Prompts where the answers differ:", ""]
        for r in differ:
            answers = " / ".join(repr(e["text"]) for e in r["engines"])
            lines.append(f"- {r['key']} (passcode {r['answer']}): {answers}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    text = markdown(result)
    write_json(args.out / f"{args.name}.json", result)
    write_text(args.out / f"{args.name}.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
