"""``criticalkv eval {needle,ruler,perturbation}``: quality evaluations of the KV policies.

Every (policy, budget) runs on the same prompts with one shared prefill per prompt (see
``criticalkv.eval.engine``); results go to ``--out DIR`` as JSON (written incrementally and
atomically), a markdown table and PNG figures next to it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path

# torch, transformers and the evaluation's figures load in run() (seconds): --help and argument errors answer at once
from criticalkv.eval.domains import DEFAULT_DOMAIN, DOMAINS, get_domain
from criticalkv.eval.ruler import TASKS as RULER_TASKS
from criticalkv.eval.specs import PolicyRun, check_lengths, default_policy_specs, expand_runs, parse_list
from criticalkv.methods import same_selection
from criticalkv.methods import unrefined as base_policy
from criticalkv.policy import POLICIES, KVPolicy

TASKS = ("needle", "ruler", "perturbation")
ALL_POLICIES = ",".join(default_policy_specs())
PAIR_POLICIES = ",".join(default_policy_specs(pairs_only=True))


#: What every task's --help says about how it runs and where results go (plain text: argparse shows it as is).
SHARED = ("Every (policy, budget) runs on the same prompts with one shared prefill per prompt; results go to "
          "--out DIR as JSON (written after every prompt; --resume continues a stopped run, --overwrite replaces "
          "earlier results), a markdown table and PNG figures next to it.")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "eval",
        help="evaluate KV policies: needle-in-a-haystack, RULER-style tasks, perturbation analysis",
        description="Quality evaluations of the KV policies on the bundled model (or --model), offline. " + SHARED,
    )
    tasks = p.add_subparsers(dest="task", metavar="TASK", required=True)
    needle = tasks.add_parser(
        "needle", help="needle-in-a-haystack grid (lengths x depths), heatmap like the paper's Figure 8",
        description="Needle-in-a-haystack: a passcode hidden at each depth (--depths, percent) of prompts of each "
                    "length (--lengths); accuracy table and a heatmap per policy and budget like the paper's Figure 8. "
                    + SHARED)
    _common(needle, ALL_POLICIES)
    needle.add_argument("--depths", default="0,10,20,30,40,50,60,70,80,90,100",
                        help="needle depths in percent (default: 0,10,...,100)")
    _question_agnostic(needle)
    ruler = tasks.add_parser(
        "ruler", help="RULER-style synthetic tasks (NIAH single/multi-key/multi-value, vt, cwe, qa)",
        description="RULER-style synthetic tasks (--tasks): single-key, multi-key and multi-value needles, variable "
                    "tracking, common-words extraction and question answering over documents; a score per task and "
                    "the average. " + SHARED)
    _common(ruler, ALL_POLICIES)

    ruler.add_argument("--tasks", default=",".join(RULER_TASKS), help=f"tasks (default: {','.join(RULER_TASKS)})")
    _question_agnostic(ruler)
    pert = tasks.add_parser(
        "perturbation", help="the paper's Section 5: head-wise and layer-wise output perturbation",
        description="The paper's Section 5 at the first decoding token: per layer and head the L1 perturbation of "
                    "the attention output against the full cache for each base method and its CriticalKV variants "
                    "(bases are added when missing), the fraction of heads where CriticalKV is lower, and the "
                    "perturbation of every layer's hidden state. " + SHARED)
    _common(pert, PAIR_POLICIES)
    pert.add_argument("--prompts", choices=("needle", "ruler", "both"), default="both",
                      help="where the prompts come from: the needle grid, the RULER-style tasks, or both (default)")
    pert.add_argument("--depths", default="10,50,90", help="needle depths in percent for --prompts needle/both (default: 10,50,90)")
    pert.add_argument("--tasks", default=",".join(RULER_TASKS), help="RULER-style tasks for --prompts ruler/both")
    for sub in (needle, ruler, pert):
        sub.set_defaults(func=run)
    _shared_context(tasks)
    rep = tasks.add_parser(
        "report",
        help="redraw a finished run's markdown and figures from its JSON (needle/RULER summaries recomputed)",
        description="Re-render <task>.md and the PNG figures of finished evaluations from their <task>.json, without "
                    "running the model. For needle and RULER-style runs the summaries (scores, paired comparisons) "
                    "are recomputed from the stored per-prompt scores and written back into the JSON.",
    )
    rep.add_argument("paths", nargs="+", type=Path, metavar="PATH",
                     help="a results JSON, or a directory holding needle.json / ruler.json / perturbation.json")
    rep.set_defaults(func=run_report)


def _shared_context(tasks) -> None:
    from criticalkv.eval import shared_command as sc

    p = tasks.add_parser(
        "shared-context",
        help="one document, many questions: compressed once (question-agnostic) or with each question (aware), "
             "accuracy with 95 %% intervals and fidelity to the full cache",
        description="SCBench-style compress-once, answer-many on the bundled model (or --model): documents of the "
                    "domains' evaluation (or --split train) text with facts inserted, each asked several kinds of "
                    "questions (--kinds: one key's value, two keys, a value passed along a chain, whose number, a "
                    "quotation's continuation, a count, an open question scored against the full cache). Each "
                    "document is prefilled once; question-agnostically each policy compresses the context once per "
                    "budget (--fractions of the context) and every question is asked of it; question-aware "
                    "(--aware-policies) the question is inside the prompt the policy compresses. Records: "
                    "--out DIR/records.jsonl, appended after every document (--resume continues a stopped run); "
                    "tables with cluster-bootstrap 95 % intervals: DIR/tables.md (criticalkv eval report DIR redraws "
                    "them, with the records of the runs in DIR's subfolders beside them: kvpress's from python -m "
                    "criticalkv.bench.peers.kvpress shared-context --out DIR/kvpress, an adaptive-budget run's "
                    "--out DIR/adaptive).")
    p.add_argument("--domains", default=",".join(sc.DOMAIN_NAMES),
                   help=f"comma-separated domains (default: {','.join(sc.DOMAIN_NAMES)}; criticalkv/eval/domains.py)")
    p.add_argument("--documents", type=int, default=10, help="documents per domain (default: 10)")
    p.add_argument("--lengths", default=",".join(map(str, sc.DEFAULT_LENGTHS)),
                   help="context lengths in tokens, taken in turn by the documents of a domain "
                        f"(default: {','.join(map(str, sc.DEFAULT_LENGTHS))})")
    p.add_argument("--kinds", default=",".join(sc.DEFAULT_KINDS),
                   help=f"question kinds each document asks (default: {','.join(sc.DEFAULT_KINDS)})")
    p.add_argument("--fractions", default=sc.DEFAULT_FRACTIONS,
                   help=f"budgets as fractions of the tokens compressed (default: {sc.DEFAULT_FRACTIONS})")
    p.add_argument("--policies", default=sc.DEFAULT_AGNOSTIC,
                   help=f"question-agnostic policy specs (default: {sc.DEFAULT_AGNOSTIC})")
    p.add_argument("--aware-policies", default=sc.DEFAULT_AWARE,
                   help=f"question-aware policy specs, '' for none (default: {sc.DEFAULT_AWARE})")
    p.add_argument("--adaptive", default=sc.DEFAULT_ADAPTIVE,
                   help="the policy whose budget follows the document with --thresholds (default: the default "
                        "context policy)")
    p.add_argument("--thresholds", default="",
                   help="adaptive budget: keep every entry whose score (KVzip's, an attention probability) reaches "
                        "each of these thresholds, at most --adaptive-caps of the context (default: none)")
    p.add_argument("--adaptive-caps", default="0.5", help="caps of the adaptive budget, fractions (default: 0.5)")
    p.add_argument("--calibrate", default="",
                   help="instead of evaluating: print (and write to --out/calibration.json) the --thresholds at which "
                        "--adaptive keeps these mean fractions of the documents (tune on --split train)")
    p.add_argument("--split", choices=("eval", "train"), default="eval",
                   help="the domains' evaluation documents (default) or their training documents (for tuning)")
    p.add_argument("--seed", type=int, default=0, help="seed of the documents (default: 0)")
    p.add_argument("--out", type=Path, required=True, help="folder for the records and tables")
    p.add_argument("--model", help="HF folder or .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--no-chat", action="store_true", help="plain prompts instead of the model's chat template")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--window", type=int, default=None,
                   help=f"observation window of every policy (default: {KVPolicy().window})")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out (same configuration, or fewer --policies/--aware-policies/"
                        "--fractions: the documents still to do get only those runs, the finished ones keep theirs)")
    p.add_argument("--overwrite", action="store_true", help="replace the results in --out")
    p.set_defaults(func=sc.run)


def _question_agnostic(p: argparse.ArgumentParser) -> None:
    p.add_argument("--question-agnostic", action="store_true",
                   help="compress each prompt's context without its question (the selection's window is the "
                        "context's own last tokens), then ask: the question runs through the compressed cache, as "
                        "the serving context cache does when one compressed document answers many questions")


def run_report(args) -> int:
    from criticalkv.eval.report import refresh

    from criticalkv.eval.shared_command import write_tables
    from criticalkv.eval.shared_runner import CONFIG, RECORDS

    files = []
    for path in args.paths:
        if path.is_dir() and ((path / RECORDS).exists() or (path / CONFIG).exists()):
            print(write_tables(path))  # a shared-context run
            continue
        if path.is_dir():
            found = [path / f"{t}.json" for t in TASKS if (path / f"{t}.json").is_file()]
            if not found:
                raise ValueError(f"{path}: no needle.json, ruler.json or perturbation.json in this directory")
            files += found
        else:
            files.append(path)
    for f in files:
        print(refresh(f))
    return 0


def _common(p: argparse.ArgumentParser, policies: str) -> None:
    p.add_argument("--policies", default=policies,
                   help="comma-separated policy specs: a name from the registry (" + ", ".join(POLICIES) + ") "
                        "optionally with :knob=value overrides, e.g. criticalkv:stage2_scores=raw "
                        f"(default: {policies})")
    p.add_argument("--budgets", default="64,128,256", help="comma-separated budgets (default: 64,128,256)")
    p.add_argument("--lengths", default="2048,4096", help="comma-separated prompt lengths in tokens (default: 2048,4096)")
    p.add_argument("--samples", type=int, default=2, help="instances per length (and depth or task) (default: 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt generators (default: 0)")
    p.add_argument("--out", type=Path, required=True, help="folder for the JSON, markdown and PNG results")
    p.add_argument("--model", help="HF folder or .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--no-chat", action="store_true", help="plain prompts instead of the model's chat template")
    p.add_argument("--domain", default=DEFAULT_DOMAIN, choices=tuple(DOMAINS),
                   help="where the haystacks and word lists come from: " + "; ".join(
                       f"{d.name}: {d.description}" for d in DOMAINS.values()) + f" (default: {DEFAULT_DOMAIN}; "
                   "docs/evaluation.md, criticalkv/eval/domains.py)")
    p.add_argument("--verify", type=int, default=0, metavar="N",
                   help="re-run criticalkv.hf.generate on the first N prompts of each length and stop if any token "
                        "differs (default: 0)")
    p.add_argument("--resume", action="store_true", help="reuse the prompts already done in --out (same configuration)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace results already in --out (without it, finished or partial results there are refused "
                        "unless --resume continues them)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; on a shared CPU 1 can be several times faster)")
    p.add_argument("--window", type=int, default=KVPolicy().window,
                   help=f"observation window of every policy (its knobs: in --policies' specs) (default: {KVPolicy().window})")
    # --kv-policy and --budget (generate's) are refused with what to use instead, not as unknown arguments
    p.add_argument("--kv-policy", "--budget", dest="single_policy", help=argparse.SUPPRESS)


def base_policy_from_args(args) -> KVPolicy:
    """What every policy spec starts from: the default knobs and --window (names, knobs and budgets come from
    --policies / --budgets)."""
    if args.single_policy is not None:
        raise ValueError("use --policies and --budgets to choose policies and budgets (not --kv-policy / --budget)")
    return KVPolicy(name="full", window=args.window)


def canonical_command(args) -> str:
    """The command line that reproduces this run (every evaluation option spelled out)."""
    parts = ["criticalkv", "eval", args.task, "--policies", args.policies, "--budgets", args.budgets,
             "--lengths", args.lengths, "--samples", str(args.samples), "--seed", str(args.seed)]
    for opt in ("depths", "tasks", "prompts"):
        if getattr(args, opt, None) is not None:
            parts += [f"--{opt}", str(getattr(args, opt))]
    if args.model:
        parts += ["--model", args.model]
    if args.no_chat:
        parts.append("--no-chat")
    if getattr(args, "domain", DEFAULT_DOMAIN) != DEFAULT_DOMAIN:
        parts += ["--domain", args.domain]
    if getattr(args, "question_agnostic", False):
        parts.append("--question-agnostic")
    if args.verify:
        parts += ["--verify", str(args.verify)]
    if args.threads is not None:
        parts += ["--threads", str(args.threads)]
    if args.window != KVPolicy().window:
        parts += ["--window", str(args.window)]
    parts += ["--out", str(args.out)]
    return " ".join(shlex.quote(x) for x in parts)


def run(args) -> int:
    base = base_policy_from_args(args)
    runs = expand_runs(args.policies, parse_list(args.budgets, "--budgets"), base)
    lengths = parse_list(args.lengths, "--lengths")
    check_lengths(lengths, runs)
    if args.samples < 1:
        raise ValueError(f"--samples must be >= 1, got {args.samples}")
    if args.verify < 0:
        raise ValueError(f"--verify must be >= 0, got {args.verify}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    depths = parse_list(args.depths, "--depths", float) if getattr(args, "depths", None) is not None else None
    for d in depths or []:
        if not 0 <= d <= 100:
            raise ValueError(f"--depths: {d:g} is outside [0, 100] (depths are percentages)")
    tasks = parse_list(args.tasks, "--tasks", str) if getattr(args, "tasks", None) is not None else None
    if tasks is not None:
        unknown = [t for t in tasks if t not in RULER_TASKS]
        if unknown:
            raise ValueError(f"--tasks: unknown task(s) {', '.join(unknown)}; choose from {', '.join(RULER_TASKS)}")
    if args.task == "perturbation":
        if args.resume:
            raise ValueError("--resume: not supported by the perturbation analysis (its per-head arrays are not "
                             "stored per prompt); it takes minutes, run it again")
        runs = _with_bases(runs)
    if args.resume and args.overwrite:
        raise ValueError("--resume and --overwrite exclude each other")
    import torch

    from criticalkv.eval import report
    from criticalkv.eval.io import environment, prepare_out_dir
    from criticalkv.eval.runner import evaluate
    from criticalkv.hf import load_model
    from criticalkv.hf.loading import resolve_model, stop_token_ids

    out = prepare_out_dir(args.out)
    if args.task != "perturbation":  # its partial JSON lacks the per-head arrays: nothing to continue from
        args.stop_hint = f"the prompts finished so far are in {out / (args.task + '.json')} (continue with --resume)"
    chat = not args.no_chat
    config = {
        "task": args.task,
        "model": args.model or "smollm2-135m",
        "lengths": lengths,
        "depths": depths,
        "tasks": tasks,
        "prompts": getattr(args, "prompts", None),
        "samples": args.samples,
        "seed": args.seed,
        "chat": chat,
        "runs": {r.key: {"spec": r.spec, "budget": r.budget, "policy": r.policy.to_dict()} for r in runs},
    }
    question_agnostic = getattr(args, "question_agnostic", False)
    if question_agnostic:  # only then: results of earlier, question-aware runs keep their configuration
        config["question_agnostic"] = True
    if args.domain != DEFAULT_DOMAIN:  # likewise: earlier runs, all on the default domain, keep theirs
        config["domain"] = args.domain
    path = out / f"{args.task}.json"
    done, previous = _earlier_results(path, config, args.resume, args.overwrite)

    started = time.time()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    prompts = _prompts(args.task, tokenizer, lengths, depths, tasks, args.samples, args.seed, chat, getattr(args, "prompts", None),
                       args.domain)
    meta = {
        "command": canonical_command(args),
        "config": config,
        "environment": environment(),
        "model": _model_info(model, resolve_model(args.model)),
        "prompt_count": len(prompts),
        "haystack": get_domain(args.domain).provenance(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
    }
    if previous is not None:
        meta["resumed"] = previous
    writer = report.Writer(args.task, out, meta, runs, lengths, tasks)

    records = evaluate(
        model, tokenizer, prompts, runs,
        stop_token_ids=stop_token_ids(tokenizer, model),
        perturbation=args.task == "perturbation",
        verify=args.verify,
        done=done,
        on_record=writer.partial,
        question_agnostic=question_agnostic,
    )
    meta["wall_s"] = time.time() - started
    headline = writer.final(records, meta)
    print(headline)
    return 0


def _with_bases(runs):
    """The perturbation analysis compares each CriticalKV run with its base: add missing bases."""
    out = list(runs)
    for run in runs:
        base = base_policy(run.policy)
        if base is not None and not any(same_selection(base, r.policy) for r in out):
            spec = run.spec.split(":")[0]
            out.append(PolicyRun(base.name if spec == run.policy.name else spec, run.budget, base))
            print(f"criticalkv eval: adding {base.name}@{run.budget}, the base of {run.key}", file=sys.stderr)
    if not any(base_policy(r.policy) for r in out):
        raise ValueError("--policies: the perturbation analysis needs at least one CriticalKV policy "
                         "(criticalkv, pyramid-criticalkv or ada-criticalkv)")
    return out


def _prompts(task, tokenizer, lengths, depths, tasks, samples, seed, chat, source, domain=None):
    from criticalkv.eval.needle import needle_prompts
    from criticalkv.eval.ruler import ruler_prompts

    if task == "needle":
        return needle_prompts(tokenizer, lengths, depths, samples, seed, chat, domain)
    if task == "ruler":
        return ruler_prompts(tokenizer, lengths, tasks, samples, seed, chat, domain)
    prompts = []
    if source in ("needle", "both"):
        prompts += needle_prompts(tokenizer, lengths, depths, samples, seed, chat, domain)
    if source in ("ruler", "both"):
        prompts += ruler_prompts(tokenizer, lengths, tasks, samples, seed, chat, domain)
    # only the first decoding step matters here
    return [dataclasses.replace(p, max_new_tokens=1) for p in prompts]


def _portable(folder) -> str:
    """The model folder as written into results: the user's home as ``~`` (results are committed)."""
    path = Path(folder)
    try:
        return str(Path("~") / path.relative_to(Path.home()))
    except ValueError:
        return str(path)


