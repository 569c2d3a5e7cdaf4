"""``criticalkv eval shared-context``: the run behind the command (argument parsing lives in
``criticalkv.commands.eval``).

Writes into ``--out DIR``: ``config.json`` (the command, the configuration, the machine and versions),
``records.jsonl`` (one line per question, setting and run, appended after each document), ``documents.jsonl`` (one
line per finished document: its timings and budgets), then ``tables.md`` and ``summary.json``
(``criticalkv.eval.shared_stats``), which ``criticalkv eval report DIR`` redraws from the records at any time (with
kvpress's records in ``DIR/kvpress/`` beside them when present).
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path
from typing import Sequence

from criticalkv.eval.shared_context import DEFAULT_KINDS, DEFAULT_LENGTHS, KINDS

#: The question-agnostic policies by default: full, the default context policy, its variants (uncapped: the cap's
#: price; without CriticalKV's stage 2: what the stage adds; scored by KVzip's re-read, the fallback without a
#: surrogate: what the surrogate costs), and the window's own attention (the question-aware policies' scoring,
#: compressed without the question).
DEFAULT_AGNOSTIC = ("full,layer-kvzip-criticalkv:kvzip_score=surrogate:head_cap_ratio=6,"
                    "layer-kvzip-criticalkv:kvzip_score=surrogate,layer-kvzip:kvzip_score=surrogate:head_cap_ratio=6,"
                    "layer-kvzip-criticalkv:head_cap_ratio=3,snapkv")
#: The question-aware policies by default: the paper's setting (SnapKV, CriticalKV on it, and on AdaKV's shares).
DEFAULT_AWARE = "snapkv,criticalkv,ada-criticalkv"
DEFAULT_FRACTIONS = "0.125,0.25,0.5"
DEFAULT_ADAPTIVE = "layer-kvzip-criticalkv:kvzip_score=surrogate:head_cap_ratio=6"
DOMAIN_NAMES = ("shakespeare", "docs", "legal", "code")


def parse_floats(text: str, flag: str) -> list[float]:
    items = [t.strip() for t in (text or "").split(",") if t.strip()]
    try:
        values = [float(t) for t in items]
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a comma-separated list of numbers") from None
    if len(set(values)) != len(values):
        raise ValueError(f"{flag}: {text!r} repeats a value")
    return values


def parse_names(text: str, flag: str, choices: Sequence[str] | None = None) -> list[str]:
    items = [t.strip() for t in (text or "").split(",") if t.strip()]
    if len(set(items)) != len(items):
        raise ValueError(f"{flag}: {text!r} repeats a value")
    if choices is not None:
        unknown = [t for t in items if t not in choices]
        if unknown:
            raise ValueError(f"{flag}: unknown {', '.join(unknown)}; choose from {', '.join(choices)}")
    return items


def canonical_command(args) -> str:
    parts = ["criticalkv", "eval", "shared-context", "--domains", args.domains, "--documents", str(args.documents),
             "--lengths", args.lengths, "--fractions", args.fractions, "--policies", args.policies,
             "--aware-policies", args.aware_policies]
    if args.thresholds:
        parts += ["--adaptive", args.adaptive, "--thresholds", args.thresholds, "--adaptive-caps", args.adaptive_caps]
    if args.kinds != ",".join(DEFAULT_KINDS):
        parts += ["--kinds", args.kinds]
    if args.split != "eval":
        parts += ["--split", args.split]
    if args.seed:
        parts += ["--seed", str(args.seed)]
    if args.model:
        parts += ["--model", args.model]
    if args.threads is not None:
        parts += ["--threads", str(args.threads)]
    if args.window is not None:
        parts += ["--window", str(args.window)]
    if args.calibrate:
        parts += ["--calibrate", args.calibrate]
    parts += ["--out", str(args.out)]
    return " ".join(shlex.quote(x) for x in parts)


def plan(args):
    """The documents' settings and the runs, checked before any model loads."""
    from criticalkv.eval.shared_runner import make_runs
    from criticalkv.policy import KVPolicy

    domains = parse_names(args.domains, "--domains", DOMAIN_NAMES)
    if not domains:
        raise ValueError("--domains: give at least one domain")
    lengths = [int(x) for x in parse_floats(args.lengths, "--lengths")]
    for n in lengths:
        if not 512 <= n <= 8192:
            raise ValueError(f"--lengths: {n} is outside 512-8192 tokens (the bundled model's context is 8,192)")
    if args.documents < 1:
        raise ValueError(f"--documents must be >= 1, got {args.documents}")
    kinds = parse_names(args.kinds, "--kinds", tuple(KINDS))
    if not kinds:
        raise ValueError("--kinds: give at least one question kind")
    fractions = parse_floats(args.fractions, "--fractions")
    base = KVPolicy(name="full") if args.window is None else KVPolicy(name="full", window=args.window)
    runs = make_runs("agnostic", parse_names(args.policies, "--policies"), fractions, base)
    if args.aware_policies:
        runs += make_runs("aware", parse_names(args.aware_policies, "--aware-policies"), fractions, base)
    thresholds = parse_floats(args.thresholds, "--thresholds") if args.thresholds else []
    if thresholds:
        caps = parse_floats(args.adaptive_caps, "--adaptive-caps")
        runs += make_runs("agnostic", [args.adaptive], caps, base, thresholds)
    if len({(r.setting, r.key) for r in runs}) != len(runs):
        raise ValueError("--policies / --aware-policies: a run is named twice")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    calibrate = parse_floats(args.calibrate, "--calibrate") if args.calibrate else []
    for f in calibrate:
        if not 0 < f < 1:
            raise ValueError(f"--calibrate: {f:g} is not a fraction in (0, 1)")
    return domains, lengths, kinds, runs, calibrate


