"""Count the options of ``criticalkv``'s command line: every leaf subcommand's options (argparse actions with option
strings; --help and suppressed ones left out), summed: the measure a target on the number of options ("30 %
fewer") is read on.

    .venv/bin/python scripts/count_cli_options.py        # "<leaves> leaves, <options> options"
    .venv/bin/python scripts/count_cli_options.py -v     # and each leaf's count

A subcommand that parses its own arguments behind ``argparse.REMAINDER`` (bench gpu) and one with a positional
argument only (bench report) count 0 here; the laboratory's benchmarks (``python -m benchmarks.NAME``) are not
``criticalkv``'s options.
"""

from __future__ import annotations

import argparse
import sys

from criticalkv.cli import build_parser


def leaves(parser: argparse.ArgumentParser, path: list[str]):
    """(command words, parser) of every leaf under ``parser``."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for sub in subs:
        for name, child in sub.choices.items():
            yield from leaves(child, path + [name])


def options(parser: argparse.ArgumentParser) -> int:
    return sum(1 for a in parser._actions
               if a.option_strings and a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction))


def main(argv: list[str] | None = None) -> int:
    verbose = "-v" in (sys.argv[1:] if argv is None else argv)
    found = list(leaves(build_parser(), []))
    if verbose:
        for path, parser in found:
            print(f"{' '.join(path)}: {options(parser)}")
    print(f"{len(found)} leaves, {sum(options(p) for _, p in found)} options")
    return 0


if __name__ == "__main__":
    sys.exit(main())
