"""The proxy's own exceptions, the error envelope, and the one client-exception boundary.

Every error the proxy itself produces is a ``ProxyError`` carrying its HTTP status and
envelope ``type``. aiohttp client exceptions are translated into these in exactly one
place, ``map_client_errors`` (like httpx's ``map_httpcore_exceptions``); the middleware
(http/middleware.py) turns them into HTTP responses.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError


class ProxyError(Exception):
    status: int = 500
    type: str = "server_error"
    outcome: str = "error"
    #: the request body was left half-read, so the connection cannot carry another
    #: request: the response says ``Connection: close``
    close_connection: bool = False

    def __init__(self, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}

    def envelope(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "code": self.status,
                "src": "llmproxy",
            }
        }

    def body(self) -> bytes:
        return json.dumps(self.envelope(), separators=(",", ":")).encode()


class HTTPStatusError(ProxyError):
    """An HTTP error raised by aiohttp itself (unknown method, bad request line...)."""

    outcome = "rejected"

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.type = "invalid_request_error" if status < 500 else "server_error"


class BadRequest(ProxyError):
    status, type, outcome = 400, "invalid_request_error", "rejected"


class Unauthorized(ProxyError):
    status, type, outcome = 401, "authentication_error", "rejected"


class Forbidden(ProxyError):
    """Refused whoever presents it: a Host or Origin the proxy does not serve."""

    status, type, outcome = 403, "permission_error", "rejected"


class NotFound(ProxyError):
    status, type, outcome = 404, "not_found_error", "rejected"


class UnknownModel(NotFound):
    """A request names a model no upstream serves (pool/models.py); the message lists those
    they do."""


class NotAllowed(ProxyError):
    status, type, outcome = 405, "invalid_request_error", "rejected"


class RequestTimeout(ProxyError):
    status, type, outcome = 408, "request_timeout", "rejected"
    close_connection = True  # RFC 9110 15.5.9


class BodyTooLarge(ProxyError):
    status, type, outcome = 413, "request_too_large", "rejected"


class QueueFull(ProxyError):
    status, type, outcome = 429, "queue_full", "rejected"


SUPERSEDED = "superseded by a newer request from the same session"


class Superseded(ProxyError):
    """A newer request from the same session replaced this one (Continue: silent cancel)."""

    status, type, outcome = 499, "superseded", "superseded"


class QueueTimeout(ProxyError):
    status, type, outcome = 503, "queue_timeout", "rejected"


class ShuttingDown(ProxyError):
    status, type, outcome = 503, "shutting_down", "rejected"


class UpstreamUnreachable(ProxyError):
    """No connection could be made (refused, unreachable, unresolvable): the request never left."""

    status, type, outcome = 502, "upstream_unreachable", "error"


class UpstreamFailed(ProxyError):
    status, type, outcome = 502, "upstream_error", "error"


class UpstreamTimeout(ProxyError):
    status, type, outcome = 504, "upstream_timeout", "error"


class UpstreamConnectTimeout(UpstreamTimeout):
    """No connection within ``connect_timeout_s`` (a black-holed host): the request never left."""


def map_client_errors(what: str = "upstream") -> ClientErrorMap:
    """``with map_client_errors():`` translates aiohttp/asyncio client exceptions raised in
    the block into ProxyErrors (the one boundary)."""
    return ClientErrorMap(what)


class ClientErrorMap:
    """The context manager ``map_client_errors`` returns (a plain class: it is on every
    relayed request's path, where a generator-based one costs more)."""

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, _type: type[BaseException] | None, exc: BaseException | None, _tb: object
    ) -> None:
        if exc is None or isinstance(exc, ProxyError) or not isinstance(exc, Exception):
            return  # nothing raised, already ours, or not an error (cancellation): as it is
        mapped = _translate(exc, self.what)
        if mapped is not None:
            raise mapped from exc
        # anything else is a bug of ours: it propagates as it is


def _translate(exc: Exception, what: str) -> ProxyError | None:
    if isinstance(exc, (aiohttp.ClientConnectorError, ConnectionRefusedError)):
        return UpstreamUnreachable(f"{what} unreachable: {exc.__class__.__name__}: {exc}")
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return UpstreamConnectTimeout(f"{what} connect timed out")
    if isinstance(exc, (aiohttp.ServerTimeoutError, asyncio.TimeoutError, TimeoutError)):
        return UpstreamTimeout(f"{what} timed out")
    if isinstance(exc, aiohttp.ClientResponseError):
        return UpstreamFailed(f"{what} error: {exc.status} {exc.message}")
    if isinstance(exc, HttpProcessingError):
        # aiohttp's response parser: not HTTP/1.1 as it knows it
        return UpstreamFailed(f"{what} sent a malformed response: {exc.message}")
    if isinstance(exc, (aiohttp.ClientError, ConnectionError, OSError)):
        return UpstreamFailed(f"{what} failed: {exc.__class__.__name__}: {exc}")
    return None
