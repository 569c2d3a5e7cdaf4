"""``criticalkv serve``: serve an engine with Triton Inference Server (the server of the nvidia-pytriton wheel)
and an OpenAI-compatible API in front of it."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

from criticalkv.commands.arguments import port, port_or_zero, positive_float, positive_int
from criticalkv.commands.model_options import add_model_arguments, prefix_cache_note, scheduler_config
from criticalkv.commands.serve_replicas import add_replica_arguments, run_replicas, wants_replicas
from criticalkv.files import remove_stale_temporaries, temporary_dir
from criticalkv.request import TextBound
from criticalkv.runtime.manifest import load_tokenizer, read_manifest
from criticalkv.serving import launcher
from criticalkv.serving.repository import make_repository

#: temporary model repositories: <tmp>/criticalkv-serve-<launcher pid>-<random>/ (a killed launcher's is removed
#: by the next start)
TEMP_PREFIX = "criticalkv-serve-"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve an engine over HTTP/gRPC with Triton Inference Server and an OpenAI-compatible API "
             "(continuous batching)",
        description="Render a model repository for --engine-dir (unless --repo names one), start tritonserver, "
        "wait until it is ready, start the OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models; "
        "the chat template is the engine tokenizer's) in front of it, print the URLs, and stop everything on "
        "Ctrl-C / SIGTERM: it stops accepting, ends the requests in flight at once with an error (OpenAI's error "
        "object, status 503 \"the server is shutting down\"; a stream gets it as its last event before [DONE]), stops "
        "tritonserver and exits with status 0, within seconds. Both APIs share one engine and scheduler per model "
        "instance. A port already in use, or a --backend that cannot run here (no TensorRT engines, no GPU), is "
        "named and the command exits with status 2 before anything starts. tritonserver and its model processes "
        "stop when this command dies in any way (SIGKILL included: a watchdog process kills them and removes the "
        "temporary repository and their shared memory; what a killed run left is removed by the next start). The "
        "server and its Python-backend stub come from the nvidia-pytriton wheel; `--setup` (also run by "
        "scripts/install.sh) unpacks them into .triton/ with a numpy<2 environment for the model. NVIDIA GPUs "
        "(--backend tensorrt, the official Triton container): docs/gpu.md.",
    )
    p.add_argument("--engine-dir", type=Path, help="engine directory built by scripts/build_engine.py")
    p.add_argument("--repo", type=Path, help="serve this model repository as is (default: render one into a temp dir)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address every port binds to (default: 127.0.0.1, this machine only). 0.0.0.0 exposes all "
                        "of them to every network the machine is on: Triton's HTTP and gRPC inference and "
                        "model-control endpoints and its metrics (never authenticated) and the OpenAI API "
                        "(authenticated only with --api-key)")
    p.add_argument("--http-port", type=port, default=8000, help="Triton HTTP port (default: 8000)")
    p.add_argument("--grpc-port", type=port, default=8001, help="Triton gRPC port (default: 8001)")
    p.add_argument("--metrics-port", type=port, default=8002, help="Prometheus metrics port (default: 8002)")
    p.add_argument("--openai-port", type=port_or_zero, default=9000,
                   help="port of the OpenAI-compatible API (default: 9000, as Triton's own OpenAI frontend; "
                        "0 = do not start it)")
    p.add_argument("--api-key", default=None,
                   help="as `vllm serve --api-key`: every OpenAI API request (/v1/...) must carry the header "
                        "'Authorization: Bearer KEY', else 401 (default: $CRITICALKV_API_KEY, or no key). "
                        "Triton's own ports are not covered")
    p.add_argument("--max-body-bytes", type=positive_int, default=None, metavar="BYTES",
                   help="largest OpenAI API request body; a larger one is refused with 413 from its Content-Length, "
                        "before it is read (default: what the engine's max input length can need, every character "
                        "at its longest JSON escape: 12 bytes x the max input length x the longest token's characters "
                        "+ 1 MiB, e.g. 4.0 MB for a 4,096-token engine of SmolLM2's vocabulary)")
    p.add_argument("--request-timeout", type=positive_float, default=300.0, metavar="SECONDS",
                   help="the server-side deadline of every request: past it the request is cancelled and answered "
                        "with OpenAI's error object, status 504 (the whole answer; a stream's first token and each "
                        "next one). Default: 300, half of the openai client's own timeout, so that a default client "
                        "reads the error; raise it for long answers that are not streamed on a busy server")
    add_model_arguments(p)
    p.add_argument("--tritonserver", type=Path, default=os.environ.get(launcher.TRITONSERVER_ENV) or None,
                   metavar="DIR",
                   help="run this Triton installation (DIR/bin/tritonserver, DIR/backends) instead of the one --setup "
                        "unpacks, e.g. /opt/tritonserver in NVIDIA's tritonserver container (docs/gpu.md); the model "
                        "then runs in that server's Python with this environment's packages on its path "
                        "(default: $CRITICALKV_TRITONSERVER)")
    p.add_argument("--setup", action="store_true", help="only set up tritonserver and the model environment, then exit")
    p.add_argument("--write-repo", type=Path, metavar="REPO",
                   help="only write the model repository for --engine-dir into REPO and exit: REPO/NAME/config.pbtxt "
                        "(decoupled Python-backend model, vllm_backend's inputs and outputs + kv_budget and KV bytes), "
                        "REPO/NAME/1/model.py (the adapter over the continuous-batching scheduler) and model.json (the "
                        "engine arguments), for another Triton server (a container: scripts/container_serve.sh); "
                        "REPO/NAME must not exist yet")
    p.add_argument("--execution-env", default="auto",
                   help="with --write-repo: the virtual environment the model runs in (EXECUTION_ENV_PATH): 'auto' = "
                        "the one `criticalkv serve --setup` made for the bundled CPU server, 'none' = the server's own "
                        "Python (default: auto)")
    p.add_argument("--ready-timeout", type=positive_float, default=600.0,
                   help="seconds to wait for the server (default: 600)")
    add_replica_arguments(p)
    p.set_defaults(func=run)


def engine_dir_of(args) -> Path:
    """The engine directory: --engine-dir, or the one the --repo model's model.json names."""
    if args.engine_dir is not None:
        return Path(args.engine_dir)
    arguments = Path(args.repo) / args.model_name / "1" / "model.json"
    try:
        return Path(json.loads(arguments.read_text())["engine_dir"])
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"--repo {args.repo}: cannot read the engine directory from {arguments} ({err}); "
                         "the OpenAI API needs the engine's tokenizer (or give --openai-port 0)") from None


