"""The targets and the Markdown report of ``criticalkv bench gpu-serve``, from its results alone."""

from __future__ import annotations

#: The issue's targets (H100, bf16, the 8B-shaped model, ratios within one run).
TARGETS = {"ttft_ratio_max": 1.05, "throughput_ratio_min": 3.0, "step_floor_ratio_max": 1.3,
           "kvpress_ttft_ratio_max": 0.5, "kvpress_decode_ratio_min": 2.0}


def _find(results: dict, n: int, policy: str) -> dict | None:
    return next((r for r in results["runs"] if r["prompt_tokens"] == n and r["name"] == policy), None)


def _served(entry: dict | None, c: int) -> dict | None:
    if not entry:
        return None
    return next((s for s in entry.get("served", []) if s.get("concurrency") == c and s.get("completed")), None)


def check_targets(results: dict) -> list[dict]:
    """The issue's targets, from this run (None where a measurement is missing)."""
    lengths = results["workload"]["prompt_lengths"]
    n = max(lengths)
    c = min(results["workload"]["concurrency"], key=lambda x: abs(x - 32))
    crit, full = _find(results, n, "criticalkv"), _find(results, n, "full")
    out = []

    measured = "gpu" in results  # a CPU dry run checks the plumbing, not the targets

    def add(name, value, limit, op, note=""):
        met = None if value is None or not measured else (value <= limit if op == "<=" else value >= limit)
        note = note if measured else "CPU dry run: not a measurement" + (f"; {note}" if note else "")
        out.append({"target": name, "value": value, "limit": f"{op} {limit}", "met": met, "note": note})

    ttft = None
    if crit and full and crit.get("cold") and full.get("cold"):
        ttft = crit["cold"]["ttft_s"] / full["cold"]["ttft_s"]
    add(f"TTFT at {n} tokens, criticalkv / full", ttft, TARGETS["ttft_ratio_max"], "<=")
    a, b = _served(crit, c), _served(full, c)
    ratio = a["output_throughput"] / b["output_throughput"] if a and b and b.get("output_throughput") else None
    add(f"output tokens/s at {n} tokens, concurrency {c}, criticalkv / full", ratio, TARGETS["throughput_ratio_min"], ">=",
        f"rows: criticalkv {crit.get('rows') if crit else None}, full {full.get('rows') if full else None}")
    step = (crit or {}).get("step")
    add(f"decode step at {step['batch'] if step else '?'} rows / memory floor (criticalkv, {n} tokens)",
        step["floor_ratio"] if step else None, TARGETS["step_floor_ratio_max"], "<=")
    press = next((k for k in results.get("kvpress", []) if k.get("prompt_tokens") == n and "ttft_s" in k), None)
    add(f"TTFT criticalkv / kvpress at {n} tokens", crit["cold"]["ttft_s"] / press["ttft_s"]
        if press and crit and crit.get("cold") else None, TARGETS["kvpress_ttft_ratio_max"], "<=")
    one = _served(crit, 1)
    decode = 1e3 / one["tpot_ms"]["p50"] if one and one.get("tpot_ms", {}).get("p50") else None
    add(f"decode tokens/s at batch 1, criticalkv / kvpress at {n} tokens",
        decode / press["decode_tokens_per_s"] if press and decode else None, TARGETS["kvpress_decode_ratio_min"], ">=")
    return out


def _ms(summary: dict, metric: str, p: str) -> str:
    value = (summary.get(metric) or {}).get(p)
    return "-" if value is None else f"{value:.1f}"


