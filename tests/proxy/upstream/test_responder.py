"""The Responder (responder.py): one client response written by another task as it arrives.

A real aiohttp server whose handler creates a Responder and waits on its outcome while a
separate writer task (standing in for the upstream job) follows a script; real clients
on loopback read what came out. Steps are synchronised with events, never sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict

from llmproxy.proxy.errors import ProxyError, ShuttingDown, Superseded, UpstreamFailed
from llmproxy.proxy.relay.responder import Responder
from tests.helpers.net import dechunk, serve_app, wait_until

Script = Callable[[Responder, web.Request], Awaitable[None]]


@contextlib.asynccontextmanager
async def responder_server(
    script: Script, ends: list[str] | None = None
) -> AsyncIterator[tuple[str, dict[str, Responder]]]:
    """A server whose one route answers through a Responder that ``script`` writes from its
    own task; yields the URL and the last request's Responder (``seen["out"]``). ``ends``
    gets how each handler ended: "returned", "answered" (an error) or the exception's name."""
    seen: dict[str, Responder] = {}
    writers: set[asyncio.Task[None]] = set()

    async def handler(request: web.Request) -> web.StreamResponse:
        out = seen["out"] = Responder(request, "rid-1")
        writer = asyncio.create_task(script(out, request))
        writers.add(writer)
        try:
            resp = await out.outcome()
        except ProxyError as exc:  # the proxy's middleware does this
            (ends if ends is not None else []).append("answered")
            return web.Response(status=exc.status, body=exc.body(), content_type="application/json")
        except BaseException as exc:
            (ends if ends is not None else []).append(type(exc).__name__)
            raise
        (ends if ends is not None else []).append("returned")
        return resp

    app = web.Application()
    app.router.add_post("/r", handler)
    async with serve_app(app) as url:
        try:
            yield url + "/r", seen
        finally:
            await asyncio.gather(*writers, return_exceptions=True)


