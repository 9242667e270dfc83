"""UpstreamClient (proxy/upstream/client.py) against real loopback servers.

A recording aiohttp app shows what reached the upstream (request line, headers, body, and
which TCP connection carried it); raw asyncio servers send what aiohttp's server never
would (a body delimited by close, a malformed head). Through the proxy, the same client
carries every relayed request, so these cases are also checked end to end where the
answer matters to a client.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from yarl import URL

from llmproxy.proxy.errors import UpstreamFailed, UpstreamUnreachable, map_client_errors
from llmproxy.proxy.upstream.client import UpstreamClient
from tests.helpers.net import closed_port, wait_until
from tests.helpers.proxy import run_proxy


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
                "conn": request.transport.get_extra_info("peername")[1]
                if request.transport
                else None,  # client port
            }
        )
        if request.path == "/close":
            return web.Response(text="bye", headers={"Connection": "close"})
        if (
            request.path == "/slow"
        ):  # a stream that waits for the test; a client that leaves aborts it
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
    assert (
        get["Host"] == host and "Content-Length" not in get
    )  # a bodiless GET says nothing about a body
    assert rec.seen[0]["body"] == b'{"a":1}'


async def test_base_path_prefixes_the_target() -> None:
    async with recorder() as (rec, url):
        c = client(url + "/llama/")
        assert (await fetch(c, "POST", "/infill?x=1", b"{}"))[0] == 200
        c.close()
    assert rec.seen[0]["line"] == "POST /llama/infill?x=1"


async def test_credentials_in_the_base_url_become_basic_auth() -> None:
    async with recorder() as (rec, url):
        c = client(url.replace("http://", "http://user:s%20cret@"))
        assert (await fetch(c, "POST", "/x", b"{}", {"Authorization": "Bearer client"}))[0] == 200
        c.close()
    assert rec.seen[0]["headers"]["Authorization"] == aiohttp.encode_basic_auth("user", "s cret")
    assert rec.seen[0]["headers"]["Host"] == URL(url).host_port_subcomponent


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


async def test_leaving_early_closes_the_connection_and_the_upstream_sees_the_abort() -> None:
    async with recorder() as (rec, url):
        c = client(url)
        async with c.exchange("POST", "/slow", {}, b"{}") as resp:
            assert await resp.content.readany() == b"first "
        await asyncio.wait_for(
            rec.aborted.wait(), 5
        )  # closing the connection is how a generation is cancelled
        assert c.idle == 0


async def test_cancelling_the_reader_closes_the_connection() -> None:
    async with recorder() as (rec, url):
        c = client(url)
        started = asyncio.Event()

        async def reader() -> None:
            async with c.exchange("POST", "/slow", {}, b"{}") as resp:
                await resp.content.readany()
                started.set()
                await resp.content.read()

        task = asyncio.create_task(reader())
        await asyncio.wait_for(started.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(rec.aborted.wait(), 5)
        assert c.idle == 0


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


async def test_body_delimited_by_close_is_read_to_the_end() -> None:
    async with raw_server(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it") as url:
        c = client(url)
        assert await fetch(c, "GET", "/") == (200, b"all of it")
        assert c.idle == 0


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
        assert await fetch(c, "POST", "/completion", b"{}") == (
            200,
            b"ok",
        )  # a new connection, kept alive
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


async def test_a_cancelled_request_never_arrives_whole_afterwards() -> None:
    """Cancelling an exchange whose large body is still going out drops the unsent bytes (a
    reset, not a graceful close that would deliver the rest): the upstream can never get
    the complete request after the proxy gave it up, and start a generation nobody holds."""
    head_read, go, ended, total = asyncio.Event(), asyncio.Event(), asyncio.Event(), [0]
    size = 16 << 20

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        head_read.set()
        await go.wait()  # reads the body only after the client gave the request up
        try:
            while chunk := await reader.read(1 << 16):
                total[0] += len(chunk)
        finally:
            ended.set()  # end of stream or reset: nothing more can arrive

    async with scripted_server(handle) as url:
        c = client(url)
        task = asyncio.create_task(fetch(c, "POST", "/completion", b"x" * size))
        await asyncio.wait_for(head_read.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        go.set()
        await asyncio.wait_for(ended.wait(), 10)
    assert c.idle == 0 and 0 < total[0] < size, total


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


async def test_malformed_response_maps_to_a_502() -> None:
    async with raw_server(b"NOT HTTP AT ALL\r\n\r\n") as url:
        c = client(url)
        with pytest.raises(HttpProcessingError):
            await fetch(c, "GET", "/")
        with pytest.raises(UpstreamFailed, match="malformed response"), map_client_errors():
            await fetch(c, "GET", "/")


async def test_refused_connection_is_unreachable_and_never_sent() -> None:
    c = client(f"http://127.0.0.1:{closed_port()}")
    sent: list[bool] = []
    with pytest.raises(UpstreamUnreachable) as info, map_client_errors():
        async with c.exchange("POST", "/completion", {}, b"{}", on_send=lambda: sent.append(True)):
            pass
    assert info.value.status == 502 and sent == []


async def test_on_send_comes_before_the_bytes_leave_and_not_for_a_cancelled_connect() -> None:
    async with recorder() as (rec, url):
        c = client(url)
        seen_at_send: list[int] = []
        async with c.exchange(
            "POST", "/x", {}, b"{}", on_send=lambda: seen_at_send.append(len(rec.seen))
        ) as resp:
            await resp.content.read()
        assert seen_at_send == [0]
        c.close()
    # cancelled while connecting: never sent
    with socket.socket() as hole, socket.socket() as filler:
        hole.bind(("127.0.0.1", 0))
        hole.listen(0)  # never accepts; one queued connection fills it ...
        filler.connect(hole.getsockname())  # ... so the kernel drops every later SYN
        c = client(f"http://127.0.0.1:{hole.getsockname()[1]}", connect=30.0)
        sent: list[bool] = []
        task = asyncio.create_task(fetch_with(c, sent))
        for _ in range(5):  # a few loop turns: the task is in connect, which the dropped SYN holds
            await asyncio.sleep(0)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sent == []


async def fetch_with(c: UpstreamClient, sent: list[bool]) -> None:
    async with c.exchange("POST", "/x", {}, b"{}", on_send=lambda: sent.append(True)) as resp:
        await resp.content.read()


async def test_read_timeout_is_an_upstream_timeout() -> None:
    async with recorder() as (rec, url):
        c = client(url, read=0.2)
        with pytest.raises(aiohttp.ServerTimeoutError):
            async with c.exchange("POST", "/slow", {}, b"{}") as resp:
                await resp.content.read()
        await asyncio.wait_for(rec.aborted.wait(), 5)


def test_only_http_urls_with_a_host() -> None:
    for bad in ("ftp://h/", "unix:///tmp/s", "http:///x"):
        with pytest.raises(ValueError, match="http:// or https://"):
            client(bad)


@pytest.fixture
def tls_cert(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


async def test_an_early_error_answer_over_tls_does_not_pool_the_connection(
    tls_cert: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over TLS the unsent part of a large body cannot be seen (the TLS transport does not
    count the TCP buffer under it): a connection answered with an error before its large body
    was read is not reused, so the next request does not queue behind that body."""
    cert, key = tls_cert
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    done = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")  # the head only, for now
            writer.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            await done.wait()
        finally:
            writer.transport.abort()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)
    c = client(f"https://localhost:{server.sockets[0].getsockname()[1]}")
    try:
        assert await asyncio.wait_for(fetch(c, "POST", "/completion", b"x" * (16 << 20)), 10) == (
            413,
            b"",
        )
        assert c.idle == 0
    finally:
        done.set()
        c.close()
        server.close()
        await server.wait_closed()


