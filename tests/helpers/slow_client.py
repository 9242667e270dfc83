"""A client that stops reading (a suspended editor, a stuck socket), for the tests of the
proxy's slow-client guard (``client_write_timeout_s``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Mapping
from typing import Any


@contextlib.asynccontextmanager
async def stalled(
    url: str, path: str, body: dict[str, Any], headers: Mapping[str, str] | None = None
) -> AsyncIterator[asyncio.StreamReader]:
    """A client that sends ``body`` (with ``headers``) and reads only the response head, then
    nothing: its receive buffer is small, so the proxy's writes soon wait for it."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
    payload = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nX-Request-Id: stalled\r\n{extra}\r\n".encode()
        + payload
    )
    await writer.drain()
    try:
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        yield reader
    finally:
        writer.close()


async def dropped(reader: asyncio.StreamReader) -> bool:
    """Does the connection end (once what is left was read), as the proxy's drop ends it?"""
    with contextlib.suppress(ConnectionError):
        while await reader.read(1 << 16):
            pass
    return True
