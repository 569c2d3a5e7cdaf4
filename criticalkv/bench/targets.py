"""The serving issue's targets, checked from the committed result files of one folder.

* output tokens/s of criticalkv b=256 >= 1.8x ``full`` at ISL 2048, OSL 64, concurrency 8;
* output tokens/s at concurrency 8 >= 2.5x concurrency 1 at ISL 512, OSL 256 (continuous batching);
* KV bytes per sequence kept / full = b / n for every policy (the server's kv_bytes_kept / kv_bytes_full);
* one request, ISL 2048, OSL 16: criticalkv on ONNX Runtime <= 0.5x kvpress's time, same run;
* AIPerf agrees with this load generator within 10 % (TTFT, TPOT / ITL, output tokens/s);
* a short request arriving during a long generation's decode gets its first token within 1.5x of its
  idle TTFT (medians, ``criticalkv bench interference``); the same request arriving during the long
  prompt's prefill is reported beside it (no goal: the prefill is not chunked, it waits).
"""

from __future__ import annotations

import json
from pathlib import Path

from criticalkv.bench.interference import summarize_cases


def _runs(folder: Path) -> list[dict]:
    runs = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        for run in data.get("runs", []):
            run = dict(run, file=path.name)
            runs.append(run)
    return runs


def _find(runs, policy, isl, osl, conc, budget=None):
    for r in runs:
        if (r["engine"]["policy"] == policy and r["isl"] == isl and r["osl"] == osl and r.get("concurrency") == conc
                and (budget is None or r["engine"].get("budget") == budget) and r["summary"].get("completed")):
            return r
    return None


def check(folder: Path) -> list[dict]:
    """One dict per target: name, measured, ratio, goal, met (None when the files lack the data)."""
    folder = Path(folder)
    runs = _runs(folder)
    out = []
    ckv, full = _find(runs, "criticalkv", 2048, 64, 8, 256), _find(runs, "full", 2048, 64, 8)
    if ckv and full:
        a, b = ckv["summary"]["output_throughput"], full["summary"]["output_throughput"]
        prof = {k: v.get("profile") for k, v in (("criticalkv", ckv), ("full", full))}
        out.append({"target": "ISL 2048 OSL 64 conc 8: criticalkv b=256 output tokens/s >= 1.8x full",
                    "measured": f"{a:.2f} vs {b:.2f} tokens/s", "ratio": a / b, "goal": 1.8, "met": a / b >= 1.8,
                    "profile": prof, "files": [ckv["file"], full["file"]]})
    for policy in ("criticalkv", "full", "snapkv", "ada-criticalkv"):
        one, eight = _find(runs, policy, 512, 256, 1), _find(runs, policy, 512, 256, 8)
        if one and eight:
            a, b = eight["summary"]["output_throughput"], one["summary"]["output_throughput"]
            out.append({"target": f"ISL 512 OSL 256 ({eight['engine']['label']}): conc 8 output tokens/s >= 2.5x conc 1",
                        "measured": f"{a:.2f} vs {b:.2f} tokens/s", "ratio": a / b, "goal": 2.5, "met": a / b >= 2.5,
                        "profile": {"conc 8": eight.get("profile"), "conc 1": one.get("profile")},
                        "files": [eight["file"], one["file"]]})
    seen = set()
    for r in runs:
        s = r["summary"]
        kept, fullb = (s.get("kv_mib_kept_per_seq") or {}).get("avg"), (s.get("kv_mib_full_per_seq") or {}).get("avg")
        key = (r["engine"]["label"], r["isl"])
        if kept is None or not fullb or key in seen or not s.get("completed"):
            continue
        seen.add(key)
        budget = r.get("kv_budget") or r["engine"].get("budget")
        expected = 1.0 if budget is None else min(budget, r["isl"]) / r["isl"]
        ratio = kept / fullb
        out.append({"target": f"KV bytes per sequence, {r['engine']['label']}, ISL {r['isl']}: kept / full = b / n",
                    "measured": f"{kept:.3f} of {fullb:.3f} MiB", "ratio": ratio, "goal": expected,
                    "met": abs(ratio - expected) <= 1e-3, "files": [r["file"]]})
    single = folder / "single_request.json"
    if single.is_file():
        s = json.loads(single.read_text())["single"]
        if "kvpress" in s["impls"]:
            a, b = s["impls"]["criticalkv"]["median_s"], s["impls"]["kvpress"]["median_s"]
            out.append({"target": f"single request ISL {s['isl']} OSL {s['new_tokens']}: criticalkv (ONNX Runtime) <= 0.5x kvpress",
                        "measured": f"{a:.2f} s vs {b:.2f} s (medians)", "ratio": a / b, "goal": 0.5, "met": a / b <= 0.5,
                        "files": [single.name]})
    cross = folder / "aiperf_crosscheck.json"
    if cross.is_file():
        c = json.loads(cross.read_text())["cross_check"]
        rows = [r for r in c["comparison"] if r["within"] is not None]
        worst = max(rows, key=lambda r: abs(r["ratio"] - 1.0)) if rows else None
        out.append({"target": f"AIPerf cross-check ({c['engine']}, ISL {c['isl']} OSL {c['osl']} conc {c['concurrency']}): within 10 %",
                    "measured": "; ".join(f"{r['what']}: {r['ratio']:.3f}" for r in rows),
                    "ratio": worst["ratio"] if worst else None, "goal": "0.9-1.1",
                    "met": all(r["within"] for r in rows) if rows else None, "files": [cross.name]})
    out += _interference_rows(folder)
    return out


