"""``criticalkv serve``: serve an engine with Triton Inference Server (the server of the nvidia-pytriton wheel)."""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
from pathlib import Path

from criticalkv.commands.triton_repo import add_model_arguments, scheduler_config


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve an engine over HTTP/gRPC with Triton Inference Server (continuous batching)",
        description="Render a model repository for --engine-dir (unless --repo names one), start tritonserver on "
        "127.0.0.1, wait until it is ready, print its URLs, and stop it on Ctrl-C / SIGTERM. The server and its "
        "Python-backend stub come from the nvidia-pytriton wheel; `--setup` (also run by scripts/install.sh) "
        "unpacks them into .triton/ with a numpy<2 environment for the model. GPU machines: see the README "
        "(official Triton container, --backend tensorrt).",
    )
    p.add_argument("--engine-dir", type=Path, help="engine directory built by scripts/build_engine.py")
    p.add_argument("--repo", type=Path, help="serve this model repository as is (default: render one into a temp dir)")
    p.add_argument("--http-port", type=int, default=8000, help="HTTP port (default: 8000)")
    p.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (default: 8001)")
    p.add_argument("--metrics-port", type=int, default=8002, help="Prometheus metrics port (default: 8002)")
    add_model_arguments(p)
    p.add_argument("--setup", action="store_true", help="only set up tritonserver and the model environment, then exit")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the server (default: 600)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from criticalkv.serving import launcher
    from criticalkv.serving.repository import make_repository

    launcher.setup(log=lambda m: print(m, file=sys.stderr))
    if args.setup:
        print(f"tritonserver ready to run from {launcher.server_dir()} (model environment {launcher.model_env()})")
        return 0
    if args.repo is None and args.engine_dir is None:
        raise ValueError("give --engine-dir (or --repo with a rendered model repository)")
    with tempfile.TemporaryDirectory(prefix="criticalkv-triton-") as tmp:
        repo = args.repo
        if repo is None:
            repo = Path(tmp) / "models"
            make_repository(args.engine_dir, repo, model_name=args.model_name, instances=args.instances,
                            scheduler=scheduler_config(args), backend=args.backend,
                            gpus=args.gpus, threads=args.threads, execution_env=str(launcher.model_env()),
                            python_paths=launcher.project_paths())
        elif not Path(repo).is_dir():
            raise FileNotFoundError(f"{repo}: no such model repository")
        server = launcher.TritonServer(repo, args.http_port, args.grpc_port, args.metrics_port,
                                       log_file=Path(tmp) / "tritonserver.log")
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        print(f"starting tritonserver (log: {server.log_file}) ...", file=sys.stderr)
        try:
            try:
                server.start(timeout_s=args.ready_timeout)
            except (RuntimeError, TimeoutError) as err:
                print(f"criticalkv serve: error: {err}", file=sys.stderr)
                return 1
            print(f"ready: HTTP {server.http_url}  gRPC {server.grpc_url}  metrics {server.metrics_url}\n"
                  f"  curl -N -X POST {server.http_url}/v2/models/{args.model_name}/generate_stream "
                  "-d '{\"text_input\": \"...\", \"max_tokens\": 64, \"stream\": true}'\n"
                  "Ctrl-C stops the server.", flush=True)
            while not stop.wait(1.0):
                if server.process.poll() is not None:
                    print(f"tritonserver exited with code {server.process.returncode}:\n{server.log_tail()}",
                          file=sys.stderr)
                    return 1
        finally:
            code = server.stop()
            print(f"tritonserver stopped (exit code {code})", file=sys.stderr)
    return 0
