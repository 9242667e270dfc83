"""The one middleware: request id + canonical log record, path, Host, Origin and key checks
(http/trust.py), error mapping.

Every ProxyError (and aiohttp's own HTTP exceptions) becomes a response in the error
envelope here and nowhere else. The request's RequestRecord is ended in ``finally``; for a
gated request whose job is still running, the job ends it later (see telemetry/record.py).
"""

from __future__ import annotations

import asyncio
import re
from random import getrandbits  # an id for logs, not a secret: no syscall per request

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler

from llmproxy.proxy.errors import BadRequest, HTTPStatusError, NotAllowed, ProxyError
from llmproxy.proxy.gating.routes import is_safe_path
from llmproxy.proxy.http.trust import TRUST
from llmproxy.proxy.state import METRICS, RECORD, REQUEST_LOG
from llmproxy.proxy.telemetry.record import RequestRecord

log = structlog.get_logger("llmproxy.http")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def error_response(exc: ProxyError) -> web.Response:
    resp = web.Response(
        status=exc.status, body=exc.body(), content_type="application/json", headers=exc.headers
    )
    if exc.close_connection:
        resp.force_close()
    return resp


@web.middleware
async def proxy_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    app = request.app
    supplied = request.headers.get("X-Request-Id", "")
    request_id = supplied if supplied and _REQUEST_ID.match(supplied) else f"{getrandbits(64):016x}"
    # Bound in this request's own context: aiohttp runs each handler in a task of its own
    # (a copy of the connection's context), so the binding ends with it, unbound by nobody.
    structlog.contextvars.bind_contextvars(request_id=request_id)
    rec = RequestRecord(
        request_id,
        request.method,
        request.path,
        on_done=app[METRICS].observe,
        request_log=app[REQUEST_LOG],
    )
    request[RECORD] = rec
    try:
        if not is_safe_path(request.raw_path):
            raise BadRequest("only origin-form request targets without dot segments are accepted")
        if request.method == "CONNECT":
            raise NotAllowed("CONNECT is not supported")
        preflight = app[TRUST].admit(request)  # or Forbidden, Unauthorized
        resp = preflight or await handler(request)
        if rec.status is None:
            rec.status = resp.status
        if not resp.prepared:  # ours replaces an upstream's: it is the id in our log line
            resp.headers["X-Request-Id"] = request_id
        return resp
    except ProxyError as exc:
        rec.status = exc.status
        rec.error = exc.message
        if exc.outcome != "error" or rec.outcome is None:
            rec.outcome = rec.outcome or exc.outcome
        resp = error_response(exc)
        resp.headers["X-Request-Id"] = request_id
        return resp
    except web.HTTPException as exc:
        rec.status = exc.status
        return error_response(HTTPStatusError(exc.status, exc.reason))
    except asyncio.CancelledError:
        rec.client_gone = True
        raise
    except ConnectionResetError:
        # The client left while we were writing to it: not an error. aiohttp's own
        # finish_response drops this placeholder quietly on the closed transport.
        rec.client_gone = True
        return web.Response(status=499)
    except Exception as exc:
        log.exception("unhandled error")
        rec.status = 500
        rec.error = repr(exc)
        rec.outcome = "error"
        return error_response(ProxyError("internal proxy error"))
    finally:
        rec.end_ref()
