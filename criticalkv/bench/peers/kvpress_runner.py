#!/usr/bin/env python3
"""kvpress's presses on the evaluation's prompts, run inside kvpress's virtual environment (question-agnostic).

Standalone on purpose (it imports torch, transformers and kvpress, never criticalkv):

    KVPRESS_PYTHON criticalkv/bench/peers/kvpress_runner.py --model DIR --prompts IN.json --out OUT.json

``IN.json``: {"runs": [{"key", "press", "kwargs", "budget"}], "prompts": [{"key", "context_ids", "question_ids",
"max_new_tokens"}], "stop_token_ids": [...]}. For every prompt and run, the context's token ids go through kvpress's
own ``KVPressTextGenerationPipeline._forward`` (the press compresses the context alone, then the question runs through
the compressed cache and greedy decoding follows, kvpress's ``generate_answer``) with the press built as
``PRESS(compression_ratio=1 - budget / context tokens, **kwargs)``: the same average of ``budget`` entries per KV head
as criticalkv's budget. Writes ``OUT.json`` after every prompt: {"answers": {prompt key: {run key: text}}, "seconds":
...}; an existing ``OUT.json`` is continued (its prompts are skipped).

``KVzipPress``'s scores (its re-read of the context) do not depend on the compression ratio: the runs of one prompt
that differ only in the budget compute them once (kvpress's own ``score_val`` after the re-read, kept before its
``compress_post`` and given back to the next budget's ``compress_post``), so a budget after the first costs a prefill
and a decode, not a re-read (``"seconds"`` shows it). The kept entries are the ones a fresh re-read would give.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from importlib import metadata

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face model folder (safetensors + tokenizer)")
    p.add_argument("--prompts", required=True, help="the runs and prompts (JSON)")
    p.add_argument("--out", required=True, help="answers (JSON, rewritten after every prompt)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import kvpress  # only kvpress's environment has it
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    from kvpress.pipeline import KVPressTextGenerationPipeline

    with open(args.prompts, encoding="utf-8") as f:
        spec = json.load(f)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = list(spec["stop_token_ids"])  # generate_answer stops at these ids
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer, device="cpu")
    out = {"answers": {}, "seconds": {}}
    if os.path.exists(args.out):
        with open(args.out, encoding="utf-8") as f:
            out = json.load(f)
    versions = {name: metadata.version(name) for name in ("kvpress", "torch", "transformers")}
    for prompt in spec["prompts"]:
        if prompt["key"] in out["answers"]:
            continue
        context = torch.tensor([prompt["context_ids"]])
        question = torch.tensor([prompt["question_ids"]])
        answers, seconds = {}, {}
        memo: dict = {}
        for run in spec["runs"]:
            ratio = max(0.0, 1.0 - run["budget"] / context.shape[1])
            press = getattr(kvpress, run["press"])(compression_ratio=ratio, **run["kwargs"])
            if isinstance(press, kvpress.KVzipPress):
                share_kvzip_scores(press, memo, (run["press"], json.dumps(run["kwargs"], sort_keys=True)))
            start = time.perf_counter()
            with torch.inference_mode():
                answers[run["key"]] = pipe._forward({"context_ids": context, "questions_ids": [question]},
                                                    max_new_tokens=prompt["max_new_tokens"], press=press)[0]
            seconds[run["key"]] = time.perf_counter() - start
        out["answers"][prompt["key"]] = answers
        out["seconds"][prompt["key"]] = seconds
        out["versions"] = versions
        out["torch_threads"] = torch.get_num_threads()
        tmp = args.out + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(out, f)
        os.replace(tmp, args.out)
        print(f"kvpress: {len(out['answers'])}/{len(spec['prompts'])} prompts ({prompt['key']})", file=sys.stderr,
              flush=True)
    return 0


def share_kvzip_scores(press, memo: dict, key) -> None:
    """Let ``press`` (a KVzipPress) reuse the scores of an earlier budget of the same prompt and press (module
    docstring): its re-read runs only when ``memo`` has no scores under ``key``."""
    compress_post, perform = press.compress_post, press._perform_kvzip_compression

    def keep_then_compress(model):
        if key not in memo:
            memo[key] = press.score_val.clone()  # compress_post writes the sinks' score into score_val
        compress_post(model)

    def reuse_or_reread(model, tokenizer):
        if key not in memo:
            return perform(model, tokenizer)
        press.context_length = press._context_ids.shape[1]
        press.score_val = memo[key].clone()
        compress_post(model)

    press.compress_post = keep_then_compress
    press._perform_kvzip_compression = reuse_or_reread


if __name__ == "__main__":
    sys.exit(main())
