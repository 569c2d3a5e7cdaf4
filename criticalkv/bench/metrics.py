"""Serving metrics from client-side timestamps, defined as ``trtllm-bench`` and AIPerf define them.

Per request (all times in seconds, from one monotonic clock, ``time.perf_counter``):

* ``ttft``: time to first token = arrival of the first response carrying output - request start;
* ``latency``: request latency = arrival of the last response carrying output - request start
  (AIPerf's ``request_latency``; the HTTP stream closing afterwards is not counted);
* ``tpot``: time per output token = (latency - ttft) / (output tokens - 1), for two or more tokens
  (``trtllm-bench``'s TPOT, which AIPerf calls ``inter_token_latency``);
* ``itl``: inter-token latencies = every gap between consecutive responses; a response carrying k > 1
  tokens contributes k gaps of (its gap / k), so there is one entry per token after the first
  (vLLM's and this module's ITL; AIPerf's closest metric is ``inter_chunk_latency``).

Over a run of requests: ``duration`` = last request end - first request start (warm-up excluded);
request throughput = completed requests / duration; output throughput = output tokens / duration;
per-user output throughput (``trtllm-bench``'s ``[w/ ctx]``) = mean of output tokens / latency;
per-user output speed = mean of 1 / tpot. Every latency metric is reported as avg, min, max and the
p50 / p90 / p95 / p99 percentiles (linear interpolation, ``numpy.percentile``'s default, as AIPerf).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

#: Percentiles reported for every latency metric.
PERCENTILES = (50, 90, 95, 99)
#: Latency metrics summarised per run (seconds in the records, milliseconds in the summary).
LATENCY_METRICS = ("ttft", "tpot", "itl", "latency")


@dataclass
class RequestRecord:
    """What the client saw of one request.

    start : time the request was sent (s, ``perf_counter``)
    chunks : (arrival time, tokens carried) of every response that carried output, in arrival order
    input_tokens, output_tokens : counts reported by the server (``output_tokens`` None: the sum of
        the chunks' tokens is used)
    kv_bytes_kept, kv_bytes_full : the server's KV bytes of this sequence (None when not returned)
    context_cache_hit : for a request with a context, whether the server found it compressed in its cache
        (None: no context, or not returned)
    error : the error message of a failed request (its timings are not used)
    text : the streamed text, piece by piece (the answer: ``answer``)
    """

    start: float
    chunks: list[tuple[float, int]] = field(default_factory=list)
    input_tokens: int | None = None
    output_tokens: int | None = None
    kv_bytes_kept: int | None = None
    kv_bytes_full: int | None = None
    context_cache_hit: bool | None = None
    finish_reason: str | None = None
    error: str | None = None
    text: list[str] = field(default_factory=list)

    @property
    def answer(self) -> str:
        return "".join(self.text)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunks)

    @property
    def num_output_tokens(self) -> int:
        if self.output_tokens is not None:
            return int(self.output_tokens)
        return sum(n for _, n in self.chunks)

    @property
    def end(self) -> float:
        return self.chunks[-1][0]

    @property
    def ttft(self) -> float:
        return self.chunks[0][0] - self.start

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """(latency - ttft) / (output tokens - 1); None for a single output token."""
        n = self.num_output_tokens
        return (self.latency - self.ttft) / (n - 1) if n > 1 else None

    def itl(self) -> list[float]:
        """One gap per token after the first: a chunk of k tokens splits its gap into k equal parts.

        When the server's token count exceeds the chunks' (it merged tokens into fewer responses
        without saying how many each carried), the last chunk is taken to carry the difference."""
        counts = [n for _, n in self.chunks]
        extra = self.num_output_tokens - sum(counts)
        if extra > 0:
            counts[-1] += extra
        gaps: list[float] = []
        # the first chunk's extra tokens arrived with the first token: zero gaps
        gaps += [0.0] * max(counts[0] - 1, 0)
        for (t0, _), (t1, _), k in zip(self.chunks, self.chunks[1:], counts[1:]):
            if k > 0:
                gaps += [(t1 - t0) / k] * k
        return gaps


def distribution(values: Sequence[float], scale: float = 1.0) -> dict[str, float | int | None]:
    """avg, min, max, p50/p90/p95/p99 and count of ``values`` (times ``scale``); None entries when empty."""
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64) * scale
    out: dict[str, float | int | None] = {"count": int(arr.size)}
    if arr.size == 0:
        out.update({"avg": None, "min": None, "max": None, **{f"p{p}": None for p in PERCENTILES}})
        return out
    out.update({"avg": float(arr.mean()), "min": float(arr.min()), "max": float(arr.max())})
    for p, v in zip(PERCENTILES, np.percentile(arr, PERCENTILES)):
        out[f"p{p}"] = float(v)
    return out


def summarize(records: Iterable[RequestRecord]) -> dict:
    """Run-level metrics of the completed requests (failed ones only counted).

    Returns a dict with ``completed``, ``failed``, ``duration_s``, ``request_throughput`` (req/s),
    ``output_throughput`` (tokens/s), ``total_token_throughput`` (input + output tokens/s),
    ``per_user_output_throughput`` (mean tokens/s of one request, ``trtllm-bench``'s ``[w/ ctx]``),
    ``per_user_output_speed`` (mean of 1 / tpot, tokens/s), ``output_tokens`` (distribution of the
    output lengths), and ``ttft_ms`` / ``tpot_ms`` / ``itl_ms`` / ``latency_ms`` distributions.
    """
    records = list(records)
    done = [r for r in records if r.ok]
    failed = len(records) - len(done)
    if not done:
        return {"completed": 0, "failed": failed}
    duration = max(r.end for r in done) - min(r.start for r in done)
    out_tokens = [r.num_output_tokens for r in done]
    in_tokens = sum(r.input_tokens or 0 for r in done)
    tpots = [r.tpot for r in done]
    itls = [g for r in done for g in r.itl()]
    return {
        "completed": len(done),
        "failed": failed,
        "duration_s": duration,
        "request_throughput": len(done) / duration if duration > 0 else None,
        "output_throughput": sum(out_tokens) / duration if duration > 0 else None,
        "total_token_throughput": (sum(out_tokens) + in_tokens) / duration if duration > 0 else None,
        "per_user_output_throughput": float(np.mean([n / r.latency for n, r in zip(out_tokens, done) if r.latency > 0])),
        "per_user_output_speed": float(np.mean([1.0 / t for t in tpots if t])) if any(tpots) else None,
        "output_tokens": distribution(out_tokens),
        "input_tokens": distribution([r.input_tokens for r in done]),
        "ttft_ms": distribution([r.ttft for r in done], 1e3),
        "tpot_ms": distribution(tpots, 1e3),
        "itl_ms": distribution(itls, 1e3),
        "latency_ms": distribution([r.latency for r in done], 1e3),
        "kv_mib_kept_per_seq": distribution([r.kv_bytes_kept for r in done], 2.0**-20),
        "kv_mib_full_per_seq": distribution([r.kv_bytes_full for r in done], 2.0**-20),
        "kv_mib_kept_peak_in_flight": peak_in_flight(done, "kv_bytes_kept") / 2**20,
        "peak_requests_in_flight": peak_in_flight(done, None),
        **cache_hits(done),
    }


def cache_hits(records: Sequence[RequestRecord]) -> dict:
    """Context-cache hits and misses of the requests that reported one, and the hit rate (None without any)."""
    flags = [r.context_cache_hit for r in records if r.context_cache_hit is not None]
    hits = sum(1 for f in flags if f)
    return {"context_cache_hits": hits, "context_cache_misses": len(flags) - hits,
            "context_cache_hit_rate": hits / len(flags) if flags else None}


def decoding_intervals(records: Sequence[RequestRecord]) -> list[tuple[float, float]]:
    """(first token, last token) of every completed request: the time it held a decoding sequence on the server
    (seen from the client: admission and prefill come before the first token)."""
    return [(r.chunks[0][0], r.end) for r in records if r.ok]


def concurrency_profile(intervals: Sequence[tuple[float, float]]) -> dict:
    """How many intervals overlap: the peak, and the time-weighted mean over the span from the first start to the
    last end (intervals that only touch do not overlap)."""
    if not intervals:
        return {"peak": 0, "mean": None, "span_s": 0.0}
    events = sorted([(a, 1) for a, b in intervals] + [(b, -1) for a, b in intervals], key=lambda e: (e[0], e[1]))
    level = peak = 0
    area, last = 0.0, events[0][0]
    for t, delta in events:
        area += level * (t - last)
        last = t
        level += delta
        peak = max(peak, level)
    span = events[-1][0] - events[0][0]
    return {"peak": peak, "mean": area / span if span > 0 else None, "span_s": span}


def peak_in_flight(records: Sequence[RequestRecord], attr: str | None) -> float:
    """Largest sum of ``attr`` (1 per request when None) over the requests in flight at one time
    (a request is in flight from its start to its last response)."""
    events = []
    for r in records:
        value = 1 if attr is None else (getattr(r, attr) or 0)
        events += [(r.start, 1, value), (r.end, 0, -value)]  # at equal times an end comes before a start
    total = best = 0
    for _, _, delta in sorted(events):
        total += delta
        best = max(best, total)
    return best
