"""Tables, CSV, target checks and figures of a serving benchmark, from its JSON alone."""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from pathlib import Path

from criticalkv.bench.machine import header_lines
from criticalkv.bench.metrics import LATENCY_METRICS, PERCENTILES


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def add_out_argument(p, default: str) -> None:
    """``--out STEM``: where a benchmark's files go, ``STEM.json``, ``STEM.md`` and the like (one option instead of a
    folder and a file stem). ``args.out`` is the stem as a ``Path``."""
    p.add_argument("--out", type=Path, default=Path(default), metavar="STEM",
                   help=f"results as STEM.json, STEM.md, ... (folders created) (default: {default})")


def write_results(stem: Path, results: dict, table: str) -> None:
    """``STEM.json`` (the results) and ``STEM.txt`` (the printed table), each written whole or not at all."""
    stem = Path(stem)
    write_atomic(stem.with_suffix(".json"), json.dumps(results, indent=2) + "\n")
    write_atomic(stem.with_suffix(".txt"), table + "\n")


def load_label(run: dict) -> str:
    if run.get("concurrency") is not None:
        return f"conc {run['concurrency']}"
    cap = f", max {run['max_concurrency']}" if run.get("max_concurrency") else ""
    return f"rate {run['request_rate']}/s{cap}"


def _f(x, digits=1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


# ---------------------------------------------------------------------- CSV
def csv_rows(results: dict) -> list[dict]:
    rows = []
    for run in results["runs"]:
        s = run["summary"]
        row = {"engine": run["engine"]["label"], "policy": run["engine"]["policy"], "budget": run["engine"]["budget"],
               "isl": run["isl"], "osl": run["osl"], "concurrency": run.get("concurrency"),
               "request_rate": run.get("request_rate"), "kv_budget": run.get("kv_budget"),
               "completed": s.get("completed"), "failed": s.get("failed"), "duration_s": s.get("duration_s"),
               "request_throughput": s.get("request_throughput"), "output_throughput": s.get("output_throughput"),
               "per_user_output_throughput": s.get("per_user_output_throughput"),
               "per_user_output_speed": s.get("per_user_output_speed")}
        for metric in LATENCY_METRICS:
            d = s.get(f"{metric}_ms") or {}
            for stat in ("avg", *(f"p{p}" for p in PERCENTILES)):
                row[f"{metric}_{stat}_ms"] = d.get(stat)
        row["output_tokens_avg"] = (s.get("output_tokens") or {}).get("avg")
        row["kv_mib_kept_per_seq"] = (s.get("kv_mib_kept_per_seq") or {}).get("avg")
        row["kv_mib_full_per_seq"] = (s.get("kv_mib_full_per_seq") or {}).get("avg")
        row["kv_mib_kept_peak_in_flight"] = s.get("kv_mib_kept_peak_in_flight")
        row["server_peak_rss_mib"] = run.get("server_peak_rss_mib")
        rows.append(row)
    return rows


def to_csv(results: dict) -> str:
    rows = csv_rows(results)
    if not rows:
        return ""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


# ---------------------------------------------------------------------- text
def run_block(run: dict) -> list[str]:
    """trtllm-bench's overview fields for one run."""
    s = run["summary"]
    head = (f"## {run['engine']['label']} | ISL {run['isl']} OSL {run['osl']} | {load_label(run)}"
            + (f" | kv_budget {run['kv_budget']}" if run.get("kv_budget") else ""))
    if not s.get("completed"):
        return [head, f"all {s.get('failed')} requests failed: {run.get('first_error')}", ""]
    out_tok = s["output_tokens"]
    lines = [
        head,
        f"completed {s['completed']}, failed {s['failed']}, duration {s['duration_s']:.2f} s, "
        f"output tokens per request {out_tok['min']:.0f}-{out_tok['max']:.0f}"
        + ("" if run.get("osl_exact") else f" (NOT all {run['osl']}: see finish reasons)")
        + ("" if run.get("isl_exact") in (True, None) else f"; input tokens NOT all {run['isl']}"),
        f"Request throughput (req/s):              {_f(s['request_throughput'], 3)}",
        f"Output token throughput (tokens/s):      {_f(s['output_throughput'], 2)}",
        f"Per-user output throughput [w/ ctx] (tokens/s/user): {_f(s['per_user_output_throughput'], 2)}",
        f"Per-user output speed [1/TPOT] (tokens/s/user):      {_f(s['per_user_output_speed'], 2)}",
        "| ms | avg | p50 | p90 | p95 | p99 |",
        "|---|---|---|---|---|---|",
    ]
    for metric, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("latency", "request latency")):
        d = s[f"{metric}_ms"]
        lines.append(f"| {name} | " + " | ".join(_f(d[k]) for k in ("avg", "p50", "p90", "p95", "p99")) + " |")
    kept, full = s["kv_mib_kept_per_seq"], s["kv_mib_full_per_seq"]
    lines.append(f"KV MiB per sequence kept {_f(kept['avg'], 2)} of full {_f(full['avg'], 2)}; "
                 f"kept in flight at peak {_f(s['kv_mib_kept_peak_in_flight'], 2)} MiB "
                 f"({s['peak_requests_in_flight']} requests); server peak RSS {_f(run.get('server_peak_rss_mib'), 0)} MiB")
    prof = run.get("profile")
    if prof and prof.get("samples"):
        lines.append(f"server profile (py-spy, {prof['samples']} samples of active threads, {prof['file']}): prefill "
                     f"{100 * prof['prefill_fraction']:.1f} %, decode {100 * prof['decode_fraction']:.1f} %, "
                     f"other {100 * prof['other_fraction']:.1f} %")
    return lines + [""]


