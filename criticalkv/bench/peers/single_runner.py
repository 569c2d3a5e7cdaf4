#!/usr/bin/env python3
"""One implementation's single-request timing, run inside a peer's virtual environment.

Standalone on purpose (it imports torch, transformers and kvpress, never criticalkv):

    PEER_PYTHON criticalkv/bench/peers/single_runner.py --impl kvpress --model DIR --text-file F --budget 256 --new-tokens 16

``kvpress``: ``CriticalKVPress(SnapKVPress(compression_ratio=1 - budget / context tokens))`` through the
``kv-press-text-generation`` pipeline (question empty, so the whole chat-wrapped text is the context);
``transformers``: ``model.generate`` with the full cache. The model is loaded once (not timed); one
warm-up, then ``--repeats`` timed calls, each from the text to the generated tokens (tokenisation
included). Stop tokens are disabled so that every call generates exactly ``--new-tokens`` tokens.
Prints one JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=("kvpress", "transformers"), required=True)
    p.add_argument("--model", required=True, help="Hugging Face model folder (safetensors)")
    p.add_argument("--text-file", required=True, help="the user message (UTF-8)")
    p.add_argument("--budget", type=int, default=256, help="kvpress: tokens kept per head")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
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


if __name__ == "__main__":
    sys.exit(main())
