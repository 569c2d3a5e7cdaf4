#!/usr/bin/env python3
"""A CPU peer runtime as a long-lived worker, run inside the peer's virtual environment by ``criticalkv bench peers``.

Standalone on purpose (it imports onnxruntime_genai or openvino_genai, never criticalkv):

    PEER_PYTHON criticalkv/bench/peers/cpu_runner.py --impl openvino --model DIR

``--impl onnxruntime-genai``: ``DIR`` holds the model builder's export (``genai_config.json``, ``model.onnx``);
``--impl openvino``: ``DIR`` holds ``optimum-cli export openvino``'s IR (``openvino_model.xml``).

The model is loaded once; then every line of stdin is one JSON request and every answer one JSON line on stdout
(log lines go to stderr):

* ``{"op": "single", "ids": [...], "new_tokens": N}``: one request, greedy, exactly N new tokens (stop tokens
  ignored): ``{"prefill_s", "decode_s_per_token", "tokens"}``. onnxruntime-genai: prefill = ``append_tokens``
  (the prompt's forward), decode = the median ``generate_next_token`` after the first (which only samples);
  OpenVINO: ``LLMPipeline.generate`` with its own perf metrics (TTFT, TPOT); prefix caching is off in both OpenVINO
  pipelines (a repeated prompt would reuse its KV blocks);
* ``{"op": "batch", "prompts": [[...], ...], "new_tokens": N, "eviction": null | {...}}``: the prompts together
  (equal lengths: no padding), wall time from the call to the last token: ``{"seconds", "output_tokens",
  "tokens"}``. onnxruntime-genai: one Generator with ``batch_size`` = the number of prompts; OpenVINO:
  ``ContinuousBatchingPipeline`` (its default scheduler, ``cache_size`` GB of KV cache), with
  ``CacheEvictionConfig(start_size, recent_size, max_cache_size, NORM_SUM)`` when ``eviction`` is given;
* ``{"op": "info"}``: versions and the compute precision (``--precision``: OpenVINO's CPU default, bf16 on CPUs
  with BF16 even for fp32 weights, or f32); ``{"op": "quit"}`` ends the worker.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from importlib import metadata


class OrtGenAI:
    def __init__(self, folder: str):
        import onnxruntime_genai as og

        self.og = og
        self.model = og.Model(folder)

    def _generator(self, prompts, new_tokens: int):
        import numpy as np

        ids = np.asarray(prompts, dtype=np.int32)
        params = self.og.GeneratorParams(self.model)
        total = ids.shape[1] + new_tokens
        params.set_search_options(max_length=total, min_length=total, do_sample=False, batch_size=ids.shape[0])
        return self.og.Generator(self.model, params), ids

    def single(self, ids, new_tokens: int) -> dict:
        generator, array = self._generator([ids], new_tokens)
        start = time.perf_counter()
        generator.append_tokens(array)
        prefill = time.perf_counter() - start
        steps = []
        while not generator.is_done():
            start = time.perf_counter()
            generator.generate_next_token()
            steps.append(time.perf_counter() - start)
        tokens = [int(t) for t in generator.get_sequence(0)[len(ids):]]
        return {"prefill_s": prefill, "decode_s_per_token": statistics.median(steps[1:]) if len(steps) > 1 else 0.0,
                "tokens": tokens}

    def batch(self, prompts, new_tokens: int, eviction) -> dict:
        if eviction:
            raise ValueError("onnxruntime-genai has no KV eviction")
        start = time.perf_counter()
        generator, array = self._generator(prompts, new_tokens)
        generator.append_tokens(array)
        while not generator.is_done():
            generator.generate_next_token()
        seconds = time.perf_counter() - start
        tokens = [[int(t) for t in generator.get_sequence(b)[array.shape[1]:]] for b in range(len(prompts))]
        return {"seconds": seconds, "output_tokens": sum(map(len, tokens)), "tokens": tokens}


class OpenVINOGenAI:
    def __init__(self, folder: str, cache_gb: int, precision: str = "default"):
        import openvino as ov
        import openvino_genai as genai

        self.ov, self.genai, self.folder, self.cache_gb = ov, genai, folder, cache_gb
        # OpenVINO's CPU plugin computes in bf16 by default where the CPU has BF16 (INFERENCE_PRECISION_HINT), even for
        # fp32 weights; "f32" asks for fp32 compute, criticalkv's precision
        self.properties = {"INFERENCE_PRECISION_HINT": "f32"} if precision == "f32" else {}
        self.precision = ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").to_string() if precision == "default" else "f32"
        # no prefix caching: a repeated prompt would otherwise reuse its KV blocks (a 2k-token prefill measured
        # 0.26 s the second time), and criticalkv's Engine.generate keeps nothing between calls
        self.pipe = genai.LLMPipeline(folder, "CPU", scheduler_config=self._scheduler(), **self.properties)
        self.batch_pipes = {}

    def _scheduler(self):
        scheduler = self.genai.SchedulerConfig()
        scheduler.cache_size = self.cache_gb
        scheduler.enable_prefix_caching = False
        return scheduler

    def _config(self, new_tokens: int):
        config = self.genai.GenerationConfig()
        config.max_new_tokens = new_tokens
        config.min_new_tokens = new_tokens
        config.ignore_eos = True
        config.do_sample = False
        return config

    def _tensor(self, ids):
        import numpy as np

        return self.ov.Tensor(np.asarray([ids], dtype=np.int64))

    def single(self, ids, new_tokens: int) -> dict:
        import numpy as np

        ones = self.ov.Tensor(np.ones((1, len(ids)), dtype=np.int64))
        result = self.pipe.generate(self.genai.TokenizedInputs(self._tensor(ids), ones), self._config(new_tokens))
        metrics = result.perf_metrics
        return {"prefill_s": metrics.get_ttft().mean / 1e3, "decode_s_per_token": metrics.get_tpot().mean / 1e3,
                "tokens": [int(t) for t in result.tokens[0]]}

    def _batch_pipe(self, eviction):
        key = json.dumps(eviction, sort_keys=True)
        if key not in self.batch_pipes:
            genai = self.genai
            scheduler = self._scheduler()
            if eviction:
                scheduler.use_cache_eviction = True
                scheduler.cache_eviction_config = genai.CacheEvictionConfig(
                    eviction["start_size"], eviction["recent_size"], eviction["max_cache_size"], genai.AggregationMode.NORM_SUM)
            self.batch_pipes[key] = genai.ContinuousBatchingPipeline(self.folder, scheduler, "CPU", self.properties)
        return self.batch_pipes[key]

    def batch(self, prompts, new_tokens: int, eviction) -> dict:
        pipe = self._batch_pipe(eviction)
        inputs = [self._tensor(ids) for ids in prompts]
        configs = [self._config(new_tokens) for _ in prompts]
        start = time.perf_counter()
        results = pipe.generate(inputs, configs)
        seconds = time.perf_counter() - start
        tokens = [[int(t) for t in r.m_generation_ids[0]] for r in results]
        return {"seconds": seconds, "output_tokens": sum(map(len, tokens)), "tokens": tokens}


def versions(impl: str) -> dict:
    out = {"python": sys.version.split()[0]}
    names = ("onnxruntime-genai", "onnxruntime") if impl == "onnxruntime-genai" else ("openvino", "openvino-genai", "optimum-intel")
    for dist in names:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def serve_requests(worker, info, load_s: float) -> None:
    """The workers' protocol over stdin/stdout, shared with criticalkv's own ``engine_worker``: a ``{"ready", "load_s"}``
    line, then one JSON answer line per JSON request line (``info()`` answers ``info``; ``worker.single`` and
    ``worker.batch`` the others) until ``quit`` or the end of stdin. Errors are answered per request (``{"error"}``)."""
    print(json.dumps({"ready": True, "load_s": load_s}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        op = request.get("op")
        try:
            if op == "quit":
                break
            if op == "info":
                answer = info()
            elif op == "single":
                answer = worker.single(request["ids"], request["new_tokens"])
            elif op == "batch":
                answer = worker.batch(request["prompts"], request["new_tokens"], request.get("eviction"))
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as err:  # reported to the caller, which raises it with the worker's name
            answer = {"error": f"{type(err).__name__}: {err}"}
        print(json.dumps(answer), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=("onnxruntime-genai", "openvino"), required=True)
    p.add_argument("--model", required=True, help="the peer's exported model folder")
    p.add_argument("--cache-gb", type=int, default=2, help="OpenVINO ContinuousBatchingPipeline KV cache size (GB)")
    p.add_argument("--precision", choices=("default", "f32"), default="default",
                   help="OpenVINO compute precision: its CPU default (bf16 where the CPU has BF16) or f32")
    args = p.parse_args()
    start = time.perf_counter()
    runner = (OrtGenAI(args.model) if args.impl == "onnxruntime-genai"
              else OpenVINOGenAI(args.model, args.cache_gb, args.precision))
    serve_requests(runner, lambda: {"versions": versions(args.impl), "precision": getattr(runner, "precision", "f32")},
                   time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
