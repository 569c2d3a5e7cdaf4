"""The question-agnostic needle grid through ``criticalkv serve``, one server per backend: does a GPU user's backend
(torch) find what the CPU engine (ONNX Runtime) finds, on the same engine and prompts?

Each prompt of the needle grid (``criticalkv eval needle``'s generator, seed and chat template; ``--domain`` picks the
haystack) is sent as a context request: the context (the prompt up to its question) as ``context_ids``, the question
as ``input_ids``, greedy, to ``POST /v2/models/criticalkv/generate`` of a server started with ``--backend B``. The
server compresses the context with the engine's context policy (without the question: what its context cache keeps),
then answers. Each answer is scored like ``criticalkv eval`` scores it (``digits``), and every backend's tokens are
compared with the first backend's.

    python -m benchmarks.served_needles --engine-dir engines/smollm2-criticalkv --backends onnxruntime,torch \\
        --domain legal --out results/served_needles/legal

``vllm`` among the backends serves the same model with ``vllm serve`` (``criticalkv.bench.peers.vllm``; its
environment created on first use): the context and the question as one prompt of the same ids, its full cache (its
prefix caching on): the lossless answer the compressed context is measured against.

Writes ``STEM.json`` (every prompt's answer per backend, the server commands, the load average) and ``STEM.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

import benchmarks
from criticalkv.bench.machine import header_lines
from criticalkv.eval.io import write_json, write_text


def parse_args(argv=None) -> argparse.Namespace:
    from criticalkv.eval.domains import DEFAULT_DOMAIN, DOMAINS

    ap = argparse.ArgumentParser(prog="python -m benchmarks.served_needles", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", required=True, type=Path, help="the engine every server serves")
    ap.add_argument("--backends", default="onnxruntime,torch",
                    help="comma-separated `criticalkv serve --backend` values, one server each, and vllm (vllm serve "
                         "on the same model, the whole prompt uncompressed); the first is the reference (default: "
                         "onnxruntime,torch)")
    ap.add_argument("--domain", default=DEFAULT_DOMAIN, choices=tuple(DOMAINS), help="the haystacks' text")
    ap.add_argument("--lengths", default="2048", help="comma-separated prompt lengths (default: 2048)")
    ap.add_argument("--samples", type=int, default=3, help="needle instances per length and depth (default: 3)")
    ap.add_argument("--depths", default="10,50,90",
                    help="needle depths in percent (default: 10,50,90: with the defaults, the 9 prompts per domain of "
                         "results/domains)")
    ap.add_argument("--seed", type=int, default=0, help="the prompt generator's seed (default: 0)")
    ap.add_argument("--threads", type=int, default=2, help="each server's --threads (default: 2)")
    ap.add_argument("--out", type=Path, required=True, metavar="STEM", help="results as STEM.json and STEM.md")
    return ap.parse_args(argv)


def ask(url: str, context_ids: list[int], question_ids: list[int], max_tokens: int) -> dict:
    """One context request, answered whole (not streamed): its text, token count and whether the context was cached."""
    body = {"context_ids": context_ids, "input_ids": question_ids, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps({"max_tokens": max_tokens, "temperature": 0.0}),
            "return_num_output_tokens": True}
    request = urllib.request.Request(f"{url}/v2/models/criticalkv/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        out = json.loads(response.read().decode())
    text = out.get("text_output")
    return {"text": "".join(text) if isinstance(text, list) else text, "hit": out.get("context_cache_hit")}


def ask_vllm(url: str, ids: list[int], max_tokens: int) -> dict:
    """The same prompt (context and question ids together) as one vLLM completion, greedy, answered whole."""
    body = {"model": "vllm", "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0}
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        out = json.loads(response.read().decode())
    return {"text": out["choices"][0]["text"], "hit": None}


def run(args) -> dict:
    from transformers import AutoTokenizer

    from criticalkv.bench import machine
    from criticalkv.bench.served import ServerProcess, engine_label
    from criticalkv.eval.needle import needle_prompts
    from criticalkv.eval.runner import split_question
    from criticalkv.eval.scoring import score

    from criticalkv.bench.served import SERVE_BACKENDS, comma_choices

    backends = comma_choices(args.backends, "--backends", SERVE_BACKENDS + ("vllm",))
    tokenizer = AutoTokenizer.from_pretrained(args.engine_dir / "tokenizer")
    lengths = [int(x) for x in args.lengths.split(",") if x]
    depths = [float(x) for x in args.depths.split(",") if x]
    prompts = needle_prompts(tokenizer, lengths, depths, args.samples, args.seed, True, args.domain)
    results = machine.header(" ".join(["python -m benchmarks.served_needles", *sys.argv[1:]]))
    results.update(engine=engine_label(args.engine_dir), domain=args.domain, backends=backends, prompts=[])
    for p in prompts:
        results["prompts"].append({"key": p.key, "answers": list(p.answers), "by_backend": {}})
    for backend in backends:
        flags = ["--backend", backend, "--threads", str(args.threads)]
        started = time.perf_counter()
        if backend == "vllm":
            from criticalkv.bench.peers import peers_dir
            from criticalkv.bench.peers.vllm import VllmServer

            server_cm = VllmServer(peers_dir())
            flags = [server_cm.command]
        else:
            server_cm = ServerProcess(args.engine_dir, flags)
        with server_cm as server:
            ready = time.perf_counter() - started
            print(f"{backend}: ready in {ready:.1f} s", file=sys.stderr, flush=True)
            for p, row in zip(prompts, results["prompts"]):
                cut = split_question(p)
                t0 = time.perf_counter()
                if backend == "vllm":
                    got = ask_vllm(server.url, list(p.input_ids), p.max_new_tokens)
                else:
                    got = ask(server.url, list(p.input_ids[:cut]), list(p.input_ids[cut:]), p.max_new_tokens)
                got["seconds"] = round(time.perf_counter() - t0, 3)
                got["score"] = score(p.metric, got["text"] or "", p.answers)
                row["by_backend"][backend] = got
                print(f"{backend} {p.key}: {got['score']:.0f} {got['text']!r} ({got['seconds']} s)", file=sys.stderr,
                      flush=True)
        results.setdefault("servers", {})[backend] = {"flags": flags, "ready_s": round(ready, 1)}
    reference = backends[0]
    results["summary"] = {b: {"found": sum(r["by_backend"][b]["score"] for r in results["prompts"]),
                              "prompts": len(prompts),
                              "same_text_as_" + reference: sum(r["by_backend"][b]["text"] == r["by_backend"][reference]["text"]
                                                               for r in results["prompts"])}
                          for b in backends}
    machine.finish(results)
    return results


def render(results: dict) -> str:
    backends = results["backends"]
    lines = [*header_lines(results), "",
             f"Engine: {results['engine']['label']} ({results['engine']['engine_dir']}), domain {results['domain']}; "
             "each prompt's context compressed by the server's context policy, then the question.", "",
             "| backend | needles found | same answer as " + backends[0] + " |", "|---|---|---|"]
    for b in backends:
        s = results["summary"][b]
        lines.append(f"| {b} | {s['found']:g} of {s['prompts']} | {s['same_text_as_' + backends[0]]} of {s['prompts']} |")
    lines += ["", "| prompt | answer | " + " | ".join(backends) + " |", "|---|---|" + "---|" * len(backends)]
    for r in results["prompts"]:
        cells = [f"{r['by_backend'][b]['text']!r} ({r['by_backend'][b]['score']:.0f})".replace("|", "\\|") for b in backends]
        lines.append(f"| {r['key']} | {', '.join(r['answers'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if not (args.engine_dir / "manifest.json").is_file():
        print(f"{args.engine_dir}: not an engine directory (no manifest.json)", file=sys.stderr)
        return 2
    results = run(args)
    write_json(args.out.with_suffix(".json"), results)
    text = render(results)
    write_text(args.out.with_suffix(".md"), text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(benchmarks.run("served_needles", main))