async def test_https_upstream_is_verified(
    tls_cert: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = tls_cert

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/health", health)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx).start()
    url = f"https://localhost:{runner.addresses[0][1]}"
    try:
        with pytest.raises(aiohttp.ClientConnectorError):  # a certificate nobody trusts: refused
            await fetch(client(url), "GET", "/health")
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # trusted by the default context
        assert await fetch(client(url), "GET", "/health") == (200, b'{"status": "ok"}')
    finally:
        await runner.cleanup()


async def test_proxy_relays_through_one_kept_alive_connection(http: aiohttp.ClientSession) -> None:
    async with recorder() as (rec, url), run_proxy(url, upstream_kind="openai") as px:
        for _ in range(3):
            async with http.post(px.url + "/v1/completions", data=b'{"prompt":"x"}') as r:
                assert r.status == 200 and await r.read() == b'echo:{"prompt":"x"}'
        async with http.get(px.url + "/v1/models") as r:
            assert r.status == 200
        assert px.state.adapter.client.idle == 1
    relayed = [s for s in rec.seen if s["line"] in ("POST /v1/completions", "GET /v1/models")]
    assert len(relayed) == 4 and len({s["conn"] for s in relayed}) == 1


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
        await asyncio.wait_for(px.state.gate.wait_quiescent(), 5)