def comparisons(results: dict) -> list[dict]:
    """Output-throughput ratios: each engine vs ``full`` (same workload), each load vs concurrency 1."""
    out = []
    runs = [r for r in results["runs"] if r["summary"].get("completed")]
    key = lambda r: (r["isl"], r["osl"], r.get("concurrency"), r.get("request_rate"), r.get("kv_budget"))
    full = {key(r): r for r in runs if r["engine"]["policy"] == "full"}
    for r in runs:
        base = full.get(key(r))
        if base is not None and base is not r:
            out.append({"kind": "vs full", "engine": r["engine"]["label"], "isl": r["isl"], "osl": r["osl"],
                        "load": load_label(r), "value": r["summary"]["output_throughput"],
                        "base": base["summary"]["output_throughput"],
                        "ratio": r["summary"]["output_throughput"] / base["summary"]["output_throughput"]})
    single = {(r["engine"]["label"], r["isl"], r["osl"], r.get("kv_budget")): r for r in runs if r.get("concurrency") == 1}
    for r in runs:
        base = single.get((r["engine"]["label"], r["isl"], r["osl"], r.get("kv_budget")))
        if base is not None and base is not r and r.get("concurrency"):
            out.append({"kind": "vs conc 1", "engine": r["engine"]["label"], "isl": r["isl"], "osl": r["osl"],
                        "load": load_label(r), "value": r["summary"]["output_throughput"],
                        "base": base["summary"]["output_throughput"],
                        "ratio": r["summary"]["output_throughput"] / base["summary"]["output_throughput"]})
    return out


def kv_rows(results: dict) -> list[dict]:
    """KV bytes per sequence kept / full against budget / prompt length, per engine and ISL."""
    rows, seen = [], set()
    for r in results["runs"]:
        s = r["summary"]
        if not s.get("completed") or (s.get("kv_mib_kept_per_seq") or {}).get("avg") is None:
            continue
        budget = r.get("kv_budget") or r["engine"]["budget"]
        k = (r["engine"]["label"], r["isl"], budget)
        if k in seen:
            continue
        seen.add(k)
        kept, full = s["kv_mib_kept_per_seq"]["avg"], s["kv_mib_full_per_seq"]["avg"]
        expected = 1.0 if budget is None else min(budget, r["isl"]) / r["isl"]
        rows.append({"engine": r["engine"]["label"], "isl": r["isl"], "budget": budget, "kept_mib": kept,
                     "full_mib": full, "ratio": kept / full if full else None, "expected": expected})
    return rows


