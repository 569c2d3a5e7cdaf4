"""The project's one GPU check (``bash scripts/gpu_check.sh``): everything a GPU machine should tell, in one call.

Steps, in this order, each under its own time limit (a step that fails or runs out of time is reported and the
next one runs; the whole run stops starting steps when --total-budget is spent):

  prepare    what the machine is (GPU, driver, CUDA, torch, nvcc, compute-sanitizer), which of the project's
             Python imports it lacks, carried wheels installed with pip install --no-deps --target (no network)
  build      scripts/build_plugin.sh for this GPU's architecture only (CKV_CUDA_ARCHS from nvidia-smi or torch),
             TensorRT headers from build/trt-headers (carried: the machine has no network; without them only the
             TensorRT plugin is skipped, the kernels, torch ops and sanitizer driver are built), without -Werror (CI
             keeps it: a new compiler's warning must not stop a check's run)
  bench      criticalkv bench gpu: every policy's selection per layer vs the layer's prefill (8k/32k/128k),
             floors, batch 8, kvpress presses; before the tests, on an idle GPU
  pytest     pytest -m gpu on the test files that hold GPU tests, cheap and decisive files first (PYTEST_ORDER: the
             op, then the kernel matrix, the torch backend, the TensorRT tests, the served path last), at most 30 s
             per test (pytest-timeout), each failure printed the moment it happens (tests/live_report.py),
             optionally pytest-xdist workers; the tests it did not reach are listed in the summary
  sanitizer  compute-sanitizer memcheck, racecheck, synccheck and initcheck on build/plugins/ckv_sanitizer_driver,
             the four tools at once (test_compute_sanitizer is deselected from the pytest step)
  serve      criticalkv bench gpu-serve, when this checkout has it; skipped with a message otherwise (its
             short GPU test is deselected from the pytest step then: this step runs the same command)

Output (at most 8 files, so that a remote machine that returns few files sends everything back): summary.md
(rewritten after every step), gpu_check.json, gpu_check.log (everything printed), selection_gpu.{json,md}, and up to
three files of bench gpu-serve; outside a dry run the same files are copied to results/gpu/ of the checkout.

Without CUDA, or with --dry-run, the GPU steps are skipped with a message (build only when --steps names it), pytest
runs (every GPU test skips), bench and serve run their --dry-run. Only the standard library is imported here: a
machine whose torch is broken still gets a summary saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("build", "bench", "pytest", "sanitizer", "serve")
#: seconds per step (the table of docs/gpu_check.md): 320 s in all, inside a call of at most 6 minutes (timeout_s 360)
DEFAULT_BUDGETS = {"prepare": 15, "build": 60, "bench": 70, "pytest": 110, "sanitizer": 35, "serve": 30}
DEFAULT_TOTAL = 320
SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
#: the sanitizer driver's shapes, most decisive first (plugins/testing/sanitizer_driver.cu: `--list`): the d 128
#: kernels (the 172 KiB cp.async ring, gramQuad, WindowTiles<8>), a row over 4,096 (the multi-CTA top-k), the
#: model-level selection, then the small shape
SANITIZER_SHAPES = ("d128", "longrow", "model", "small")
#: the project's Python imports a GPU machine may lack (pyproject dependencies and extras)
PROJECT_IMPORTS = ("torch", "numpy", "tqdm", "transformers", "gguf", "accelerate", "safetensors", "onnx", "onnxruntime",
                   "polygraphy", "tritonclient", "fastapi", "uvicorn", "psutil", "matplotlib", "kvpress",
                   "pytest_timeout", "xdist")
HEADERS_HINT = ("no TensorRT headers: the TensorRT plugin is not built (the rest is); carry build/trt-headers with the "
                "call to build it (bash scripts/build_plugin.sh unpacks them there once on a machine with the package "
                "index; the folder holds kernel_lens/include/tensorrt)")
OUT_FILES = ("summary.md", "gpu_check.json", "gpu_check.log", "selection_gpu.json", "selection_gpu.md")
SERVE_FILES = 3  # of the 8 files the check writes at most
#: GPU test files, cheap and decisive first (what a first GPU run must tell before its time runs out: the selection
#: op on CUDA against the reference, then the kernel matrix of every flow, shape and dtype, the torch backend on CUDA),
#: the TensorRT tests (they skip at once without TensorRT) and the served path last (bench gpu-serve's own step runs
#: it as well); a file not named here runs after them
PYTEST_ORDER = ("tests/selection/test_select_op.py", "tests/selection/test_kernel_ops.py",
                "tests/selection/test_reference.py", "tests/plugins/test_plugin_gpu.py", "tests/runtime/test_torch_backend.py",
                "tests/runtime/test_tensorrt_backend.py", "tests/plugins/test_plugin_engine_build.py",
                "tests/bench/test_gpu_serve.py")
#: tests a step of their own runs (deselected from the pytest step when that step runs)
RUN_BY_STEP = {"sanitizer": "tests/plugins/test_plugin_gpu.py::test_compute_sanitizer",
               "serve": "tests/bench/test_gpu_serve.py::test_a_short_gpu_run_measures_every_step"}
#: the per-test limit of the pytest step: a test that needs more belongs to a step of its own
TEST_TIMEOUT_S = 30


@dataclass
class StepResult:
    name: str
    status: str  # passed | failed | timed out | skipped | not run
    budget_s: float | None = None
    seconds: float = 0.0
    returncode: int | None = None
    note: str = ""
    details: dict = field(default_factory=dict)


class Log:
    """Everything printed goes to stdout (flushed) and to gpu_check.log."""

    def __init__(self, path: Path):
        self.path = path
        self.lock = threading.Lock()
        self.file = open(path, "a", buffering=1)

    def __call__(self, text: str = "") -> None:
        with self.lock:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
            self.file.write(text + "\n")


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def probe(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int | None, str]:
    """(exit code or None when it could not run / timed out, stdout + stderr)."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        return out.returncode, (out.stdout + out.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as err:
        return None, f"{type(err).__name__}: {err}"


def stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM to the process group (it may write what it has), SIGKILL after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def stream(cmd: list[str], budget: float, log: Log, env: dict, prefix: str = "",
           lines: list[str] | None = None) -> tuple[int | None, bool, float]:
    """Run ``cmd`` in its own process group, its output line by line into the log (and into ``lines`` when given);
    stopped after ``budget`` seconds. Returns (exit code, timed out, seconds)."""
    begin = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=ROOT, env=env, start_new_session=True, text=True, errors="replace", bufsize=1)
    except OSError as err:
        log(f"{prefix}could not start {cmd[0]}: {err}")
        return None, False, 0.0

    def pump():
        for line in proc.stdout:
            log(prefix + line.rstrip("\n"))
            if lines is not None:
                lines.append(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=max(budget, 0.1))
    except subprocess.TimeoutExpired:
        timed_out = True
        log(f"{prefix}--- time limit of {budget:.0f} s reached: stopping {shlex.join(cmd[:6])} ...")
        stop(proc)
    reader.join(timeout=10)
    return proc.returncode, timed_out, time.monotonic() - begin


# ------------------------------------------------------------------------------------------------ the check
class Check:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.scratch = Path(tempfile.mkdtemp(prefix="ckv-gpu-check-"))
        self.log = Log(self.out / "gpu_check.log")
        self.begin = time.monotonic()
        self.results: list[StepResult] = []
        self.env_info: dict = {}
        self.python = args.python or sys.executable
        self.site = None
        self.dry = args.dry_run
        self.cuda = False
        self.archs = None

    # -------------------------------------------------------------------- bookkeeping
    def remaining(self) -> float:
        return self.args.total_budget - (time.monotonic() - self.begin)

    def budget(self, step: str) -> float:
        return min(self.args.budgets[step], self.remaining())

    def env(self, step: str, budget: float, tests: bool = False) -> dict:
        paths = [str(ROOT)] + ([str(ROOT / "tests")] if tests else []) + ([str(self.site)] if self.site else [])
        if os.environ.get("PYTHONPATH"):
            paths.append(os.environ["PYTHONPATH"])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1",
               # nothing is downloaded: a pip call (build_plugin.sh's header fetch) fails at once instead of retrying
               "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHON": self.python,
               # the step's own limit, for commands that fit their work into it (bench gpu, bench gpu-serve)
               "CRITICALKV_TIME_BUDGET_S": str(max(1, int(budget - 15)))}
        if self.archs:
            env["CKV_CUDA_ARCHS"] = self.archs  # pytest's native_build fixture then finds the build up to date
        # a warning of the GPU machine's compilers (another host compiler, another nvcc) must not stop the one check
        # a GPU machine runs: CI builds with -Werror, the check does not (the same value for every step, so pytest's
        # native_build fixture finds the build up to date)
        env["CKV_WERROR"] = "OFF"
        return env

    def record(self, result: StepResult) -> None:
        self.results.append(result)
        line = f"=== {result.name}: {result.status}" + (f" ({result.note})" if result.note else "")
        self.log(line + f" [{result.seconds:.0f} s]")
        self.write_summary()

    def header(self, step: str, budget: float, what: str) -> None:
        self.log("")
        self.log(f"=== {step} (limit {budget:.0f} s, {self.remaining():.0f} s left in all): {what}")

    # -------------------------------------------------------------------- prepare
    def prepare(self) -> None:
        begin = time.monotonic()
        args, info = self.args, self.env_info
        info["started_utc"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        info["command"] = args.command_line
        info["python"] = f"{self.python} ({sys.version.split()[0]} runs the driver)"
        info["git_head"] = self.git_head()
        self.header("prepare", args.budgets["prepare"], "the machine, the imports, carried wheels")
        code, text = probe(["nvidia-smi", "--query-gpu=name,driver_version,compute_cap,memory.total",
                            "--format=csv,noheader"], 20)
        info["nvidia_smi"] = text.splitlines()[0] if code == 0 and text else f"unavailable ({text[:200]})"
        wheels = sorted(Path(args.wheels).glob("*.whl")) if args.wheels else []
        if wheels:
            self.site = self.scratch / "site"
            code, text = probe([self.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                                "--no-cache-dir", "--target", str(self.site), *map(str, wheels)], 90)
            info["wheels"] = {"installed": [w.name for w in wheels] if code == 0 else [],
                              "error": None if code == 0 else text[-800:]}
        else:
            info["wheels"] = {"installed": [],
                              "note": f"no *.whl in {args.wheels} (kvpress is skipped unless installed)"}
        torch_probe = ("import json, torch\n"
                       "d = {'torch': torch.__version__, 'cuda': torch.version.cuda, "
                       "'cuda_available': torch.cuda.is_available()}\n"
                       "if d['cuda_available']:\n"
                       "    p = torch.cuda.get_device_properties(0)\n"
                       "    d.update(name=p.name, capability=f'{p.major}.{p.minor}', sms=p.multi_processor_count, "
                       "memory_gib=round(p.total_memory / 2**30, 1))\n"
                       "print(json.dumps(d))")
        code, text = probe([self.python, "-c", torch_probe], 120, env=self.env("prepare", 60))
        try:
            info["torch"] = json.loads(text.splitlines()[-1]) if code == 0 else {"error": text[-800:]}
        except (ValueError, IndexError):
            info["torch"] = {"error": text[-800:]}
        self.cuda = bool(info["torch"].get("cuda_available"))
        code, text = probe(["nvcc", "--version"], 20)
        if code is None and Path("/usr/local/cuda/bin/nvcc").exists():
            code, text = probe(["/usr/local/cuda/bin/nvcc", "--version"], 20)
        info["nvcc"] = text.splitlines()[-1] if code == 0 and text else "not found"
        info["compute_sanitizer"] = self.sanitizer_path() or "not found"
        imports_probe = ("import importlib.util as u, json, sys\n"
                         "print(json.dumps({m: u.find_spec(m) is not None for m in sys.argv[1:]}))")
        code, text = probe([self.python, "-c", imports_probe, *PROJECT_IMPORTS], 60, env=self.env("prepare", 60))
        try:
            found = json.loads(text.splitlines()[-1])
            info["imports_missing"] = [m for m, ok in found.items() if not ok]
        except (ValueError, IndexError):
            info["imports_missing"] = [f"probe failed: {text[-300:]}"]
        info["versions"] = self.versions()
        info["trt_headers"] = self.trt_headers()
        self.archs = args.archs or os.environ.get("CKV_CUDA_ARCHS") or self.local_arch()
        info["cuda_archs"] = self.archs
        if not self.cuda and not self.dry:
            self.dry = True
            info["dry_run_reason"] = "no CUDA device visible to torch"
        info["dry_run"] = self.dry
        for key in ("git_head", "nvidia_smi", "torch", "nvcc", "compute_sanitizer", "cuda_archs", "trt_headers",
                    "imports_missing", "wheels", "dry_run"):
            self.log(f"{key}: {info[key]}")
        self.record(StepResult("prepare", "passed", args.budgets["prepare"], time.monotonic() - begin,
                               note="dry run" if self.dry else ""))

    def git_head(self) -> str:
        """The commit of the tree checked: git's (``-dirty`` when the tree differs from it); ``--commit`` wins where it
        is given and git says otherwise (a copy whose git metadata is older than its files)."""
        code, text = probe(["git", "rev-parse", "HEAD"], 10)
        git = None
        if code == 0 and re.fullmatch(r"[0-9a-f]{40}", text):
            code2, dirty = probe(["git", "status", "--porcelain", "--untracked-files=no"], 20)
            git = text + ("-dirty" if code2 == 0 and dirty else "")
        commit = self.args.commit
        if commit and git is None:
            return f"{commit} (--commit: this copy has no git metadata)"
        if commit and git != commit:
            return f"{commit} (--commit; the copy's git metadata says {git})"
        return git or "unknown (no git metadata here; pass --commit)"

    def versions(self) -> dict:
        code, text = probe([self.python, "-c", "import json, sys\nfrom importlib import metadata\nout = {}\n"
                            "for name in sys.argv[1:]:\n    try: out[name] = metadata.version(name)\n"
                            "    except metadata.PackageNotFoundError: pass\nprint(json.dumps(out))",
                            "torch", "transformers", "numpy", "onnx", "onnxruntime", "triton", "pytest",
                            "pytest-timeout", "pytest-xdist", "kvpress"], 60, env=self.env("prepare", 60))
        try:
            return json.loads(text.splitlines()[-1])
        except (ValueError, IndexError):
            return {"error": text[-300:]}

    def trt_headers(self) -> str:
        if os.environ.get("TRT_INCLUDE_DIR"):
            return f"TRT_INCLUDE_DIR={os.environ['TRT_INCLUDE_DIR']}"
        unpacked = ROOT / "build" / "trt-headers" / "kernel_lens" / "include" / "tensorrt" / "NvInfer.h"
        if unpacked.is_file():
            return "build/trt-headers (unpacked)"
        if list((ROOT / "build" / "trt-headers").glob("kernel_lens-*.whl")):
            return "build/trt-headers (the wheel; build_plugin.sh unpacks it)"
        for folder in ("/usr/include/x86_64-linux-gnu", "/usr/include", "/usr/local/tensorrt/include"):
            if Path(folder, "NvInfer.h").is_file():
                return f"installed TensorRT ({folder})"
        return "none: " + HEADERS_HINT

    def local_arch(self) -> str | None:
        code, text = probe(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], 20)
        if code == 0 and re.fullmatch(r"\d+\.\d+", text.splitlines()[0].strip() if text else ""):
            return text.splitlines()[0].strip().replace(".", "")
        capability = self.env_info.get("torch", {}).get("capability")
        return capability.replace(".", "") if capability else None

    @staticmethod
    def sanitizer_path() -> str | None:
        found = shutil.which("compute-sanitizer")
        default = Path("/usr/local/cuda/bin/compute-sanitizer")
        return found or (str(default) if default.exists() else None)

    # -------------------------------------------------------------------- steps
    def wanted(self, step: str) -> bool:
        return step in self.args.steps

    def step(self, name: str, fn) -> None:
        if not self.wanted(name):
            return
        if self.remaining() < 5:
            self.record(StepResult(name, "not run", self.args.budgets[name], note="the total budget is spent"))
            return
        begin = time.monotonic()
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001 (a bug of one step must not lose the others' results)
            result = StepResult(name, "failed", self.args.budgets[name],
                                note=f"driver error {type(err).__name__}: {err}")
        result.seconds = result.seconds or time.monotonic() - begin
        self.record(result)

    @staticmethod
    def outcome(name: str, budget: float, code: int | None, timed_out: bool, seconds: float, note: str = "",
                details: dict | None = None) -> StepResult:
        if timed_out:
            status = "timed out"
        elif code == 0:
            status = "passed"
        else:
            status = "failed"
        note = note or (f"exit {code}" if code not in (0, None) else "")
        return StepResult(name, status, budget, seconds, code, note, details or {})

    def build(self) -> StepResult:
        budget = self.budget("build")
        if self.dry and not self.args.steps_given:
            return StepResult("build", "skipped", budget, note="dry run (name it in --steps to build anyway)")
        if not self.archs:
            return StepResult("build", "failed", budget, note="no GPU architecture found (give --archs, e.g. 90)")
        self.header("build", budget, f"CKV_CUDA_ARCHS={self.archs} bash scripts/build_plugin.sh")
        lines: list[str] = []
        code, timed_out, seconds = stream(["bash", "scripts/build_plugin.sh"], budget, self.log,
                                          self.env("build", budget), lines=lines)
        # what the script did not build, and why (no TensorRT headers, a failing torch CMake config)
        skipped = [line.removeprefix("not built: ") for line in lines if line.startswith("not built: ")]
        note = "; ".join([f"exit {code}"] * (code not in (0, None)) + [f"not built: {s}" for s in skipped])
        return self.outcome("build", budget, code, timed_out, seconds, note, {"not_built": skipped})

    def build_failed(self) -> bool:
        build = next((r for r in self.results if r.name == "build"), None)
        return build is not None and build.status in ("failed", "timed out")

    def bench(self) -> StepResult:
        budget = self.budget("bench")
        cmd = [self.python, "-m", "criticalkv.cli", "bench", "gpu", "--out", str(self.out), "--name", "selection_gpu",
               "--time-budget", str(max(10, int(budget - 25)))]
        cmd += ["--dry-run"] if self.dry else []
        cmd += shlex.split(self.args.bench_args)
        self.header("bench", budget, shlex.join(cmd[2:]))
        note = "the build failed: the op may run the PyTorch reference (its path column)" if self.build_failed() else ""
        code, timed_out, seconds = stream(cmd, budget, self.log, self.env("bench", budget))
        details = {}
        path = self.out / "selection_gpu.json"
        if path.is_file():
            try:
                data = json.loads(path.read_text())
                rows = data.get("selection", [])
                details = {"status": data.get("status"), "rows": len(rows),
                           "met": sum(1 for r in rows if r.get("met") is True),
                           "not_met": sum(1 for r in rows if r.get("met") is False),
                           "not_measured": len(data.get("not_measured", [])), "errors": len(data.get("errors", []))}
                note = note or (f"{details['rows']} rows, targets met {details['met']}, not met {details['not_met']}, "
                                f"{details['not_measured']} not measured, {details['errors']} errors")
            except ValueError:
                pass
        return self.outcome("bench", budget, code, timed_out, seconds, note, details)

    def pytest_files(self) -> list[str]:
        if self.args.pytest_paths:
            return shlex.split(self.args.pytest_paths)
        files = []
        for path in sorted((ROOT / "tests").rglob("test_*.py")):
            if re.search(r"mark\.gpu\b", path.read_text(errors="replace")):
                files.append(str(path.relative_to(ROOT)))
        return sorted(files, key=lambda f: (PYTEST_ORDER.index(f) if f in PYTEST_ORDER else len(PYTEST_ORDER), f))

    def pytest(self) -> StepResult:
        budget = self.budget("pytest")
        live = self.scratch / "pytest_live.jsonl"
        live.unlink(missing_ok=True)
        cmd = [self.python, "-m", "pytest", "-p", "live_report", "-v", "--tb=short", "-rfE", "--durations=15",
               "--continue-on-collection-errors", "-o", "console_output_style=classic", "-p", "no:cacheprovider"]
        if self.args.marker:
            cmd += ["-m", self.args.marker]
        notes = []
        missing = self.env_info.get("imports_missing") or []
        if "pytest_timeout" not in missing:
            cmd += [f"--timeout={self.args.test_timeout}"]
        else:
            notes.append("pytest-timeout absent: no per-test limit")
        workers = self.args.pytest_workers if self.cuda else 0
        if workers and "xdist" in missing:
            notes.append("pytest-xdist absent: one process")
        elif workers and shutil.which("flock") is None:
            # each worker's session fixture runs scripts/build_plugin.sh, which serialises them with flock
            notes.append("no flock: one process")
        elif workers:
            cmd += ["-n", str(workers)]
        for step, test in RUN_BY_STEP.items():
            if self.wanted(step) and self.cuda:
                cmd += ["--deselect", test]
        cmd += self.pytest_files() + shlex.split(self.args.pytest_args)
        self.header("pytest", budget, shlex.join(cmd[2:]))
        env = self.env("pytest", budget, tests=True)
        env["CKV_LIVE_REPORT"] = str(live)
        code, timed_out, seconds = stream(cmd, budget, self.log, env)
        details = summarize_live(live)
        counts = details.get("counts", {})
        parts = [f"{v} {k}" for k, v in sorted(counts.items())] + ([details["problem"]] if "problem" in details else [])
        if details.get("not_reached"):
            parts.append(f"{len(details['not_reached'])} not reached")
        if not self.cuda and self.args.marker == "gpu":
            notes.append("no CUDA: every GPU test skips")
        note = ", ".join(parts + notes) or (f"exit {code}" if code else "")
        return self.outcome("pytest", budget, code, timed_out, seconds, note, details)

    def sanitizer(self) -> StepResult:
        """The four tools on each of the driver's shapes in turn (SANITIZER_SHAPES first: the d 128 kernels, the
        multi-CTA top-k of a long row, the model-level selection, then the rest), the four at once per shape, until the
        step's time runs out; a shape not reached is listed."""
        budget = self.budget("sanitizer")
        tool = self.sanitizer_path()
        driver = ROOT / "build" / "plugins" / "ckv_sanitizer_driver"
        if not self.cuda:
            return StepResult("sanitizer", "skipped", budget, note="needs a GPU")
        if tool is None:
            return StepResult("sanitizer", "skipped", budget, note="compute-sanitizer not found")
        if not driver.is_file():
            return StepResult("sanitizer", "failed", budget, note=f"{driver.relative_to(ROOT)} not built")
        code, listed = probe([str(driver), "--list"], 20)
        shapes = sanitizer_shapes(listed if code == 0 else "")
        self.header("sanitizer", budget, f"{' / '.join(SANITIZER_TOOLS)} on {driver.relative_to(ROOT)}, shape by "
                                         f"shape ({', '.join(s or 'every' for s in shapes)}), the four tools at once")
        begin = time.monotonic()
        deadline = begin + budget
        tools, not_reached = {}, []
        for shape in shapes:
            if deadline - time.monotonic() < 3:
                not_reached.append(shape)
                continue
            procs = {}
            for name in SANITIZER_TOOLS:
                out = open(self.scratch / f"sanitizer_{name}_{shape or 'all'}.log", "w")
                cmd = [tool, "--tool", name, "--error-exitcode", "3", str(driver)] + ([shape] if shape else [])
                procs[name] = (subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                                start_new_session=True), out)
            for name, (proc, out) in procs.items():
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                    timed_out = False
                except subprocess.TimeoutExpired:
                    stop(proc, grace=2)
                    timed_out = True
                out.close()
                text = (self.scratch / f"sanitizer_{name}_{shape or 'all'}.log").read_text(errors="replace")
                summary = re.findall(r"ERROR SUMMARY: \d+ errors?", text)
                clean = bool(summary) and summary[-1].startswith("ERROR SUMMARY: 0 ")
                ok = not timed_out and proc.returncode == 0 and clean
                key = f"{name} {shape}".strip()
                tools[key] = {"status": "passed" if ok else ("timed out" if timed_out else "failed"),
                              "returncode": proc.returncode, "summary": summary[-1] if summary else None}
                self.log(f"--- {key}: {tools[key]['status']} (exit {proc.returncode}; {tools[key]['summary']})")
                tail = text.splitlines()[-40:] if not ok else text.splitlines()[-3:]
                for line in tail:
                    self.log(f"[{key}] {line}")
        seconds = time.monotonic() - begin
        states = {t["status"] for t in tools.values()}
        status = "passed" if states == {"passed"} and not not_reached else (
            "timed out" if "timed out" in states or not_reached else "failed")
        bad = [k for k, v in tools.items() if v["status"] != "passed"]
        note = (f"{len(tools) - len(bad)} of {len(tools)} tool runs clean" + (f"; not clean: {', '.join(bad)}" if bad else "")
                + (f"; shapes not reached: {', '.join(not_reached)}" if not_reached else ""))
        return StepResult("sanitizer", status, budget, seconds, None, note,
                          {"tools": tools, "not_reached": not_reached})

    def serve_available(self) -> bool:
        for path in (ROOT / "criticalkv" / "commands").glob("*.py"):
            if '"gpu-serve"' in path.read_text(errors="replace"):
                return True
        return False

    def serve(self) -> StepResult:
        budget = self.budget("serve")
        if not self.serve_available():
            return StepResult("serve", "skipped", budget,
                              note="this checkout has no `criticalkv bench gpu-serve`")
        folder = self.scratch / "serve"
        cmd = [self.python, "-m", "criticalkv.cli", "bench", "gpu-serve", "--out", str(folder / "serving")]
        if self.dry:
            code, text = probe(cmd[:5] + ["--help"], 60, env=self.env("serve", 60))
            if code != 0 or "--dry-run" not in text:
                return StepResult("serve", "skipped", budget, note="dry run: bench gpu-serve has no --dry-run")
            cmd.append("--dry-run")
        cmd += shlex.split(self.args.serve_args)
        self.header("serve", budget, shlex.join(cmd[2:]))
        code, timed_out, seconds = stream(cmd, budget, self.log, self.env("serve", budget))
        files = sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []
        preferred = sorted(files, key=lambda p: (p.suffix not in (".json", ".md", ".txt"),
                                                 not p.stem.startswith("serv"), p.name))
        kept = preferred[:SERVE_FILES]
        for p in kept:
            shutil.copy2(p, self.out / p.name)
        note = f"files: {', '.join(p.name for p in kept) or 'none'}"
        if len(files) > len(kept):
            note += f"; not kept (8 files come back): {', '.join(p.name for p in files if p not in kept)}"
        return self.outcome("serve", budget, code, timed_out, seconds, note, {"files": [p.name for p in kept]})

    # -------------------------------------------------------------------- summary
    def write_summary(self) -> None:
        data = {"environment": self.env_info, "steps": [asdict(r) for r in self.results],
                "total_budget_s": self.args.total_budget, "elapsed_s": round(time.monotonic() - self.begin, 1)}
        write_atomic(self.out / "gpu_check.json", json.dumps(data, indent=1) + "\n")
        write_atomic(self.out / "summary.md", render_summary(data, self.out))

    def copy_results(self) -> None:
        if self.dry or self.args.no_results_copy:
            return
        target = ROOT / "results" / "gpu"
        if self.out.resolve() == target.resolve():
            return
        target.mkdir(parents=True, exist_ok=True)
        for path in self.out.iterdir():
            if path.is_file() and not path.name.startswith("."):
                shutil.copy2(path, target / path.name)
        self.log(f"copied {self.out} to {target.relative_to(ROOT)}")

    def run(self) -> int:
        self.log(f"# {self.args.command_line}")
        self.prepare()
        self.step("build", self.build)
        self.step("bench", self.bench)
        self.step("pytest", self.pytest)
        self.step("sanitizer", self.sanitizer)
        self.step("serve", self.serve)
        self.write_summary()
        self.log("")
        self.log((self.out / "summary.md").read_text())
        self.log.file.close()
        self.copy_results()
        shutil.rmtree(self.scratch, ignore_errors=True)
        failed = [r for r in self.results if r.status in ("failed", "timed out")]
        return 1 if failed else 0


