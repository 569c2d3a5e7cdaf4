"""The two errors a user of criticalkv meets: an engine that cannot be served and a request that cannot be.

Both are ``ValueError``s whose message names the problem (and the field); the serving frontends turn a
``RequestError`` into an HTTP 400 / gRPC INVALID_ARGUMENT for that request alone.
"""

from __future__ import annotations


class EngineError(ValueError):
    """An engine directory, or a request to it, that cannot be served (the message says why)."""


class RequestError(EngineError):
    """A request the engine cannot serve: a field out of range or of the wrong type (the message names it)."""
