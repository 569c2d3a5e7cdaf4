"""criticalkv's ONNX Runtime engines against the CPU runtimes a user would pick instead, on the same token ids,
interleaved in one run, with this CPU's GEMM rate and read bandwidth measured in the same run.

    criticalkv bench setup-peers --peers onnxruntime-genai,openvino     # once: .peers/ (git-ignored), ~3 GB
    criticalkv bench peers --engine-dir engines/full --engine-dir engines/ckv256
    python -m criticalkv.bench.peers.cpu needle --engine-dir engines/full --out results/weight_precision/needle_openvino

Build the engines for batches of 8 prompts of 2k tokens, e.g.
``python scripts/build_engine.py --kv-policy criticalkv --budget 256 --max-input-len 2048 --max-batch-size 8
--output engines/ckv256`` (and ``--kv-policy full`` for ``engines/full``).

Systems (each in its own process: criticalkv's engines through ``criticalkv.bench.peers.engine_worker``, each peer
in its virtual environment through ``criticalkv/bench/peers/cpu_runner.py``, which imports nothing from criticalkv):

* criticalkv: ``Engine.generate`` of every ``--engine-dir`` on every ``--backends`` (stop tokens off; one engine per
  process, ``criticalkv.bench.peers.engine_worker``): ONNX Runtime in the forms the engine runs by default (the fused
  prompt and decode graphs, with the weights it was built with: ``--weights fp32|int8|int4``; a row is named by its weights
  when they are not fp32), OpenVINO with the engine's openvino graphs at the CPU plugin's default precision (``on
  OpenVINO (bf16)`` where the CPU has BF16); and of every ``--portable-engine-dir`` with its portable graphs
  (``prefill.onnx``, ``decode.onnx``: fp32, the Loop attention) on ONNX Runtime;
* onnxruntime-genai 0.18: its model builder's fp32 CPU export of the same Hugging Face folder
  (``python -m onnxruntime_genai.models.builder -i HF -o OUT -p fp32 -e cpu``), one ``Generator``;
* OpenVINO GenAI 2026.4: ``optimum-cli export openvino --weight-format fp32 --task text-generation-with-past``
  (fp32 weights; its KV cache is f16 by default), prefix caching off, once with its CPU plugin's default compute
  precision (bf16 on CPUs with BF16, even for fp32 weights) and once with ``INFERENCE_PRECISION_HINT=f32``
  (``--peers openvino:precision=default+f32``); ``LLMPipeline`` for one request, ``ContinuousBatchingPipeline``
  for the batch, without and with ``CacheEvictionConfig`` (``--peers openvino:eviction=START/RECENT/MAX``, default
  32/96/256: block-wise eviction to about the criticalkv budget, during decoding only).

The exports are written once under ``$CRITICALKV_PEERS_DIR/models/`` (their commands are recorded). Workload: one
chat-wrapped prompt of exactly ``--isl`` tokens (prefill seconds, decode ms per token, ``--new-tokens`` greedy tokens),
then ``--batch`` different prompts of the same length together (output tokens per second over the whole call, prefill
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

from criticalkv.bench.peers import check_ready, peer_python

RUNNER = Path(__file__).with_name("cpu_runner.py")
CPU_PEERS = ("onnxruntime-genai", "openvino", "vllm")
#: ``bench peers --peers``'s default (vLLM, a served peer with a 3.4 GB environment, when asked).
DEFAULT_PEERS = ("onnxruntime-genai", "openvino")
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
    """``"START/RECENT/MAX"`` -> OpenVINO's CacheEvictionConfig sizes (tokens; MAX > START + RECENT)."""
    try:
        start, recent, most = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--peers: openvino:eviction= expected START/RECENT/MAX (three integers), got {text!r}") from None
    if min(start, recent) < 1 or most <= start + recent:
        raise ValueError(f"--peers: openvino:eviction= need START, RECENT >= 1 and MAX > START + RECENT, got {text!r}")
    return {"start_size": start, "recent_size": recent, "max_cache_size": most}


def parse_precisions(text: str) -> list[str]:
    """``"default+f32"`` -> the OpenVINO compute precisions to run, each a row."""
    names = [n for n in text.split("+") if n]
    bad = [n for n in names if n not in OV_PRECISIONS]
    if bad or not names or len(set(names)) != len(names):
        raise ValueError(f"--peers: openvino:precision= expected a +-separated subset of {'+'.join(OV_PRECISIONS)}, "
                         f"got {text!r}")
    return names


#: Every CPU peer's knobs in ``--peers NAME:knob=value``, with their parser and their default.
KNOBS = {"onnxruntime-genai": {}, "vllm": {},
         "openvino": {"precision": (parse_precisions, "+".join(OV_PRECISIONS)),
                      "eviction": (parse_eviction, "/".join(map(str, DEFAULT_EVICTION)))}}


