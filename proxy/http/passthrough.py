"""Ungated routes (/health, /props, /slots, /v1/models, /api/tags, ...): straight through.

No permit, no queue: the request is forwarded to the configured upstream only, and the
response written as it arrives, like a gated one (upstream/forward.py, relay/writer.py,
relay/responder.py), by this handler itself. A client disconnect cancels the handler,
which closes the upstream request. Errors, ours included, end the response through the
Responder: the envelope if nothing was sent yet, else the stream's error event or a cut.
"""

from __future__ import annotations

import structlog
from aiohttp import web

from llmproxy.proxy.errors import ProxyError
from llmproxy.proxy.http.bodies import read_body
from llmproxy.proxy.http.trust import TRUST
from llmproxy.proxy.relay.responder import Responder
from llmproxy.proxy.state import RECORD, STATE
from llmproxy.proxy.upstream.forward import forward
from llmproxy.proxy.upstream.headers import request_headers

log = structlog.get_logger("llmproxy.passthrough")


async def passthrough(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    body = await read_body(request, st.settings.max_body_bytes, st.settings.body_timeout_s)
    headers = request_headers(request.headers, strip=request.app[TRUST].strip)
    rec = request[RECORD]
    out = Responder(
        request,
        rec.request_id,
        buffer_bytes=st.settings.client_buffer_bytes,
        write_timeout_s=st.settings.client_write_timeout_s,
    )
    try:
        await forward(
            st.passthrough_adapter(),
            request.method,
            request.raw_path,
            headers,
            body or None,
            out,
            rec,
        )
    except ProxyError as exc:
        rec.upstream_error = exc
        out.fail(exc)  # answered in the envelope, or the started stream's last event
    except Exception as exc:
        # Our own bug, as an upstream job treats it: once the response started, the
        # middleware's answer could only go out as a second status line inside this body.
        log.exception("passthrough relay failed", request_id=rec.request_id)
        rec.error = repr(exc)
        rec.outcome = "error"
        out.fail(ProxyError("internal proxy error"))
    return await out.outcome()