def render(results: dict) -> str:
    lines = header_lines(results)
    lines += [f"# server: {results.get('server_note', '')}", ""]
    for run in results["runs"]:
        lines += run_block(run)
    comps = comparisons(results)
    if comps:
        lines += ["## output tokens/s ratios", "| engine | ISL | OSL | load | comparison | tokens/s | base | ratio |",
                  "|---|---|---|---|---|---|---|---|"]
        for c in comps:
            lines.append(f"| {c['engine']} | {c['isl']} | {c['osl']} | {c['load']} | {c['kind']} | {c['value']:.2f} | "
                         f"{c['base']:.2f} | {c['ratio']:.2f}x |")
        lines.append("")
    kv = kv_rows(results)
    if kv:
        lines += ["## KV cache per sequence (server's kv_bytes_kept / kv_bytes_full)",
                  "| engine | ISL | budget | kept MiB | full MiB | kept / full | budget / ISL |", "|---|---|---|---|---|---|---|"]
        for k in kv:
            lines.append(f"| {k['engine']} | {k['isl']} | {k['budget'] or '-'} | {k['kept_mib']:.3f} | {k['full_mib']:.3f} | "
                         f"{_f(k['ratio'], 4)} | {k['expected']:.4f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- figures
def plot(results: dict, path: Path) -> None:
    import matplotlib  # optional (the eval / bench extras): needed only for figures

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in results["runs"] if r["summary"].get("completed")]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    # 1. output throughput vs concurrency, one line per engine and (ISL, OSL)
    ax = axes[0]
    series: dict = {}
    for r in runs:
        if r.get("concurrency") is not None:
            series.setdefault((r["engine"]["label"], r["isl"], r["osl"]), []).append(
                (r["concurrency"], r["summary"]["output_throughput"]))
    for (label, isl, osl), pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{label}, {isl}/{osl}")
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput vs concurrency (ISL/OSL)")
    ax.legend(fontsize=7)
    # 2. TTFT and TPOT p50 vs ISL at the lowest concurrency of each engine
    ax = axes[1]
    lat: dict = {}
    for r in runs:
        c = r.get("concurrency") or 0
        lat.setdefault((r["engine"]["label"], c), []).append((r["isl"], r["summary"]["ttft_ms"]["p50"], r["summary"]["tpot_ms"]["p50"]))
    for (label, c), pts in sorted(lat.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"TTFT {label}, conc {c}")
        ax.plot([p[0] for p in pts], [p[2] for p in pts], "s--", label=f"TPOT {label}, conc {c}")
    ax.set_xlabel("input tokens (ISL)")
    ax.set_ylabel("ms (p50)")
    ax.set_yscale("log")
    ax.set_title("TTFT and TPOT vs input length")
    ax.legend(fontsize=6)
    # 3. KV MiB per sequence kept and full, per engine and ISL (ordered by budget)
    ax = axes[2]
    kv = sorted(kv_rows(results), key=lambda k: (k["isl"], k["budget"] or 10**9, k["engine"]))
    if kv:
        xs = range(len(kv))
        ax.bar(xs, [k["full_mib"] for k in kv], color="lightgray", label="full cache")
        ax.bar(xs, [k["kept_mib"] for k in kv], color="tab:blue", label="kept")
        for x, k in zip(xs, kv):
            ax.text(x, k["kept_mib"], f"{k['kept_mib'] / k['full_mib']:.3f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(xs), [f"{k['engine']}\nISL {k['isl']}" for k in kv], fontsize=6, rotation=30)
        ax.legend(fontsize=7)
    ax.set_ylabel("KV MiB per sequence")
    ax.set_title("KV cache kept per sequence (kept / full)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_all(results: dict, stem: Path, figures: bool = True) -> None:
    """stem.json, stem.csv, stem.txt and (``figures``) stem.png, each written atomically."""
    write_atomic(stem.with_suffix(".json"), json.dumps(results, indent=1) + "\n")
    write_atomic(stem.with_suffix(".csv"), to_csv(results))
    write_atomic(stem.with_suffix(".txt"), render(results))
    if figures and any(r["summary"].get("completed") for r in results["runs"]):
        plot(results, stem.with_suffix(".png"))
