"""Why did 512 entries lose needles that 256 kept? The capped model-level allocation before and after nesting it.

On the question-agnostic needle prompts of a domain (``criticalkv eval needle --question-agnostic --domain ...``'s),
each context is prefilled once and scored once (the policy's KVzip score: the surrogate or the re-read), then selected
at each budget by two allocation rules on the same scores:

* ``greedy``, the earlier rule: one walk down the model-wide ranking at the final budget, a head skipped once
  it holds ``head_cap_ratio`` x budget entries (reproduced here as it was: each head's top ``older_cap`` eligible, then
  the shared allocation);
* ``nested``, the rule now (``criticalkv.methods.defensivekv.nested_capped_mask``).

For each rule and budget it reports how many of the needle's entries are kept over every layer and KV head (the
allocation alone, ``layer-kvzip``; and with CriticalKV's two stages, ``layer-kvzip-criticalkv``), the entries a larger
budget drops that a smaller one kept, the heads whose count falls, and (``--decode``) whether the answer holds the
needle. No tuning: a diagnosis on fixed prompts.

    python -m criticalkv.eval.nesting_diagnosis --domain legal --budgets 256,512 --samples 3 --depths 10,50,90 \\
        --out results/domains/nesting_diagnosis_legal.json
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

from criticalkv.eval.domains import DOMAINS
from criticalkv.eval.engine import ScoreBank, decode, select_all_layers, shared_prefill
from criticalkv.eval.io import environment, write_json, write_text
from criticalkv.eval.needle import needle_prompts
from criticalkv.eval.runner import split_question
from criticalkv.eval.scoring import score
from criticalkv.methods import defensivekv
from criticalkv.methods.adakv import head_floors, shared_allocation_mask
from criticalkv.methods.kvzip import ReconstructionPrompt
from criticalkv.methods.topk import topk_mask
from criticalkv.policy import KVPolicy, parse_policy_spec


def greedy_allocation(policy, ranking, eligible, r):
    """The capped model-level allocation as it was before the nested rule (module docstring)."""
    cap = defensivekv.older_cap(policy)
    if cap is not None:
        eligible = topk_mask(ranking, torch.clamp(eligible.sum(-1), max=cap), eligible)
    return shared_allocation_mask(ranking, r, head_floors(policy, r), eligible)


@contextlib.contextmanager
def allocation_rule(rule: str):
    """Select with ``rule`` (``greedy`` or ``nested``) inside the block (layer-kvzip delegates to layer-defensivekv's)."""
    method = defensivekv.LAYER_METHOD
    if rule == "nested":
        yield
        return
    method.model_allocate = lambda policy, ranking, eligible, r: greedy_allocation(policy, ranking, eligible, r)
    try:
        yield
    finally:
        del method.model_allocate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m criticalkv.eval.nesting_diagnosis", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--domain", default="legal", choices=tuple(DOMAINS))
    ap.add_argument("--policy", default="layer-kvzip-criticalkv:kvzip_score=surrogate:head_cap_ratio=6",
                    help="the two-stage policy (its allocation alone is the same spec on layer-kvzip)")
    ap.add_argument("--budgets", default="256,512")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--depths", default="10,50,90")
    ap.add_argument("--decode", action="store_true", help="also answer the question from each selection")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    from criticalkv.hf import load_model
    from criticalkv.hf.loading import stop_token_ids

    torch.set_num_threads(args.threads)
    started = time.time()
    model, tokenizer = load_model(None)
    stops = stop_token_ids(tokenizer, model)
    budgets = [int(b) for b in args.budgets.split(",")]
    refined = parse_policy_spec(args.policy, KVPolicy())
    base_spec = args.policy.replace("layer-kvzip-criticalkv", "layer-kvzip", 1)
    allocation = parse_policy_spec(base_spec, KVPolicy())
    prompts = needle_prompts(tokenizer, [2048], [float(d) for d in args.depths.split(",")], args.samples, 0,
                             domain=args.domain)
    reconstruction = ReconstructionPrompt.from_tokenizer(tokenizer)
    records = []
    for prompt in prompts:
        split = split_question(prompt)
        ids = torch.tensor([prompt.input_ids])
        context, question = ids[:, :split], ids[:, split:]
        prefill = shared_prefill(model, context, [refined.window], keep_hidden=True)
        bank = ScoreBank(prefill, model, reconstruction)
        start, length = prompt.meta["needle_start"], prompt.meta["needle_tokens"]
        record = {"key": prompt.key, "rules": {}}
        for rule in ("greedy", "nested"):
            masks = {}
            out = {}
            with allocation_rule(rule):
                for name, spec in (("allocation", allocation), ("two_stage", refined)):
                    for b in budgets:
                        selections = select_all_layers(spec.replace(budget=b), bank)
                        mask = torch.stack([s.mask(prefill.n)[0] for s in selections])  # [L, H_kv, n]
                        masks[name, b] = mask
                        entry = {"needle_kept": int(mask[:, :, start:start + length].sum()),
                                 "needle_entries": int(mask[:, :, start:start + length].numel())}
                        if args.decode and name == "two_stage":
                            decoded = decode(model, prefill, selections, prompt.max_new_tokens, stops,
                                             question_ids=question)
                            text = tokenizer.decode([t for t in decoded.tokens if t not in set(stops)],
                                                    skip_special_tokens=True)
                            entry.update(text=text, score=score(prompt.metric, text, prompt.answers))
                        out[f"{name}@{b}"] = entry
            for name in ("allocation", "two_stage"):
                for small, large in zip(budgets, budgets[1:]):
                    dropped = masks[name, small] & ~masks[name, large]
                    counts_small, counts_large = masks[name, small].sum(-1), masks[name, large].sum(-1)
                    out[f"{name}@{small}->{large}"] = {
                        "dropped_entries": int(dropped.sum()),
                        "dropped_needle_entries": int(dropped[:, :, start:start + length].sum()),
                        "heads_losing_entries": int((counts_large < counts_small).sum()),
                    }
            record["rules"][rule] = out
        records.append(record)
        print(f"nesting diagnosis: {len(records)}/{len(prompts)} {prompt.key}", file=sys.stderr, flush=True)
    result = {"command": "python -m criticalkv.eval.nesting_diagnosis " + " ".join(sys.argv[1:] if argv is None else argv),
              "domain": args.domain, "policy": args.policy, "budgets": budgets, "records": records,
              "environment": environment(), "wall_s": time.time() - started}
    write_json(args.out, result)
    write_text(args.out.with_suffix(".md"), markdown(result))
    print(markdown(result))
    return 0


