"""Ungated routes (/health, /props, /slots, /v1/models, /api/tags, ...): straight through.

No permit, no queue: the request is forwarded to the configured upstream only, and the
response relayed chunk by chunk like a gated one. A client disconnect cancels the handler,
which closes the upstream request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from aiohttp import web

from llmproxy.proxy.bodies import read_body
from llmproxy.proxy.errors import ProxyError
from llmproxy.proxy.headers import request_headers
from llmproxy.proxy.channel import Error, Event, Headers
from llmproxy.proxy.relay import relay
from llmproxy.proxy.security import auth_headers_to_strip
from llmproxy.proxy.state import RECORD, STATE
from llmproxy.proxy.upstream import upstream_events


async def passthrough(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    body = await read_body(request, st.settings.max_body_bytes, st.settings.body_timeout_s)
    headers = request_headers(request.headers, strip=auth_headers_to_strip(st.settings))
    rec = request[RECORD]

    async def events() -> AsyncIterator[Event]:
        started = False
        try:
            async with aclosing(
                upstream_events(st.adapter, request.method, request.raw_path, headers, body or None, rec.mark_sent)
            ) as upstream:
                async for ev in upstream:
                    if isinstance(ev, Headers):
                        started, rec.upstream_status = True, ev.status
                    yield ev
        except ProxyError as exc:
            rec.upstream_error = exc
            if not started:
                raise
            yield Error(exc)

    async with aclosing(events()) as stream:  # a client that leaves closes the upstream at once
        return await relay(request, stream)
