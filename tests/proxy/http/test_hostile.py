"""Hostile clients: slow headers, slow bodies, conflicting framing, CRLF injection."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from llmproxy.bench.fake.upstream import FakeUpstream
from tests.helpers.net import raw_exchange
from tests.helpers.proxy import run_proxy


def assert_envelope_body(raw: bytes, status: int) -> None:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"application/json" in head.lower(), head
    err = json.loads(body)["error"]
    assert (
        err["code"] == status
        and err["src"] == "llmproxy"
        and err["type"] == "invalid_request_error"
    ), err


async def _connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def _refused(url: str, raw: bytes) -> bytes:
    """``raw_exchange``, checked to be a 400 in our error envelope; returns the raw response."""
    resp = await raw_exchange(url, raw)
    assert resp.split(b" ", 2)[1] == b"400", resp[:300]
    assert_envelope_body(resp, 400)
    return resp


async def test_slow_headers_are_cut_off(fake: FakeUpstream) -> None:
    async with run_proxy(fake.url, idle_timeout_s=0.5) as px:
        reader, writer = await _connect(px.url)
        # never finishes the headers
        writer.write(b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        await writer.drain()
        t0 = time.monotonic()
        data = await asyncio.wait_for(reader.read(), 5)  # EOF: the server closed it
        assert data == b"" and time.monotonic() - t0 < 3
        writer.close()
        assert not fake.generations


async def test_slow_body_gets_408_with_connection_close(fake: FakeUpstream) -> None:
    """The body is left half-read, so the connection cannot carry another request: the
    408 says ``Connection: close`` (else the client's next request on it would meet the
    rest of this body, or the parser's queued error)."""
    async with run_proxy(fake.url, body_timeout_s=0.3) as px:
        reader, writer = await _connect(px.url)
        writer.write(
            b'POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{"prompt":'
        )
        await writer.drain()
        head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).lower()
        assert head.startswith(b"http/1.1 408") and b"\r\nconnection: close\r\n" in head, head
        length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
        assert json.loads(await reader.readexactly(length))["error"]["type"] == "request_timeout"
        writer.close()
        assert not fake.generations
        await asyncio.wait_for(px.state.pool.wait_quiescent(), 2)


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(
            b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            id="conflicting-framing",
        ),
        pytest.param(
            b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
            b'5\r\n{"pro\r\nZZ-not-a-size\r\n\r\n',
            id="broken-chunk-size",
        ),
    ],
)
async def test_bad_framing_is_400(fake: FakeUpstream, raw: bytes) -> None:
    async with run_proxy(fake.url) as px:
        await _refused(px.url, raw)  # answered by the HTTP parser, in our envelope
        assert not fake.generations
        await asyncio.wait_for(px.state.pool.wait_quiescent(), 2)


async def test_crlf_in_header_value_does_not_reach_upstream(fake: FakeUpstream) -> None:
    async with run_proxy(fake.url) as px:
        body = b'{"prompt":"x"}'
        # a bare CR in a header value is a parse error
        await _refused(
            px.url,
            b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Evil: a\rInjected: 1\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body,
        )
        assert all("injected" not in {k.lower() for k in g.headers} for g in fake.received)


async def test_huge_headers_rejected(fake: FakeUpstream) -> None:
    async with run_proxy(fake.url) as px, aiohttp.ClientSession() as http:
        async with http.post(
            px.url + "/completion", json={"prompt": "x"}, headers={"X-Big": "a" * 20000}
        ) as r:
            assert r.status in (400, 431)
            assert (await r.json(content_type=None))["error"]["src"] == "llmproxy"
        assert not fake.generations


async def test_compressed_request_body_refused(fake: FakeUpstream) -> None:
    """Bodies are forwarded byte for byte: a gzip body (decoded by aiohttp, still labelled
    gzip) or a corrupt one gets 400 in the envelope, never a 500 and never the upstream."""
    import gzip

    good = gzip.compress(b'{"prompt":"x","n_predict":4}')
    async with run_proxy(fake.url) as px:
        for body in (good, b"this is not gzip"):
            resp = await _refused(
                px.url,
                b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Encoding: gzip\r\n"
                b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body),
            )
            assert b"compressed request bodies are not supported" in resp
        assert not fake.generations
        await asyncio.wait_for(px.state.pool.wait_quiescent(), 2)
