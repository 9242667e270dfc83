"""UpstreamClient's keep-alive pool: one connection reused for requests in turn, none
reused that the upstream closes or that holds an unread body, a bounded pool whose idle
connections expire, and the proxy relaying through one kept-alive connection.
"""

from __future__ import annotations

import asyncio

import aiohttp
from yarl import URL

from tests.helpers.net import wait_until
from tests.helpers.proxy import run_proxy
from tests.helpers.upstreams import client, fetch, read_request, recorder, scripted_server


async def test_keep_alive_reuses_one_connection_and_sends_the_request_as_given() -> None:
    async with recorder() as (rec, url):
        c = client(url)
        for i in range(3):
            status, body = await fetch(
                c, "POST", f"/completion?i={i}", b'{"a":1}', {"User-Agent": "curl/8", "X-Y": "z"}
            )
            assert (status, body) == (200, b'echo:{"a":1}')
        assert await fetch(c, "GET", "/health") == (200, b"echo:")
        c.close()
    assert [s["line"] for s in rec.seen] == [
        *(f"POST /completion?i={i}" for i in range(3)),
        "GET /health",
    ]
    assert len({s["conn"] for s in rec.seen}) == 1, (
        "sequential requests must share one kept-alive connection"
    )
    first, get = rec.seen[0]["headers"], rec.seen[3]["headers"]
    host = URL(url).host_port_subcomponent
    assert (
        first["Host"] == host and first["Content-Length"] == "7" and first["User-Agent"] == "curl/8"
    )
    assert first["X-Y"] == "z" and "Accept-Encoding" not in first and "Content-Type" not in first
    # a bodiless GET says nothing about a body
    assert get["Host"] == host and "Content-Length" not in get
    assert rec.seen[0]["body"] == b'{"a":1}'


async def test_connection_close_and_unread_bodies_are_not_reused() -> None:
    async with recorder() as (rec, url):
        c = client(url)
        assert await fetch(c, "GET", "/close") == (200, b"bye")
        assert c.idle == 0  # the upstream said Connection: close
        async with c.exchange("GET", "/big", {}, None) as resp:
            assert len(await resp.content.read(10)) == 10  # left with most of the body unread
        assert c.idle == 0
        assert await fetch(c, "GET", "/a") == (200, b"echo:")
        assert await fetch(c, "GET", "/b") == (200, b"echo:")
        assert c.idle == 1
        c.close()
        assert c.idle == 0
    conns = [s["conn"] for s in rec.seen]
    assert len(set(conns[:3])) == 3 and conns[3] == conns[2], conns


async def test_idle_pool_is_bounded_and_expires() -> None:
    async with recorder() as (rec, url):
        c = client(url, max_idle=2, keepalive_s=0.2)
        async with (
            c.exchange("GET", "/1", {}, None) as r1,
            c.exchange("GET", "/2", {}, None) as r2,
            c.exchange("GET", "/3", {}, None) as r3,
        ):
            for r in (r1, r2, r3):
                await r.content.read()
        assert c.idle == 2  # the third release closed the oldest idle one
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 0.25
        await wait_until(lambda: loop.time() > deadline, what="keep-alive expiry")
        assert await fetch(c, "GET", "/4") == (200, b"echo:")
        c.close()
    assert rec.seen[-1]["conn"] not in {s["conn"] for s in rec.seen[:3]}, (
        "an expired connection was reused"
    )


async def test_head_response_has_no_body_and_keeps_the_connection() -> None:
    async with recorder() as (rec, url):
        c = client(url)
        async with c.exchange("HEAD", "/x", {}, None) as resp:
            assert (
                resp.status == 200 and resp.content_length == 5 and await resp.content.read() == b""
            )
        assert await fetch(c, "GET", "/y") == (200, b"echo:")
        c.close()
    assert rec.seen[0]["conn"] == rec.seen[1]["conn"]


async def test_idle_connections_are_closed_when_they_expire_without_more_requests() -> None:
    closed = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        assert await reader.read() == b""  # the client closed it
        closed.set()

    async with scripted_server(handle) as url:
        c = client(url, keepalive_s=0.1)
        assert await fetch(c, "GET", "/") == (200, b"ok")
        assert c.idle == 1
        await asyncio.wait_for(closed.wait(), 5)
        assert c.idle == 0
        c.close()


async def test_proxy_relays_through_one_kept_alive_connection(http: aiohttp.ClientSession) -> None:
    async with (
        recorder() as (rec, url),
        run_proxy(url, upstream_kind="openai", upstream_stream="off") as px,
    ):
        probed = len(rec.seen)  # detection's own requests (its session, not the relay's)
        for _ in range(3):
            async with http.post(px.url + "/v1/completions", data=b'{"prompt":"x"}') as r:
                assert r.status == 200 and await r.read() == b'echo:{"prompt":"x"}'
        async with http.get(px.url + "/v1/models") as r:
            assert r.status == 200
        assert px.member.adapter.client.idle == 1
    relayed = [
        s for s in rec.seen[probed:] if s["line"] in ("POST /v1/completions", "GET /v1/models")
    ]
    assert len(relayed) == 4 and len({s["conn"] for s in relayed}) == 1