def render(results: dict) -> str:
    from criticalkv.bench.machine import header_lines

    lines = ["# criticalkv bench gpu-serve", ""]
    lines += [line.removeprefix("# ") + "  " for line in header_lines(results)]
    gpu = results.get("gpu")
    lines.append(f"GPU: {gpu['name']}, {gpu['memory_gib']:.0f} GiB" if gpu else "GPU: none (a CPU dry run: plumbing, "
                 "not a measurement)")
    w, m = results["workload"], results["model"]
    lines += [f"model: {m['name']} ({m['parameters'] / 1e9:.2f} B parameters, {m['dtype']}); budget {w['budget']} "
              f"entries per KV head; KV memory {w['kv_memory_gib']:.3g} GiB for every policy; {w['new_tokens']} new "
              f"tokens, questions of {w['question_tokens']} tokens",
              f"device copy bandwidth {results['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s; weights read per decode "
              f"step {results['weights_bytes_per_step'] / 2**30:.2f} GiB; run {results['elapsed_s']:.0f} s", ""]
    lines += ["## Targets", "", "| target | value | limit | met |", "|---|---|---|---|"]
    for t in results["targets"]:
        value = "not measured" if t["value"] is None else f"{t['value']:.3f}"
        met = "-" if t["met"] is None else ("yes" if t["met"] else "NO")
        lines.append(f"| {t['target']} | {value} | {t['limit']} | {met} |" + (f" {t['note']}" if t["note"] else ""))
    lines += ["", "## Cold requests (one at a time): TTFT and the selection", "",
              "| prompt | policy | rows | TTFT s | vs full | prefill s | selection s | selection runs on |",
              "|---|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        cold = r.get("cold")
        full = (_find(results, r["prompt_tokens"], "full") or {}).get("cold")
        if not cold:
            lines.append(f"| {r['prompt_tokens']} | {r['policy']} | {r.get('rows', '-')} | - | - | - | - | "
                         f"{r.get('skipped') or r.get('error') or '-'} |")
            continue
        ratio = f"{cold['ttft_s'] / full['ttft_s']:.3f}" if full else "-"
        sel = "-" if cold["selection_s"] is None else f"{cold['selection_s']:.3f}"
        lines.append(f"| {r['prompt_tokens']} | {r['policy']} | {r['rows']} | {cold['ttft_s']:.3f} | {ratio} | "
                     f"{cold['prefill_s']:.3f} | {sel} | {r['selection_kernels']} |")
    lines += ["", "## Served: one document, concurrent questions (ms; tokens/s)", "",
              "| prompt | policy | conc | rows | done | TTFT p50/p90/p99 | TPOT p50/p90/p99 | ITL p50/p90/p99 | "
              "output tok/s | vs full |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        for s in r.get("served", []):
            if not s.get("completed"):
                lines.append(f"| {r['prompt_tokens']} | {r['policy']} | {s['concurrency']} | {r['rows']} | 0 | "
                             f"{s.get('skipped') or ', '.join(s.get('errors') or []) or '-'} | | | | |")
                continue
            full = _served(_find(results, r["prompt_tokens"], "full"), s["concurrency"])
            ratio = f"{s['output_throughput'] / full['output_throughput']:.2f}" if full else "-"
            trio = lambda metric: "/".join(_ms(s, metric, p) for p in ("p50", "p90", "p99"))  # noqa: E731
            cut = " (cut)" if s.get("cut_by_time_limit") else ""
            lines.append(f"| {r['prompt_tokens']} | {r['policy']} | {s['concurrency']} | {r['rows']} | "
                         f"{s['finished']}/{s['requests']}{cut} | {trio('ttft_ms')} | {trio('tpot_ms')} | {trio('itl_ms')} "
                         f"| {s['output_throughput']:.1f} | {ratio} |")
    lines += ["", "## Decode step vs its memory floor", "",
              "| prompt | policy | rows | step ms | decode call ms | floor ms (kept K/V) | step / floor | "
              "floor ms (K/V the step reads: spans) |", "|---|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        s = r.get("step")
        if s:
            lines.append(f"| {r['prompt_tokens']} | {r['policy']} | {s['batch']} | {1e3 * s['step_s']:.2f} | "
                         f"{1e3 * s['decode_call_s']:.2f} | {1e3 * s['floor_s']:.2f} | {s['floor_ratio']:.2f} | "
                         f"{1e3 * s['read_floor_s']:.2f} |")
    lines += ["", "## kvpress (transformers + its press, batch 1)", ""]
    for k in results.get("kvpress", []):
        if "ttft_s" in k:
            lines.append(f"- {k['prompt_tokens']} tokens: {k['press']}: TTFT {k['ttft_s']:.3f} s, decode "
                         f"{k['decode_tokens_per_s']:.1f} tokens/s, {k['kept_tokens_per_head']} entries kept per head")
        else:
            lines.append(f"- {k['prompt_tokens']} tokens: {k.get('skipped') or k.get('error')}")
    if results["skipped"]:
        lines += ["", "Skipped: " + "; ".join(f"{s['policy']} at {s['prompt_tokens']} ({s['why']})"
                                              for s in results["skipped"])]
    return "\n".join(lines) + "\n"
