"""The targets and the Markdown report of ``criticalkv bench gpu-serve``, from its results alone."""

from __future__ import annotations

#: The issue's targets (H100, bf16, the 8B-shaped model, ratios within one run).
TARGETS = {"ttft_ratio_max": 1.05, "throughput_ratio_min": 3.0, "step_floor_ratio_max": 1.3,
           "kvpress_ttft_ratio_max": 0.5, "kvpress_decode_ratio_min": 2.0}


def _find(results: dict, n: int, policy: str) -> dict | None:
    return next((r for r in results.get("runs") or [] if r.get("prompt_tokens") == n and r.get("name") == policy), None)


def _served(entry: dict | None, c: int) -> dict | None:
    if not entry:
        return None
    return next((s for s in entry.get("served", []) if s.get("concurrency") == c and s.get("completed")), None)


def _div(a, b) -> float | None:
    """a / b, or None when either was not measured (or b is 0)."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b:
        return a / b
    return None


def check_targets(results: dict) -> list[dict]:
    """The issue's targets, from this run (None where a measurement is missing)."""
    workload = results.get("workload") or {}
    n = max(workload.get("prompt_lengths") or [0])
    c = min(workload.get("concurrency") or [32], key=lambda x: abs(x - 32))
    crit, full = _find(results, n, "criticalkv"), _find(results, n, "full")
    out = []

    measured = "gpu" in results  # a CPU dry run checks the plumbing, not the targets

    def add(name, value, limit, op, note=""):
        met = None if value is None or not measured else (value <= limit if op == "<=" else value >= limit)
        note = note if measured else "CPU dry run: not a measurement" + (f"; {note}" if note else "")
        out.append({"target": name, "value": value, "limit": f"{op} {limit}", "met": met, "note": note})

    cold = (crit or {}).get("cold") or {}
    add(f"TTFT at {n} tokens, criticalkv / full", _div(cold.get("ttft_s"), ((full or {}).get("cold") or {}).get("ttft_s")),
        TARGETS["ttft_ratio_max"], "<=")
    a, b = _served(crit, c) or {}, _served(full, c) or {}
    add(f"output tokens/s at {n} tokens, concurrency {c}, criticalkv / full",
        _div(a.get("output_throughput"), b.get("output_throughput")), TARGETS["throughput_ratio_min"], ">=",
        f"rows: criticalkv {crit.get('rows') if crit else None}, full {full.get('rows') if full else None}")
    step = (crit or {}).get("step") or {}
    add(f"decode step at {step.get('batch', '?')} rows / memory floor (criticalkv, {n} tokens)",
        step.get("floor_ratio"), TARGETS["step_floor_ratio_max"], "<=")
    press = next((k for k in results.get("kvpress", []) if k.get("prompt_tokens") == n and "ttft_s" in k), None) or {}
    add(f"TTFT criticalkv / kvpress at {n} tokens", _div(cold.get("ttft_s"), press.get("ttft_s")),
        TARGETS["kvpress_ttft_ratio_max"], "<=")
    one = _served(crit, 1) or {}
    decode = _div(1e3, (one.get("tpot_ms") or {}).get("p50"))
    add(f"decode tokens/s at batch 1, criticalkv / kvpress at {n} tokens",
        _div(decode, press.get("decode_tokens_per_s")), TARGETS["kvpress_decode_ratio_min"], ">=")
    return out


