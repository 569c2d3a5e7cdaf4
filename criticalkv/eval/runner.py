"""Run every (policy, budget) of an evaluation on a list of prompts, one shared prefill per prompt.

``evaluate`` returns one record per prompt (what each run answered, its score, timings and, with
``perturbation``, the analysis of ``criticalkv.eval.perturbation``) and calls ``on_record`` after
each prompt so that the command can write its results file incrementally (and ``--resume`` can skip
the prompts already done). Progress goes to standard error: a tqdm bar on a terminal, one line per
prompt otherwise (a log file gets no carriage-return bars).
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from criticalkv.eval import perturbation as pert
from criticalkv.eval.engine import (
    ScoreBank,
    decode,
    kept_fraction,
    select_all_layers,
    shared_prefill,
    tokens_equal_generate,
)
from criticalkv.eval.prompts import EvalPrompt
from criticalkv.eval.scoring import score
from criticalkv.eval.specs import PolicyRun
from criticalkv.methods.kvzip import ReconstructionPrompt
from criticalkv.methods.surrogate import uses_surrogate
from criticalkv.policy import KVPolicy


class VerificationError(RuntimeError):
    """The shared-prefill path produced other tokens than ``criticalkv.hf.generate``."""


def _text(tokenizer, tokens: Sequence[int], stop: set[int]) -> str:
    return tokenizer.decode([t for t in tokens if t not in stop], skip_special_tokens=True)


def evaluate(
    model,
    tokenizer,
    prompts: Sequence[EvalPrompt],
    runs: Sequence[PolicyRun],
    stop_token_ids: Sequence[int] = (),
    perturbation: bool = False,
    verify: int = 0,
    progress: bool = True,
    done: dict[str, dict] | None = None,
    on_record: Callable[[list[dict]], None] | None = None,
    question_agnostic: bool = False,
) -> list[dict]:
    """Evaluate ``runs`` on ``prompts``; records come back in prompt order.

    perturbation : also run the first decoding step's perturbation analysis for every run
    verify : re-run ``criticalkv.hf.generate`` for every run on the first ``verify`` prompts of each
        length computed here and raise ``VerificationError`` if any token differs
    done : records of an earlier, interrupted run of the same configuration, by prompt key (reused)
    question_agnostic : compress each prompt's context without its question (the prompt up to the end of its
        ``context_span``; the selection's window is the context's last tokens), then ask: the question runs through
        the compressed cache and the answer follows (what the serving context cache does)
    """
    if question_agnostic and perturbation:
        raise ValueError("the perturbation analysis runs on question-aware prompts only")
    done = done or {}
    stop = {int(t) for t in stop_token_ids}
    windows = sorted({r.policy.window for r in runs})
    device = next(model.parameters()).device
    records: list[dict] = []
    verified: dict[int, int] = {}
    todo = sum(1 for p in prompts if p.key not in done)
    terminal = sys.stderr.isatty()
    # kvzip re-reads each context after kvpress's repeat prompt, in this tokenizer's ids
    reconstruction = (ReconstructionPrompt.from_tokenizer(tokenizer)
                      if any(r.policy.method.base.external_scores for r in runs) else None)
    bar = tqdm(total=todo * len(runs), disable=not (progress and terminal), unit="run", dynamic_ncols=True, desc="eval")
    started, finished = time.perf_counter(), 0
    try:
        for prompt in prompts:
            if prompt.key in done:
                records.append(done[prompt.key])
                continue
            bar.set_description(prompt.key)
            check = verify > verified.get(prompt.length, 0)
            record = _evaluate_prompt(model, tokenizer, prompt, runs, stop, windows, device, perturbation, check, bar,
                                      question_agnostic, reconstruction)
            verified[prompt.length] = verified.get(prompt.length, 0) + check
            records.append(record)
            finished += 1
            if progress and not terminal:
                print(f"eval: {finished}/{todo} prompts ({prompt.key}, {len(runs)} runs), "
                      f"{time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
            if on_record is not None:
                on_record(records)
    finally:
        bar.close()
    return records


def split_question(prompt: EvalPrompt) -> int:
    """Where a prompt's question starts: the end of its context (``meta["context_span"]``)."""
    span = prompt.meta.get("context_span")
    if not span or not 0 < span[1] < prompt.length:
        raise ValueError(f"{prompt.key}: no context span to split the question from (question-agnostic mode)")
    return span[1]