def sanitizer_shapes(listed: str) -> list[str]:
    """The driver's shapes from its ``--list`` ("shapes: small d128 longrow model"), SANITIZER_SHAPES' order first;
    [""] (one run of every shape) when it lists none."""
    shapes = next((line.split()[1:] for line in listed.splitlines() if line.startswith("shapes:")), [])
    order = {name: i for i, name in enumerate(SANITIZER_SHAPES)}
    return sorted(shapes, key=lambda s: (order.get(s, len(order)), s)) or [""]


def summarize_live(path: Path) -> dict:
    """Outcome counts, failures and tests never reached, from tests/live_report.py's lines."""
    collected, outcomes = [], {}
    if not path.is_file():
        return {"counts": {}, "problem": "no live report: pytest did not start or loaded no tests/live_report.py"}
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == "collected":
            collected = record["nodeids"]
        elif record.get("event") == "outcome":
            previous = outcomes.get(record["nodeid"])
            # a failed teardown after a passed call makes the test an error; otherwise the first report stands
            if previous is None or (record["outcome"] == "failed" and previous["outcome"] != "failed"):
                outcomes[record["nodeid"]] = record
    counts: dict[str, int] = {}
    for record in outcomes.values():
        kind = record["outcome"] if record["when"] == "call" or record["outcome"] == "skipped" else "error"
        counts[kind] = counts.get(kind, 0) + 1
    failures = [{"nodeid": r["nodeid"], "when": r["when"], "duration": r["duration"], "message": r["message"]}
                for r in outcomes.values() if r["outcome"] == "failed"]
    slowest = sorted(outcomes.values(), key=lambda r: -r["duration"])[:10]
    return {"collected": len(collected), "counts": counts, "failures": failures,
            "not_reached": [n for n in collected if n not in outcomes],
            "slowest": [{"nodeid": r["nodeid"], "duration": r["duration"]} for r in slowest]}


