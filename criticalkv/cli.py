"""``criticalkv``: the command-line entry point. Each subcommand lives in its own module."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import signal
import sys
from importlib import metadata
from typing import Iterator

#: Modules that define ``register(subparsers)``; one line per subcommand.
SUBCOMMANDS = [
    "criticalkv.commands.policies",
    "criticalkv.commands.select",
    "criticalkv.commands.generate",
    "criticalkv.commands.eval",
    "criticalkv.commands.triton_repo",
    "criticalkv.commands.serve",
    "criticalkv.commands.bench",
]

#: Exit status after Ctrl-C (128 + SIGINT) and after SIGTERM (128 + SIGTERM), as shells report them.
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


class Terminated(BaseException):
    """Raised in the main thread on SIGTERM (``timeout``, ``kill``, a CI cancellation), like
    KeyboardInterrupt on Ctrl-C, so that every ``finally`` (temporary directories, locks) runs."""


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """While inside, SIGTERM raises ``Terminated`` in the main thread (the previous handler is restored)."""
    def handler(signum, frame):
        raise Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def version() -> str:
    try:
        return metadata.version("criticalkv")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="criticalkv",
        description="Compressed KV caches for long-context LLM serving (CriticalKV and its base methods).",
    )
    parser.add_argument("--version", action="version", version=f"criticalkv {version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in SUBCOMMANDS:
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    name = f"criticalkv {args.command}"
    try:
        with sigterm_raises():
            return int(args.func(args) or 0)
    except (ValueError, OSError) as err:  # user errors: one clear line, no traceback
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted{_hint(args)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print(f"{name}: terminated (SIGTERM){_hint(args)}", file=sys.stderr)
        return EXIT_TERMINATED


def _hint(args) -> str:
    """What a stopped command leaves behind, when it says (``args.stop_hint``, set as the command runs)."""
    hint = getattr(args, "stop_hint", None)
    return f"; {hint}" if hint else ""


if __name__ == "__main__":
    sys.exit(main())
