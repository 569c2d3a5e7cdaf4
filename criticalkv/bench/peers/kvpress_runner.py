#!/usr/bin/env python3
"""kvpress (and transformers' full cache) inside the peer's own virtual environment, for
``criticalkv.bench.peers.kvpress``.

Standalone on purpose (it imports torch, transformers and kvpress, never criticalkv; the driver runs it by path with the
peer environment's Python). Two commands:

``time``: one implementation's single-request timing (``criticalkv bench single``)::

    PEER_PYTHON criticalkv/bench/peers/kvpress_runner.py time --impl kvpress --model DIR --text-file F \
        --budget 256 --new-tokens 16

``kvpress``: ``CriticalKVPress(SnapKVPress(compression_ratio=1 - budget / context tokens))`` through the
``kv-press-text-generation`` pipeline (question empty, so the whole chat-wrapped text is the context);
``transformers``: ``model.generate`` with the full cache. The model is loaded once (not timed); one
warm-up, then ``--repeats`` timed calls, each from the text to the generated tokens (tokenisation
included). Stop tokens are disabled so that every call generates exactly ``--new-tokens`` tokens.
Prints one JSON object on the last line of stdout.

``answer``: kvpress's presses on the evaluation's prompts, question-agnostic (``python -m criticalkv.bench.peers.kvpress
needle|ruler``)::

    KVPRESS_PYTHON criticalkv/bench/peers/kvpress_runner.py answer --model DIR --prompts IN.json --out OUT.json

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
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, pipeline


class ForwardTimer:
    """Times every call of the decoder stack (``model.model.forward``): the first call of a request is
    its prefill (kvpress: the compressed prefill with the press's hooks), the others decode one token."""

    def __init__(self, model):
        self.calls: list[float] = []
        inner = model.model
        forward = inner.forward

        def timed_forward(*args, **kwargs):
            start = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                self.calls.append(time.perf_counter() - start)

        inner.forward = timed_forward

    def reset(self) -> None:
        self.calls = []

    def split(self) -> tuple[float, float]:
        """(prefill seconds, mean decode seconds per token) of the calls since ``reset``."""
        rest = self.calls[1:]
        return self.calls[0], (sum(rest) / len(rest) if rest else 0.0)


def chat_text(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)


def run_transformers(args, text: str) -> dict:
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    load_s = time.perf_counter() - start
    timer = ForwardTimer(model)

    def once():
        timer.reset()
        ids = tokenizer(chat_text(tokenizer, text), add_special_tokens=False, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        return ids.shape[1], out.shape[1] - ids.shape[1], ids.shape[1]

    return timed(once, args, load_s, timer)


def run_kvpress(args, text: str) -> dict:
    from kvpress import CriticalKVPress, SnapKVPress  # only the kvpress peer's environment has it

    start = time.perf_counter()
    pipe = pipeline("kv-press-text-generation", model=args.model, device="cpu", dtype=torch.float32)
    pipe.model.generation_config.eos_token_id = []  # the pipeline stops at these ids: none, exactly --new-tokens
    load_s = time.perf_counter() - start
    pre = pipe.preprocess(text, [""], "", 10**9)
    context_tokens = pre["context_ids"].shape[1]  # compressed; the question part (end of turn, assistant header) is not
    prompt_tokens = context_tokens + pre["questions_ids"][0].shape[1]
    ratio = max(0.0, 1.0 - args.budget / context_tokens)
    press = CriticalKVPress(press=SnapKVPress(compression_ratio=ratio))
    calls = {"decode": 0}
    forward = pipe.model.forward

    def counting_forward(*a, **kw):  # counts the decode forwards: one per generated token after the first
        calls["decode"] += 1
        return forward(*a, **kw)

    pipe.model.forward = counting_forward
    timer = ForwardTimer(pipe.model)

    def once():
        timer.reset()
        cache = DynamicCache()
        calls["decode"] = 0
        pipe(text, question="", press=press, max_new_tokens=args.new_tokens, cache=cache)
        kept = cache.get_seq_length(0)
        # model(question) gives the first token, then one forward per further token
        return prompt_tokens, calls["decode"], kept

    result = timed(once, args, load_s, timer)
    result["compression_ratio"] = ratio
    result["press"] = f"CriticalKVPress(SnapKVPress(compression_ratio={ratio:.4f}))"
    return result


def timed(once, args, load_s: float, timer: ForwardTimer) -> dict:
    once()  # warm-up
    seconds, prefill, decode = [], [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        prompt_tokens, new_tokens, kept = once()
        seconds.append(time.perf_counter() - start)
        p, d = timer.split()
        prefill.append(p)
        decode.append(d)
    return {"seconds": seconds, "prompt_tokens": int(prompt_tokens), "new_tokens": int(new_tokens),
            "kept_tokens_per_head": int(kept), "load_s": load_s, "prefill_s": prefill, "decode_s_per_token": decode}


def time_one(args) -> int:
    with open(args.text_file, encoding="utf-8") as f:
        text = f.read()
    result = (run_kvpress if args.impl == "kvpress" else run_transformers)(args, text)
    versions = {"python": sys.version.split()[0]}
    for dist in ("torch", "transformers", "kvpress"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    result.update({"impl": args.impl, "torch_threads": torch.get_num_threads(), "versions": versions})
    print(json.dumps(result))
    return 0


def answer(args) -> int:
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("time", help="one implementation's single-request timing")
    t.add_argument("--impl", choices=("kvpress", "transformers"), required=True)
    t.add_argument("--text-file", required=True, help="the user message (UTF-8)")
    t.add_argument("--budget", type=int, default=256, help="kvpress: tokens kept per head")
    t.add_argument("--new-tokens", type=int, default=16)
    t.add_argument("--repeats", type=int, default=5)
    a = sub.add_parser("answer", help="kvpress's presses on the evaluation's prompts")
    a.add_argument("--prompts", required=True, help="the runs and prompts (JSON)")
    a.add_argument("--out", required=True, help="answers (JSON, rewritten after every prompt)")
    for s in (t, a):
        s.add_argument("--model", required=True, help="Hugging Face model folder (safetensors + tokenizer)")
        s.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    return time_one(args) if args.command == "time" else answer(args)


if __name__ == "__main__":
    sys.exit(main())
