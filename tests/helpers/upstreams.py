"""Upstreams for UpstreamClient's tests (proxy/upstream/client.py), on real loopback sockets.

``recorder`` is a real aiohttp upstream that shows what reached it (request line, headers,
body, and which TCP connection carried it); ``scripted_server`` and ``raw_server`` are raw
asyncio servers that send what aiohttp's server never would (a body delimited by close, a
malformed head, an interim response).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web
from yarl import URL

from llmproxy.proxy.upstream.client import UpstreamClient


class Recorder:
    """A real upstream that answers every request and records it with its connection."""

    def __init__(self) -> None:
        self.seen: list[dict[str, object]] = []
        self.aborted = asyncio.Event()
        self.release = asyncio.Event()
        self.app = web.Application()
        self.app.router.add_route("*", "/{tail:.*}", self.handle)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append(
            {
                "line": f"{request.method} {request.raw_path}",
                "headers": request.headers.copy(),
                "body": body,
                # the client's port: which connection carried it
                "conn": request.transport.get_extra_info("peername")[1]
                if request.transport
                else None,
            }
        )
        if request.path == "/close":
            return web.Response(text="bye", headers={"Connection": "close"})
        if request.path == "/slow":  # waits for the test; a client that leaves aborts it
            resp = web.StreamResponse()
            await resp.prepare(request)
            await resp.write(b"first ")
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.aborted.set()
                raise
            await resp.write_eof(b"last")
            return resp
        if request.path == "/big":
            return web.Response(body=b"x" * 300_000)
        return web.Response(body=b"echo:" + body, headers={"X-Seen": request.path_qs})


@contextlib.asynccontextmanager
async def recorder() -> AsyncIterator[tuple[Recorder, str]]:
    rec = Recorder()
    runner = web.AppRunner(rec.app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield rec, f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def scripted_server(
    handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[str]:
    """A raw TCP server running ``handle`` per connection: what aiohttp's server would not send."""

    async def run(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handle(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(run, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


def raw_server(answer: bytes) -> contextlib.AbstractAsyncContextManager[str]:
    """Reads one request head, writes ``answer`` and closes."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()

    return scripted_server(handle)


def client(url: str, **kw: float) -> UpstreamClient:
    return UpstreamClient(
        URL(url), connect_timeout_s=kw.pop("connect", 2.0), read_timeout_s=kw.pop("read", 5.0), **kw
    )


async def fetch(
    c: UpstreamClient,
    method: str,
    target: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    async with c.exchange(method, target, headers or {}, body) as resp:
        return resp.status, await resp.content.read()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request (head + Content-Length body) off a raw connection; its request line."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (
            int(ln.split(b":")[1])
            for ln in head.split(b"\r\n")
            if ln.lower().startswith(b"content-length:")
        ),
        0,
    )
    await reader.readexactly(length)
    return head.split(b"\r\n", 1)[0]
