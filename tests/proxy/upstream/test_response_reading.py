"""How UpstreamClient reads what the upstream answers: a body delimited by close, interim
1xx responses, an answer that comes before the request body was read, and a malformed
response (a 502 through the proxy).
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp.http_exceptions import HttpProcessingError

from llmproxy.proxy.errors import UpstreamFailed
from llmproxy.proxy.upstream.client_errors import map_client_errors
from tests.helpers.net import wait_until
from tests.helpers.proxy import run_proxy
from tests.helpers.upstreams import client, fetch, raw_server, read_request, scripted_server


async def test_body_delimited_by_close_is_read_to_the_end() -> None:
    async with raw_server(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it") as url:
        c = client(url)
        assert await fetch(c, "GET", "/") == (200, b"all of it")
        assert c.idle == 0


async def test_interim_1xx_responses_are_skipped_and_the_connection_stays_in_step() -> None:
    """103 Early Hints (or 100 Continue) is not the answer: taking it as one would return the
    connection with the real answer still coming, for the next request to read."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for n in (1, 2):
            await read_request(reader)
            writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n")
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nanswer %d" % n)
            await writer.drain()
        await reader.read()

    async with scripted_server(handle) as url:
        c = client(url)
        assert await fetch(c, "POST", "/completion", b"{}") == (200, b"answer 1")
        assert await fetch(c, "POST", "/completion", b"{}") == (200, b"answer 2")
        c.close()


async def test_an_answer_in_the_same_packet_as_its_1xx_leaves_no_read_timer_behind() -> None:
    """The read timeout restarts after a 1xx only if the answer is still to come: armed on a
    finished exchange, it would fire on the idle pooled connection and spoil it."""
    conns: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns.append(writer.get_extra_info("peername")[1])
        while True:
            await read_request(reader)
            writer.write(
                b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
            )
            await writer.drain()

    async with scripted_server(handle) as url:
        c = client(url, read=0.1)
        assert await fetch(c, "POST", "/a", b"{}") == (200, b"ok")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 0.3  # well past the read timeout, well within the keep-alive
        await wait_until(lambda: loop.time() > deadline, what="the read timeout to pass")
        assert await fetch(c, "POST", "/b", b"{}") == (200, b"ok")
        c.close()
    assert len(conns) == 1, "the pooled connection was spoiled by a stale read timer"


async def test_an_answer_before_the_whole_body_is_read_is_not_blocked_by_it() -> None:
    """An upstream may refuse a large body (413) without reading it: the answer arrives while
    most of the body is still unsent, and the connection is not reused."""

    done = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")  # the head only; never reads the body
        writer.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 4\r\n\r\nbig!")
        await writer.drain()
        await done.wait()

    async with scripted_server(handle) as url:
        c = client(url)
        try:
            status, body = await asyncio.wait_for(
                fetch(c, "POST", "/completion", b"x" * (16 << 20)), 5
            )
            assert (status, body) == (413, b"big!") and c.idle == 0
        finally:
            done.set()
            c.close()


async def test_malformed_response_maps_to_a_502() -> None:
    async with raw_server(b"NOT HTTP AT ALL\r\n\r\n") as url:
        c = client(url)
        with pytest.raises(HttpProcessingError):
            await fetch(c, "GET", "/")
        with pytest.raises(UpstreamFailed, match="malformed response"), map_client_errors():
            await fetch(c, "GET", "/")


async def test_proxy_answers_502_for_a_malformed_upstream_response(
    http: aiohttp.ClientSession,
) -> None:
    async with (
        raw_server(b"HTTP/1.1 abc\r\n\r\n") as url,
        run_proxy(url, upstream_kind="openai") as px,
    ):
        async with http.post(px.url + "/v1/completions", json={"prompt": "x"}) as r:
            body = await r.json()
        assert r.status == 502 and body["error"]["type"] == "upstream_error"
        assert "malformed" in body["error"]["message"]
        await asyncio.wait_for(px.state.pool.wait_quiescent(), 5)
