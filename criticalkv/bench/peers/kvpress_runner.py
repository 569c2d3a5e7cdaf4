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
import math
import os
import sys
import time
from importlib import metadata

# run by path, this file's folder comes first on sys.path, where the driver's kvpress.py would shadow the kvpress package
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, pipeline  # noqa: E402


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


# ------------------------------------------------------------------------------------------------ shared context
def build_press(spec: dict, ratio: float):
    """A press from ``{"press": "CriticalKVPress(SnapKVPress)" | "KnormPress", "kwargs": {...}}`` at ``ratio``: a
    wrapper press (``Outer(Inner)``) gets ``Inner(compression_ratio=ratio, ...)`` as its ``press``; a knob goes to the
    inner press when it is one of the inner press's fields (``window_size``, ``kernel_size``), else to the outer one."""
    import dataclasses
    import re

    import kvpress

    match = re.fullmatch(r"(\w+)\((\w+)\)", spec["press"])
    if match:
        inner_cls = getattr(kvpress, match.group(2))
        fields = {f.name for f in dataclasses.fields(inner_cls)}
        inner = inner_cls(compression_ratio=ratio, **{k: v for k, v in spec["kwargs"].items() if k in fields})
        return getattr(kvpress, match.group(1))(press=inner, **{k: v for k, v in spec["kwargs"].items()
                                                                 if k not in fields})
    return getattr(kvpress, spec["press"])(compression_ratio=ratio, **spec["kwargs"])


class AnswerRecorder:
    """Records what kvpress's ``generate_answer`` computes, without changing it: a forward hook on the causal LM
    (the pipeline's prefill calls the inner model, so only the answers' calls reach it) keeps each call's last logits:
    the first call's are the first answer token's distribution, their argmaxes are the answer's tokens."""

    def __init__(self, model):
        self.logits: list = []
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.logits.append(output.logits[0, -1].detach().float())

    def take(self):
        out, self.logits = self.logits, []
        return out


def _kl(reference, other) -> float:
    p = torch.log_softmax(reference.double(), dim=-1)
    q = torch.log_softmax(other.double(), dim=-1)
    return float((p.exp() * (p - q)).sum())


def _answer(calls: list, max_new_tokens: int, stops: set) -> list[int]:
    """The greedy answer from the recorded calls, cut at its own ``max_new_tokens`` and before a stop token (the
    pipeline answered every question with the document's largest ``max_new_tokens``: greedy, so the first tokens are
    the ones a shorter limit would give)."""
    out = []
    for logits in calls[:max_new_tokens]:
        t = int(logits.argmax())
        if t in stops:
            break
        out.append(t)
    return out


def _fidelity(reference, tokens, first) -> dict:
    ref_tokens, ref_first = reference
    same = 0
    for a, b in zip(ref_tokens, tokens):
        if a != b:
            break
        same += 1
    agree = same / len(ref_tokens) if ref_tokens else (1.0 if not tokens else 0.0)
    return {"exact": tokens == ref_tokens, "agree": round(agree, 6), "kl": round(_kl(ref_first, first), 8)}


def _append(path: str, lines: list) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(x) + "\n" for x in lines))
        f.flush()
        os.fsync(f.fileno())


def _done(path: str) -> set:
    if not os.path.exists(path):
        return set()
    with open(path, encoding="utf-8") as f:
        return {json.loads(line)["doc"] for line in f if line.endswith("\n")}


def _drop_unfinished(path: str, done: set) -> None:
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.endswith("\n") and json.loads(line)["doc"] in done]
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(lines)
    os.replace(path + ".tmp", path)


