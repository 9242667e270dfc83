"""The job -> handler channel and the relay's one-piece path for bodies that arrived whole.

Pure logic, no sockets: ``take_complete_body`` must hand out a body only when the
upstream already ended it (terminal ``End``, nothing but chunks buffered), and then
leave the channel drained; anything else (stream still running, an error at the end,
headers-only) must take nothing, so that the relay streams as before.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict

from llmproxy.proxy.channel import Channel, Chunk, End, Error, Headers
from llmproxy.proxy.errors import ProxyError
from llmproxy.proxy.relay import relay


async def test_whole_body_is_taken_with_its_end() -> None:
    ch = Channel()
    await ch.put(Chunk(b'{"content":'))
    await ch.put(Chunk(b'"x"}'))
    ch.finish(End())
    assert ch.take_complete_body() == b'{"content":"x"}'
    assert [ev async for ev in ch] == []  # drained: the terminal event went with the body


async def test_running_stream_takes_nothing() -> None:
    ch = Channel()
    await ch.put(Chunk(b"data: 1\n\n"))
    assert ch.take_complete_body() is None  # no terminal event yet
    ch.finish(End())
    assert [ev async for ev in ch] == [Chunk(b"data: 1\n\n"), End()]


async def test_error_at_the_end_takes_nothing() -> None:
    ch = Channel()
    await ch.put(Chunk(b"partial"))
    err = Error(ProxyError("upstream broke"))
    ch.finish(err)
    assert ch.take_complete_body() is None
    assert [ev async for ev in ch] == [Chunk(b"partial"), err]


async def test_empty_body_takes_nothing() -> None:
    ch = Channel()
    ch.finish(End())
    assert ch.take_complete_body() is None  # e.g. HEAD or 204: the stream path keeps its framing
    assert [ev async for ev in ch] == [End()]


async def test_relay_answers_a_whole_body_as_one_response() -> None:
    ch = Channel()
    headers = CIMultiDict({"Content-Type": "application/json", "X-Upstream": "1"})
    await ch.put(Headers(200, headers, 7))
    await ch.put(Chunk(b'{"a":'))
    await ch.put(Chunk(b"1}"))
    ch.finish(End())
    resp = await relay(make_mocked_request("POST", "/completion"), ch)
    assert type(resp) is web.Response and not resp.prepared  # aiohttp writes it in one piece
    assert resp.status == 200 and resp.body == b'{"a":1}'
    assert resp.headers["X-Upstream"] == "1" and resp.content_type == "application/json"


async def test_end_is_taken_only_when_it_is_next() -> None:
    ch = Channel()
    await ch.put(Chunk(b"a"))
    ch.finish(End())
    assert not ch.take_end_if_next()  # a chunk is still buffered
    assert await ch.__anext__() == Chunk(b"a")
    assert ch.take_end_if_next()
    assert [ev async for ev in ch] == []
    failed = Channel()
    failed.finish(Error(ProxyError("x")))
    assert not failed.take_end_if_next()  # an error is not a clean end: the relay must see it