def resolve_api_key(args: argparse.Namespace) -> None:
    """``args.api_key`` from --api-key, else $CRITICALKV_API_KEY; ``args.api_key_source`` says which (the ready
    banner shows the header as the user gave the key: the variable's name, or a placeholder for the flag's value)."""
    if args.api_key is not None:
        args.api_key_source = "--api-key"
    elif os.environ.get("CRITICALKV_API_KEY") is not None:
        args.api_key, args.api_key_source = os.environ["CRITICALKV_API_KEY"], "$CRITICALKV_API_KEY"
    else:
        args.api_key_source = None
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError(f"{args.api_key_source} is empty")


def run(args: argparse.Namespace) -> int:
    resolve_api_key(args)
    if wants_replicas(args):  # Ray Serve replicas (criticalkv.replicas), no Triton
        return run_replicas(args)
    if args.tritonserver is not None:  # the launcher's helpers read it (and tritonserver's children inherit it)
        os.environ[launcher.TRITONSERVER_ENV] = str(Path(args.tritonserver).resolve())
    if args.setup:
        launcher.setup(log=lambda m: print(m, file=sys.stderr))
        env = f"model environment {launcher.model_env()}" if launcher.model_env() else "the model runs in its Python"
        print(f"tritonserver ready to run from {launcher.server_dir()} ({env})")
        return 0
    if args.write_repo is not None:
        return write_repo(args)
    # every argument is checked before anything is set up or started (each a one-line error, status 2)
    if args.repo is None and args.engine_dir is None:
        raise ValueError("give --engine-dir (or --repo with a rendered model repository)")
    if args.repo is not None and not Path(args.repo).is_dir():
        raise FileNotFoundError(f"{args.repo}: no such model repository")
    manifest = None if args.engine_dir is None else \
        read_manifest(args.engine_dir, verify=False)  # a file, a missing or unfinished engine: named now
    scheduler = scheduler_config(args)
    say = lambda m: print(f"criticalkv serve: {m}", file=sys.stderr)  # noqa: E731
    chosen = None  # why serve picked the backend itself, said once nothing stands in the way of the start
    if args.repo is None and args.backend is None:  # the fastest CPU backend here
        from criticalkv.runtime.registry import served_backend

        args.backend, chosen = served_backend(manifest)
    if args.repo is None:
        check_backend(Path(args.engine_dir), args.backend, args.gpus)
        note = prefix_cache_note(args)
        if note:
            say(note)
    else:
        check_backend(*repo_backend(args))
    launcher.setup(log=lambda m: print(m, file=sys.stderr))
    parent = Path(tempfile.gettempdir())
    launcher.remove_stale_servers(say)  # a killed run's processes and shared memory, when its watchdog died too
    remove_stale_temporaries(parent, TEMP_PREFIX, say)
    ports = {"--http-port": args.http_port, "--grpc-port": args.grpc_port, "--metrics-port": args.metrics_port}
    if args.openai_port:
        ports["--openai-port"] = args.openai_port
    launcher.check_ports_free(args.host, ports)  # PortInUse (an OSError): one line, status 2
    openai_sock = launcher.bind_socket(args.host, args.openai_port, "--openai-port") if args.openai_port else None
    if chosen is not None:
        say(f"backend {args.backend}: {chosen}")

    # handlers first: a signal during start-up stops what has started (the finally below)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    # the watchdog cleans up after this process if it dies without its finally (SIGKILL, the OOM killer)
    watchdog = launcher.Watchdog("criticalkv serve")
    tmp = temporary_dir(parent, TEMP_PREFIX)
    watchdog.remove(tmp)
    server = frontend = None
    try:
        repo = args.repo
        if repo is None:
            repo = tmp / "models"
            make_repository(args.engine_dir, repo, model_name=args.model_name, instances=args.instances,
                            scheduler=scheduler, backend=args.backend,
                            gpus=args.gpus, threads=args.threads,
                            execution_env=str(launcher.model_env()) if launcher.model_env() else None,
                            python_paths=launcher.project_paths(), request_timeout=args.request_timeout)
        engine_dir = engine_dir_of(args) if openai_sock is not None else None
        server = launcher.TritonServer(repo, args.http_port, args.grpc_port, args.metrics_port,
                                       log_file=tmp / "tritonserver.log", host=args.host, watchdog=watchdog,
                                       drain_file=tmp / "draining")
        print(f"starting tritonserver (log: {server.log_file}) ...", file=sys.stderr, flush=True)
        # from this (the main) thread: tritonserver gets SIGKILL when the thread that started it ends
        server.launch()
        try:
            # the frontend's imports and tokenizer load while the model loads
            tokenizer = _load_tokenizer(engine_dir) if engine_dir is not None else None
            server.wait_ready(args.ready_timeout, cancelled=stop.is_set)
            if openai_sock is not None and not stop.is_set():
                from criticalkv.serving.openai_api import OpenAIFrontend

                build = read_manifest(engine_dir, verify=False)["build"]
                frontend = OpenAIFrontend(openai_sock, server.grpc_url, args.model_name, tokenizer, args.api_key,
                                          chat_max_tokens=int(build["max_new_tokens"]),
                                          text_bound=TextBound.of(tokenizer, int(build["max_input_len"])),
                                          max_body_bytes=args.max_body_bytes,
                                          request_timeout=args.request_timeout)
                frontend.start(cancelled=stop.is_set)
        except (RuntimeError, TimeoutError) as err:
            print(f"criticalkv serve: error: {err}", file=sys.stderr)
            return 1
        if stop.is_set():
            return 0
        print(ready_message(args, server), flush=True)
        while not stop.wait(1.0):
            if server.process.poll() is not None:
                print(f"tritonserver exited with code {server.process.returncode}:\n{server.log_tail()}",
                      file=sys.stderr)
                return 1
            if frontend is not None and not frontend.alive():
                print("criticalkv serve: the OpenAI-compatible frontend stopped", file=sys.stderr)
                return 1
    finally:
        if stop.is_set():
            say("stopping: ending the requests in flight")
        if frontend is not None:
            frontend.stop()
        elif openai_sock is not None:
            openai_sock.close()
        if server is not None and server.process is not None:
            code = server.stop()
            print(f"tritonserver stopped (exit code {code})", file=sys.stderr)
        shutil.rmtree(tmp, ignore_errors=True)
        watchdog.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def write_repo(args: argparse.Namespace) -> int:
    """``--write-repo REPO``: the model repository for --engine-dir, written and nothing started."""
    if args.engine_dir is None:
        raise ValueError("--write-repo: give --engine-dir (the engine the repository's model serves)")
    read_manifest(args.engine_dir, verify=False)
    auto = launcher.model_env()  # None with an external server ($CRITICALKV_TRITONSERVER): its own Python
    env = {"auto": str(auto) if auto else None, "none": None}.get(args.execution_env, args.execution_env)
    paths = launcher.project_paths() if args.execution_env != "none" else []
    target = make_repository(args.engine_dir, args.write_repo, model_name=args.model_name, instances=args.instances,
                             scheduler=scheduler_config(args), backend=args.backend,
                             gpus=args.gpus, threads=args.threads, execution_env=env, python_paths=paths)
    print(f"model repository written: {target}")
    return 0


