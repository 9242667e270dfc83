"""A reused connection closed under a request: retried once on a new connection only when
the method is idempotent; a request that never left (refused connection) is unreachable.
"""

from __future__ import annotations

import asyncio

import pytest

from llmproxy.proxy.errors import UpstreamFailed, UpstreamUnreachable
from llmproxy.proxy.upstream.client_errors import map_client_errors
from tests.helpers.net import closed_port
from tests.helpers.upstreams import client, fetch, read_request, scripted_server


async def test_a_reused_connection_closed_under_a_request_is_retried_only_when_idempotent() -> None:
    """The upstream closes a kept-alive connection just as the next request arrives on it
    (its idle timeout racing our reuse): a GET is sent again on a new connection, as
    aiohttp does; a POST is not (it may have started a generation) and fails as a 502."""
    lines: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lines.append(await read_request(reader))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        lines.append(await read_request(reader))  # the second request on this connection: dropped

    async with scripted_server(handle) as url:
        c = client(url)
        assert await fetch(c, "GET", "/v1/models") == (200, b"ok")
        assert await fetch(c, "GET", "/v1/models") == (200, b"ok")  # on a new connection
        assert lines == [b"GET /v1/models HTTP/1.1"] * 3
        c.close()
        lines.clear()
        c = client(url)
        # a new connection, kept alive
        assert await fetch(c, "POST", "/completion", b"{}") == (200, b"ok")
        with pytest.raises(UpstreamFailed, match="ServerDisconnectedError"), map_client_errors():
            await fetch(c, "POST", "/completion", b"{}")
        assert lines == [b"POST /completion HTTP/1.1"] * 2  # sent once, never again
        c.close()


async def test_a_retry_that_cannot_connect_reports_the_lost_connection() -> None:
    """The request went out on the reused connection and was lost with it; that the retry
    then finds the upstream gone must not read as 'never sent' (upstream_unreachable)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await read_request(reader)  # the second request: dropped, and the server is gone
        server_gone.set()

    server_gone = asyncio.Event()
    async with scripted_server(handle) as url:
        c = client(url)
        assert await fetch(c, "GET", "/v1/models") == (200, b"ok")
        port = int(url.rsplit(":", 1)[1])
    # the listener is closed now; the kept-alive connection is still open until the handler drops it
    with pytest.raises(UpstreamFailed, match="ServerDisconnectedError"), map_client_errors():
        await fetch(c, "GET", "/v1/models")
    assert server_gone.is_set() and port > 0
    c.close()


async def test_refused_connection_is_unreachable_and_never_sent() -> None:
    c = client(f"http://127.0.0.1:{closed_port()}")
    sent: list[bool] = []
    with pytest.raises(UpstreamUnreachable) as info, map_client_errors():
        async with c.exchange("POST", "/completion", {}, b"{}", on_send=lambda: sent.append(True)):
            pass
    assert info.value.status == 502 and sent == []