def render_summary(data: dict, out: Path) -> str:
    env = data["environment"]
    torch = env.get("torch", {})
    lines = ["# GPU check (`bash scripts/gpu_check.sh`)", "",
             f"- command: `{env.get('command')}`",
             f"- started: {env.get('started_utc')}; elapsed {data['elapsed_s']} s of a {data['total_budget_s']} s "
             "budget",
             f"- git head: {env.get('git_head')}",
             f"- GPU (nvidia-smi: name, driver, compute capability, memory): {env.get('nvidia_smi')}",
             (f"- torch {torch.get('torch')} (CUDA {torch.get('cuda')}, device {torch.get('name', '-')}, "
              f"{torch.get('sms', '-')} SMs)" if not torch.get("error") else
              f"- torch: **not usable**: {torch['error'].strip().splitlines()[-1][:300]}"),
             f"- nvcc: {env.get('nvcc')}; compute-sanitizer: {env.get('compute_sanitizer')}; "
             f"CKV_CUDA_ARCHS={env.get('cuda_archs')}",
             f"- python: {env.get('python')}; versions: "
             + ", ".join(f"{k} {v}" for k, v in (env.get("versions") or {}).items()),
             f"- imports the project may use that are absent: {', '.join(env.get('imports_missing') or []) or 'none'}",
             f"- TensorRT headers: {env.get('trt_headers')}; carried wheels: "
             f"{', '.join((env.get('wheels') or {}).get('installed') or []) or 'none'}"]
    if env.get("dry_run"):
        lines.append(f"- **dry run**{': ' + env['dry_run_reason'] if env.get('dry_run_reason') else ''}: GPU steps "
                     "skipped, bench numbers from tiny CPU shapes mean nothing")
    lines += ["", "| step | status | seconds | limit | note |", "|---|---|---:|---:|---|"]
    for s in data["steps"]:
        budget = "-" if s["budget_s"] is None else f"{s['budget_s']:.0f}"
        lines.append(f"| {s['name']} | {s['status']} | {s['seconds']:.0f} | {budget} | {s['note']} |")
    steps = {s["name"]: s for s in data["steps"]}
    pytest = steps.get("pytest", {}).get("details", {})
    if pytest.get("failures"):
        lines += ["", "## Failed tests", ""]
        lines += [f"- `{f['nodeid']}` ({f['when']}, {f['duration']:.1f} s): {f['message']}" for f in pytest["failures"]]
    if pytest.get("not_reached"):
        lines += ["", f"## Tests not reached ({len(pytest['not_reached'])})", ""]
        lines += [f"- `{n}`" for n in pytest["not_reached"][:60]]
        if len(pytest["not_reached"]) > 60:
            lines.append(f"- ... and {len(pytest['not_reached']) - 60} more (gpu_check.json)")
    slowest = [s for s in pytest.get("slowest") or [] if s["duration"] >= 0.5]
    if slowest:
        lines += ["", "Slowest tests: " + "; ".join(f"`{s['nodeid']}` {s['duration']:.1f} s" for s in slowest)]
    tools = steps.get("sanitizer", {}).get("details", {}).get("tools")
    if tools:
        lines += ["", "## compute-sanitizer", "", "| tool | status | exit | summary |", "|---|---|---:|---|"]
        lines += [f"| {k} | {v['status']} | {v['returncode']} | {v['summary']} |" for k, v in tools.items()]
    md = out / "selection_gpu.md"
    if md.is_file():
        text = md.read_text()
        section = re.search(r"## Selection vs prefill\n.*?(?=\n## |\Z)", text, re.S)
        lines += ["", "## criticalkv bench gpu (selection_gpu.md)", ""]
        lines.append(section.group(0).replace("## Selection vs prefill", "### Selection vs prefill") if section
                     else "(no table yet)")
        batch = re.search(r"## Batch of mixed lengths.*?(?=\n## |\Z)", text, re.S)
        if batch:
            lines += ["", batch.group(0).replace("## ", "### ", 1)]
    files = [p.name for p in sorted(out.iterdir()) if p.is_file() and not p.name.startswith(".")]
    lines += ["", "Files: " + ", ".join(files)]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ command line
