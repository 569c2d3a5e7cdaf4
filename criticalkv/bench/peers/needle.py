"""The needle grid's answers of the CPU peers at their compute precisions, against a criticalkv fp32 engine.

``python -m criticalkv.eval.kv_precision`` counts how often an engine with lower-precision weights (``--weights
int8|int4``) gives the fp32 engine's greedy tokens. This is the yardstick for that count: the same prompts (the
committed needle grid's: same generator, seed and chat template) through OpenVINO GenAI at its CPU default (bf16
compute on CPUs with BF16, what a CPU user gets) and at f32 compute, each compared with the first ``--engine-dir``
(build it with ``--kv-policy full``: the peers keep the whole cache in a single request). f32 against fp32 shows what
another summation order alone does to these answers; bf16 what the peer's own default does.

    python -m criticalkv.bench.peers.needle --engine-dir engines/full --lengths 2048 --samples 2 \\
        --out results/weight_precision --name needle_openvino

Tokens are compared up to the reference's first stop token: the tokens before it must be the same, and for the
criticalkv engines the stop token too (the peers' runner makes them generate a fixed count, which suppresses their stop
token: OpenVINO then writes ' 3042.\n\n' where the engines stop after ' 3042.'). Needs ``criticalkv bench setup-peers --peers openvino``; the OpenVINO export is
the one ``criticalkv bench peers`` writes. Writes ``NAME.json`` and ``NAME.md``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from criticalkv.eval.io import write_json, write_text
from criticalkv.eval.needle import DEFAULT_DEPTHS, needle_prompts
from criticalkv.eval.scoring import score


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m criticalkv.bench.peers.needle", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", action="append", required=True, type=Path,
                    help="a criticalkv engine (repeat; the first is the reference: build it with --kv-policy full)")
    ap.add_argument("--ov-precision", default="default,f32", help="OpenVINO compute precisions (default: default,f32)")
    ap.add_argument("--lengths", default="2048", help="comma-separated prompt lengths (default: 2048)")
    ap.add_argument("--samples", type=int, default=2, help="needle instances per length (default: 2)")
    ap.add_argument("--depths", default=",".join(f"{d:g}" for d in DEFAULT_DEPTHS), help="needle depths in percent")
    ap.add_argument("--seed", type=int, default=0, help="the prompt generator's seed (0: the committed grid's)")
    ap.add_argument("--peers-dir", type=Path, default=Path(".peers"), help="the peers' environments (default: .peers)")
    ap.add_argument("--model", help="HF folder or .gguf OpenVINO exports (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--out", type=Path, required=True, help="results folder")
    ap.add_argument("--name", default="needle_peers", help="file stem (default: needle_peers)")
    return ap.parse_args(argv)


def until_stop(tokens: list[int], stop: set[int]) -> list[int]:
    """``tokens`` up to and including the first stop token."""
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[:i + 1]
    return tokens


def same_answer(reference: list[int], tokens: list[int], stop: set[int], stops: bool) -> bool:
    """Whether ``tokens`` give ``reference``'s answer: the same tokens before the reference's first stop token, and the
    stop token too when the system can stop (``stops``; the peers' runner suppresses it)."""
    answer = until_stop(reference, stop)
    cut = len(answer) - 1 if answer and answer[-1] in stop else len(answer)
    return tokens[:cut] == answer[:cut] and (not stops or tokens[cut:cut + 1] == answer[cut:cut + 1])


def run(args: argparse.Namespace) -> dict:
    from criticalkv.bench.peers.cpu import (CriticalKVWorker, PeerWorker, _display, check_ready, ensure_export,
                                           parse_precisions)
    from criticalkv.hf.loading import resolve_model

    precisions = parse_precisions(args.ov_precision)
    check_ready(args.peers_dir, ["openvino"])
    workers = [CriticalKVWorker(d) for d in args.engine_dir]
    reference = workers[0].engine
    stop = set(reference.eos_token_ids)
    tokenizer = reference.tokenizer
    prompts = needle_prompts(tokenizer, [int(x) for x in args.lengths.split(",")],
                             [float(x) for x in args.depths.split(",")], samples=args.samples, seed=args.seed)
    folder, export = ensure_export(args.peers_dir, "openvino", resolve_model(args.model))
    try:
        workers += [PeerWorker(args.peers_dir, "openvino", folder, precision=p) for p in precisions]
        rows = []
        for p in prompts:
            row = {"key": p.key, "answer": p.answers[0], "systems": []}
            for w in workers:
                tokens = until_stop([int(t) for t in w.single(list(p.input_ids), p.max_new_tokens)["tokens"]], stop)
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                row["systems"].append({"tokens": tokens, "text": text, "score": score(p.metric, text, p.answers)})
            rows.append(row)
            print(p.key, " / ".join(repr(s["text"]) for s in row["systems"]), flush=True)
        labels = [w.label for w in workers]
        stops = [isinstance(w, CriticalKVWorker) for w in workers]
    finally:
        for w in workers:
            w.close()
    summary = [{"system": label, "accuracy": 100 * sum(r["systems"][i]["score"] for r in rows) / len(rows),
                "same_tokens_as_first": sum(same_answer(r["systems"][0]["tokens"], r["systems"][i]["tokens"], stop, stops[i])
                                            for r in rows),
                "prompts": len(rows), "stop_token_compared": stops[i]} for i, label in enumerate(labels)]
    return {"command": "python -m criticalkv.bench.peers.needle " + shlex.join(sys.argv[1:]),
            "loadavg_before": os.getloadavg(), "openvino_export": _display(export), "stop_tokens": sorted(stop),
            "summary": summary, "prompts": rows}


def markdown(result: dict) -> str:
    lines = [f"`{result['command']}`", "", f"load average at the start: {result['loadavg_before'][0]:.2f}", "",
             "| system | needle accuracy % | the first's answer tokens |", "|---|---:|---:|"]
    for s in result["summary"]:
        note = "" if s.get("stop_token_compared", True) else " (before its stop token)"
        lines.append(f"| {s['system']} | {s['accuracy']:.1f} | {s['same_tokens_as_first']} of {s['prompts']}{note} |")
    stop = set(result.get("stop_tokens", []))
    stops = [s.get("stop_token_compared", True) for s in result["summary"]]
    differ = [r for r in result["prompts"]
              if not all(same_answer(r["systems"][0]["tokens"], s["tokens"], stop, can) for s, can in zip(r["systems"], stops))]
    if differ:
        lines += ["", "Prompts where the answers differ (the peers' text runs on past the suppressed stop token):", ""]
        lines += [f"- {r['key']} (passcode {r['answer']}): " + " / ".join(repr(s["text"]) for s in r["systems"])
                  for r in differ]
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
