"""Error replies of the web layer: the JSON envelope, ``BadRequest`` and the middleware.

Errors use llama-server's envelope ``{"error": {"code", "message", "type"}}`` (with any
extra top-level keys a caller adds, e.g. /health's ``status``). ``error_middleware`` turns
``BadRequest``, the dispatcher's ``Unavailable`` and ``PromptRefused`` and aiohttp's HTTP
errors into that envelope, and any other exception into a logged 500 in it (or, once a
response has been written, a dropped connection); a worker's ``Failed`` event becomes one
through ``failed_response``.
"""

from __future__ import annotations

import json
from typing import Any

import structlog
from aiohttp import web

from llmproxy.backend.protocol import Failed
from llmproxy.backend.runtime.slots import Unavailable
from llmproxy.backend.runtime.tokenize import PromptRefused

log = structlog.get_logger("llmproxy.backend.web")
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "unavailable_error",
    500: "server_error",
    501: "not_supported_error",
    502: "server_error",
    503: "unavailable_error",
}


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(text=dumps(obj), status=status, content_type="application/json")


def error_body(code: int, message: str, type_: str | None = None) -> dict[str, Any]:
    """The error envelope (llama-server's shape); ``type_`` defaults from the status."""
    return {
        "error": {
            "code": code,
            "message": message,
            "type": type_ or ERROR_TYPES.get(code, "server_error"),
        }
    }


def error_bytes(code: int, message: str) -> bytes:
    """The envelope's body, encoded (for answers written outside a handler)."""
    return dumps(error_body(code, message)).encode()


def failed_body(f: Failed) -> dict[str, Any]:
    """The envelope for a failed generation (a generic worker type maps from its status)."""
    return error_body(f.status, f.message, f.type if f.type != "server_error" else None)


def error_response(code: int, message: str, type_: str | None = None, **extra: Any) -> web.Response:
    body = error_body(code, message, type_)
    body.update(extra)
    return json_response(body, code)


def failed_response(f: Failed) -> web.Response:
    """The plain JSON error for a generation that failed before its first token."""
    return json_response(failed_body(f), f.status)


class BadRequest(Exception):
    """A client error raised by request parsing; the middleware answers it with ``status``."""

    def __init__(
        self, message: str, status: int = 400, type_: str | None = None, close: bool = False
    ) -> None:
        """``close``: end the connection after the answer (a body that never arrived)."""
        super().__init__(message)
        self.status = status
        self.type = type_
        self.close = close


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as exc:
        resp = error_response(exc.status, str(exc), exc.type)
        if exc.close:  # answer, then close at once (not after aiohttp's lingering read)
            resp.force_close()
            await resp.prepare(request)
            await resp.write_eof()
            if request.transport is not None:
                request.transport.close()
        return resp
    except PromptRefused as exc:
        return failed_response(exc.failed)
    except Unavailable as exc:
        resp = error_response(exc.status, str(exc), "unavailable_error")
        if exc.retry_after_s:
            resp.headers["Retry-After"] = str(exc.retry_after_s)
        return resp
    except web.HTTPException as exc:
        if exc.status >= 400:
            msg = "File Not Found" if exc.status == 404 else exc.reason
            return error_response(exc.status, msg)
        raise
    except ConnectionError:
        raise  # the client left: nobody to answer
    except Exception as exc:  # a bug of ours: still an answer in the envelope, and a loud log line
        log.exception("unhandled error", path=request.path)
        if request.writer is not None and request.writer.output_size > 0:
            raise  # a response is already on the wire: aiohttp drops the connection
        return error_response(500, f"internal server error: {type(exc).__name__}")