def parse_budgets(items: list[str]) -> dict:
    budgets = dict(DEFAULT_BUDGETS)
    for item in items:
        step, sep, value = item.partition("=")
        if not sep or step not in budgets:
            raise ValueError(f"--budget {item!r}: give STEP=SECONDS with STEP one of {', '.join(budgets)}")
        try:
            budgets[step] = float(value)
        except ValueError:
            raise ValueError(f"--budget {item!r}: {value!r} is not a number of seconds") from None
        if budgets[step] <= 0:
            raise ValueError(f"--budget {item!r}: must be > 0")
    return budgets


def parse_args(argv: list[str] | None):
    budgets = "; ".join(f"{k} {v} s" for k, v in DEFAULT_BUDGETS.items())
    p = argparse.ArgumentParser(
        prog="scripts/gpu_check.sh", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__,
        epilog=f"Default limits: {budgets}; at most {DEFAULT_TOTAL} s in all.\n\n"
               "On a GPU machine without network or venv: carry build/trt-headers and a folder of wheels (.whl: "
               "kvpress 0.5.5, pure Python; `python3 -m pip download --no-deps -d .whl kvpress==0.5.5` beforehand) "
               "and give --commit (the copy has no git metadata). The imports the machine lacks (gguf, polygraphy, "
               "tritonclient, fastapi, uvicorn, kvpress's face needs datasets/cachetools/fire) are not on the GPU "
               "path: nothing else needs carrying. docs/gpu_check.md has the exact call.")
    p.add_argument("--steps", help=f"comma-separated subset of {','.join(STEPS)} (default: all; a dry run skips "
                                   "build unless named here); prepare always runs")
    p.add_argument("--budget", action="append", default=[], metavar="STEP=SECONDS",
                   help="one step's time limit (repeatable)")
    p.add_argument("--total-budget", type=float, default=DEFAULT_TOTAL,
                   help=f"seconds for the whole check: no step starts past it and each step's limit is cut to what "
                        f"is left (default: {DEFAULT_TOTAL})")
    p.add_argument("--test-timeout", type=int, default=TEST_TIMEOUT_S,
                   help=f"pytest-timeout seconds per test (default: {TEST_TIMEOUT_S})")
    p.add_argument("--pytest-workers", type=int, default=4,
                   help="pytest-xdist workers on a GPU machine when pytest-xdist is installed (0: one process; "
                        "default: 4)")
    p.add_argument("--marker", default="gpu", help="pytest -m expression (default: gpu; '' for none)")
    p.add_argument("--pytest-paths", default="", help="test files instead of those that hold GPU tests")
    p.add_argument("--pytest-args", default="", help="more pytest arguments, one shell-quoted string (write "
                                                    "--pytest-args=... when it starts with a dash; so for the others)")
    p.add_argument("--bench-args", default="", help="more `criticalkv bench gpu` arguments (one string)")
    p.add_argument("--serve-args", default="", help="more `criticalkv bench gpu-serve` arguments (one string)")
    p.add_argument("--archs", help="CKV_CUDA_ARCHS for the build (default: $CKV_CUDA_ARCHS, else this GPU's, e.g. 90)")
    p.add_argument("--wheels", default=".whl", help="folder of carried wheels installed with --no-deps --target into "
                                                   "a temporary folder (default: .whl)")
    p.add_argument("--commit", help="the git head to record when the copy has no git metadata")
    p.add_argument("--python", help="interpreter of the steps (default: this one)")
    p.add_argument("--out", help="results folder (default: $OUT when set, else out/gpu-check/<UTC time>)")
    p.add_argument("--no-results-copy", action="store_true", help="do not copy the results to results/gpu/")
    p.add_argument("--dry-run", action="store_true", help="skip the GPU steps, run the CPU dry runs (automatic "
                                                          "without CUDA)")
    args = p.parse_args(argv)
    try:
        args.budgets = parse_budgets(args.budget)
    except ValueError as err:
        p.error(str(err))
    args.steps_given = args.steps is not None
    steps = [s.strip() for s in (args.steps or ",".join(STEPS)).split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if unknown or not steps:
        p.error(f"--steps: {', '.join(unknown) or 'empty'}: choose from {', '.join(STEPS)}")
    args.steps = steps
    if args.total_budget <= 0 or args.test_timeout <= 0 or args.pytest_workers < 0:
        p.error("--total-budget and --test-timeout must be > 0, --pytest-workers >= 0")
    if args.out is None:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        args.out = os.environ.get("OUT") or str(ROOT / "out" / "gpu-check" / stamp)
    args.command_line = "bash scripts/gpu_check.sh " + shlex.join(sys.argv[1:] if argv is None else argv)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return Check(args).run()


if __name__ == "__main__":
    sys.exit(main())
