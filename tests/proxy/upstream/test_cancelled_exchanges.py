"""Leaving or cancelling an exchange closes its connection, which is how a generation is
cancelled at the upstream: the upstream sees the abort, a cancelled request never arrives
whole afterwards, and ``on_send`` tells whether the request may have left.
"""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest

from llmproxy.proxy.upstream.client import UpstreamClient
from tests.helpers.upstreams import client, fetch, recorder, scripted_server


async def test_leaving_early_closes_the_connection_and_the_upstream_sees_the_abort() -> None:
    async with recorder() as (rec, url):
        c = client(url)
        async with c.exchange("POST", "/slow", {}, b"{}") as resp:
            assert await resp.content.readany() == b"first "
        # closing the connection is how a generation is cancelled
        await asyncio.wait_for(rec.aborted.wait(), 5)
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
