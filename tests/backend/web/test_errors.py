"""The backend's error middleware on a real loopback server: a bug of ours before the
response is a 500 in the envelope; after a response started, the connection is dropped
(never a second status line inside the body)."""

from __future__ import annotations

from aiohttp import web

from llmproxy.backend.web.errors import error_middleware
from tests.helpers.net import raw_exchange, serve_app


async def boom(request: web.Request) -> web.StreamResponse:
    raise KeyError("early")


async def late(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(b'data: {"content":"x"}\n\n')
    raise KeyError("after the first event")


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()


async def test_unhandled_errors() -> None:
    app = web.Application(middlewares=[error_middleware])
    app.router.add_get("/boom", boom)
    app.router.add_get("/late", late)
    async with serve_app(app) as url:
        early = await raw_exchange(url, get("/boom"))
        assert early.startswith(b"HTTP/1.1 500 ")
        assert early.endswith(
            b'{"error":{"code":500,"message":"internal server error: KeyError",'
            b'"type":"server_error"}}'
        )
        raw = await raw_exchange(url, get("/late"))
        assert raw.startswith(b"HTTP/1.1 200 ") and b'data: {"content":"x"}' in raw
        # cut, not ended cleanly
        assert raw.count(b"HTTP/1.1") == 1 and not raw.endswith(b"0\r\n\r\n")
