"""``criticalkv``: the command-line entry point. Each subcommand lives in its own module."""

from __future__ import annotations

import argparse
import importlib
import sys

#: Modules that define ``register(subparsers)``; one line per subcommand.
SUBCOMMANDS = [
    "criticalkv.commands.policies",
    "criticalkv.commands.select",
    "criticalkv.commands.generate",
    "criticalkv.commands.eval",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="criticalkv",
        description="Compressed KV caches for long-context LLM serving (CriticalKV and its base methods).",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in SUBCOMMANDS:
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as err:  # user errors: one clear line, no traceback
        print(f"criticalkv {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