def _interference_rows(folder: Path) -> list[dict]:
    """The rows of every ``criticalkv bench interference`` result of the folder (JSON with ``interference``
    settings and a ``summary``)."""
    rows = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        if not isinstance(data, dict) or "rounds" not in data or "summary" not in data:
            continue

        summary = summarize_cases(data["rounds"], data["settings"].get("goal", 1.5))  # from the raw rounds
        s, cases, t = data["settings"], summary["cases"], summary["target"]
        idle, dec, pre = (cases[c]["ttft_ms"] for c in ("idle", "decode", "prefill"))
        label = (data.get("engine") or {}).get("label", "?")
        where = (f"({path.stem}: {label}, short ISL {s['short_isl']} OSL {s['short_osl']}, long ISL {s['long_isl']} "
                 f"OSL {s['long_osl']})")

        def ms(d):
            return "-" if d["p50"] is None else f"{d['p50']:.0f} ms"

        rows.append({"target": f"short request during a long one's decode {where}: TTFT <= {t['goal']:g}x idle (medians)",
                     "measured": f"{ms(dec)} vs {ms(idle)} (p50 of {cases['decode']['used']} / {cases['idle']['used']}; "
                                 f"p90 ratio {_fmt(cases['decode'].get('ratio_p90'))}; same-round ratio p50 "
                                 f"{_fmt(cases['decode']['paired_ratio']['p50'])})",
                     "ratio": t["ratio"], "goal": t["goal"], "met": t["met"], "files": [path.name]})
        rows.append({"target": f"same, arriving during the long prompt's prefill {where} (not chunked: waits; no goal)",
                     "measured": f"{ms(pre)} vs {ms(idle)} (p50 of {cases['prefill']['used']} / {cases['idle']['used']}; "
                                 f"p90 ratio {_fmt(cases['prefill'].get('ratio_p90'))}; same-round ratio p50 "
                                 f"{_fmt(cases['prefill']['paired_ratio']['p50'])})",
                     "ratio": cases["prefill"].get("ratio_p50"), "goal": "-", "met": None, "files": [path.name]})
    return rows


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def render(rows: list[dict]) -> str:
    lines = ["| target | measured | ratio | goal | met |", "|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        goal = r["goal"] if isinstance(r["goal"], str) else f"{r['goal']:.4g}"
        met = "-" if r["met"] is None else ("met" if r["met"] else "NOT met")
        lines.append(f"| {r['target']} | {r['measured']} | {ratio} | {goal} | {met} |")
    for r in rows:
        for name, prof in (r.get("profile") or {}).items():
            if prof and prof.get("samples"):
                lines.append(f"- profile of {r['target'].split(':')[0]}, {name}: prefill {100 * prof['prefill_fraction']:.1f} %, "
                             f"decode {100 * prof['decode_fraction']:.1f} %, other {100 * prof['other_fraction']:.1f} % "
                             f"of {prof['samples']} py-spy samples ({prof['file']})")
    return "\n".join(lines) + "\n"