def shared(args) -> int:
    """Every document of the spec: kvpress's full cache (the reference), the question-agnostic presses (the context
    compressed once per press and budget, every question then answered from it) and the question-aware ones
    (document + question compressed but the last token); JSON lines per answer, a document marked done after its
    answers (a stopped run continues with the next document).

    By default one forward of the context serves every press and budget (``LayerInputs``), and each question-aware
    prompt extends it by its question; ``--via-pipeline`` runs kvpress's pipeline instead, a prefill with the press per
    press, budget and (question-aware) question: the same answers (``tests/bench/test_kvpress_shared.py``), several
    times the cost. KVzipPress runs through the pipeline either way (its re-read is its own ``__call__``)."""
    import kvpress
    from kvpress.pipeline import KVPressTextGenerationPipeline
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with open(args.prompts, encoding="utf-8") as f:
        spec = json.load(f)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    stops = set(spec["stop_token_ids"])
    model.generation_config.eos_token_id = sorted(stops)  # generate_answer stops at these ids
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer, device="cpu")
    for layer in model.model.layers:  # what a press's __call__ sets before its hooks (some presses read it)
        layer.self_attn.rotary_emb = model.model.rotary_emb
    records, documents = args.out, args.out.replace(".jsonl", ".documents.jsonl")
    done = _done(documents)
    _drop_unfinished(records, done)
    recorder = AnswerRecorder(model)
    versions = {name: metadata.version(name) for name in ("kvpress", "torch", "transformers")}
    todo = [d for d in spec["documents"] if d["key"] not in done]
    started = time.perf_counter()
    for count, doc in enumerate(todo, 1):
        t_doc = time.perf_counter()
        context = torch.tensor([doc["context_ids"]])
        n = context.shape[1]
        questions = [torch.tensor([q["ids"]]) for q in doc["questions"]]
        longest = max(q["max_new_tokens"] for q in doc["questions"])
        out, info = [], {"doc": doc["key"], "length": n, "runs": {}, "versions": versions,
                         "torch_threads": torch.get_num_threads(), "via_pipeline": args.via_pipeline}
        shared_inputs = None if args.via_pipeline else LayerInputs.of(pipe, context)

        def answer_all(press):
            """Every question from the context compressed by ``press`` (None: full): per question (the recorded
            calls of its answer, the first one's logits), and the seconds it took."""
            t0 = time.perf_counter()
            torch.manual_seed(0)  # LeverageScorePress and CompactorPress draw a random sketch
            if shared_inputs is None or isinstance(press, kvpress.KVzipPress):
                recorder.take()
                with torch.inference_mode():
                    pipe._forward({"context_ids": context, "questions_ids": questions}, max_new_tokens=longest,
                                  press=press)
                return split_calls(recorder.take(), len(questions), longest, stops), time.perf_counter() - t0
            kv = shared_inputs.compress(press, pipe.model)
            answers = []
            for q_ids in questions:
                calls = generate(pipe, recorder, kv, q_ids, n, longest)
                answers.append((calls, calls[0]))
            shared_inputs.release()
            return answers, time.perf_counter() - t0

        reference = {}
        full, seconds = answer_all(None)
        info["runs"]["full"] = {"seconds": seconds}
        for q, (calls, first) in zip(doc["questions"], full):
            tokens = _answer(calls, q["max_new_tokens"], stops)
            reference[q["key"]] = (tokens, first)
            out.append({"doc": doc["key"], "question": q["key"], "setting": "agnostic", "run": "kvpress full",
                        "press": "full", "fraction": None, "n": n, "kept": 1.0, "tokens": tokens,
                        "text": tokenizer.decode(tokens, skip_special_tokens=True)})
        kvzip_scores: dict = {}
        for run in [r for r in spec["runs"] if r["setting"] == "agnostic"]:
            budget = max(1, math.ceil(run["fraction"] * n))
            ratio = max(0.0, 1.0 - (budget + 0.5) / n)  # int(n * (1 - ratio)) = budget, kvpress's count
            press = build_press(run, ratio)
            if isinstance(press, kvpress.KVzipPress):  # its re-read once per document, every budget ranking it
                share_kvzip_scores(press, kvzip_scores, (run["press"], json.dumps(run["kwargs"], sort_keys=True)))
            answers, seconds = answer_all(press)
            info["runs"][run["key"]] = {"seconds": seconds, "budget": budget, "ratio": ratio}
            for q, (calls, first) in zip(doc["questions"], answers):
                tokens = _answer(calls, q["max_new_tokens"], stops)
                out.append({"doc": doc["key"], "question": q["key"], "setting": "agnostic", "run": run["key"],
                            "press": run["press"], "fraction": run["fraction"], "budget": budget, "n": n,
                            "kept": budget / n, "tokens": tokens, "text": tokenizer.decode(tokens, skip_special_tokens=True),
                            **_fidelity(reference[q["key"]], tokens, first)})
        aware_runs = [r for r in spec["runs"] if r["setting"] == "aware"]
        if aware_runs:
            t0 = time.perf_counter()
            for q, q_ids in zip(doc["questions"], questions):
                prompt = torch.cat([context, q_ids], dim=1)
                inputs = None if shared_inputs is None else shared_inputs.extend(pipe, q_ids)
                for run, tokens, first, budget in aware_answers(pipe, recorder, prompt, aware_runs,
                                                                  q["max_new_tokens"], stops, inputs):
                    out.append({"doc": doc["key"], "question": q["key"], "setting": "aware", "run": run["key"],
                                "press": run["press"], "fraction": run["fraction"], "budget": budget,
                                "n": prompt.shape[1], "kept": budget / prompt.shape[1], "tokens": tokens,
                                "text": tokenizer.decode(tokens, skip_special_tokens=True),
                                **_fidelity(reference[q["key"]], tokens, first)})
            info["aware_s"] = time.perf_counter() - t0
        info["total_s"] = time.perf_counter() - t_doc
        _append(records, out)
        _append(documents, [info])
        print(f"kvpress: {count}/{len(todo)} documents ({doc['key']}), {(time.perf_counter() - started) / 60:.1f} min",
              file=sys.stderr, flush=True)
    return 0


