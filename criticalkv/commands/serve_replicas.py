"""``criticalkv serve --replicas N`` / ``--ray-address ADDR``: the flags of the Ray Serve deployment
(``criticalkv.replicas``) beside those of the Triton server, and the run that uses them."""

from __future__ import annotations

import argparse
import os
import signal
import threading
from pathlib import Path


def add_replica_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "replicas (Ray Serve; needs `pip install criticalkv[ray]`)",
        "--replicas N (or --ray-address) serves the engine as N Ray Serve replicas, each its own engine and scheduler, "
        "behind the same OpenAI-compatible API on --openai-port (no Triton: its ports are not used); a request's "
        "`context` goes to the replica that holds it compressed, and compressed contexts are shared through Ray's "
        "object store (docs/serving.md, 'Past one machine')")
    g.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="engine replicas (default: 1 with --ray-address; without either flag, Triton serves)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (e.g. 10.0.0.1:6379, or 'auto' on one of its nodes) instead of starting "
                        "a local Ray for the replicas")
    g.add_argument("--replica-options", type=replica_options, default={}, metavar="KEY=VALUE[,KEY=VALUE...]",
                   help="the deployment's advanced settings: router=affinity (default: a request goes to the replica "
                        "holding its context compressed unless that replica's queue is longer than the shortest by more "
                        "than imbalance_threshold, else to the least loaded) or pow2 (Ray Serve's power-of-two-choices "
                        "router); imbalance_threshold=4; context_store_mib=1024 (compressed contexts kept in Ray's "
                        "object store for every replica; 0 = none); replica_cpus=1 (CPUs Ray reserves per replica: set "
                        "--threads to match); replica_gpus=0 (1 with --backend tensorrt or torch on GPU nodes); "
                        "max_ongoing_requests=64 (requests one replica takes at once; beyond it the router holds them); "
                        "prepack=0 (1: ONNX Runtime's sessions prepack their own copies of the weights as `criticalkv "
                        "serve` does: faster prefill and decode, about 1.9 GB more per replica of the bundled model); "
                        "app_name=criticalkv (the Serve application's name: several models on one cluster)")


def switch(value: str) -> bool:
    """0 or 1 (a --replica-options switch)."""
    if value not in ("0", "1"):
        raise ValueError(value)
    return value == "1"


switch.__name__ = "0 or 1"

#: --replica-options' keys: type and default (the ReplicaServeConfig field each sets, named alike but store_mib).
REPLICA_OPTIONS = {"router": (str, "affinity"), "imbalance_threshold": (int, 4), "context_store_mib": (float, 1024.0),
                   "replica_cpus": (float, 1.0), "replica_gpus": (float, 0.0), "max_ongoing_requests": (int, 64),
                   "prepack": (switch, False),
                   "app_name": (str, "criticalkv")}


def replica_options(text: str) -> dict:
    """``key=value,...`` -> {key: value} of REPLICA_OPTIONS (argparse type: a bad one is one argparse line)."""
    out = {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        key, sep, value = item.partition("=")
        if not sep or key not in REPLICA_OPTIONS:
            raise argparse.ArgumentTypeError(f"{item!r}: give KEY=VALUE with KEY one of {', '.join(REPLICA_OPTIONS)}")
        kind = REPLICA_OPTIONS[key][0]
        try:
            out[key] = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{key}={value!r} is not a valid {kind.__name__}") from None
    return out


def wants_replicas(args: argparse.Namespace) -> bool:
    return getattr(args, "replicas", None) is not None or getattr(args, "ray_address", None) is not None


def run_replicas(args: argparse.Namespace) -> int:
    """``criticalkv serve`` with ``--replicas`` / ``--ray-address``."""
    from criticalkv.commands.model_options import scheduler_config

    if args.repo is not None:
        raise ValueError("--repo is a Triton model repository: the replicas serve --engine-dir")
    if args.engine_dir is None:
        raise ValueError("give --engine-dir")
    if args.instances != 1:
        raise ValueError("--instances is Triton's: with the replicas, give --replicas")
    if not args.openai_port:
        raise ValueError("--openai-port 0: the replicas are reached through the OpenAI API only")
    from criticalkv.replicas.launch import ReplicaServeConfig, ray_environment, serve_replicas
    from criticalkv.serving import launcher

    os.environ.update(ray_environment(args.host, local=args.ray_address is None))  # before ray is imported
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        raise ValueError("--replicas needs Ray Serve: pip install 'criticalkv[ray]'") from None

    options = {key: default for key, (_, default) in REPLICA_OPTIONS.items()}
    options.update(args.replica_options)
    fields = dict(  # the replicas' own flags first (ReplicaServeConfig checks them), then the engine's
        engine_dir=Path(args.engine_dir), replicas=args.replicas if args.replicas is not None else 1,
        ray_address=args.ray_address, host=args.host, port=args.openai_port, api_key=args.api_key,
        api_key_source=getattr(args, "api_key_source", None), request_timeout=args.request_timeout,
        model_name=args.model_name, backend=args.backend, threads=args.threads, router=options["router"],
        imbalance_threshold=options["imbalance_threshold"],
        store_mib=options["context_store_mib"], replica_cpus=options["replica_cpus"],
        replica_gpus=options["replica_gpus"], max_ongoing_requests=options["max_ongoing_requests"],
        prepack=options["prepack"],
        app_name=options["app_name"], ready_timeout=args.ready_timeout,
        max_body_bytes=args.max_body_bytes)
    ReplicaServeConfig(**fields)
    config = ReplicaServeConfig(**fields, scheduler=scheduler_config(args).to_dict())
    launcher.check_ports_free(args.host, {"--openai-port": args.openai_port})  # PortInUse: one line, status 2
    sock = launcher.bind_socket(args.host, args.openai_port, "--openai-port")  # held from now on: nobody takes it
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return serve_replicas(config, stop, sock)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
