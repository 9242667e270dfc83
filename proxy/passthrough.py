"""Ungated routes (/health, /props, /slots, /v1/models, /api/tags, ...): straight through.

No permit, no queue: the request is forwarded to the configured upstream only, and the
response relayed chunk by chunk like a gated one. A client disconnect cancels the handler,
which closes the upstream request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from llmproxy.proxy.bodies import read_body
from llmproxy.proxy.errors import ProxyError, map_client_errors
from llmproxy.proxy.headers import request_headers, response_headers
from llmproxy.proxy.channel import Chunk, End, Error, Event, Headers
from llmproxy.proxy.relay import relay
from llmproxy.proxy.security import auth_headers_to_strip
from llmproxy.proxy.state import STATE


async def passthrough(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    body = await read_body(request, st.settings.max_body_bytes, st.settings.body_timeout_s)
    headers = request_headers(request.headers, strip=auth_headers_to_strip(st.settings))

    async def events() -> AsyncIterator[Event]:
        started = False
        try:
            with map_client_errors():
                async with st.session.request(
                    request.method, st.adapter.url(request.raw_path), headers=headers, data=body or None
                ) as up:
                    yield Headers(up.status, response_headers(up.headers), up.content_length)
                    started = True
                    async for data in up.content.iter_any():
                        yield Chunk(data)
            yield End()
        except ProxyError as exc:
            if not started:
                raise
            yield Error(exc)

    return await relay(request, events())