def _model_info(model, folder) -> dict:
    c = model.config
    return {
        "folder": _portable(folder),
        "model_type": c.model_type,
        "layers": c.num_hidden_layers,
        "heads": c.num_attention_heads,
        "kv_heads": c.num_key_value_heads,
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        "hidden": c.hidden_size,
        "dtype": str(model.dtype).replace("torch.", ""),
    }


def _earlier_results(path: Path, config: dict, resume: bool, overwrite: bool) -> tuple[dict, dict | None]:
    """Records already in ``path`` to continue from (by prompt key) and what is known about their run.

    Results already there are never replaced silently: ``--resume`` continues them when the configuration
    is the same, ``--overwrite`` replaces them, and anything else is refused with what is there.
    """
    if not path.exists():
        return {}, None
    if overwrite:
        print(f"criticalkv eval: replacing {path} (--overwrite)", file=sys.stderr)
        return {}, None
    choices = "pass " if config["task"] == "perturbation" else "pass --resume to continue them (same configuration) or "
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
        records = {rec["key"]: rec for rec in old.get("records", [])}
    except (OSError, ValueError, AttributeError, KeyError, TypeError) as err:
        raise ValueError(f"--out: {path} holds results that cannot be read ({err}); pass --overwrite to replace "
                         "them, or choose another --out") from None
    state = "complete" if old.get("complete") else f"partial: {len(records)} of {old.get('prompt_count', '?')} prompts"
    if not resume:
        raise ValueError(f"--out: {path} already holds results ({state}); {choices}--overwrite to replace them, "
                         "or choose another --out")
    stored, wanted = old.get("config"), json.loads(json.dumps(config))
    if stored != wanted:
        stored = stored if isinstance(stored, dict) else {}
        differs = ", ".join(sorted(k for k in set(wanted) | set(stored) if stored.get(k) != wanted.get(k))) or "format"
        raise ValueError(f"--resume: {path} holds results ({state}) of another configuration (differs in: {differs}); "
                         "pass --overwrite to replace them, or choose another --out")
    return records, {"records": len(records), "complete": old.get("complete", False), "wall_s": old.get("wall_s"),
                     "started": old.get("started")}
