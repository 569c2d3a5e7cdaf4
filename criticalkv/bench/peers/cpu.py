"""criticalkv's ONNX Runtime engines against the CPU runtimes a user would pick instead, on the same token ids,
interleaved in one run, with this CPU's GEMM rate and read bandwidth measured in the same run.

    criticalkv bench setup-peers --peers onnxruntime-genai,openvino     # once: .peers/ (git-ignored), ~3 GB
    criticalkv bench peers --engine-dir engines/full --engine-dir engines/ckv256

Build the engines for batches of 8 prompts of 2k tokens, e.g.
``python scripts/build_engine.py --kv-policy criticalkv --budget 256 --max-input-len 2048 --max-batch-size 8
--output engines/ckv256`` (and ``--kv-policy full`` for ``engines/full``).

Systems (each in its own process: criticalkv's engines through ``criticalkv.bench.peers.engine_worker``, each peer in its
virtual environment through ``criticalkv/bench/peers/cpu_runner.py``, which imports nothing from criticalkv):

* criticalkv: ``Engine.generate`` of every ``--engine-dir`` on every ``--backends`` (stop tokens off; one engine per
  process, ``criticalkv.bench.peers.engine_worker``): ONNX Runtime in the forms the engine runs by default (the fused prompt
  and decode graphs, with the weights it was built with: ``--weights fp32|int8|int4``; a row is named by its weights
  when they are not fp32), OpenVINO with the engine's openvino graphs at the CPU plugin's default precision (``on
  OpenVINO (bf16)`` where the CPU has BF16); and of every ``--portable-engine-dir`` with its portable graphs
  (``prefill.onnx``, ``decode.onnx``: fp32, the Loop attention) on ONNX Runtime;
* onnxruntime-genai 0.18: its model builder's fp32 CPU export of the same Hugging Face folder
  (``python -m onnxruntime_genai.models.builder -i HF -o OUT -p fp32 -e cpu``), one ``Generator``;
* OpenVINO GenAI 2026.4: ``optimum-cli export openvino --weight-format fp32 --task text-generation-with-past``
  (fp32 weights; its KV cache is f16 by default), prefix caching off, once with its CPU plugin's default compute
  precision (bf16 on CPUs with BF16, even for fp32 weights) and once with ``INFERENCE_PRECISION_HINT=f32``
  (``--ov-precision``); ``LLMPipeline`` for one request, ``ContinuousBatchingPipeline``
  for the batch, without and with ``CacheEvictionConfig`` (``--ov-eviction START,RECENT,MAX``, default 32,96,256:
  block-wise eviction to about the criticalkv budget, during decoding only).

The exports are written once under ``PEERS_DIR/models/`` (their commands are recorded). Workload: one chat-wrapped
prompt of exactly ``--isl`` tokens (prefill seconds, decode ms per token, ``--new-tokens`` greedy tokens), then
``--batch`` different prompts of the same length together (output tokens per second over the whole call, prefill
included). After one warm-up round, ``--repeats`` rounds run every system once each, in a rotated order; the table
gives medians. Nothing is installed by this command: without a peer's environment it stops and says which
``setup-peers`` command creates it. Timings are only comparable on an idle machine: the load average is recorded.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from criticalkv.bench.peers.engine_worker import label
from criticalkv.bench.peers import peer_python, peer_ready

RUNNER = Path(__file__).with_name("cpu_runner.py")
CPU_PEERS = ("onnxruntime-genai", "openvino")
#: OpenVINO's CacheEvictionConfig (start_size, recent_size, max_cache_size) by default: ~the b=256 budget.
DEFAULT_EVICTION = (32, 96, 256)
LABELS = {"onnxruntime-genai": "onnxruntime-genai (model builder, fp32)",
          "openvino": "OpenVINO GenAI (fp32 export"}
#: OpenVINO compute precisions run by default: its CPU default (bf16 on CPUs with BF16, even for fp32 weights) and f32.
OV_PRECISIONS = ("default", "f32")


def ov_label(precision: str | None) -> str:
    """OpenVINO's row: the compute precision the runner reported (``bf16`` where its CPU default is bf16)."""
    return f"{LABELS['openvino']}, {precision or '?'} compute)"


