"""Ctrl-C and SIGTERM on the command line: a signal ends a command with one line, at whatever moment it lands.

Python runs a signal's handler between bytecodes, in the main thread, and two moments defeat a handler that
only raises:

* a signal that lands just before a blocking system call (a ``read()`` of a FIFO or a terminal) is noted, but
  the call does not return, so the handler never runs: long waits must wake up now and then
  (``criticalkv.files.read_text_interruptibly``) and call ``raise_pending()``;
* an exception raised while Python runs a ``__del__`` method or a weakref callback (the import system's
  module locks have one) is printed as "Exception ignored" and dropped: the command would go on, and hang
  at its next wait.

So the handlers here note every signal before raising, ``raise_pending()`` raises a noted signal again, and
``signals_raise()`` raises, on entry, a signal noted by ``note`` during start-up (``criticalkv.cli`` installs
it first thing when run as ``python -m criticalkv.cli``). Standard library only: imported before anything heavy.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

#: exit status after Ctrl-C (128 + SIGINT) and after SIGTERM (128 + SIGTERM), as shells report them
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_pending: list[int] = []


class Terminated(BaseException):
    """Raised in the main thread on SIGTERM (``timeout``, ``kill``, a CI cancellation), like
    KeyboardInterrupt on Ctrl-C, so that every ``finally`` (temporary directories, locks) runs."""


def _exception(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated()


def note(signum: int, frame=None) -> None:
    """A handler that only notes the signal (start-up, before ``signals_raise``)."""
    _pending.append(signum)


def _note_and_raise(signum: int, frame) -> None:
    _pending.append(signum)
    raise _exception(signum)


def raise_pending() -> None:
    """Raise KeyboardInterrupt / Terminated for a signal noted since ``signals_raise`` began (or before),
    whose own exception was lost or not raised yet; nothing when none came."""
    if _pending:
        raise _exception(_pending[0])


def note_early() -> None:
    """Note SIGINT / SIGTERM from now on (only note: raising at the first lines of a program leaves a traceback)."""
    for sig in SIGNALS:
        signal.signal(sig, note)


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """While inside: SIGINT raises KeyboardInterrupt and SIGTERM raises Terminated in the main thread (both
    noted for ``raise_pending``); a signal noted before entry is raised at once. On exit the previous
    handlers come back and the notes are cleared. Outside the main thread: nothing changes."""
    try:
        previous = {sig: signal.signal(sig, _note_and_raise) for sig in SIGNALS}
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        raise_pending()
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _pending.clear()


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """``signals_raise()`` (the older name: SIGTERM raises Terminated; Ctrl-C raises KeyboardInterrupt)."""
    with signals_raise():
        yield