def parse_peer_specs(text: str) -> dict[str, dict]:
    """``--peers``: comma-separated peers, each ``NAME`` or ``NAME:knob=value[:knob=value]`` as ``--kv-policy`` takes a
    policy: ``onnxruntime-genai,openvino:precision=f32:eviction=32/96/512``. Returns {name: {knob: parsed value}},
    every knob of the peer present (the defaults where not given): openvino's ``precision`` (the compute precisions
    to run, ``+``-separated: ``default``, its CPU plugin's, bf16 on CPUs with BF16, and ``f32``; default
    ``default+f32``) and ``eviction`` (the ``CacheEvictionConfig`` of its batch run with eviction,
    ``START/RECENT/MAX`` tokens; default ``32/96/256``)."""
    out: dict[str, dict] = {}
    for spec in (s.strip() for s in text.split(",")):
        if not spec:
            continue
        name, *knobs = spec.split(":")
        if name not in KNOBS:
            raise ValueError(f"--peers: unknown {name} (choose from {', '.join(CPU_PEERS)})")
        if name in out:
            raise ValueError(f"--peers: {name} given twice")
        given = {}
        for knob in knobs:
            key, eq, value = knob.partition("=")
            if not eq or key not in KNOBS[name]:
                known = ", ".join(f"{k}=" for k in KNOBS[name]) or "none"
                raise ValueError(f"--peers: {knob!r} is not a knob of {name} (its knobs: {known})")
            given[key] = value
        out[name] = {key: parse(given.get(key, default)) for key, (parse, default) in KNOBS[name].items()}
    return out


def parse_peers(text: str) -> list[str]:
    """The peers' names in ``--peers`` (``parse_peer_specs``)."""
    return list(parse_peer_specs(text))


#: The criticalkv backends ``bench peers`` runs engines on (``--backends``).
ENGINE_BACKENDS = ("onnxruntime", "openvino")


def parse_backends(text: str) -> list[str]:
    from criticalkv.bench.served import comma_choices

    return comma_choices(text, "--backends", ENGINE_BACKENDS)


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
    from criticalkv.bench.prompts import chat_ids, text_for_chat_length

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
    exports = {name: ensure_export(root, name, model_dir, log) for name in peers if name != "vllm"}
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
            if name == "vllm":  # served (criticalkv.bench.peers.vllm): the model's HF folder, vLLM's defaults here
                from criticalkv.bench.peers.vllm import VllmWorker

                log("starting vllm serve (55-70 s on 2 idle cores) ...")
                w = VllmWorker(root, model_dir, log_path=Path(root) / "logs" / "vllm.log")
                workers[w.label] = w
                continue
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
    """The targets (prefill, decode, batch throughput against OpenVINO GenAI): (what, measured ratio, bound, met)
    for each; None where a system is missing."""
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


# ---------------------------------------------------------------------------------------------- the needle
NEEDLE_DOC = """The needle grid's answers of the CPU peers at their compute precisions, against a criticalkv fp32 engine.

``python research/kv_precision.py`` counts how often an engine with lower-precision weights (``--weights
int8|int4``) gives the fp32 engine's greedy tokens. This is the yardstick for that count: the same prompts (the
committed needle grid's: same generator, seed and chat template) through OpenVINO GenAI at its CPU default (bf16
compute on CPUs with BF16, what a CPU user gets) and at f32 compute, each compared with the first ``--engine-dir``
(build it with ``--kv-policy full``: the peers keep the whole cache in a single request). f32 against fp32 shows what
another summation order alone does to these answers; bf16 what the peer's own default does.

    python -m criticalkv.bench.peers.cpu needle --engine-dir engines/full --lengths 2048 --samples 2 \\
        --out results/weight_precision/needle_openvino

Tokens are compared up to the reference's first stop token: the tokens before it must be the same, and for the
criticalkv engines the stop token too (the peers' runner makes them generate a fixed count, which suppresses their stop
token: OpenVINO then writes ' 3042.\n\n' where the engines stop after ' 3042.'). Needs ``criticalkv bench setup-peers
--peers openvino``; the OpenVINO export is the one ``criticalkv bench peers`` writes. Writes ``STEM.json`` and
``STEM.md`` (``--out STEM``).
"""


def parse_args(argv=None):
    """``python -m criticalkv.bench.peers.cpu needle``'s arguments."""
    import argparse

    from criticalkv.bench.peers import PEERS_DIR_HELP
    from criticalkv.bench.report import add_out_argument
    from criticalkv.eval.needle import DEFAULT_DEPTHS

    ap = argparse.ArgumentParser(prog="python -m criticalkv.bench.peers.cpu", description=NEEDLE_DOC,
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=PEERS_DIR_HELP)
    ap.add_argument("task", choices=("needle",), help="needle: the needle grid's answers (the only task)")
    ap.add_argument("--engine-dir", action="append", required=True, type=Path,
                    help="a criticalkv engine (repeat; the first is the reference: build it with --kv-policy full)")
    ap.add_argument("--precision", default="+".join(OV_PRECISIONS),
                    help="OpenVINO compute precisions, +-separated, as in --peers openvino:precision= "
                         "(default: %(default)s)")
    ap.add_argument("--lengths", default="2048", help="comma-separated prompt lengths (default: 2048)")
    ap.add_argument("--samples", type=int, default=2, help="needle instances per length (default: 2)")
    ap.add_argument("--depths", default=",".join(f"{d:g}" for d in DEFAULT_DEPTHS), help="needle depths in percent")
    ap.add_argument("--seed", type=int, default=0, help="the prompt generator's seed (0: the committed grid's)")
    ap.add_argument("--model", help="HF folder or .gguf OpenVINO exports (default: the bundled SmolLM2-135M-Instruct)")
    add_out_argument(ap, "results/weight_precision/needle_openvino")
    return ap.parse_args(argv)