def run(args) -> int:
    domains, lengths, kinds, runs, calibrate = plan(args)
    if args.resume and args.overwrite:
        raise ValueError("--resume and --overwrite exclude each other")
    import torch

    from criticalkv.eval import shared_runner as sr
    from criticalkv.eval.io import environment, prepare_out_dir, write_json
    from criticalkv.eval.shared_context import shared_documents
    from criticalkv.hf import load_model
    from criticalkv.hf.loading import stop_token_ids

    out = prepare_out_dir(args.out)
    config = {"task": "shared-context", "model": args.model or "smollm2-135m", "domains": domains,
              "documents": args.documents, "lengths": lengths, "kinds": kinds, "split": args.split, "seed": args.seed,
              "chat": not args.no_chat, "runs": [[r.setting, r.key, r.policy.to_dict()] for r in runs]}
    if calibrate:
        config["calibrate"] = calibrate
    _check_earlier(out, config, args.resume, args.overwrite)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    started = time.time()
    model, tokenizer = load_model(args.model)
    documents = shared_documents(tokenizer, domains, args.documents, lengths, args.seed, args.split, kinds,
                                 not args.no_chat)
    meta = {"command": canonical_command(args), "config": config, "environment": environment(),
            "documents": len(documents), "questions": sum(len(d.questions) for d in documents),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started))}
    if calibrate:
        return _calibrate(model, tokenizer, documents, runs, calibrate, out, meta)
    if args.resume:
        earlier = [c for c in _earlier_commands(out) if c != meta["command"]]
        if earlier:
            meta["earlier_commands"] = earlier
            meta["started"] = json.loads((out / sr.CONFIG).read_text(encoding="utf-8")).get("started", meta["started"])
    write_json(out / sr.CONFIG, meta)
    dropped = sr.drop_unfinished(out)
    if dropped:
        print(f"criticalkv eval shared-context: {dropped} records of an unfinished document dropped (redone)",
              file=sys.stderr)
    done = sr.finished_documents(out)
    args.stop_hint = f"the documents finished so far are in {out / sr.RECORDS} (continue with --resume)"
    evaluator = sr.DocumentEvaluator(model, tokenizer, runs, stop_token_ids(tokenizer, model))
    todo = [d for d in documents if d.key not in done]
    print(f"criticalkv eval shared-context: {len(documents)} documents ({len(done)} done), "
          f"{meta['questions']} questions, {len(runs)} runs", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    for i, doc in enumerate(todo, 1):
        records, info = evaluator.evaluate(doc)
        sr.append_document(out, records, info)
        sr.progress_line(len(done) + i, len(documents), doc.key, time.perf_counter() - t0)
    print(write_tables(out))
    return 0


def _check_earlier(out: Path, config: dict, resume: bool, overwrite: bool) -> None:
    from criticalkv.eval import shared_runner as sr

    path = out / sr.CONFIG
    if not path.exists() and not (out / sr.RECORDS).exists():
        return
    if overwrite:
        for name in (sr.RECORDS, sr.DOCUMENTS, sr.CONFIG, "tables.md", "summary.json"):
            if (out / name).exists():
                (out / name).unlink()
        print(f"criticalkv eval shared-context: replacing the results in {out} (--overwrite)", file=sys.stderr)
        return
    done = len(sr.finished_documents(out))
    if not resume:
        raise ValueError(f"--out: {out} already holds shared-context results ({done} documents); pass --resume to "
                         "continue them (same configuration) or --overwrite to replace them, or choose another --out")
    try:
        stored = json.loads(path.read_text(encoding="utf-8")).get("config")
    except (OSError, ValueError):
        stored = None
    config = _normalized(json.loads(json.dumps(config)))
    stored = _normalized(stored)
    if stored != config:
        stored = stored if isinstance(stored, dict) else {}
        differs = sorted(k for k in set(config) | set(stored) if stored.get(k) != config.get(k))
        if differs == ["runs"] and _is_subset(config["runs"], stored.get("runs") or []):
            return  # a narrower resume: the documents still to do get fewer runs, those done keep all theirs
        raise ValueError(f"--resume: {out} holds results of another configuration (differs in: {', '.join(differs)}); "
                         "pass --overwrite to replace them, or choose another --out (--resume may drop runs, "
                         "nothing else)")


def _normalized(config):
    """``config`` with each run's policy in today's form (a run recorded before the knobs moved to the methods lists
    every knob; ``KVPolicy.from_dict`` reads both forms), so that such a run resumes."""
    from criticalkv.policy import KVPolicy

    if not isinstance(config, dict) or not isinstance(config.get("runs"), list):
        return config
    runs = []
    for run in config["runs"]:
        if isinstance(run, list) and run and isinstance(run[-1], dict) and "name" in run[-1]:
            try:
                run = [*run[:-1], KVPolicy.from_dict(run[-1]).to_dict()]
            except (TypeError, ValueError):
                pass  # not a policy this version reads: compared as it is
        runs.append(run)
    return {**config, "runs": runs}


def _is_subset(runs: list, stored: list) -> bool:
    """Whether every run of ``runs`` (``[setting, key, policy]``) is one of ``stored``, the same policy."""
    return all(r in stored for r in runs)


def _earlier_commands(out: Path) -> list[str]:
    """The commands of the earlier runs into ``out`` (a narrower resume keeps the records they wrote)."""
    from criticalkv.eval import shared_runner as sr

    try:
        meta = json.loads((out / sr.CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    earlier = list(meta.get("earlier_commands", []))
    if meta.get("command") and meta["command"] not in earlier:
        earlier.append(meta["command"])
    return earlier


def _calibrate(model, tokenizer, documents, runs, fractions, out: Path, meta: dict) -> int:
    """The thresholds at which the adaptive policy keeps, on average over ``documents``, each of ``fractions`` of the
    cache (no answer is generated): what ``--thresholds`` then takes, tuned on the training documents."""
    import numpy as np
    import torch

    from criticalkv.eval.engine import ScoreBank, shared_prefill
    from criticalkv.eval.io import write_json
    from criticalkv.methods.kvzip import ReconstructionPrompt
    from criticalkv.methods.surrogate import uses_surrogate

    adaptive = [r for r in runs if r.threshold is not None] or [r for r in runs if r.policy.method.base.external_scores]
    if not adaptive:
        raise ValueError("--calibrate: no policy with a score of its own (--adaptive SPEC with --thresholds, or a kvzip "
                         "policy in --policies)")
    policy = adaptive[0].policy
    reconstruction = ReconstructionPrompt.from_tokenizer(tokenizer)
    per_doc = []
    for doc in documents:
        prefill = shared_prefill(model, torch.tensor([doc.context_ids]), [policy.window], uses_surrogate(policy))
        scores = ScoreBank(prefill, model, reconstruction).external_scores(policy)
        n, w = prefill.n, min(policy.window, prefill.n)
        per_doc.append(np.sort(np.concatenate([s[..., : n - w].flatten().float().numpy() for s in scores]))[::-1])
        print(f"calibrate: {doc.key}", file=sys.stderr, flush=True)

    def mean_fraction(t: float) -> float:
        return float(np.mean([(w_ + (s >= t).sum() / (len(s) / (n_ - w_))) / n_ for s, n_, w_ in
                              ((s, len(d.context_ids), min(policy.window, len(d.context_ids)))
                               for s, d in zip(per_doc, documents))]))

    thresholds = {}
    for f in fractions:
        lo, hi = 1e-12, 1.0
        for _ in range(60):  # bisection on the log scale: the kept fraction falls as the threshold rises
            mid = (lo * hi) ** 0.5
            lo, hi = (mid, hi) if mean_fraction(mid) > f else (lo, mid)
        thresholds[f"{f:g}"] = float(f"{hi:.3g}")
    result = {**meta, "policy": policy.to_dict(), "thresholds": thresholds,
              "kept_at_thresholds": {k: mean_fraction(v) for k, v in thresholds.items()}}
    write_json(out / "calibration.json", result)
    print(json.dumps(thresholds))
    return 0


def write_tables(out: Path) -> str:
    """``tables.md`` and ``summary.json`` from the records in ``out`` and in its subfolders (``kvpress/``: kvpress's
    run; ``adaptive/``: an adaptive-budget run on the same documents); returns a one-line summary of what was written."""
    from criticalkv.eval.io import write_json, write_text
    from criticalkv.eval.shared_runner import CONFIG, DOCUMENTS, RECORDS, read_jsonl
    from criticalkv.eval.shared_stats import Cells, load_records, render, summarize

    out = Path(out)
    folders = [out] + sorted(p for p in out.iterdir() if p.is_dir() and (p / RECORDS).exists())
    records = load_records([f / RECORDS for f in folders])
    if not records:
        raise ValueError(f"{out}: no shared-context records ({RECORDS}) to make tables from")
    metas = [json.loads((f / CONFIG).read_text(encoding="utf-8")) for f in folders if (f / CONFIG).exists()]
    meta = metas[0] if metas and (out / CONFIG).exists() else {}
    kinds = [k for k in meta.get("config", {}).get("kinds", DEFAULT_KINDS) if k != "open"]
    cells = Cells(records, kinds)
    documents = [d for f in folders if f.name != "kvpress" for d in read_jsonl(f / DOCUMENTS)]
    summary = summarize(cells, documents)
    write_json(out / "summary.json", summary)
    write_text(out / "tables.md", render(summary, meta, metas[1:] if meta else metas, read_jsonl(out / DOCUMENTS)))
    return f"wrote {out / 'tables.md'} and {out / 'summary.json'} ({len(records)} records)"