async def lagging_client(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to ``url`` with a small receive buffer (set before the connect, so the
    window stays small): with ``small_send_buffer`` on the server's side, a few MB written
    to a client that does not read stay in the server's transport, whatever the kernel's
    buffer autotuning would otherwise absorb."""
    host, port = url.removeprefix("http://").split("/")[0].split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 26)
    writer.write(f"POST /r HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\n\r\n".encode())
    await writer.drain()
    return reader, writer


def small_send_buffer(request: web.Request) -> asyncio.Transport:
    """The request's transport, its socket's send buffer made small (see lagging_client)."""
    transport = request.transport
    assert transport is not None
    transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 << 10)
    return transport  # type: ignore[return-value]


def json_head() -> CIMultiDict[str]:
    return CIMultiDict({"Content-Type": "application/json", "X-Upstream": "1"})


def sse_head() -> CIMultiDict[str]:
    return CIMultiDict({"Content-Type": "text/event-stream"})


async def test_whole_body_goes_out_with_its_headers() -> None:
    async def script(out: Responder, _r: web.Request) -> None:
        await out.whole(200, json_head(), b'{"content":"x"}')

    async with responder_server(script) as (url, _), aiohttp.ClientSession() as http:
        async with http.post(url) as r:
            assert r.status == 200 and await r.read() == b'{"content":"x"}'
            assert (
                r.headers["Content-Length"] == "15"
                and r.headers["Content-Type"] == "application/json"
            )
            assert r.headers["X-Upstream"] == "1" and r.headers["X-Request-Id"] == "rid-1"


async def test_pieces_reach_the_client_as_they_are_written() -> None:
    first_read = asyncio.Event()

    async def script(out: Responder, _r: web.Request) -> None:
        await out.head(200, sse_head(), None)
        await out.piece(b"data: 1\n\n")
        await first_read.wait()  # the client saw the first piece before the rest exists
        await out.piece(b"data: 2\n\n")
        await out.end(b"data: 3\n\n")

    async with responder_server(script) as (url, seen), aiohttp.ClientSession() as http:
        async with http.post(url) as r:
            assert r.status == 200 and r.headers["X-Request-Id"] == "rid-1"
            assert await r.content.readuntil(b"\n\n") == b"data: 1\n\n"
            first_read.set()
            assert await r.read() == b"data: 2\n\ndata: 3\n\n"
        assert seen["out"].ended and not seen["out"].gone


async def test_failure_before_the_start_is_the_handlers_to_answer() -> None:
    async def script(out: Responder, _r: web.Request) -> None:
        out.fail(UpstreamFailed("upstream failed: reset"))
        await out.whole(200, json_head(), b"{}")  # too late: the first ending wins

    async with responder_server(script) as (url, _), aiohttp.ClientSession() as http:
        async with http.post(url) as r:
            assert r.status == 502
            assert (await r.json())["error"]["type"] == "upstream_error"


async def test_failure_after_the_start_ends_the_stream_with_an_event() -> None:
    async def script(out: Responder, _r: web.Request) -> None:
        await out.head(200, sse_head(), None)
        await out.piece(b'data: {"content":"a')  # cut inside an event
        out.fail(UpstreamFailed("upstream failed: reset"))
        await out.piece(b"never\n\n")

    async with responder_server(script) as (url, _), aiohttp.ClientSession() as http:
        async with http.post(url) as r:
            body = await r.read()
    events = body.split(b"\n\n")
    assert events[0] == b'data: {"content":"a' and events[-1] == b"" and len(events) == 3
    assert json.loads(events[1].removeprefix(b"data: "))["error"]["src"] == "llmproxy"


@pytest.mark.parametrize(
    ("head", "first"),
    [(json_head, b'{"content":'), (sse_head, b"data: 1\n\n")],
    ids=["plain", "sse-of-fixed-length"],
)
async def test_failure_inside_a_body_of_fixed_length_cuts_the_connection(
    head: Callable[[], CIMultiDict[str]], first: bytes
) -> None:
    """A plain body has no error event; nor has any body framed with a Content-Length (an
    SSE stream, say): an event after the cut would be clipped to the bytes still owed and
    read as a whole body of the promised length."""

    async def script(out: Responder, _r: web.Request) -> None:
        await out.head(200, head(), 100)
        await out.piece(first)
        out.fail(UpstreamFailed("upstream failed: reset"))

    async with responder_server(script) as (url, _), aiohttp.ClientSession() as http:
        async with http.post(url) as r:
            assert r.headers["Content-Length"] == "100"
            with pytest.raises(aiohttp.ClientPayloadError):  # short of its Content-Length
                await r.read()


async def test_client_gone_turns_writes_into_no_ops() -> None:
    client_left = asyncio.Event()
    writes_after: list[int] = []

    async def script(out: Responder, _r: web.Request) -> None:
        await out.head(200, sse_head(), None)
        await out.piece(b"data: 1\n\n")
        await client_left.wait()
        for i in range(10_000):  # a job draining its generation: never raises, never waits
            await out.piece(b"data: more\n\n")
            if out.gone:
                writes_after.append(i)
                break
        await out.end(b"data: last\n\n")
        out.fail(UpstreamFailed("ignored"))

    async with responder_server(script) as (url, seen), aiohttp.ClientSession() as http:
        async with http.post(url) as r:
            assert await r.content.readuntil(b"\n\n") == b"data: 1\n\n"
            r.connection.transport.abort()  # type: ignore[union-attr]
        client_left.set()
        await wait_until(lambda: bool(writes_after), what="a write noticing the client left")
        assert seen["out"].gone and seen["out"].ended


async def test_detach_ends_it_and_later_writes_do_nothing() -> None:
    detached = asyncio.Event()
    done = asyncio.Event()

    async def script(out: Responder, _r: web.Request) -> None:
        await out.head(200, sse_head(), None)
        await detached.wait()
        await out.piece(b"data: after\n\n")
        await out.end()
        done.set()

    async with responder_server(script) as (url, seen), aiohttp.ClientSession() as http:
        async with http.post(url) as r:
            await wait_until(lambda: "out" in seen and seen["out"].started, what="the head")
            seen["out"].detach()  # what the job does when the handler is cancelled
            assert seen["out"].gone and seen["out"].ended
            detached.set()
            await done.wait()
            assert (
                await r.read() == b""
            )  # aiohttp ends what the handler returned; nothing written after


async def test_error_after_an_interrupted_last_write_closes_instead_of_an_event() -> None:
    """A job cut (shutdown) while its last write waits on a reader that stopped reading:
    the body's end is already in the transport, so no event may follow it."""
    big = b"x" * (8 << 20)  # well past the socket buffers and the transport's high-water mark
    cut = asyncio.Event()

    async def script(out: Responder, request: web.Request) -> None:
        transport = small_send_buffer(request)
        await out.head(200, sse_head(), None)
        last = asyncio.create_task(out.end(big))
        await wait_until(
            lambda: transport.get_write_buffer_size() > 0 and not last.done(),
            what="the last write to wait on the client",
        )
        last.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await last
        out.fail(ShuttingDown("llmproxy shut down before the upstream finished"))
        cut.set()

    async with responder_server(script) as (url, _):
        reader, writer = await lagging_client(url)
        await asyncio.wait_for(cut.wait(), 30)  # not reading until the writer was cut
        got = await asyncio.wait_for(reader.read(), 30)  # until the server closes
        writer.close()
    assert got.startswith(b"HTTP/1.1 200") and got.endswith(b"0\r\n\r\n")  # the body's own end
    assert b"shutting_down" not in got


async def test_a_writer_stopped_while_the_client_lags_leaves_an_event_that_parses() -> None:
    """stop() cancels the job while its piece waits for a client that stopped reading (found
    by review): the piece's bytes are in the transport already, so the error event must start
    a new event after them; and aiohttp's flow-control future, cancelled with the job, must
    not surface in the handler as a cancellation it was never sent."""
    cut = asyncio.Event()
    handler_ends: list[str] = []

    async def script(out: Responder, request: web.Request) -> None:
        transport = small_send_buffer(request)
        await out.head(200, sse_head(), None)
        await out.piece(b'data: {"content":"a"}\n\n')  # a whole event: the tail at a boundary
        write = asyncio.create_task(
            out.piece(b'data: {"content":"' + b"x" * (8 << 20))
        )  # one cut mid-event
        await wait_until(
            lambda: transport.get_write_buffer_size() > 0 and not write.done(),
            timeout=20,
            what="the piece to wait on the client",
        )
        write.cancel()  # what stop() does to the job task
        with contextlib.suppress(asyncio.CancelledError):
            await write
        out.fail(Superseded("superseded by a newer request from the same session"))
        cut.set()

    async with responder_server(script, handler_ends) as (url, _):
        reader, writer = await lagging_client(url)
        await asyncio.wait_for(cut.wait(), 30)  # not reading until the writer was stopped
        got = bytearray()
        while not got.endswith(b"\r\n0\r\n\r\n"):  # the chunked body's end
            piece = await asyncio.wait_for(reader.read(1 << 20), 30)
            assert piece, f"closed before the body's end: {bytes(got[-100:])!r}"
            got += piece
        writer.close()
        await wait_until(lambda: bool(handler_ends), what="the handler to end")
    assert handler_ends == ["returned"]  # no stray CancelledError in the handler
    body = dechunk(bytes(got[got.index(b"\r\n\r\n") + 4 :]))
    events = body.split(b"\n\n")
    assert (
        events[-1] == b""
        and events[-2].startswith(b"data: {")
        and events[0] == b'data: {"content":"a"}'
    )
    assert json.loads(events[-2].removeprefix(b"data: "))["error"]["type"] == "superseded"