def repo_backend(args) -> tuple[Path | None, str, list[int] | None]:
    """(engine directory, backend, GPU ids) of the --repo model, as its model.json and config.pbtxt say (None, ...
    when model.json cannot be read: the server then says what is wrong)."""
    arguments = Path(args.repo) / args.model_name / "1" / "model.json"
    try:
        config = json.loads(arguments.read_text())
        return Path(config["engine_dir"]), config.get("backend", "onnxruntime"), None
    except (OSError, ValueError, KeyError, TypeError):
        return None, "onnxruntime", None


def check_backend(engine_dir: Path | None, backend: str, gpus: list[int] | None) -> None:
    """EngineError (one line, status 2) before anything starts when --backend tensorrt cannot run here: no TensorRT
    engines in the engine directory (the message `generate --backend tensorrt` gives), no TensorRT or no CUDA GPU,
    a GPU id that does not exist, or no plugin library."""
    if backend != "tensorrt" or engine_dir is None:
        return
    from criticalkv.errors import EngineError
    from criticalkv.runtime.tensorrt_backend import engine_files
    from criticalkv.tensorrt import resolve_plugin_library, tensorrt_unavailable_reason

    manifest = read_manifest(engine_dir, verify=False)
    engine_files(engine_dir, manifest)
    reason = tensorrt_unavailable_reason()
    if reason is not None:
        raise EngineError(f"--backend tensorrt cannot run here: {reason}")
    import torch

    count = torch.cuda.device_count()
    missing = [g for g in (gpus or [0]) if not 0 <= g < count]
    if missing:
        raise EngineError(f"--gpus: no GPU {', '.join(map(str, missing))} here ({count} visible: 0..{count - 1})")
    resolve_plugin_library(engine_dir, manifest["tensorrt"].get("plugin_library"))


