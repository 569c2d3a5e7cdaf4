"""Why do some policies lose the needle? Which of the needle's answer digits each policy keeps.

Re-creates the committed needle prompts (same seed and configuration as results/needle), prefills each
once, runs every policy's selection (the same shared-prefill path as ``criticalkv eval``) and measures,
over the 30 layers x 3 KV heads, how often each answer-digit token of the needle is kept and how often
the whole number is, next to whether the policy found the needle in results/needle/needle.json. No
decoding, no tuning: a diagnosis of the committed results.

    python research/needle_diagnosis.py --lengths 2048 --out results/needle_diagnosis.json
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's criticalkv, installed or not

from criticalkv import KVPolicy  # noqa: E402
from criticalkv.eval.engine import ScoreBank, select_all_layers, shared_prefill  # noqa: E402
from criticalkv.eval.io import environment, write_json  # noqa: E402
from criticalkv.eval.needle import needle_prompts  # noqa: E402
from criticalkv.eval.specs import expand_runs  # noqa: E402
from criticalkv.hf import load_model  # noqa: E402

POLICIES = "snapkv,criticalkv,criticalkv:stage2_scores=raw,adakv,ada-criticalkv,ada-criticalkv:stage2_scores=raw"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--needle-json", type=Path, default=Path("results/needle/needle.json"))
    ap.add_argument("--lengths", default="2048")
    ap.add_argument("--budgets", default="128,256")
    ap.add_argument("--policies", default=POLICIES)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    committed = json.loads(args.needle_json.read_text())
    cfg = committed["config"]
    found = {r["key"]: {k: v["score"] for k, v in r["results"].items()} for r in committed["records"]}
    lengths = [int(x) for x in args.lengths.split(",")]
    model, tok = load_model(cfg["model"])
    prompts = needle_prompts(tok, lengths, cfg["depths"], cfg["samples"], cfg["seed"], cfg["chat"])
    runs = expand_runs(args.policies, [int(b) for b in args.budgets.split(",")], KVPolicy("full"))
    stats = {r.key: {"digit_kept": [], "number_kept": [], "number_kept_by_layer": [], "found": []} for r in runs}
    start = time.time()
    for i, p in enumerate(prompts):
        a, k = p.meta["needle_start"], p.meta["needle_tokens"]
        digits = [a + j for j in range(k) if tok.decode([p.input_ids[a + j]]).strip().isdigit()]
        assert "".join(tok.decode([p.input_ids[j]]).strip() for j in digits) == p.answers[0]
        prefill = shared_prefill(model, torch.tensor([p.input_ids]), [32])
        bank = ScoreBank(prefill)
        for run in runs:
            masks = torch.stack([s.mask(prefill.n)[0] for s in select_all_layers(run.policy, bank)])  # [L, H_kv, n]
            kept = masks[:, :, digits].float()  # [L, H_kv, digits]
            st = stats[run.key]
            st["digit_kept"].append(kept.mean(dim=(0, 1)).tolist())
            st["number_kept"].append(float(kept.min(dim=2).values.mean()))
            st["number_kept_by_layer"].append(kept.min(dim=2).values.mean(dim=1).tolist())
            st["found"].append(found[p.key][run.key])
        print(f"{i + 1}/{len(prompts)} {p.key} {time.time() - start:.0f}s", file=sys.stderr)
    summary = {}
    for key, st in stats.items():
        found_arr = np.array(st["found"])
        number = np.array(st["number_kept"])
        summary[key] = {
            "found": float(found_arr.mean()),
            "digit_kept_mean": np.mean(st["digit_kept"], axis=0).tolist(),
            "number_kept_mean": float(number.mean()),
            "number_kept_when_found": float(number[found_arr == 1].mean()) if (found_arr == 1).any() else None,
            "number_kept_when_missed": float(number[found_arr == 0].mean()) if (found_arr == 0).any() else None,
            "number_kept_by_layer": np.mean(st["number_kept_by_layer"], axis=0).tolist(),
        }
    write_json(args.out, {"command": "python " + " ".join(sys.argv), "config": {**cfg, "lengths": lengths},
                          "policies": args.policies, "budgets": args.budgets, "prompts": len(prompts),
                          "wall_s": time.time() - start, "environment": environment(), "summary": summary})
    for key, s in summary.items():
        print(f"{key:42s} found {s['found']:.2f}  digits kept {np.round(s['digit_kept_mean'], 2)}  "
              f"whole number kept {s['number_kept_mean']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
