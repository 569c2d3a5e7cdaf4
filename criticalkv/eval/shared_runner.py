"""Run a shared-context evaluation: every document prefilled once, compressed once per policy and budget, every
question asked of it; records written per document (JSON lines), resumable.

Per document (``evaluate_document``):

1. one prefill of the context (the chat opening, the instruction and the document) with the full cache
   (``criticalkv.eval.engine.shared_prefill``), whose scores (``ScoreBank``: window attention, value norms, KVzip's
   re-read or its surrogate) every policy and budget share;
2. **question-agnostic** (the context cache's way): each policy selects over the context alone at each budget
   (a fraction of the context's tokens), once; every question then runs through that compressed cache and is answered
   (``criticalkv.eval.engine.decode(question_ids=...)``); ``full`` is the reference every answer is compared with;
3. **adaptive** (question-agnostic): a policy keeps what its scorer ranks above a threshold, at most a cap
   (``adaptive_budget``): the budget follows the document;
4. **question-aware** (the document and the question in one prompt, the question inside the window): for each
   question the document's full cache is extended by the question (``extend_shared_prefill``: the same as one
   prefill of document + question) and each policy selects over the whole prompt at each budget (a fraction of the
   prompt's tokens).

Every answer is greedy, at most its kind's ``max_new_tokens``, and stops at the model's stop tokens. A record per
(question, setting, run): the answer, its score, the kept fraction, and its fidelity to ``full``'s answer (whether
the answer's tokens are full's, the share of full's tokens it repeats before the first difference, and the KL
divergence of the first answer token's distribution from full's).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from criticalkv.eval.engine import (
    ScoreBank,
    decode,
    extend_shared_prefill,
    kept_fraction,
    select_all_layers,
    shared_prefill,
)
from criticalkv.eval.shared_context import SharedDocument, score_answer
from criticalkv.methods.budget import adaptive_budget
from criticalkv.methods.kvzip import ReconstructionPrompt
from criticalkv.methods.surrogate import uses_surrogate
from criticalkv.policy import KVPolicy, parse_policy_spec

SETTINGS = ("agnostic", "aware")


@dataclass(frozen=True)
class SharedRun:
    """One (policy, budget rule) of the evaluation. ``fraction``: the budget is this fraction of the tokens compressed
    (rounded up); with ``threshold`` it is the cap of ``adaptive_budget``. ``key`` names it in the records."""

    setting: str
    spec: str
    policy: KVPolicy
    fraction: float | None = None
    threshold: float | None = None

    @property
    def key(self) -> str:
        if self.policy.name == "full":
            return "full"
        rule = f"{100 * self.fraction:g}%"
        if self.threshold is not None:
            rule = f"t{self.threshold:g}<={rule}"
        return f"{self.spec}@{rule}"

    def budget(self, n: int) -> int:
        """The fixed budget for ``n`` tokens compressed (the cap, for an adaptive run)."""
        return max(1, math.ceil(self.fraction * n))


def make_runs(setting: str, specs: Sequence[str], fractions: Sequence[float], base: KVPolicy,
              thresholds: Sequence[float] = ()) -> list[SharedRun]:
    """Every (spec, fraction) of a setting (``full`` once); with ``thresholds``, every (spec, threshold, cap)."""
    if setting not in SETTINGS:
        raise ValueError(f"setting: one of {', '.join(SETTINGS)}, got {setting!r}")
    for f in fractions:
        if not 0 < f < 1:
            raise ValueError(f"--fractions: {f:g} is not a fraction of the cache in (0, 1)")
    runs = []
    for spec in specs:
        policy = parse_policy_spec(spec, base)
        if policy.name == "full":
            if not thresholds:
                runs.append(SharedRun(setting, spec, policy))
            continue
        if thresholds and not policy.method.base.external_scores:
            raise ValueError(f"--adaptive: {spec!r} has no score of its own to threshold (a kvzip policy has: "
                             "KVzip's score, re-read or surrogate)")
        for f in fractions:
            if thresholds:
                runs += [SharedRun(setting, spec, policy, f, t) for t in thresholds]
            else:
                runs.append(SharedRun(setting, spec, policy, f))
    return runs


def _kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """KL(reference || other) of the next-token distributions given by two [1, V] logits (nats)."""
    p = torch.log_softmax(reference.double(), dim=-1)
    q = torch.log_softmax(other.double(), dim=-1)
    return float((p.exp() * (p - q)).sum())


def _agreement(reference: list[int], tokens: list[int]) -> float:
    """The share of ``reference``'s tokens an answer repeats before its first difference (1.0: full's answer)."""
    if not reference:
        return 1.0 if not tokens else 0.0
    same = 0
    for a, b in zip(reference, tokens):
        if a != b:
            break
        same += 1
    return same / len(reference)


def _answer_tokens(tokens: list[int], stop: set[int]) -> list[int]:
    out = []
    for t in tokens:
        if t in stop:
            break
        out.append(t)
    return out


class DocumentEvaluator:
    """Evaluates documents with a fixed list of runs (one model, its tokenizer and stop tokens)."""

    def __init__(self, model, tokenizer, runs: Sequence[SharedRun], stop_token_ids: Sequence[int] = ()):
        self.model, self.tokenizer, self.runs = model, tokenizer, list(runs)
        self.stop = {int(t) for t in stop_token_ids}
        self.windows = sorted({r.policy.window for r in self.runs} | {KVPolicy().window})
        self.keep_hidden = any(uses_surrogate(r.policy) for r in self.runs)
        self.reconstruction = (ReconstructionPrompt.from_tokenizer(tokenizer)
                               if any(r.policy.method.base.external_scores for r in self.runs) else None)
        self.device = next(model.parameters()).device

    def _text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(_answer_tokens(tokens, self.stop), skip_special_tokens=True)

    def _record(self, doc, question, run, decoded, kept, budget, n, reference) -> dict:
        tokens = [int(t) for t in decoded.tokens]
        text = self._text(tokens)
        answer = _answer_tokens(tokens, self.stop)
        rec = {"doc": doc.key, "question": question.key, "kind": question.kind, "domain": doc.domain,
               "setting": run.setting, "run": run.key, "policy": run.spec, "fraction": run.fraction,
               "threshold": run.threshold, "budget": budget, "n": n, "kept": round(kept, 6), "text": text,
               "tokens": answer, "score": score_answer(question.metric, text, question.answers)}
        if reference is not None:
            ref_tokens, ref_logits = reference
            rec["exact"] = answer == ref_tokens
            rec["agree"] = round(_agreement(ref_tokens, answer), 6)
            rec["kl"] = round(_kl(ref_logits, decoded.extras["first_logits"]), 8)
        return rec

    @torch.no_grad()
    def evaluate(self, doc: SharedDocument, on_progress: Callable[[str], None] | None = None) -> tuple[list[dict], dict]:
        """Every run on every question of ``doc``: (records, the document's timings and budgets)."""
        ids = torch.tensor([doc.context_ids], device=self.device)
        started = time.perf_counter()
        prefill = shared_prefill(self.model, ids, self.windows, keep_hidden=self.keep_hidden)
        bank = ScoreBank(prefill, self.model, self.reconstruction)
        n = prefill.n
        questions = [(q, torch.tensor([q.ids], device=self.device)) for q in doc.questions]
        info = {"doc": doc.key, "domain": doc.domain, "length": n, "questions": len(questions),
                "prefill_s": prefill.prefill_s, "runs": {}}
        records: list[dict] = []
        references: dict[str, tuple[list[int], torch.Tensor]] = {}
        agnostic = [r for r in self.runs if r.setting == "agnostic"]
        aware = [r for r in self.runs if r.setting == "aware"]
        # full first: every other answer is compared with its answer to the same question
        full_runs = [r for r in agnostic + aware if r.policy.name == "full"] or [SharedRun("agnostic", "full",
                                                                                           KVPolicy("full"))]
        ordered = full_runs[:1] + [r for r in agnostic if r.policy.name != "full"]
        source_s: dict[str, float] = {}

        def scoring_seconds(policy: KVPolicy) -> float:
            """The time the policy's own score of the document took (KVzip's re-read or its surrogate; computed once
            per document and shared by the policies and budgets that read it); 0 for a policy without one."""
            if not policy.method.base.external_scores:
                return 0.0
            key = "surrogate" if uses_surrogate(policy) else f"reread:{policy.kvzip_chunk}:{policy.kvzip_reread}"
            if key not in source_s:
                before = bank.seconds
                bank.external_scores(policy)
                source_s[key] = bank.seconds - before
            return source_s[key]

        for run in ordered:
            is_full = run.policy.name == "full"
            scores_s = 0.0 if is_full else scoring_seconds(run.policy)
            t0 = time.perf_counter()
            if is_full:
                budget = n
            elif run.threshold is not None:
                scores = bank.external_scores(run.policy)
                # at least what the policy always keeps (window and sink tokens), as the engines' adaptive budget
                budget = max(run.policy.min_budget,
                             adaptive_budget(scores, run.threshold, run.policy.window, run.budget(n)))
            else:
                budget = run.budget(n)
            policy = run.policy if is_full else run.policy.replace(budget=min(budget, n))
            selections = select_all_layers(policy, bank)
            kept = kept_fraction(selections, n)
            info["runs"][run.key] = {"budget": budget, "kept": kept, "scores_s": scores_s,
                                     "selection_s": time.perf_counter() - t0}
            for question, q_ids in questions:
                decoded = decode(self.model, prefill, selections, question.max_new_tokens, sorted(self.stop),
                                 question_ids=q_ids)
                if is_full:
                    references[question.key] = (_answer_tokens([int(t) for t in decoded.tokens], self.stop),
                                                decoded.extras["first_logits"])
                if is_full and run not in self.runs:
                    continue  # the reference alone (full not asked for): nothing recorded
                records.append(self._record(doc, question, run, decoded, kept, budget, n,
                                            None if is_full else references[question.key]))
            if on_progress is not None:
                on_progress(run.key)
        if aware:
            extend_s = 0.0
            for question, q_ids in questions:
                t0 = time.perf_counter()
                whole = extend_shared_prefill(self.model, prefill, q_ids, self.windows)
                extend_s += time.perf_counter() - t0
                q_bank = ScoreBank(whole, self.model, self.reconstruction)
                m = whole.n
                for run in aware:
                    if run.policy.name == "full":
                        continue  # the same answers as the question-agnostic full (nothing is evicted)
                    budget = run.budget(m)
                    selections = select_all_layers(run.policy.replace(budget=min(budget, m)), q_bank)
                    decoded = decode(self.model, whole, selections, question.max_new_tokens, sorted(self.stop))
                    records.append(self._record(doc, question, run, decoded, kept_fraction(selections, m), budget, m,
                                                references[question.key]))
                if on_progress is not None:
                    on_progress(question.key)
            info["extend_s"] = extend_s
        info["total_s"] = time.perf_counter() - started
        return records, info


# ------------------------------------------------------------------------------------------------ record files
RECORDS, DOCUMENTS, CONFIG = "records.jsonl", "documents.jsonl", "config.json"


def read_jsonl(path: Path) -> list[dict]:
    """The complete lines of a JSON-lines file (a line cut by an interruption is ignored)."""
    if not path.exists():
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break  # the last line was being written when the run stopped
            out.append(json.loads(line))
    return out


def finished_documents(out: Path) -> dict[str, dict]:
    """Documents whose records are all written (their line in ``documents.jsonl``, written after their records)."""
    return {d["doc"]: d for d in read_jsonl(Path(out) / DOCUMENTS)}


def drop_unfinished(out: Path) -> int:
    """Rewrite ``records.jsonl`` without the records of documents not finished (a run stopped in the middle of one);
    returns how many records were dropped."""
    out = Path(out)
    path = out / RECORDS
    if not path.exists():
        return 0
    done = finished_documents(out)
    records = read_jsonl(path)
    keep = [r for r in records if r["doc"] in done]
    raw = path.read_bytes()
    if len(keep) == len(records) and raw.endswith(b"\n") or not raw:
        return 0
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in keep:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return len(records) - len(keep)


def append_document(out: Path, records: list[dict], info: dict) -> None:
    """Append a document's records, then its line in ``documents.jsonl`` (which marks them complete), each flushed to
    disk."""
    out = Path(out)
    for name, lines in ((RECORDS, records), (DOCUMENTS, [info])):
        with open(out / name, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines))
            f.flush()
            os.fsync(f.fileno())


def progress_line(done: int, total: int, key: str, seconds: float) -> None:
    print(f"shared-context: {done}/{total} documents ({key}), {seconds / 60:.1f} min", file=sys.stderr, flush=True)