def until_stop(tokens: list[int], stop: set[int]) -> list[int]:
    """``tokens`` up to and including the first stop token."""
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[:i + 1]
    return tokens


def same_answer(reference: list[int], tokens: list[int], stop: set[int], stops: bool) -> bool:
    """Whether ``tokens`` give ``reference``'s answer: the same tokens before the reference's first stop token, and the
    stop token too when the system can stop (``stops``; the peers' runner suppresses it)."""
    answer = until_stop(reference, stop)
    cut = len(answer) - 1 if answer and answer[-1] in stop else len(answer)
    return tokens[:cut] == answer[:cut] and (not stops or tokens[cut:cut + 1] == answer[cut:cut + 1])


def needle_run(args) -> dict:
    """The needle grid through every engine and OpenVINO GenAI at each precision (``NEEDLE_DOC``)."""
    import shlex

    from transformers import AutoTokenizer

    from criticalkv.bench.peers import peers_dir
    from criticalkv.eval.needle import needle_prompts
    from criticalkv.eval.scoring import score
    from criticalkv.hf.loading import resolve_model
    from criticalkv.runtime.manifest import read_manifest

    precisions = parse_precisions(args.precision)
    root = peers_dir()
    check_ready(root, ["openvino"])
    # the reference engine's tokenizer and stop tokens (its manifest's), each engine then in its own worker process
    first = Path(args.engine_dir[0])
    stop = set(read_manifest(first, verify=False).get("generation", {}).get("eos_token_ids", []))
    tokenizer = AutoTokenizer.from_pretrained(first / "tokenizer")
    prompts = needle_prompts(tokenizer, [int(x) for x in args.lengths.split(",")],
                             [float(x) for x in args.depths.split(",")], samples=args.samples, seed=args.seed)
    folder, export = ensure_export(root, "openvino", resolve_model(args.model))
    workers = []
    try:
        workers += [CriticalKVWorker(root, d) for d in args.engine_dir]
        workers += [PeerWorker(root, "openvino", folder, precision=p) for p in precisions]
        rows = []
        for p in prompts:
            row = {"key": p.key, "answer": p.answers[0], "systems": []}
            for w in workers:
                tokens = until_stop([int(t) for t in w.single(list(p.input_ids), p.max_new_tokens)["tokens"]], stop)
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                row["systems"].append({"tokens": tokens, "text": text, "score": score(p.metric, text, p.answers)})
            rows.append(row)
            print(p.key, " / ".join(repr(s["text"]) for s in row["systems"]), flush=True)
        labels = [w.label for w in workers]
        stops = [isinstance(w, CriticalKVWorker) for w in workers]
    finally:
        for w in workers:
            w.close()
    summary = [{"system": label, "accuracy": 100 * sum(r["systems"][i]["score"] for r in rows) / len(rows),
                "same_tokens_as_first": sum(same_answer(r["systems"][0]["tokens"], r["systems"][i]["tokens"], stop, stops[i])
                                            for r in rows),
                "prompts": len(rows), "stop_token_compared": stops[i]} for i, label in enumerate(labels)]
    return {"command": "python -m criticalkv.bench.peers.cpu " + shlex.join(sys.argv[1:]),
            "loadavg_before": os.getloadavg(), "openvino_export": _display(export), "stop_tokens": sorted(stop),
            "summary": summary, "prompts": rows}


def needle_markdown(result: dict) -> str:
    lines = [f"`{result['command']}`", "", f"load average at the start: {result['loadavg_before'][0]:.2f}", "",
             "| system | needle accuracy % | the first's answer tokens |", "|---|---:|---:|"]
    for s in result["summary"]:
        note = "" if s.get("stop_token_compared", True) else " (before its stop token)"
        lines.append(f"| {s['system']} | {s['accuracy']:.1f} | {s['same_tokens_as_first']} of {s['prompts']}{note} |")
    stop = set(result.get("stop_tokens", []))
    stops = [s.get("stop_token_compared", True) for s in result["summary"]]
    differ = [r for r in result["prompts"]
              if not all(same_answer(r["systems"][0]["tokens"], s["tokens"], stop, can) for s, can in zip(r["systems"], stops))]
    if differ:
        lines += ["", "Prompts where the answers differ (the peers' text runs on past the suppressed stop token):", ""]
        lines += [f"- {r['key']} (passcode {r['answer']}): " + " / ".join(repr(s["text"]) for s in r["systems"])
                  for r in differ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from criticalkv.eval.io import write_json, write_text

    args = parse_args(argv)
    result = needle_run(args)
    text = needle_markdown(result)
    write_json(args.out.with_suffix(".json"), result)
    write_text(args.out.with_suffix(".md"), text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
