"""kvpress, the peer of criticalkv's selection in PyTorch (and transformers' full cache beside it): its driver side.
The runner ``kvpress_runner.py`` runs inside the peer's virtual environment (``kvpress/`` or ``transformers/`` under
``$CRITICALKV_PEERS_DIR``, created on first use: kvpress 0.5.5 pins transformers < 5.3, so it cannot share
criticalkv's environment). Three comparisons:

**One request** (``criticalkv bench single``): one request timed end to end (tokenisation + prefill + selection +
decode, model load excluded, ``--repeats`` after one warm-up, medians): criticalkv's ``Engine.generate`` on ONNX
Runtime in this process, kvpress ``CriticalKVPress(SnapKVPress)`` through its ``kv-press-text-generation`` pipeline
and transformers ``generate`` in their environments. Every implementation gets the same text wrapped in the model's
chat template, greedy decoding and stop tokens disabled, so each produces exactly ``--new-tokens`` tokens.

**Answers** (``python -m criticalkv.bench.peers.kvpress needle|ruler``): kvpress's presses as the peer of
``criticalkv eval needle|ruler --question-agnostic``, on the same prompts (the same generators, seed and chat
template as ``criticalkv eval``), each cut at the end of its context as ``--question-agnostic`` cuts it (the context
compressed alone, then the question through the compressed cache); the answers are scored here with criticalkv's
metrics. For example, KVzip and KVzip+ at two budgets:

    python -m criticalkv.bench.peers.kvpress needle --presses KVzipPress,KVzipPress:kvzip_plus_normalization=true \\
        --budgets 256,512 --lengths 2048 --samples 2 --depths 0,25,50,75,100 --out results/kvpress_needle

A press spec is a kvpress class name, optionally with ``:knob=value`` keyword arguments (true/false, numbers);
the compression ratio is 1 - budget / context tokens. Writes ``kvpress_<task>.json`` (every answer and score, the
command, the machine's load, kvpress's versions) and ``kvpress_<task>.md``; a stopped run continues where it was
(the runner skips the prompts already answered).

**On the GPU** (``criticalkv bench gpu-serve``): kvpress in criticalkv's own process beside the torch backend, its
CriticalKVPress(SnapKVPress) through transformers, batch 1, on the same model, prompts and budget. kvpress 0.5.5 is
pure Python (carried as a wheel and installed with ``--no-deps --target``); what it needs beyond torch and
transformers for these two presses is ``cachetools``. Its package imports every press, DuoAttention's needing
``datasets``: without it the two presses are imported alone, with kvpress's attention patch, as its package would
apply it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from criticalkv.bench.machine import header_lines
from criticalkv.bench.peers import PEERS_DIR_HELP, ensure_ready, peer_python, peers_dir
from criticalkv.bench.prompts import chat_ids, text_for_chat_length
from criticalkv.eval.domains import DEFAULT_DOMAIN, DOMAINS, get_domain
from criticalkv.eval.needle import needle_prompts
from criticalkv.eval.ruler import TASKS as RULER_TASKS
from criticalkv.eval.ruler import ruler_prompts
from criticalkv.eval.scoring import score
from criticalkv.eval.shared_stats import SNAPKV_MATCHED
from criticalkv.eval.specs import parse_list
from criticalkv.runtime import Engine
from criticalkv.runtime.manifest import read_manifest

#: The runner, started by path with the peer environment's Python.
RUNNER = Path(__file__).with_name("kvpress_runner.py")


# ---------------------------------------------------------------------------------------------- one request
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
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as f:
        f.write(text)
        path = f.name
    try:
        run = subprocess.run([str(peer_python(root, name)), str(RUNNER), "time", "--impl", name, "--model", str(model_dir),
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

    ensure_ready(root, peers, log)
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

# ---------------------------------------------------------------------------------------------- answers
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


def parse_wrapped_press(spec: str) -> tuple[str, dict]:
    """``parse_press`` where the name may wrap another press: ``"CriticalKVPress(SnapKVPress):epsilon=0.001"``."""
    import re

    head, _, knobs = spec.partition(":")
    if not re.fullmatch(r"\w+(\(\w+\))?", head):
        raise ValueError(f"--presses: {spec!r} does not start with a kvpress class name (or OUTER(INNER))")
    return head, parse_press("Press:" + knobs)[1] if knobs else {}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m criticalkv.bench.peers.kvpress", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=PEERS_DIR_HELP)
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
    ap.add_argument("--model", help="HF folder (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the kvpress process (default: 1)")
    ap.add_argument("--out", type=Path, required=True, help="folder for kvpress_<task>.json and .md")
    ap.add_argument("--score-only", action="store_true",
                    help="score the prompts the runner has answered so far in --out (a stopped or still running run) "
                         "without running kvpress")
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from criticalkv.eval.io import environment, prepare_out_dir, write_json, write_text
    from criticalkv.eval.runner import split_question
    from criticalkv.hf.loading import resolve_model, stop_token_ids

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
        root = peers_dir()
        ensure_ready(root, ["kvpress"])
        python = peer_python(root, "kvpress")
        write_json(spec_file, {"runs": runs, "prompts": items, "stop_token_ids": stops})
        subprocess.run([str(python), str(RUNNER), "answer", "--model", str(model_dir), "--prompts", str(spec_file), "--out",
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

# ---------------------------------------------------------------------------------------------- shared context
#: kvpress's question-agnostic presses that run on the bundled model with no downloaded weights (FastKVzipPress,
#: KVzapPress and DMSPress need trained weights published for other models), and its question-aware ones.
SHARED_AGNOSTIC = ("KVzipPress,ExpectedAttentionPress,KeyDiffPress,CompactorPress,LeverageScorePress,KnormPress,"
                   "SnapKVPress")
#: The question-aware ones get criticalkv's observation window and pooling kernel (``SNAPKV_MATCHED``): the same
#: observation as criticalkv's snapkv and criticalkv policies, so that a difference is the selection's, not the window's.
SHARED_AWARE = ",".join(f"{p}{SNAPKV_MATCHED}" for p in ("SnapKVPress", "CriticalKVPress(SnapKVPress)",
                                                            "CriticalAdaKVPress(SnapKVPress)"))


def parse_shared_args(argv=None) -> argparse.Namespace:
    from criticalkv.eval.shared_command import DEFAULT_FRACTIONS, DOMAIN_NAMES
    from criticalkv.eval.shared_context import DEFAULT_KINDS, DEFAULT_LENGTHS

    ap = argparse.ArgumentParser(
        prog="python -m criticalkv.bench.peers.kvpress shared-context",
        description="kvpress beside `criticalkv eval shared-context`, on the same documents and questions (the same "
                    "generator, seed and chat template), in kvpress's own environment. Question-agnostic: kvpress's "
                    "pipeline compresses each context once per press and budget and answers every question of it "
                    "(its questions_ids); question-aware: each press compresses the document and the question as "
                    "its hooks do in the prompt's prefill (kvpress's with press(model)), the first answer token comes "
                    "from that prefill and the rest from the compressed cache, as criticalkv answers. kvpress's own "
                    "full cache answers too: the reference of its fidelity columns. "
                    "Writes OUT/records.jsonl (scored with criticalkv's metrics) and OUT/config.json; put OUT in the "
                    "criticalkv run's folder as DIR/kvpress and `criticalkv eval report DIR` sets kvpress beside "
                    "every row. A stopped run continues with the next document.",
        epilog=PEERS_DIR_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("task", choices=("shared-context",))
    ap.add_argument("--presses", default=SHARED_AGNOSTIC,
                    help=f"question-agnostic press specs (default: {SHARED_AGNOSTIC}); NAME or OUTER(INNER), "
                         "optionally with :knob=value")
    ap.add_argument("--aware-presses", default=SHARED_AWARE, help=f"question-aware presses (default: {SHARED_AWARE})")
    ap.add_argument("--fractions", default=DEFAULT_FRACTIONS, help=f"budgets (default: {DEFAULT_FRACTIONS})")
    ap.add_argument("--domains", default=",".join(DOMAIN_NAMES), help="as criticalkv eval shared-context --domains")
    ap.add_argument("--documents", type=int, default=10, help="documents per domain (default: 10)")
    ap.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)), help="context lengths in tokens, in turn")
    ap.add_argument("--kinds", default=",".join(DEFAULT_KINDS), help="question kinds")
    ap.add_argument("--split", choices=("eval", "train"), default="eval")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", help="HF folder (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the kvpress process (default: 1)")
    ap.add_argument("--out", type=Path, required=True, help="folder for records.jsonl (DIR/kvpress of the criticalkv run)")
    ap.add_argument("--score-only", action="store_true",
                    help="score what the runner has answered so far (a stopped or still running run), no kvpress run")
    return ap.parse_args(argv)


def run_shared(args: argparse.Namespace) -> str:
    """kvpress on the shared-context documents; returns where the records went."""
    from transformers import AutoTokenizer

    from criticalkv.eval.io import environment, prepare_out_dir, write_json
    from criticalkv.eval.shared_command import DOMAIN_NAMES, parse_floats, parse_names
    from criticalkv.eval.shared_context import KINDS, score_answer, shared_documents
    from criticalkv.hf.loading import resolve_model

    domains = parse_names(args.domains, "--domains", DOMAIN_NAMES)
    kinds = parse_names(args.kinds, "--kinds", tuple(KINDS))
    lengths = [int(x) for x in parse_floats(args.lengths, "--lengths")]
    fractions = parse_floats(args.fractions, "--fractions")
    for f in fractions:
        if not 0 < f < 1:
            raise ValueError(f"--fractions: {f:g} is not a fraction of the cache in (0, 1)")
    runs = []
    for setting, presses in (("agnostic", args.presses), ("aware", args.aware_presses)):
        for spec in parse_list(presses, "--presses", str) if presses else []:
            name, kwargs = parse_wrapped_press(spec)
            for f in fractions:
                runs.append({"key": f"kvpress {spec}@{100 * f:g}%", "setting": setting, "press": name,
                             "kwargs": kwargs, "fraction": f})
    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    documents = shared_documents(tokenizer, domains, args.documents, lengths, args.seed, args.split, kinds)
    out = prepare_out_dir(args.out)
    spec_file, answers = out / "prompts.json", out / "answers.jsonl"
    command = "python -m criticalkv.bench.peers.kvpress " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if not args.score_only:
        from types import SimpleNamespace

        from transformers import AutoConfig, GenerationConfig

        from criticalkv.hf.loading import stop_token_ids

        try:
            generation = GenerationConfig.from_pretrained(model_dir)
        except OSError:
            generation = None
        stops = stop_token_ids(tokenizer, SimpleNamespace(config=AutoConfig.from_pretrained(model_dir),
                                                          generation_config=generation))
        root = peers_dir()
        ensure_ready(root, ["kvpress"])
        write_json(spec_file, {"runs": runs, "stop_token_ids": stops, "documents": [
            {"key": d.key, "context_ids": list(d.context_ids),
             "questions": [{"key": q.key, "ids": list(q.ids), "max_new_tokens": q.max_new_tokens} for q in d.questions]}
            for d in documents]})
        earlier = []
        if (out / "config.json").exists() and answers.exists():  # a resumed run: the documents done keep their runs
            before = json.loads((out / "config.json").read_text(encoding="utf-8"))
            earlier = [c for c in before.get("earlier_commands", []) + [before.get("command")] if c and c != command]
        write_json(out / "config.json", {"command": command, **({"earlier_commands": earlier} if earlier else {}),
                                         "runs": runs, "domains": domains, "kinds": kinds,
                                         "lengths": lengths, "documents": args.documents, "split": args.split,
                                         "seed": args.seed, "environment": environment(),
                                         "load_average_at_start": os.getloadavg()})
        subprocess.run([str(peer_python(root, "kvpress")), str(RUNNER), "shared", "--model", str(model_dir),
                        "--prompts", str(spec_file), "--out", str(answers), "--threads", str(args.threads)], check=True)
    questions = {q.key: (d, q) for d in documents for q in d.questions}
    records = []
    if answers.exists():
        with open(answers, encoding="utf-8") as f:
            for line in f:
                if not line.endswith("\n"):
                    break
                a = json.loads(line)
                doc, q = questions[a["question"]]
                records.append({**a, "kind": q.kind, "domain": doc.domain,
                                "score": score_answer(q.metric, a["text"], q.answers)})
    done_file = out / "answers.documents.jsonl"
    finished = [json.loads(x) for x in done_file.read_text(encoding="utf-8").splitlines()] if done_file.exists() else []
    config_path = out / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {"command": command}
    config.update({"versions": finished[-1]["versions"] if finished else None, "documents_done": len(finished),
                   "documents_total": len(documents), "load_average_at_end": os.getloadavg()})
    write_json(config_path, config)
    done = {d["doc"] for d in finished}
    from criticalkv.eval.io import write_text

    write_text(out / "records.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records
                                              if r["doc"] in done))
    return f"kvpress: {len(done)} of {len(documents)} documents answered; records in {out / 'records.jsonl'}"


# ---------------------------------------------------------------------------------------------- on the GPU
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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["shared-context"]:
        print(run_shared(parse_shared_args(argv)))
        return 0
    result = run(parse_args(argv))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