def _evaluate_prompt(model, tokenizer, prompt, runs, stop, windows, device, perturbation, verify, bar,
                     question_agnostic=False, reconstruction=None) -> dict:
    ids = torch.tensor([prompt.input_ids], device=device)
    question = None
    if question_agnostic:
        split = split_question(prompt)
        ids, question = ids[:, :split], ids[:, split:]
    start = time.perf_counter()
    prefill = shared_prefill(model, ids, windows, keep_hidden=any(uses_surrogate(r.policy) for r in runs))
    bank = ScoreBank(prefill, model, reconstruction)
    n = prefill.n
    reference = None
    full_decoded = None
    if perturbation:
        recorder = pert.FirstStepRecorder(model, attention_inputs=True)
        full_runs = [r for r in runs if r.policy.name == "full"]
        full_policy = full_runs[0].policy if full_runs else KVPolicy("full")
        full_sel = select_all_layers(full_policy, bank)
        full_decoded = decode(model, prefill, full_sel, prompt.max_new_tokens, sorted(stop), recorder, True)
        reference = pert.full_reference(prefill, recorder, full_decoded.cache)
    results: dict[str, dict] = {}
    for run in runs:
        t0 = time.perf_counter()
        bank_before = bank.seconds
        selections = select_all_layers(run.policy, bank)
        selection_s = time.perf_counter() - t0
        recorder = pert.FirstStepRecorder(model) if perturbation else None
        if full_decoded is not None and run.policy.name == "full":
            decoded = full_decoded  # the reference run is this run (the recorder changes no numbers)
            recorder = None
        else:
            decoded = decode(model, prefill, selections, prompt.max_new_tokens, sorted(stop), recorder, perturbation,
                             question_ids=question)
        text = _text(tokenizer, decoded.tokens, stop)
        result = {
            "text": text,
            "tokens": decoded.tokens,
            "score": score(prompt.metric, text, prompt.answers),
            "kept_fraction": kept_fraction(selections, n),
            "needle_kept": needle_kept(prompt, selections, n),
            "selection_s": selection_s,
            "scores_s": bank.seconds - bank_before,
            "decode_s": decoded.decode_s,
        }
        if perturbation:
            result.update(_perturbation(run, bank, reference, selections, recorder, n))
        if verify:
            same, ref = tokens_equal_generate(model, prefill, run.policy, decoded.tokens, prompt.max_new_tokens,
                                              sorted(stop), question, reconstruction)
            if not same:
                raise VerificationError(
                    f"{prompt.key} {run.key}: the shared prefill decoded {decoded.tokens} but criticalkv.hf.generate "
                    f"decoded {ref}; the results of this run would not be generate's"
                )
            result["verified"] = True
        results[run.key] = result
        bar.update(1)
    return {
        "key": prompt.key,
        "task": prompt.task,
        "length": prompt.length,
        "answers": list(prompt.answers),
        "metric": prompt.metric,
        "meta": prompt.meta,
        "prefill_s": prefill.prefill_s,
        "total_s": time.perf_counter() - start,
        "results": results,
    }


def needle_spans(prompt: EvalPrompt) -> list[tuple[int, int]]:
    """(start, length) of every needle of a prompt (none for list and document tasks)."""
    meta = prompt.meta
    if "needle_start" in meta:
        return [(meta["needle_start"], meta["needle_tokens"])]
    return list(zip(meta.get("needle_starts", []), meta.get("needle_lengths", [])))


def needle_kept(prompt: EvalPrompt, selections, n: int) -> list[float]:
    """For each needle, the fraction of its tokens kept, over every layer and KV head (a diagnostic)."""
    spans = needle_spans(prompt)
    if not spans:
        return []
    kept = torch.stack([s.mask(n)[0] for s in selections]).float()  # [L, H_kv, n]
    return [float(kept[:, :, a : a + k].mean()) for a, k in spans]


def _perturbation(run: PolicyRun, bank, reference, selections, recorder, n: int) -> dict:
    out: dict = {}
    heads = pert.head_perturbation(reference, selections, n)
    out["head_l1"] = heads
    out["kept_mass"] = pert.attention_mass(reference, [pert.keep_with_token(s, n) for s in selections])
    if recorder is None:  # the full run itself
        num_layers = len(selections)
        out.update({"layer_l1": [0.0] * num_layers, "layer_rel": [0.0] * num_layers, "final_l1": 0.0, "final_rel": 0.0})
    else:
        out.update(pert.layer_perturbation(reference, recorder))
    if run.policy.two_stage:
        out["sigma"] = pert.attention_mass(reference, pert.stage1_masks(run.policy, bank, selections))
    return out


#: Per-prompt perturbation arrays kept out of the stored records (their means are in the summary).
PER_PROMPT_ARRAYS = ("layer_l1", "layer_rel")


def strip_arrays(records: list[dict]) -> list[dict]:
    """Records without the per-head and per-layer arrays (those are summarised, not stored per prompt)."""
    out = []
    for rec in records:
        results = {}
        for key, res in rec["results"].items():
            small = {k: v for k, v in res.items() if not isinstance(v, np.ndarray) and k not in PER_PROMPT_ARRAYS}
            if "head_l1" in res:
                small["head_l1_mean"] = float(np.mean(res["head_l1"]))
            results[key] = small
        out.append({**rec, "results": results})
    return out