def split_calls(calls: list, questions: int, longest: int, stops: set) -> list:
    """The recorded forward calls of ``_forward``'s answers, question by question: (calls, the first's logits).
    generate_answer makes the question's call, then up to ``longest`` - 1 more, stopping after a stop token (the first
    token is not checked)."""
    out, i = [], 0
    for _ in range(questions):
        j = i + 1
        for _ in range(longest - 1):
            if j >= len(calls):
                break
            j += 1
            if int(calls[j - 1].argmax()) in stops:
                break
        out.append((calls[i:j], calls[i]))
        i = j
    if i != len(calls):
        raise RuntimeError(f"{len(calls)} forward calls do not split into {questions} answers")
    return out


def generate(pipe, recorder, kv, question_ids, context_length: int, max_new_tokens: int) -> list:
    """kvpress's ``generate_answer`` on a cache holding ``kv`` (per layer (keys, values), left as they are: the
    answer's entries go into new tensors) and the recorded calls."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for idx, (k, v) in enumerate(kv):
        cache.update(k, v, idx)
    recorder.take()
    with torch.inference_mode():
        pipe.generate_answer(question_ids=question_ids, cache=cache, context_length=context_length,
                             max_new_tokens=max_new_tokens)
    return recorder.take()


class LayerInputs:
    """What kvpress's forward hook hands each attention layer's press during a prefill (``BasePress.forward_hook``:
    the layer's input, its keys and values once the prompt is in the cache, its attention weights, its keyword
    arguments), kept from one forward with the full cache. A press's ``compress`` on them is what it computes inside
    that prefill, since compressing changes only the cache, never a layer's output: every press and budget share one
    forward. ``extend`` adds tokens after the prompt (a question): the inputs of one prefill of prompt + tokens, up to
    float rounding."""

    def __init__(self, layers: list, last_logits=None):
        self.layers = layers  # per layer (module, hidden [1, n, d], keys, values [1, H_kv, n, d_h], attentions, kwargs)
        self.last_logits = last_logits  # [V] the prompt's last token's logits (full attention, as in the prefill)

    @classmethod
    def of(cls, pipe, ids, past: "LayerInputs | None" = None) -> "LayerInputs":
        from transformers import DynamicCache

        model = pipe.model
        captured: list = [None] * len(model.model.layers)
        cache = DynamicCache()
        if past is not None:
            for idx, (_, _, k, v, _, _) in enumerate(past.layers):
                cache.update(k, v, idx)
        start = 0 if past is None else past.layers[0][2].shape[2]

        def make_hook(idx):
            def hook(module, args, kwargs, output):
                layer = kwargs["past_key_values"].layers[idx]
                captured[idx] = (module, kwargs["hidden_states"], layer.keys, layer.values, output[1], dict(kwargs))

            return hook

        handles = [layer.self_attn.register_forward_hook(make_hook(i), with_kwargs=True)
                   for i, layer in enumerate(model.model.layers)]
        try:
            with torch.inference_mode():
                out = model.model(input_ids=ids, past_key_values=cache,
                                  position_ids=torch.arange(start, start + ids.shape[1])[None])
                last_logits = model.lm_head(out.last_hidden_state[:, -1:])[0, -1].float()
        finally:
            for h in handles:
                h.remove()
        if past is None:
            return cls(captured, last_logits)
        layers = []
        for (module, h0, _, _, _, kw0), (_, h1, k, v, att, kw1) in zip(past.layers, captured):
            kwargs = dict(kw1)
            kwargs["hidden_states"] = torch.cat([h0, h1], dim=1)
            kwargs["position_embeddings"] = tuple(torch.cat([a, b], dim=1) for a, b in
                                                  zip(kw0["position_embeddings"], kw1["position_embeddings"]))
            kwargs["cache_position"] = torch.arange(k.shape[2])
            layers.append((module, kwargs["hidden_states"], k, v, att, kwargs))
        return cls(layers, last_logits)

    def extend(self, pipe, ids) -> "LayerInputs":
        return LayerInputs.of(pipe, ids, past=self)

    def compress(self, press, model) -> list:
        """Per layer (keys, values) after ``press``'s ``compress`` (a head-wise press such as AdaKV's keeps them whole
        and leaves the entries to mask on the module, as in its prefill)."""
        if press is None:  # the full cache
            return [(keys, values) for _, _, keys, values, _, _ in self.layers]
        press.post_init_from_model(model)
        out = []
        with torch.inference_mode():
            for module, hidden, keys, values, attentions, kwargs in self.layers:
                module.masked_key_indices = None
                out.append(press.compress(module, hidden, keys, values, attentions, kwargs))
        return out

    def release(self) -> None:
        """Forget what a head-wise press left on the modules (kvpress's attention patch clears it at a prefill)."""
        for module, *_ in self.layers:
            module.masked_key_indices = None


def aware_answers(pipe, recorder, prompt, runs, max_new_tokens: int, stops: set, inputs: "LayerInputs | None"):
    """Question-aware: each press compresses the whole prompt (document and question) as its hooks do inside the
    prompt's prefill (kvpress's ``with press(model): model.generate(...)``); the first answer token comes from that
    prefill's last logits (full attention, as SnapKV and CriticalKV answer), the next ones greedily from the
    compressed cache (kvpress's ``generate_answer``). ``inputs``: the layers' inputs of ``prompt`` (``LayerInputs``),
    else a prefill with each press's hooks. Yields (run, answer tokens, first logits, budget)."""
    for run in runs:
        budget = max(1, math.ceil(run["fraction"] * prompt.shape[1]))
        ratio = max(0.0, 1.0 - (budget + 0.5) / prompt.shape[1])  # int(n * (1 - ratio)) = budget
        press = build_press(run, ratio)
        torch.manual_seed(0)
        if inputs is None:  # kvpress's own hooks in a prefill of the prompt
            from transformers import DynamicCache

            cache = DynamicCache()
            with torch.inference_mode(), press(pipe.model):
                out = pipe.model.model(input_ids=prompt, past_key_values=cache)
                first = pipe.model.lm_head(out.last_hidden_state[:, -1:])[0, -1].float()
            kv = [(layer.keys, layer.values) for layer in cache.layers]
        else:
            kv, first = inputs.compress(press, pipe.model), inputs.last_logits
        token = torch.tensor([[int(first.argmax())]])
        calls = [first] + generate(pipe, recorder, kv, token, prompt.shape[1], max_new_tokens - 1)
        if inputs is not None:
            inputs.release()
        else:
            for layer in pipe.model.model.layers:
                layer.self_attn.masked_key_indices = None
        yield run, _answer(calls, max_new_tokens, stops), first, budget


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
    c = sub.add_parser("shared", help="kvpress's presses on shared-context documents (JSON lines, resumable)")
    c.add_argument("--prompts", required=True, help="the runs and documents (JSON)")
    c.add_argument("--out", required=True, help="answers (.jsonl, appended per document)")
    c.add_argument("--via-pipeline", action="store_true",
                   help="kvpress's pipeline for every press (a prefill per press, budget and question) instead of one "
                        "forward per document shared by the presses: the same answers, slower")
    for s in (t, a, c):
        s.add_argument("--model", required=True, help="Hugging Face model folder (safetensors + tokenizer)")
        s.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    return {"time": time_one, "answer": answer, "shared": shared}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