def _num(value, spec: str = ".3f", scale: float = 1.0, missing: str = "-") -> str:
    """``value * scale`` formatted, or ``missing`` when the figure was not measured (None, absent, not a number): a
    report of a run that stopped half-way still renders, with what it has."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return missing
    return format(value * scale, spec)


def _ratio(a, b, spec: str = ".3f") -> str:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b:
        return format(a / b, spec)
    return "-"


def _ms(summary: dict, metric: str, p: str) -> str:
    return _num((summary.get(metric) or {}).get(p), ".1f")


def render(results: dict) -> str:
    from criticalkv.bench.machine import header_lines

    lines = ["# criticalkv bench gpu-serve", ""]
    lines += [line.removeprefix("# ") + "  " for line in header_lines(results)]
    gpu = results.get("gpu")
    lines.append(f"GPU: {gpu.get('name', '?')}, {_num(gpu.get('memory_gib'), '.0f')} GiB" if gpu else
                 "GPU: none (a CPU dry run: plumbing, not a measurement)")
    w, m = results.get("workload") or {}, results.get("model") or {}
    lines += [f"model: {m.get('name', '?')} ({_num(m.get('parameters'), '.2f', 1e-9)} B parameters, {m.get('dtype', '?')}); "
              f"budget {w.get('budget', '?')} entries per KV head; KV memory {_num(w.get('kv_memory_gib'), '.3g')} GiB for "
              f"every policy; {w.get('new_tokens', '?')} new tokens, questions of {w.get('question_tokens', '?')} tokens",
              f"device copy bandwidth {_num(results.get('copy_bandwidth_bytes_per_s'), '.0f', 1e-9)} GB/s; weights read "
              f"per decode step {_num(results.get('weights_bytes_per_step'), '.2f', 2**-30)} GiB; run "
              f"{_num(results.get('elapsed_s'), '.0f')} s", ""]
    lines += ["## Targets", "", "| target | value | limit | met |", "|---|---|---|---|"]
    for t in results.get("targets") or []:
        value = _num(t.get("value"), missing="not measured")
        met = "-" if t.get("met") is None else ("yes" if t["met"] else "NO")
        lines.append(f"| {t.get('target')} | {value} | {t.get('limit')} | {met} |" + (f" {t['note']}" if t.get("note") else ""))
    runs = results.get("runs") or []
    lines += ["", "## Cold requests (one at a time): TTFT and the selection", "",
              "| prompt | policy | rows | TTFT s | vs full | prefill s | selection s | selection runs on |",
              "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        cold = r.get("cold")
        full = (_find(results, r.get("prompt_tokens"), "full") or {}).get("cold")
        if not cold:
            lines.append(f"| {r.get('prompt_tokens')} | {r.get('policy')} | {r.get('rows', '-')} | - | - | - | - | "
                         f"{r.get('skipped') or r.get('error') or '-'} |")
            continue
        lines.append(f"| {r.get('prompt_tokens')} | {r.get('policy')} | {r.get('rows', '-')} | {_num(cold.get('ttft_s'))} | "
                     f"{_ratio(cold.get('ttft_s'), (full or {}).get('ttft_s'))} | {_num(cold.get('prefill_s'))} | "
                     f"{_num(cold.get('selection_s'))} | {r.get('selection_kernels', '-')} |")
    lines += ["", "## Served: one document, concurrent questions (ms; tokens/s)", "",
              "| prompt | policy | conc | rows | done | TTFT p50/p90/p99 | TPOT p50/p90/p99 | ITL p50/p90/p99 | "
              "output tok/s | vs full |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        for s in r.get("served", []):
            if not s.get("completed"):
                lines.append(f"| {r.get('prompt_tokens')} | {r.get('policy')} | {s.get('concurrency')} | "
                             f"{r.get('rows', '-')} | 0 | {s.get('skipped') or ', '.join(s.get('errors') or []) or '-'} "
                             "| | | | |")
                continue
            full = _served(_find(results, r.get("prompt_tokens"), "full"), s.get("concurrency"))
            trio = lambda metric: "/".join(_ms(s, metric, p) for p in ("p50", "p90", "p99"))  # noqa: E731
            cut = " (cut)" if s.get("cut_by_time_limit") else ""
            lines.append(f"| {r.get('prompt_tokens')} | {r.get('policy')} | {s.get('concurrency')} | {r.get('rows', '-')} | "
                         f"{s.get('finished', '?')}/{s.get('requests', '?')}{cut} | {trio('ttft_ms')} | {trio('tpot_ms')} | "
                         f"{trio('itl_ms')} | {_num(s.get('output_throughput'), '.1f')} | "
                         f"{_ratio(s.get('output_throughput'), (full or {}).get('output_throughput'), '.2f')} |")
    lines += ["", "## Decode step vs its memory floor", "",
              "| prompt | policy | rows | step ms | decode call ms | floor ms (kept K/V) | step / floor | "
              "floor ms (K/V the step reads: spans) |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        s = r.get("step")
        if s:
            lines.append(f"| {r.get('prompt_tokens')} | {r.get('policy')} | {s.get('batch', '-')} | "
                         f"{_num(s.get('step_s'), '.2f', 1e3)} | {_num(s.get('decode_call_s'), '.2f', 1e3)} | "
                         f"{_num(s.get('floor_s'), '.2f', 1e3)} | {_num(s.get('floor_ratio'), '.2f')} | "
                         f"{_num(s.get('read_floor_s'), '.2f', 1e3)} |")
    lines += ["", "## kvpress (transformers + its press, batch 1)", ""]
    for k in results.get("kvpress", []):
        if "ttft_s" in k:
            lines.append(f"- {k.get('prompt_tokens')} tokens: {k.get('press')}: TTFT {_num(k.get('ttft_s'))} s, decode "
                         f"{_num(k.get('decode_tokens_per_s'), '.1f')} tokens/s, {k.get('kept_tokens_per_head', '-')} "
                         "entries kept per head")
        else:
            lines.append(f"- {k.get('prompt_tokens')} tokens: {k.get('skipped') or k.get('error')}")
    v = results.get("vllm")
    if v:
        lines += ["", "## vLLM (same model, same KV memory, same token ids; prefix caching on)", "",
                  f"`{v.get('command', '-')}`; ready in {_num(v.get('ready_s'), '.0f')} s; KV {v.get('kv')}"]
        if v.get("error"):
            lines.append(f"error: {v['error']}")
        lines += ["", "| prompt | cold TTFT s | conc | done | TTFT p50/p90/p99 | TPOT p50/p90/p99 | output tok/s | "
                  "criticalkv / vLLM, output tok/s |", "|---|---|---|---|---|---|---|---|"]
        for r in v.get("runs", []):
            for s_ in r.get("served", []) or [{}]:
                trio = lambda metric: "/".join(_ms(s_, metric, p) for p in ("p50", "p90", "p99"))  # noqa: E731
                ours = _served(_find(results, r.get("prompt_tokens"), "criticalkv"), s_.get("concurrency"))
                lines.append(f"| {r.get('prompt_tokens')} | {_num((r.get('cold') or {}).get('ttft_s'))} | "
                             f"{s_.get('concurrency', '-')} | {s_.get('finished', '-')}/{s_.get('requests', '-')} | "
                             f"{trio('ttft_ms')} | {trio('tpot_ms')} | {_num(s_.get('output_throughput'), '.1f')} | "
                             f"{_ratio((ours or {}).get('output_throughput'), s_.get('output_throughput'), '.2f')} |")
    if results.get("skipped"):
        lines += ["", "Skipped: " + "; ".join(f"{s.get('policy')} at {s.get('prompt_tokens')} ({s.get('why')})"
                                              for s in results["skipped"])]
    if results.get("errors"):
        lines += ["", "Errors: " + "; ".join(str(e) for e in results["errors"])]
    return "\n".join(lines) + "\n"
