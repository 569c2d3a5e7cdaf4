"""The project's laboratory benchmarks: what measures criticalkv's own internals or re-makes a committed result.

Not installed (``pyproject.toml`` installs ``criticalkv*`` only) and imported by nothing in the package; each module
runs from the repository root of a checkout with the project's environment, on this checkout's ``criticalkv``:

    .venv/bin/python -m benchmarks.latency --help

The benchmarks a user runs against a server (``criticalkv bench serve``, ``docqa``, ``memory``, ``aiperf``, ``vllm``,
the peers, ``gpu`` and ``gpu-serve``) stay in the package, under ``criticalkv/bench/``; docs/benchmarks.md draws the
line. A module here may import the package from any floor; the package never imports a module here
(``tests/test_layers.py``).
"""

from __future__ import annotations

import shlex
import sys
from typing import Callable, Sequence

from criticalkv.interrupts import EXIT_INTERRUPTED, EXIT_TERMINATED, Terminated, signals_raise


def prog(name: str) -> str:
    """How a benchmark is run: ``python -m benchmarks.NAME``."""
    return f"python -m benchmarks.{name}"


def command_line(name: str, argv: Sequence[str] | None = None) -> str:
    """The command as typed (``argv`` None: this process's arguments), for the results' header."""
    return " ".join([prog(name), shlex.join(sys.argv[1:] if argv is None else list(argv))]).rstrip()


def plain(doc: str | None) -> str:
    """A docstring for a terminal: without its ``markup``."""
    return (doc or "").replace("``", "")


def run(name: str, main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """``main(argv)`` as the ``criticalkv`` command runs a subcommand: a user error (ValueError, OSError) is one line
    and exit status 2, Ctrl-C and SIGTERM end it with one line (130, 143) after every ``finally`` has run."""
    try:
        with signals_raise():
            return int(main(argv) or 0)
    except (ValueError, OSError) as err:
        print(f"{prog(name)}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog(name)}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print(f"{prog(name)}: terminated (SIGTERM)", file=sys.stderr)
        return EXIT_TERMINATED