def _load_tokenizer(engine_dir: Path):
    """The engine's tokenizer, as ``Engine.tokenizer`` loads it (the fast tokenizer loads no torch: this process then
    starts and exits seconds sooner)."""
    if not (Path(engine_dir) / "tokenizer").is_dir():
        raise FileNotFoundError(f"{engine_dir}: no tokenizer folder (the OpenAI API needs it; or give --openai-port 0)")
    return load_tokenizer(engine_dir)


def ready_message(args, server) -> str:
    lines = [f"ready: Triton HTTP {server.http_url}  gRPC {server.grpc_url}  metrics {server.metrics_url}"]
    host = server.http_url.split("//")[1].rsplit(":", 1)[0]
    if args.openai_port:
        base = f"http://{host}:{args.openai_port}/v1"
        auth = launcher.auth_header(args.api_key, args.api_key_source)  # the key itself is never printed
        key_note = ", API key required" if args.api_key else ""
        body = json.dumps({"model": args.model_name, "messages": [{"role": "user", "content": "..."}]})
        lines.append(f"  OpenAI API {base}  (model \"{args.model_name}\"{key_note})")
        lines.append(f"  curl {base}/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'")
    lines.append(f"  curl -N -X POST {server.http_url}/v2/models/{args.model_name}/generate_stream "
                 "-d '{\"text_input\": \"...\", \"max_tokens\": 64, \"stream\": true, \"apply_chat_template\": true}'")
    if args.host in ("0.0.0.0", "::", ""):
        lines.append(f"  listening on every network interface (--host {args.host})")
    lines.append("Ctrl-C stops the server.")
    return "\n".join(lines)
