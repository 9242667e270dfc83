"""The error envelope for requests aiohttp's HTTP parser rejects before any middleware.

Malformed framing (Content-Length with Transfer-Encoding, a bare CR in a header, headers
too large, a bad request line) never reaches the middleware: aiohttp's protocol answers it
through ``RequestHandler.handle_error`` with plain text. ``install(runner)`` makes the
runner's server build handlers whose ``handle_error`` answers with the proxy's JSON
envelope instead (same status, connection still closed). The same handlers log what the
client's own bytes caused (``BadHttpMessage``: bad framing, a corrupt compressed body,
also when aiohttp meets it while discarding an unread body) as one warning line, not an
ERROR with a traceback that any client could repeat at will. aiohttp offers no public
hook for the handler class, so this swaps the class of the runner's server instance
once, after ``runner.setup()`` and before any site starts; both subclasses add no state.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import structlog
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from llmproxy.proxy.errors import HTTPStatusError

log = structlog.get_logger("llmproxy.http")


class _EnvelopeRequestHandler(RequestHandler):
    __slots__ = ()

    def log_exception(self, *args: Any, **kw: Any) -> None:
        exc = kw.get("exc_info")
        cause = exc.__cause__ if isinstance(exc, BaseException) else None
        bad = next((e for e in (exc, cause) if isinstance(e, BadHttpMessage)), None)
        if bad is None:
            super().log_exception(*args, **kw)
            return
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        first_line = (str(bad.message).strip().splitlines() or [""])[0][:200]
        log.warning(
            "malformed request from the client",
            error=first_line,
            kind=type(bad).__name__,
            peer=peer[0] if peer else None,
        )

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        # logs; raises if output already started
        super().handle_error(request, status, exc, message)
        phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Error"
        detail = (message or "").strip().splitlines()[0][:200] if status < 500 and message else ""
        err = HTTPStatusError(status, f"{phrase}: {detail}" if detail else phrase)
        resp = web.Response(status=status, body=err.body(), content_type="application/json")
        resp.force_close()
        return resp


class _EnvelopeServer(web.Server):
    def __call__(self) -> RequestHandler:
        handler = super().__call__()
        handler.__class__ = _EnvelopeRequestHandler
        return handler


def install(runner: web.BaseRunner) -> None:
    """Call after ``runner.setup()``, before starting any site."""
    server = runner.server
    if server is None:
        raise RuntimeError("install() needs a runner that has been set up")
    server.__class__ = _EnvelopeServer