def markdown(result: dict) -> str:
    budgets = result["budgets"]
    lines = [f"# Nesting diagnosis, {result['domain']} ({result['policy']})", "", "```", result["command"], "```", "",
             "Needle entries kept over every layer and KV head (of 30 x 3 x needle tokens), the answer's score, and "
             "what the larger budget drops of the smaller one's set (entries / needle entries / heads whose count "
             "falls), for the greedy rule (before) and the nested one (now).", ""]
    header = "| prompt | rule | " + " | ".join(f"alloc {b} | 2-stage {b}" for b in budgets) + " | dropped alloc | dropped 2-stage |"
    lines += [header, "|" + "---|" * (4 + 2 * len(budgets))]
    for rec in result["records"]:
        for rule, out in rec["rules"].items():
            cells = []
            for b in budgets:
                two = out[f"two_stage@{b}"]
                found = f" ({'found' if two.get('score') else 'lost'})" if "score" in two else ""
                cells += [str(out[f"allocation@{b}"]["needle_kept"]), f"{two['needle_kept']}{found}"]
            drops = []
            for name in ("allocation", "two_stage"):
                d = [out[f"{name}@{s}->{l}"] for s, l in zip(budgets, budgets[1:])]
                drops.append(", ".join(f"{x['dropped_entries']}/{x['dropped_needle_entries']}/{x['heads_losing_entries']}"
                                       for x in d))
            lines.append(f"| {rec['key']} | {rule} | " + " | ".join(cells) + f" | {drops[0]} | {drops[1]} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
