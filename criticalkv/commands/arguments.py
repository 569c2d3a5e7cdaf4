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


def _at_least(convert, low, strict: bool = False):
    """An argparse type: ``convert(text)``, which must be >= ``low`` (> ``low`` when ``strict``)."""

    def check(text: str):
        value = convert(text)
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low}, got {text}")
        return value

    return check


positive_int = _at_least(_int, 1)
nonnegative_int = _at_least(_int, 0)
positive_float = _at_least(_float, 0, strict=True)
nonnegative_float = _at_least(_float, 0)


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


def check_request(manifest: dict, sampling, prompt_ids: list[int] | None = None, context_ids: list[int] | None = None,
                  kv_budget: int | None = None) -> None:
    """RequestError (a ValueError: one line) when the request cannot run on the engine whose manifest this is, decided
    without loading it: the engine's own rules and messages (``Request.checked``: ``max_tokens`` within the built
    maximum, the prompt and a context before it within the max input length, the question within the max question
    length, ``kv_budget`` within the policy's range), with the command line's flag names. Without ``prompt_ids`` (the
    prompt not tokenised yet), ``max_tokens`` alone."""
    from criticalkv.errors import RequestError
    from criticalkv.request import Request, check_max_tokens
    from criticalkv.runtime.manifest import engine_limits

    limits = engine_limits(manifest)
    try:
        if prompt_ids is None:
            if sampling.max_tokens is not None:
                check_max_tokens(sampling.max_tokens, limits.max_new_tokens)
            return
        Request(prompt_ids, sampling, kv_budget, context_token_ids=context_ids or ()).checked(limits)
    except RequestError as err:
        message = str(err)
        for field, flag in (("max_tokens", "--max-tokens"), ("kv_budget", "--budget")):
            if message.startswith(field):
                message = f"{flag}: {message}"
        raise RequestError(message) from None
