"""What the command line checks of its arguments, in one place, before anything loads.

* ``Parser``: argparse's parser whose errors are one line, ``PROG: error: MESSAGE (see PROG --help)``, instead of the
  usage (two dozen lines for ``serve``) followed by the error; the subcommands' parsers inherit it.
* Argument types that refuse a bad value with a message naming the range (``port``, ``positive_int``, ...): argparse
  reports them as ``argument --http-port: 99999 is not a port number: 1-65535``, before the command runs.
* ``check_request``: a request's ``--max-tokens``, ``--budget`` and prompt length against an engine's manifest, by the
  engine's own rules, without loading the engine (its weights, its ONNX Runtime sessions: seconds and gigabytes).
"""

from __future__ import annotations

import argparse


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose error is one line naming the problem and pointing at ``--help``."""

    def error(self, message: str):  # noqa: D401 (argparse's name)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def port(text: str) -> int:
    """A TCP port, 1-65535."""
    value = _int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number: 1-65535")
    return value


def port_or_zero(text: str) -> int:
    """A TCP port, or 0 (the service is not started)."""
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number: 1-65535 (or 0: not started)")
    return value


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def nonnegative_float(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def gpu_ids(text: str) -> list[int]:
    """Comma-separated GPU ids (>= 0, each once)."""
    ids = []
    for part in text.split(","):
        try:
            ids.append(int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of GPU ids (e.g. 0,1)") from None
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(f"{text!r}: GPU ids are integers >= 0, each given once")
    return ids


def check_request(manifest: dict, sampling, prompt_ids: list[int], context_ids: list[int] | None = None,
                  kv_budget: int | None = None) -> None:
    """RequestError (a ValueError: one line) when the request cannot run on the engine whose manifest this is, decided
    without loading it: the engine's own rules and messages (``Request.checked``: ``max_tokens`` within the built
    maximum, the prompt and a context before it within the max input length, the question within the max question
    length, ``kv_budget`` within the policy's range), with the command line's flag names."""
    from criticalkv.errors import RequestError
    from criticalkv.request import Request
    from criticalkv.runtime.manifest import engine_limits

    request = Request(prompt_ids, sampling, kv_budget, context_token_ids=context_ids or ())
    try:
        request.checked(engine_limits(manifest))
    except RequestError as err:
        message = str(err)
        for field, flag in (("max_tokens", "--max-tokens"), ("kv_budget", "--budget")):
            if message.startswith(field):
                message = f"{flag}: {message}"
        raise RequestError(message) from None
