"""kvpress's presses as the peer of ``criticalkv eval needle|ruler --question-agnostic``, on the same prompts.

The prompts come from the same generators, seed and chat template as ``criticalkv eval``; each is cut at the end of
its context as ``--question-agnostic`` cuts it (the context compressed alone, then the question through the
compressed cache). kvpress runs in its own virtual environment (``criticalkv bench setup-peers --peers kvpress``:
kvpress 0.5.5 pins transformers < 5.3) through ``criticalkv/bench/peers/kvpress_runner.py``; its answers are scored here
with criticalkv's metrics. For example, KVzip and KVzip+ at two budgets:

    python -m criticalkv.bench.peers.kvpress needle --presses KVzipPress,KVzipPress:kvzip_plus_normalization=true \\
        --budgets 256,512 --lengths 2048 --samples 2 --depths 0,25,50,75,100 --out results/kvpress_needle

A press spec is a kvpress class name, optionally with ``:knob=value`` keyword arguments (true/false, numbers);
the compression ratio is 1 - budget / context tokens. Writes ``kvpress_<task>.json`` (every answer and score, the
command, the machine's load, kvpress's versions) and ``kvpress_<task>.md``; a stopped run continues where it was
(the runner skips the prompts already answered).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from criticalkv.eval.domains import DEFAULT_DOMAIN, DOMAINS, get_domain
from criticalkv.eval.io import environment, prepare_out_dir, write_json, write_text
from criticalkv.eval.needle import needle_prompts
from criticalkv.eval.ruler import TASKS as RULER_TASKS
from criticalkv.eval.ruler import ruler_prompts
from criticalkv.eval.runner import split_question
from criticalkv.eval.scoring import score
from criticalkv.eval.specs import parse_list

RUNNER = Path(__file__).with_name("kvpress_runner.py")


def parse_press(spec: str) -> tuple[str, dict]:
    """``"KVzipPress:kvzip_plus_normalization=true"`` -> ("KVzipPress", {"kvzip_plus_normalization": True})."""
    name, *knobs = spec.split(":")
    if not name.isidentifier():
        raise ValueError(f"--presses: {spec!r} does not start with a kvpress class name")
    kwargs = {}
    for knob in knobs:
        key, eq, value = knob.partition("=")
        if not eq or not key.isidentifier():
            raise ValueError(f"--presses: {knob!r} in {spec!r} is not knob=value")
        lowered = value.lower()
        if lowered in ("true", "false"):
            kwargs[key] = lowered == "true"
        else:
            try:
                kwargs[key] = int(value)
            except ValueError:
                try:
                    kwargs[key] = float(value)
                except ValueError:
                    kwargs[key] = value
    return name, kwargs


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m criticalkv.bench.peers.kvpress", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("task", choices=("needle", "ruler"))
    ap.add_argument("--presses", default="KVzipPress,KVzipPress:kvzip_plus_normalization=true",
                    help="comma-separated press specs (default: KVzipPress and KVzip+)")
    ap.add_argument("--budgets", default="256,512", help="entries kept per KV head on average (default: 256,512)")
    ap.add_argument("--lengths", default="2048", help="prompt lengths in tokens (default: 2048)")
    ap.add_argument("--samples", type=int, default=2, help="instances per length (and depth or task) (default: 2)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompt generators (default: 0)")
    ap.add_argument("--depths", default="0,25,50,75,100", help="needle depths in percent (default: 0,25,50,75,100)")
    ap.add_argument("--tasks", default=",".join(RULER_TASKS), help="RULER-style tasks")
    ap.add_argument("--domain", default=DEFAULT_DOMAIN, choices=tuple(DOMAINS),
                    help=f"where the haystacks come from, as criticalkv eval --domain (default: {DEFAULT_DOMAIN})")
    ap.add_argument("--peers-dir", type=Path, default=Path(".peers"), help="where the peers' environments are")
    ap.add_argument("--model", help="HF folder (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the kvpress process (default: 1)")
    ap.add_argument("--out", type=Path, required=True, help="folder for kvpress_<task>.json and .md")
    ap.add_argument("--score-only", action="store_true",
                    help="score the prompts the runner has answered so far in --out (a stopped or still running run) "
                         "without running kvpress")
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from criticalkv.hf.loading import resolve_model, stop_token_ids

    python = Path(args.peers_dir) / "kvpress" / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"{python}: kvpress's environment is missing (criticalkv bench setup-peers --peers kvpress)")
    presses = [parse_press(s) for s in parse_list(args.presses, "--presses", str)]
    budgets = parse_list(args.budgets, "--budgets")
    lengths = parse_list(args.lengths, "--lengths")
    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if args.task == "needle":
        prompts = needle_prompts(tokenizer, lengths, parse_list(args.depths, "--depths", float), args.samples, args.seed,
                                 domain=args.domain)
    else:
        prompts = ruler_prompts(tokenizer, lengths, parse_list(args.tasks, "--tasks", str), args.samples, args.seed,
                                domain=args.domain)
    runs = [{"key": f"{name}{''.join(f':{k}={v}' for k, v in kwargs.items())}@{b}", "press": name, "kwargs": kwargs,
             "budget": b} for name, kwargs in presses for b in budgets]
    from types import SimpleNamespace

    from transformers import AutoConfig, GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(model_dir)
    except OSError:  # no generation_config.json
        generation = None
    # the stop ids criticalkv eval uses (the model's generation config, its config, the tokenizer)
    stops = stop_token_ids(tokenizer, SimpleNamespace(config=AutoConfig.from_pretrained(model_dir),
                                                      generation_config=generation))
    items = []
    for p in prompts:
        split = split_question(p)
        items.append({"key": p.key, "context_ids": list(p.input_ids[:split]), "question_ids": list(p.input_ids[split:]),
                      "max_new_tokens": p.max_new_tokens})
    out = prepare_out_dir(args.out)
    spec_file, answers_file = out / f"kvpress_{args.task}.prompts.json", out / f"kvpress_{args.task}.answers.json"
    started = time.time()
    load = os.getloadavg()
    if not args.score_only:
        write_json(spec_file, {"runs": runs, "prompts": items, "stop_token_ids": stops})
        subprocess.run([str(python), str(RUNNER), "--model", str(model_dir), "--prompts", str(spec_file), "--out",
                        str(answers_file), "--threads", str(args.threads)], check=True)
    answered = json.loads(answers_file.read_text(encoding="utf-8"))
    records = []
    for p in prompts:
        if p.key not in answered["answers"]:  # --score-only: not answered yet
            continue
        texts = answered["answers"][p.key]
        records.append({"key": p.key, "task": p.task, "length": p.length, "answers": list(p.answers),
                        "results": {r["key"]: {"text": texts[r["key"]], "score": score(p.metric, texts[r["key"]], p.answers),
                                               "seconds": answered["seconds"][p.key][r["key"]]} for r in runs}})
    result = {
        "command": "python -m criticalkv.bench.peers.kvpress " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "task": args.task, "domain": args.domain, "haystack": get_domain(args.domain).provenance(), "runs": runs, "records": records, "versions": answered.get("versions"),
        "torch_threads": answered.get("torch_threads"), "environment": environment(),
        "prompt_count": len(prompts), "complete": len(records) == len(prompts),
        "load_average_at_start": load, "load_average_at_end": os.getloadavg(), "wall_s": time.time() - started,
        "summary": summary(records, runs),
    }
    write_json(out / f"kvpress_{args.task}.json", result)
    write_text(out / f"kvpress_{args.task}.md", markdown(result))
    return result


def summary(records: list[dict], runs: list[dict]) -> dict:
    """Per run: the mean score over every prompt (%), and per task (RULER-style) or per length."""
    out = {}
    for r in runs:
        scores = [rec["results"][r["key"]]["score"] for rec in records]
        if not scores:
            continue
        by_task: dict[str, list[float]] = {}
        for rec in records:
            by_task.setdefault(f"{rec['task']}@{rec['length']}", []).append(rec["results"][r["key"]]["score"])
        out[r["key"]] = {"mean": 100 * sum(scores) / len(scores), "prompts": len(scores),
                         "by_task": {k: 100 * sum(v) / len(v) for k, v in by_task.items()}}
    return out


def markdown(result: dict) -> str:
    lines = [f"# kvpress peer, {result['task']} (question-agnostic)", "", "```", result["command"], "```", "",
             f"kvpress {result['versions']}, torch threads {result['torch_threads']}; load average "
             f"{result['load_average_at_start'][0]:.1f} at the start, {result['load_average_at_end'][0]:.1f} at the end; "
             f"{result['wall_s'] / 60:.1f} min" + ("" if result["complete"] else
                                                   f"; PARTIAL: {len(result['records'])} of {result['prompt_count']} "
                                                   "prompts answered (--score-only)"),
             "", "| run | prompts | mean % | per task/length % |", "|---|---:|---:|---|"]
    for key, s in result["summary"].items():
        tasks = ", ".join(f"{k} {v:.0f}" for k, v in s["by_task"].items())
        lines.append(f"| `{key}` | {s['prompts']} | {s['mean']:.1f} | {tasks} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    result = run(parse_args(argv))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
