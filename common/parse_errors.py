"""A server's own JSON envelope for requests aiohttp's HTTP parser rejects.

Malformed framing (Content-Length with Transfer-Encoding, a bare CR in a header, headers
too large, a bad request line) never reaches a middleware: aiohttp's protocol answers it
through ``RequestHandler.handle_error`` with plain text. ``install(runner, envelope, log)``
makes the runner's server build handlers whose ``handle_error`` answers with
``envelope(status, message)`` (the server's JSON error body) instead: same status,
connection still closed. The same handlers log what the client's own bytes caused
(``BadHttpMessage``: bad framing, a corrupt compressed body, also when aiohttp meets it
while discarding an unread body) as one warning line on ``log``, not an ERROR with a
traceback that any client could repeat at will.

aiohttp offers no public hook for the handler class, so ``install`` swaps the class of
the runner's server instance once, after ``runner.setup()`` and before any site starts,
for a subclass made for that server (its handlers' class carries ``envelope`` and
``log`` as class attributes; neither subclass adds instance state). Used by the proxy
(``proxy/http/parse_errors.py``) and the backend (``backend/server.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from http import HTTPStatus
from typing import Any, ClassVar

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

Envelope = Callable[[int, str], bytes]
"""``(status, message)`` -> the JSON body of the server's error envelope."""


class _EnvelopeRequestHandler(RequestHandler):
    __slots__ = ()
    envelope: ClassVar[Envelope]
    log: ClassVar[Any]  # a structlog logger

    def log_exception(self, *args: Any, **kw: Any) -> None:
        exc = kw.get("exc_info")
        cause = exc.__cause__ if isinstance(exc, BaseException) else None
        bad = next((e for e in (exc, cause) if isinstance(e, BadHttpMessage)), None)
        if bad is None:
            super().log_exception(*args, **kw)
            return
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        first_line = (str(bad.message).strip().splitlines() or [""])[0][:200]
        self.log.warning(
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
        body = type(self).envelope(status, f"{phrase}: {detail}" if detail else phrase)
        resp = web.Response(status=status, body=body, content_type="application/json")
        resp.force_close()
        return resp


class _EnvelopeServer(web.Server):
    handler_class: ClassVar[type[_EnvelopeRequestHandler]]

    def __call__(self) -> RequestHandler:
        handler = super().__call__()
        handler.__class__ = self.handler_class
        return handler


def install(runner: web.BaseRunner, envelope: Envelope, log: Any) -> None:
    """Call after ``runner.setup()``, before starting any site."""
    server = runner.server
    if server is None:
        raise RuntimeError("install() needs a runner that has been set up")
    handler_class = type(
        "EnvelopeRequestHandler",
        (_EnvelopeRequestHandler,),
        {"__slots__": (), "envelope": staticmethod(envelope), "log": log},
    )
    server.__class__ = type("EnvelopeServer", (_EnvelopeServer,), {"handler_class": handler_class})