#: What a criticalkv row's label says when the engine ran on the OpenVINO backend (``engine_worker.label``).
ON_OPENVINO = " on OpenVINO"


def weights_of(label_: str) -> str:
    """The weight setting a criticalkv row's label names (``label``)."""
    return next((w for w in ("int8", "int4") if f" {w}" in label_), "fp32")


def parse_eviction(text: str) -> dict:
    """``"START,RECENT,MAX"`` -> OpenVINO's CacheEvictionConfig sizes (tokens; MAX > START + RECENT)."""
    try:
        start, recent, most = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--ov-eviction: expected START,RECENT,MAX (three integers), got {text!r}") from None
    if min(start, recent) < 1 or most <= start + recent:
        raise ValueError(f"--ov-eviction: need START, RECENT >= 1 and MAX > START + RECENT, got {text!r}")
    return {"start_size": start, "recent_size": recent, "max_cache_size": most}


def parse_peers(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in CPU_PEERS]
    if unknown:
        raise ValueError(f"--peers: unknown {', '.join(unknown)} (choose from {', '.join(CPU_PEERS)})")
    return names


#: The criticalkv backends ``bench peers`` runs engines on (``--backends``).
ENGINE_BACKENDS = ("onnxruntime", "openvino")


def parse_backends(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    bad = [n for n in names if n not in ENGINE_BACKENDS]
    if bad or not names:
        raise ValueError(f"--backends: expected a comma-separated subset of {','.join(ENGINE_BACKENDS)}, got {text!r}")
    return names


def parse_precisions(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    bad = [n for n in names if n not in OV_PRECISIONS]
    if bad or not names:
        raise ValueError(f"--ov-precision: expected a comma-separated subset of {','.join(OV_PRECISIONS)}, got {text!r}")
    return names


def check_ready(root: Path, names: list[str]) -> None:
    """Raise with the command that creates the missing peer environments."""
    missing = [n for n in names if not peer_ready(root, n)]
    if missing:
        raise FileNotFoundError(
            f"peer environment(s) {', '.join(missing)} missing under {root}: create them with "
            f"`criticalkv bench setup-peers --peers {','.join(missing)} --peers-dir {root}` (or pass --peers without them)")


# ---------------------------------------------------------------------------------------------- exports
def export_command(root: Path, name: str, model_dir: Path, out: Path) -> list[str]:
    """The command that exports ``model_dir`` (a Hugging Face folder) for peer ``name`` into ``out``."""
    py = str(peer_python(root, name))
    if name == "onnxruntime-genai":
        return [py, "-m", "onnxruntime_genai.models.builder", "-i", str(model_dir), "-o", str(out), "-p", "fp32",
                "-e", "cpu", "-c", str(out) + ".cache"]
    if name == "openvino":
        return [str(Path(py).with_name("optimum-cli")), "export", "openvino", "--model", str(model_dir), "--weight-format",
                "fp32", "--task", "text-generation-with-past", str(out)]
    raise ValueError(f"unknown CPU peer {name!r}")


def ensure_export(root: Path, name: str, model_dir: Path, log=print) -> tuple[Path, list[str]]:
    """The peer's export of ``model_dir`` under ``root/models`` (made once, atomically: temp folder + rename)."""
    import shutil

    target = Path(root) / "models" / f"{name}-{model_dir.name}"
    command = export_command(root, name, model_dir, target)
    if (target / ".criticalkv-exported").is_file():
        return target, command
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    command_tmp = export_command(root, name, model_dir, tmp)
    log(f"{name}: exporting {model_dir} ({' '.join(command)}) ...")
    run = subprocess.run(command_tmp, capture_output=True, text=True)
    shutil.rmtree(str(tmp) + ".cache", ignore_errors=True)
    if run.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"{name}: export failed:\n{(run.stderr or run.stdout)[-3000:]}")
    (tmp / ".criticalkv-exported").write_text(" ".join(command) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target, command


# ---------------------------------------------------------------------------------------------- workers
class WorkerProcess:
    """A worker process speaking JSON lines over stdin/stdout (``cpu_runner.py`` in a peer's environment,
    ``criticalkv.bench.peers.engine_worker`` for a criticalkv engine): one system per process."""

    def __init__(self, name: str, command: list[str], log: Path):
        self.name = name
        self.log = log  # the worker's own messages, quoted when it fails
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        self.load_s = self._read()["load_s"]
        self.info = self.request({"op": "info"})
        self.versions = self.info.get("versions")

    def _exited(self) -> RuntimeError:
        """The error for a worker that is gone: its exit status (a SIGKILL is most often the kernel's OOM killer: the
        workers of one run share the machine's memory) and the end of its log."""
        status = self.proc.wait()
        why = " (SIGKILL: most often the kernel's out-of-memory killer; run fewer systems at once)" if status == -9 else ""
        tail = self.log.read_text(errors="replace")[-3000:] if self.log.is_file() else ""
        return RuntimeError(f"{self.name} exited (status {status}{why}); {self.log}:\n{tail}")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise self._exited()
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"{self.name}: {answer['error']}")
        return answer

    def request(self, message: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # the worker died since its last answer
            raise self._exited() from None
        return self._read()

    def single(self, ids, new_tokens: int) -> dict:
        return self.request({"op": "single", "ids": list(ids), "new_tokens": new_tokens})

    def batch(self, prompts, new_tokens: int, eviction=None) -> dict:
        return self.request({"op": "batch", "prompts": [list(p) for p in prompts], "new_tokens": new_tokens,
                             "eviction": eviction})

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


class CriticalKVWorker(WorkerProcess):
    """A criticalkv engine on one backend in its own process (``criticalkv.bench.peers.engine_worker``)."""

    def __init__(self, root: Path, engine_dir: Path, backend: str = "onnxruntime", portable: bool = False):
        command = [sys.executable, "-m", "criticalkv.bench.peers.engine_worker", "--engine-dir", str(engine_dir),
                   "--backend", backend] + (["--portable"] if portable else [])
        stem = f"criticalkv-{Path(engine_dir).name}-{backend}{'-portable' if portable else ''}"
        super().__init__(stem, command, Path(root) / "logs" / f"{stem}.log")
        self.label, self.weight_bytes, self.weights = self.info["label"], self.info["weight_bytes"], self.info["weights"]


class PeerWorker(WorkerProcess):
    """A ``cpu_runner.py`` process in the peer's virtual environment."""

    def __init__(self, root: Path, name: str, model: Path, cache_gb: int = 1, precision: str = "default"):
        super().__init__(name, [str(peer_python(root, name)), str(RUNNER), "--impl", name, "--model", str(model),
                                "--cache-gb", str(cache_gb), "--precision", precision],
                         Path(root) / "logs" / f"{name}.log")
        self.label, self.precision = LABELS[name], self.info.get("precision")
        if name == "openvino":
            self.label = ov_label(self.precision)


def _display(command: list[str]) -> str:
    """A command for the results: the home directory as ``~`` (no machine's absolute paths in result files)."""
    home = str(Path.home())
    return " ".join(("~" + a[len(home):]) if a.startswith(home + os.sep) else a for a in command)


# ---------------------------------------------------------------------------------------------- the run
def workload(tokenizer, isl: int, batch: int, seed: int = 0) -> tuple[list[int], list[list[int]]]:
    """One chat-wrapped prompt of exactly ``isl`` tokens and ``batch`` other ones of the same length."""
    from criticalkv.bench.peers import chat_ids, text_for_chat_length

    single = chat_ids(tokenizer, text_for_chat_length(tokenizer, isl, seed))
    prompts = [chat_ids(tokenizer, text_for_chat_length(tokenizer, isl, seed + 100 + 10 * i)) for i in range(batch)]
    return single, prompts


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run(engine_dirs: list[Path], peers: list[str], root: Path, isl: int = 2025, new_tokens: int = 64, batch: int = 8,
        repeats: int = 2, eviction: dict | None = None, model=None, seed: int = 0, ov_precisions=OV_PRECISIONS,
        log=print, portable_dirs: list[Path] = (), backends=("onnxruntime",)) -> dict:
    """Every system on the same ids, interleaved, each in its own process; returns the raw runs, medians and the
    floors. ``backends``: the criticalkv backends every engine of ``engine_dirs`` runs on (a row each);
    ``portable_dirs``: engines run with their portable graphs on ONNX Runtime (rows beside their default forms)."""
    from transformers import AutoTokenizer

    from criticalkv.bench import floors
    from criticalkv.hf.loading import resolve_model
    from criticalkv.runtime.manifest import read_manifest

    check_ready(root, peers)
    eviction = eviction or dict(zip(("start_size", "recent_size", "max_cache_size"), DEFAULT_EVICTION))
    model_dir = resolve_model(model)
    manifest = read_manifest(Path(engine_dirs[0]), verify=False)
    tokenizer = AutoTokenizer.from_pretrained(Path(engine_dirs[0]) / "tokenizer")
    ids, prompts = workload(tokenizer, isl, batch, seed)
    exports = {name: ensure_export(root, name, model_dir, log) for name in peers}
    log("floors (GEMM rate, GEMV bandwidth) ...")
    out = {"isl": isl, "new_tokens": new_tokens, "batch": batch, "repeats": repeats, "model": model_dir.name,
           "eviction": eviction, "floors_start": floors.measure(manifest["model"]["spec"], isl),
           "exports": {n: _display(c) for n, (_, c) in exports.items()}, "systems": {}}
    workers = {}
    try:
        for d, backend, portable in ([(d, b, False) for d in engine_dirs for b in backends]
                                     + [(d, "onnxruntime", True) for d in portable_dirs]):
            w = CriticalKVWorker(root, Path(d), backend, portable)
            workers[w.label] = w
        for name in peers:
            for precision in (ov_precisions if name == "openvino" else ["default"]):
                w = PeerWorker(root, name, exports[name][0], precision=precision)
                workers[w.label] = w
        jobs = [(label, "single", None) for label in workers]
        jobs += [(label, "batch", None) for label in workers]
        jobs += [(label, "batch", eviction) for label, w in workers.items() if getattr(w, "name", None) == "openvino"]
        records = {label: {"load_s": w.load_s, "single": [], "batch": [], "batch_eviction": [],
                           "versions": getattr(w, "versions", None), "weight_bytes": getattr(w, "weight_bytes", None)}
                   for label, w in workers.items()}
        log("warm-up round ...")
        short = [p[-256:] for p in prompts]
        for label, w in workers.items():
            w.single(ids[-256:], 4)
            w.batch(short, 4)
        for r in range(repeats):
            shift = r % len(jobs)
            for label, kind, evict in jobs[shift:] + jobs[:shift]:
                start = time.perf_counter()
                if kind == "single":
                    result = workers[label].single(ids, new_tokens)
                else:
                    result = workers[label].batch(prompts, new_tokens, evict)
                result["load_average"] = list(os.getloadavg())
                key = "single" if kind == "single" else ("batch_eviction" if evict else "batch")
                records[label][key].append(result)
                log(f"round {r + 1}/{repeats} {label} {key}: {time.perf_counter() - start:.1f} s")
    finally:
        for w in workers.values():
            w.close()
    # after the workers are gone: with two engines' batch-of-8 prefill arenas and four peer processes resident, the
    # floors' own matrices once pushed a 24 GB machine into the OOM killer, losing the whole run
    workers.clear()
    gc.collect()
    out["floors_end"] = floors.measure(manifest["model"]["spec"], isl, with_torch=False)
    reference = next(iter(records.values()))["single"][0]["tokens"] if records else []
    for label, rec in records.items():
        out["systems"][label] = summarize(rec, new_tokens, reference)
    return out


def summarize(rec: dict, new_tokens: int, reference: list[int]) -> dict:
    """Medians of one system's runs (tokens dropped from the stored runs, their agreement kept)."""
    s = {"load_s": rec["load_s"], "versions": rec["versions"]}
    if rec.get("weight_bytes"):
        s["weight_bytes"] = rec["weight_bytes"]
    singles = rec["single"]
    if singles:
        s["prefill_s"] = [r["prefill_s"] for r in singles]
        s["decode_ms"] = [1e3 * r["decode_s_per_token"] for r in singles]
        s["new_tokens"] = [len(r["tokens"]) for r in singles]
        s["agree_with_first_system"] = common_prefix(singles[0]["tokens"], reference)
    for key in ("batch", "batch_eviction"):
        runs = rec[key]
        if runs:
            s[key + "_tokens_per_s"] = [r["output_tokens"] / r["seconds"] for r in runs]
            s[key + "_output_tokens"] = [r["output_tokens"] for r in runs]
    s["load_average"] = [r["load_average"] for key in ("single", "batch", "batch_eviction") for r in rec[key]]
    for key in ("prefill_s", "decode_ms", "batch_tokens_per_s", "batch_eviction_tokens_per_s"):
        if key in s:
            s[key + "_median"] = statistics.median(s[key])
    return s


# ---------------------------------------------------------------------------------------------- report
def _find(systems: dict, prefix: str) -> dict | None:
    return next((v for k, v in systems.items() if k.startswith(prefix)), None)


def targets(results: dict) -> list[tuple[str, float | None, str, bool | None]]:
    """The issue's targets: (what, measured ratio, bound, met) for each; None where a system is missing."""
    systems = results["systems"]

    def budgeted(backend_part: bool):
        """The first budgeted fp32 criticalkv row, on OpenVINO or not (its default forms)."""
        return next((v for k, v in systems.items() if k.startswith("criticalkv") and " full" not in k
                     and weights_of(k) == "fp32" and "portable" not in k and (ON_OPENVINO in k) == backend_part), None)

    ckv, ckv_ov = budgeted(False), budgeted(True)
    ov = _find(systems, LABELS["openvino"])  # the first OpenVINO row: its default precision, what a user gets
    og = systems.get(LABELS["onnxruntime-genai"])
    floor_ms = decode_floor_ms(results)
    out = []

    def ratio(a, b):
        return a / b if a is not None and b else None

    def add(what, value, bound, ok):
        out.append((what, value, bound, None if value is None else ok(value)))

    get = (lambda s, k: s.get(k) if s else None)

    def against(ov, suffix="", ckv=ckv, name="criticalkv b"):
        add(f"prefill: {name} / OpenVINO{suffix}", ratio(get(ckv, "prefill_s_median"), get(ov, "prefill_s_median")),
            "<= 1.0", lambda v: v <= 1.0)
        add(f"decode: {name} / OpenVINO{suffix} (full cache)",
            ratio(get(ckv, "decode_ms_median"), get(ov, "decode_ms_median")), "<= 0.8", lambda v: v <= 0.8)
        if not suffix and name == "criticalkv b":
            add("decode: criticalkv b / weight-bandwidth floor", ratio(get(ckv, "decode_ms_median"), floor_ms), "<= 1.25",
                lambda v: v <= 1.25)
        add(f"batch: {name} / OpenVINO{suffix} with eviction (tokens/s)",
            ratio(get(ckv, "batch_tokens_per_s_median"), get(ov, "batch_eviction_tokens_per_s_median")), ">= 1.0",
            lambda v: v >= 1.0)

    against(ov)
    # the other OpenVINO rows (f32 compute: the same arithmetic as criticalkv's fp32 engine) are judged too, labelled
    for key, other in systems.items():
        if key.startswith(LABELS["openvino"]) and other is not ov:
            against(other, " " + key[len(LABELS["openvino"]):].strip(" ,()").replace(" compute", ""))
    if ckv_ov is not None:  # criticalkv's own OpenVINO backend against OpenVINO GenAI at its default precision
        against(ov, ckv=ckv_ov, name="criticalkv b" + ON_OPENVINO)
    # the lower-precision engines (--weights int8|int4) against OpenVINO's default (bf16 where the CPU has it) and the
    # floor of their own weight bytes
    for key, low in systems.items():
        weights = weights_of(key)
        if not key.startswith("criticalkv") or key.endswith(" full") or weights == "fp32" or "portable" in key:
            continue
        name = f"criticalkv b {weights}"
        add(f"prefill: {name} / OpenVINO", ratio(get(low, "prefill_s_median"), get(ov, "prefill_s_median")), "<= 1.0",
            lambda v: v <= 1.0)
        add(f"batch: {name} / OpenVINO with eviction (tokens/s)",
            ratio(get(low, "batch_tokens_per_s_median"), get(ov, "batch_eviction_tokens_per_s_median")), ">= 1.0",
            lambda v: v >= 1.0)
        add(f"decode: {name} / its weight-bandwidth floor",
            ratio(get(low, "decode_ms_median"), decode_floor_ms(results, low.get("weight_bytes"))), "<= 1.25",
            lambda v: v <= 1.25)
    if og and ckv:
        behind = (og["prefill_s_median"] > ckv["prefill_s_median"] and og["decode_ms_median"] > ckv["decode_ms_median"]
                  and og["batch_tokens_per_s_median"] < ckv["batch_tokens_per_s_median"])
        out.append(("onnxruntime-genai behind criticalkv b on all three", None, "yes", behind))
    return out


def decode_floor_ms(results: dict, weight_bytes: int | None = None) -> float | None:
    """Weight bytes (default: the fp32 decode weights the floor measured) / the measured GEMV bandwidth (ms): the
    least a batch-1 decode step can take. For integer weights, their bytes at the fp32 GEMV's bandwidth."""
    gemv = results.get("floors_start", {}).get("gemv")
    return 1e3 * (weight_bytes or gemv["bytes"]) / (gemv["gbps"] * 1e9) if gemv else None


def render(results: dict) -> str:
    from criticalkv.bench.machine import header_lines

    f = results["floors_start"]
    lines = header_lines(results) + [
        "",
        f"## {results['isl']}-token chat prompt, {results['new_tokens']} new tokens (greedy, stop tokens off); batch of "
        f"{results['batch']} such prompts; medians of {results['repeats']} interleaved rounds after a warm-up",
        f"floors, same run (ONNX Runtime): fp32 GEMM {f['gemm']['gflops']:.0f} GFLOP/s at the prefill's shapes, "
        f"decode-weight GEMV {f['gemv']['gbps']:.1f} GB/s ({f['gemv']['bytes'] / 1e6:.0f} MB: floor "
        f"{decode_floor_ms(results):.1f} ms/token)"
        + (f"; torch: GEMM {f['torch']['gemm_gflops']:.0f} GFLOP/s, GEMV {f['torch']['gemv_gbps']:.1f} GB/s" if f.get("torch") else ""),
        "",
        f"| system | prefill s | decode ms/token | batch of {results['batch']}, output tokens/s | "
        "with its eviction | tokens equal to the first row's |",
        "|---|---|---|---|---|---|",
    ]

    def cell(s, key, fmt):
        return fmt.format(s[key + "_median"]) if key + "_median" in s else "-"

    for label, s in results["systems"].items():
        lines.append(f"| {label} | {cell(s, 'prefill_s', '{:.2f}')} | {cell(s, 'decode_ms', '{:.1f}')} | "
                     f"{cell(s, 'batch_tokens_per_s', '{:.2f}')} | {cell(s, 'batch_eviction_tokens_per_s', '{:.2f}')} | "
                     f"{s.get('agree_with_first_system', '-')} / {results['new_tokens']} |")
    lines += ["", "| target | measured | bound | met |", "|---|---|---|---|"]
    for what, value, bound, ok in targets(results):
        lines.append(f"| {what} | {'-' if value is None else f'{value:.2f}'} | {bound} | "
                     f"{'-' if ok is None else ('yes' if ok else 'no')} |")
    ev = results.get("eviction")
    if ev:
        lines.append(f"\nOpenVINO eviction: CacheEvictionConfig(start_size={ev['start_size']}, recent_size="
                     f"{ev['recent_size']}, max_cache_size={ev['max_cache_size']}, NORM_SUM)")
    for name, command in results.get("exports", {}).items():
        lines.append(f"{name} export: {command}")
    return "\n".join(lines) + "\n"
