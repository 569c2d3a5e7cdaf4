"""One criticalkv engine as a long-lived worker process of ``criticalkv bench peers`` (one engine per process, as each
peer runs in its own: five engines in one process once ran a 24 GB machine out of memory, and a process's arenas and
compiled graphs leave with it).

    python -m criticalkv.bench.peers.engine_worker --engine-dir DIR [--backend onnxruntime|openvino] [--portable]

The protocol of ``cpu_runner.py`` (its ``serve_requests``): a ``{"ready", "load_s"}`` line once the engine is loaded,
then one JSON request per stdin line and one JSON answer per stdout line: ``info`` (the row's label, versions,
precision, the bytes of weights a decode step reads), ``single`` (one request: prefill seconds, decode seconds per
token, the tokens), ``batch`` (the prompts together: seconds, output tokens), ``quit``. Errors are answered per request (``{"error"}``).
"""

from __future__ import annotations

import argparse
import sys
import time
from importlib import metadata
from pathlib import Path

from criticalkv.bench.peers.cpu_runner import serve_requests
from criticalkv.runtime import Engine


def label(policy: str, budget: int | None, weights: str = "fp32", portable: bool = False, backend: str = "onnxruntime",
          precision: str | None = None) -> str:
    """A criticalkv engine's row: ``criticalkv full``, ``criticalkv b=256``, ``criticalkv adakv b=128``, with
    `` int8`` / `` int4`` for its weights, `` (portable graphs)`` for the portable form and `` on OpenVINO (bf16)`` for
    the OpenVINO backend at its precision."""
    if policy == "full":
        name = "criticalkv full"
    else:
        name = f"criticalkv b={budget}" if policy == "criticalkv" else f"criticalkv {policy} b={budget}"
    name += ("" if weights == "fp32" else f" {weights}") + (" (portable graphs)" if portable else "")
    return name + (f" on OpenVINO ({precision})" if backend == "openvino" else "")


class EngineWorker:
    """criticalkv's ``Engine`` with the peers' request interface."""

    def __init__(self, engine_dir: Path, backend: str = "onnxruntime", portable: bool = False):
        from criticalkv.bench.floors import LayerShapes

        start = time.perf_counter()
        forms = {"prefill": "portable", "decode": "portable"} if portable else {}
        self.engine = Engine.load(engine_dir, backend=backend, **forms)
        self.load_s = time.perf_counter() - start
        policy, manifest = self.engine.policy, self.engine.manifest
        weights = manifest["onnx"].get("weights") or {"format": "fp32"}
        # the OpenVINO backend reads the float32 graphs' weights (at its precision); ONNX Runtime the engine's format
        self.weights = "fp32" if portable or backend != "onnxruntime" else weights["format"]
        self.precision = getattr(self.engine.backend, "precision", "f32")
        self.label = label(policy.name, policy.budget, self.weights, portable, backend, self.precision)
        #: the bytes of weights one decode step reads (the decode floor of this row): fp32, or the integer forms
        fp32 = LayerShapes.from_spec(manifest["model"]["spec"]).weight_bytes()
        self.weight_bytes = fp32 if self.weights == "fp32" else weights["bytes"]
        self.versions = {name: _version(name) for name in ("onnxruntime", "openvino") if _version(name)}

    def info(self) -> dict:
        return {"label": self.label, "versions": self.versions, "precision": self.precision,
                "weight_bytes": self.weight_bytes, "weights": self.weights}

    def single(self, ids, new_tokens: int) -> dict:
        out = self.engine.generate([list(ids)], max_new_tokens=new_tokens, stop_token_ids=[])
        return {"prefill_s": out.prefill_s, "decode_s_per_token": out.decode_s_per_token, "tokens": list(out.tokens[0])}

    def batch(self, prompts, new_tokens: int, eviction=None) -> dict:
        start = time.perf_counter()
        out = self.engine.generate([list(p) for p in prompts], max_new_tokens=new_tokens, stop_token_ids=[])
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "output_tokens": sum(len(t) for t in out.tokens), "tokens": [list(t) for t in out.tokens]}

    def close(self) -> None:
        self.engine.close()


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-dir", type=Path, required=True)
    p.add_argument("--backend", choices=("onnxruntime", "openvino"), default="onnxruntime")
    p.add_argument("--portable", action="store_true", help="ONNX Runtime's portable graphs (prefill.onnx, decode.onnx)")
    args = p.parse_args(argv)
    worker = EngineWorker(args.engine_dir, args.backend, args.portable)
    serve_requests(worker, worker.info, worker.load_s)
    worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
