"""The serving issues' targets, checked from the committed result files of one folder.

* output tokens/s of criticalkv b=256 >= 1.8x ``full`` at ISL 2048, OSL 64, concurrency 8;
* output tokens/s at concurrency 8 >= 2.5x concurrency 1 at ISL 512, OSL 256 (continuous batching);
* KV bytes per sequence kept / full = b / n for every policy (the server's kv_bytes_kept / kv_bytes_full);
* one request, ISL 2048, OSL 16: criticalkv on ONNX Runtime <= 0.5x kvpress's time, same run;
* AIPerf agrees with this load generator within 10 % (TTFT, TPOT / ITL, output tokens/s);
* a short request arriving during a long generation's decode gets its first token within 1.5x of its
  idle TTFT (medians, ``python -m benchmarks.interference``); arriving during the long prompt's prefill, within
  2x with chunked prefill (each chunk size of the file its own row; not chunked: reported, no goal);
* ``docqa`` (D 16, Q 8, ISL 2048, concurrency 8, KV memory of 4 uncompressed contexts): criticalkv output
  tokens/s >= 3x ``full`` and TTFT p50 <= 0.25x ``full``;
* memory-bound decode (``criticalkv bench memory``: ISL 2048, OSL 256, KV memory of 2 full sequences): criticalkv output
  tokens/s >= 1.4x ``full``;
* a question after a cached context (``python -m benchmarks.cached``: ISL 2048 context, 32-token question): TTFT <= 0.1x
  the same request uncached.

A result of another workload than a target's is still listed, with "-" for met.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import benchmarks
from criticalkv.bench import report


def _results(folder: Path, benchmark: str) -> list[tuple[Path, dict]]:
    """(path, content) of every JSON of ``folder`` written by ``criticalkv bench BENCHMARK`` (its ``benchmark`` key)."""
    out = []
    for path in sorted(Path(folder).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(data, dict) and data.get("benchmark") == benchmark:
            out.append((path, data))
    return out


def _runs(folder: Path) -> list[dict]:
    """The runs of every ``bench serve`` result of the folder (files of the other benchmarks, which name themselves
    in a ``benchmark`` key, are not serve runs)."""
    runs = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        if not isinstance(data, dict) or data.get("benchmark", "serve") != "serve":
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
    out += _docqa_rows(folder) + _memory_rows(folder) + _cached_rows(folder)
    return out


def _docqa_rows(folder: Path) -> list[dict]:
    from criticalkv.bench import docqa

    rows = []
    for path, data in _results(folder, "docqa"):
        s = data["settings"]
        where = (f"({path.stem}: D {s['docs']} x Q {s['questions']}, ISL {s['isl']}, OSL {s['osl']}, conc "
                 f"{s['concurrency']}, KV memory {_fmt(s.get('kv_memory_mib'), 0)} MiB)")
        by_label = {r["engine"]["label"]: r for r in data["runs"]}
        for t in docqa.targets(data):
            row = next(r for r in data["versus_full"] if r["engine"] == t["engine"])
            key = "output_throughput" if "tokens/s" in t["what"] else "ttft_p50_ms"
            unit = "tokens/s" if key == "output_throughput" else "ms"
            hits = [by_label[x]["docqa"]["hit_rate"] for x in (row["engine"], row["base"])]
            rows.append({"target": f"docqa {where}: {t['engine']} {t['what']}",
                         "measured": f"{_fmt(row[key]['value'])} vs {_fmt(row[key]['base'])} {unit}; hit rate "
                                     f"{_pct(hits[0])} vs {_pct(hits[1])}",
                         "ratio": t["ratio"], "goal": t["goal"], "met": t["met"], "files": [path.name]})
    return rows


def _memory_rows(folder: Path) -> list[dict]:
    from criticalkv.bench import memory

    rows = []
    for path, data in _results(folder, "memory"):
        s = data["settings"]
        where = f"({path.stem}: ISL {s['isl']}, OSL {s['osl']}, conc {s['concurrency']}, {s['kv_memory_note']})"
        for t in memory.targets(data):
            row = next(r for r in data["versus_full"] if r["engine"] == t["engine"])
            rows.append({"target": f"memory-bound decode {where}: {t['engine']} {t['what']}",
                         "measured": f"{_fmt(row['output_throughput']['value'])} vs {_fmt(row['output_throughput']['base'])} "
                                     f"tokens/s; sequences decoding (mean) {_fmt(row['decoding_mean']['value'])} vs "
                                     f"{_fmt(row['decoding_mean']['base'])}",
                         "ratio": t["ratio"], "goal": t["goal"], "met": t["met"], "files": [path.name]})
    return rows


def _cached_rows(folder: Path) -> list[dict]:
    from benchmarks import cached

    rows = []
    for path, data in _results(folder, "cached-context"):
        s = data["settings"]
        target = cached.is_target_workload(s)
        for run in data["runs"]:
            if not run.get("rounds"):
                continue
            c = cached.summarize_rounds(run["rounds"], s.get("goal", cached.TARGET_RATIO))  # from the raw rounds
            goal = c["target"]["goal"]
            rows.append({"target": f"cached context ({path.stem}: {run['engine']['label']}, ISL {s['isl']} context, "
                                   f"{s['question_tokens']}-token question): TTFT <= {goal:g}x uncached (medians)",
                         "measured": f"{_fmt(c['cached']['p50'])} vs {_fmt(c['uncached']['p50'])} ms (p50 of {c['used']} "
                                     f"rounds; same-round ratio p50 {_fmt(c['paired_ratio']['p50'], 3)})",
                         "ratio": c["ratio_p50"], "goal": goal, "met": c["target"]["met"] if target else None,
                         "files": [path.name]})
    return rows


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _interference_rows(folder: Path) -> list[dict]:
    """The rows of every ``python -m benchmarks.interference`` result of the folder (a JSON with ``variants``, one per
    prefill chunk size, or, written before chunked prefill, ``rounds`` and a ``summary``): per chunk size, the decode
    target and the prefill case (a target when the prefill was chunked)."""
    from benchmarks.interference import summarize_cases, variants

    rows = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        if not isinstance(data, dict) or "settings" not in data or not ("variants" in data or "rounds" in data):
            continue
        s = data["settings"]
        for v in variants(data):
            if not v.get("rounds"):
                continue
            chunk = v.get("prefill_chunk")
            summary = summarize_cases(v["rounds"], s.get("goal", 1.5), chunk, s.get("prefill_goal", 2.0))  # raw rounds
            cases, t, pt = summary["cases"], summary["target"], summary["prefill_target"]
            idle, dec, pre = (cases[c]["ttft_ms"] for c in ("idle", "decode", "prefill"))
            label = (v.get("engine") or {}).get("label", "?")
            chunk_note = "" if "variants" not in data else \
                (", prefill not chunked" if chunk == 0 else f", prefill chunk {chunk}" if chunk else ", prefill chunk ?")
            where = (f"({path.stem}: {label}{chunk_note}, short ISL {s['short_isl']} OSL {s['short_osl']}, long ISL "
                     f"{s['long_isl']} OSL {s['long_osl']})")

            def ms(d):
                return "-" if d["p50"] is None else f"{d['p50']:.0f} ms"

            rows.append({"target": f"short request during a long one's decode {where}: TTFT <= {t['goal']:g}x idle (medians)",
                         "measured": f"{ms(dec)} vs {ms(idle)} (p50 of {cases['decode']['used']} / {cases['idle']['used']}; "
                                     f"p90 ratio {_fmt(cases['decode'].get('ratio_p90'))}; same-round ratio p50 "
                                     f"{_fmt(cases['decode']['paired_ratio']['p50'])})",
                         "ratio": t["ratio"], "goal": t["goal"], "met": t["met"], "files": [path.name]})
            measured = (f"{ms(pre)} vs {ms(idle)} (p50 of {cases['prefill']['used']} / {cases['idle']['used']}; "
                        f"p90 ratio {_fmt(cases['prefill'].get('ratio_p90'))}; same-round ratio p50 "
                        f"{_fmt(cases['prefill']['paired_ratio']['p50'])})")
            if pt["goal"] is None:
                rows.append({"target": f"same, arriving during the long prompt's prefill {where} (not chunked: waits; no goal)",
                             "measured": measured, "ratio": pt["ratio"], "goal": "-", "met": None, "files": [path.name]})
            else:
                rows.append({"target": f"short request during a long one's prefill {where}: TTFT <= {pt['goal']:g}x idle "
                                       "(medians)", "measured": measured, "ratio": pt["ratio"], "goal": pt["goal"],
                             "met": pt["met"], "files": [path.name]})
    return rows


def _fmt(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


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


def main(argv=None) -> int:
    """Check the targets of a results folder: writes FOLDER/targets.md and FOLDER/summary.png, prints the table."""
    p = argparse.ArgumentParser(prog=benchmarks.prog("targets"), description=benchmarks.plain(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path, nargs="?", default=Path("results/benchmarks/serving"),
                   help="results folder (default: results/benchmarks/serving); writes FOLDER/targets.md and "
                        "FOLDER/summary.png (every serving run of the folder)")
    args = p.parse_args(argv)
    if not args.folder.is_dir():
        raise FileNotFoundError(f"{args.folder}: no such folder")
    text = render(check(args.folder))
    report.write_atomic(args.folder / "targets.md", text)
    runs = _runs(args.folder)
    if any(r["summary"].get("completed") for r in runs):  # every serving run of the folder in one figure
        report.plot({"runs": runs}, args.folder / "summary.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(benchmarks.run("targets", main))
