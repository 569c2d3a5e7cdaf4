"""``criticalkv``: the command-line entry point. Each subcommand lives in its own module."""

from __future__ import annotations

if __name__ == "__main__":  # `python -m criticalkv.cli`: signals are noted from the first line, raised in main()
    from criticalkv import interrupts

    interrupts.note_early()

import gc
import importlib
import os
import sys
import warnings
from importlib import metadata

from criticalkv.commands.arguments import Parser
from criticalkv.interrupts import (  # noqa: F401 (re-exported: scripts/ use them)
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    Terminated,
    raise_pending,
    signals_raise,
    sigterm_raises,
)

#: Modules that define ``register(subparsers)``; one line per subcommand.
SUBCOMMANDS = [
    "criticalkv.commands.policies",
    "criticalkv.commands.select",
    "criticalkv.commands.generate",
    "criticalkv.commands.eval",
    "criticalkv.commands.serve",
    "criticalkv.commands.bench",
    "criticalkv.commands.surrogate",
    "criticalkv.commands.env",
]


def version() -> str:
    try:
        return metadata.version("criticalkv")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> Parser:
    parser = Parser(  # its errors are one line; the subcommands' parsers are of its class
        prog="criticalkv",
        description="Compressed KV caches for long-context LLM serving (CriticalKV and its base methods).",
    )
    parser.add_argument("--version", action="version", version=f"criticalkv {version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in SUBCOMMANDS:
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` (None: this process's command line); its exit status."""
    try:
        return _main(argv)
    finally:
        if argv is None:
            # the process ends with this command: its objects leave Python's final collection (with transformers and
            # the serving stack loaded, that collection alone took ~1 s of the command's exit); the OS frees them
            gc.freeze()


def _one_line_warning(message, category, filename, lineno, line=None, _default=warnings.formatwarning) -> str:
    """The project's own warnings (``criticalkv/...``) as one line for a command-line user; others as Python writes them."""
    if issubclass(category, UserWarning) and f"{os.sep}criticalkv{os.sep}" in filename:
        return f"criticalkv: warning: {message}\n"
    return _default(message, category, filename, lineno, line)


def _main(argv: list[str] | None) -> int:
    # Ctrl-C (KeyboardInterrupt) and SIGTERM (Terminated) are caught from here on, before the subcommands'
    # modules (torch, ONNX Runtime: seconds) are imported: a signal during start-up ends the command with
    # its one line too (before this point only Python's own start-up runs: the signal then simply kills it)
    args = None
    warnings.formatwarning = _one_line_warning
    name = _command_name(sys.argv[1:] if argv is None else argv)
    try:
        with signals_raise():
            parser = build_parser()
            args, extra = parser.parse_known_args(argv)
            if extra and not getattr(args, "passes_arguments", False):
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
            if extra:  # a subcommand that hands its arguments to a module's own parser (criticalkv bench gpu)
                args.arguments = list(args.arguments) + extra
            name = f"criticalkv {args.command}"
            code = int(args.func(args) or 0)
            raise_pending()  # a signal whose exception was dropped (it landed in a __del__): the command still ends
            return code
    except (ValueError, OSError) as err:  # user errors: one clear line, no traceback
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted{_hint(args)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print(f"{name}: terminated (SIGTERM){_hint(args)}", file=sys.stderr)
        return EXIT_TERMINATED


def _command_name(argv: list[str]) -> str:
    """``criticalkv SUBCOMMAND`` as far as the raw arguments tell (before the parser exists)."""
    words = [a for a in argv if not a.startswith("-")]
    return f"criticalkv {words[0]}" if words else "criticalkv"


def _hint(args) -> str:
    """What a stopped command leaves behind, when it says (``args.stop_hint``, set as the command runs)."""
    hint = getattr(args, "stop_hint", None)
    return f"; {hint}" if hint else ""


if __name__ == "__main__":
    sys.exit(main())
