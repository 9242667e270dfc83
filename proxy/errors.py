"""The proxy's own exceptions and the error envelope, free of any transport.

Every error the proxy itself produces is a ``ProxyError`` carrying its HTTP status and
envelope ``type``. aiohttp client exceptions are translated into these in exactly one
place, beside the client (upstream/client_errors.py, as httpx keeps ``_exceptions.py``
pure and maps in its transport); the middleware (http/middleware.py) turns them into HTTP
responses. Nothing here imports aiohttp, so the gate that raises them stays pure asyncio.
"""

from __future__ import annotations

import json
from typing import Any


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
