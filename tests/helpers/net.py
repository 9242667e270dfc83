"""Small test helpers: condition polling with a deadline, free ports, ad-hoc upstreams."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable

from aiohttp import web


async def wait_until(
    pred: Callable[[], bool],
    timeout: float = 5.0,  # noqa: ASYNC109 - part of the helper's API, given positionally
    what: str = "condition",
) -> None:
    """Poll ``pred`` (cheap, in-process state) until true; fail loudly at the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.002)


async def raw_exchange(url: str, raw: bytes) -> bytes:
    """Send ``raw`` bytes on a new connection to ``url``; everything until the server closes it."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(raw)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


def closed_port() -> int:
    """A loopback port with nothing listening (bound then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def serve_app(app: web.Application, host: str = "127.0.0.1") -> AsyncIterator[str]:
    """Run ``app`` as a real server on an ephemeral loopback port; yields its base URL. Its
    handlers still running at exit are cancelled after 2 s (an endless test upstream must
    not hang the run when its test fails)."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, host, 0).start()
    try:
        yield f"http://{host}:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def dechunk(raw: bytes) -> bytes:
    """The payload of ``raw``, an HTTP/1.1 chunked message body (what follows the head)."""
    out, pos = bytearray(), 0
    while True:
        eol = raw.index(b"\r\n", pos)
        n = int(raw[pos:eol], 16)
        if n == 0:
            return bytes(out)
        out += raw[eol + 2 : eol + 2 + n]
        pos = eol + 2 + n + 2
