"""Dump (or compare) the kept indices of every policy of tests/policies.py on the bundled model.

A refactor of the selection must not move a single kept entry. Run this once on the old code with
``--dump OLD.json`` (keep the file outside the repository), then on the new code with ``--compare OLD.json``:

    python scripts/check_kept_identity.py --dump /tmp/kept_before.json      # on the old checkout
    python scripts/check_kept_identity.py --compare /tmp/kept_before.json   # on the new one

The prompt is examples/needle_2k.txt cut to ``--prompt-tokens`` (1,100, as tests/runtime/test_bundled_parity.py);
every policy of tests/policies.py runs at each ``--budgets`` value through the PyTorch path
(``criticalkv.hf.prefill_and_compress``, i.e. ``select_layer`` on every layer). Exit status 1 when any kept
index differs, naming the first policy, budget, layer and KV head that differ.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def dump(prompt_tokens: int, budgets: list[int]) -> dict:
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from policies import POLICY_CASES, make_policy

    from criticalkv.hf import load_model
    from criticalkv.hf.compress import prefill_and_compress

    torch.set_num_threads(1)
    model, tokenizer = load_model()
    ids = tokenizer((ROOT / "examples" / "needle_2k.txt").read_text())["input_ids"][:prompt_tokens]
    input_ids = torch.tensor([ids])
    out: dict = {"prompt_tokens": len(ids), "prompt_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
                 "kept": {}}
    for budget in budgets:
        for case_id, kwargs in POLICY_CASES:
            policy = make_policy(kwargs, budget, 32)
            result = prefill_and_compress(model, input_ids, policy)
            layers = []
            for sel in result.selections:
                layers.append([[i for i in sel.indices[0, h].tolist() if i >= 0] for h in range(sel.indices.shape[1])])
            out["kept"][f"{case_id}@{budget}"] = layers
            print(f"{case_id} budget {budget}: {sum(len(h) for layer in layers for h in layer)} entries kept", flush=True)
    return out


def compare(before: dict, after: dict) -> list[str]:
    problems = []
    if before["prompt_sha256"] != after["prompt_sha256"]:
        problems.append("the prompt tokens differ")
    for key in sorted(set(before["kept"]) | set(after["kept"])):
        if key not in before["kept"] or key not in after["kept"]:
            problems.append(f"{key}: present on one side only")
            continue
        for layer, (a, b) in enumerate(zip(before["kept"][key], after["kept"][key])):
            for head, (x, y) in enumerate(zip(a, b)):
                if x != y:
                    problems.append(f"{key}: layer {layer}, KV head {head} differs")
                    break
            else:
                continue
            break
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--dump", type=Path, help="write the kept indices of this checkout to this JSON file")
    action.add_argument("--compare", type=Path, help="compare this checkout's kept indices with a --dump file")
    parser.add_argument("--prompt-tokens", type=int, default=1100, help="tokens of examples/needle_2k.txt used (default: 1100)")
    parser.add_argument("--budgets", default="256,128", help="comma-separated budgets (default: 256,128)")
    args = parser.parse_args(argv)
    budgets = [int(b) for b in args.budgets.split(",")]
    if args.compare is not None and not args.compare.is_file():
        parser.error(f"--compare: {args.compare} does not exist")
    current = dump(args.prompt_tokens, budgets)
    if args.dump is not None:
        args.dump.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=args.dump.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(current, f)
        os.replace(tmp, args.dump)
        print(f"wrote {len(current['kept'])} policy/budget runs to {args.dump}")
        return 0
    problems = compare(json.loads(args.compare.read_text()), current)
    for p in problems:
        print(f"DIFFERENT: {p}")
    runs = len(current["kept"])
    print(f"{runs} policy/budget runs compared: " + ("identical" if not problems else f"{len(problems)} differ"))
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
