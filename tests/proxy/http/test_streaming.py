"""Streaming relay: chunks as they arrive, bodies byte for byte, and errors after the start
as a last event."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import pytest
from aiohttp import web

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.proxy.errors import Superseded
from llmproxy.proxy.relay.responder import stream_error_bytes
from tests.helpers.net import serve_app
from tests.helpers.proxy import run_proxy
from tests.helpers.streams import read_all


@pytest.mark.parametrize(
    ("kind", "path", "body", "ctype"),
    [
        ("llamacpp", "/completion", {"prompt": "x", "stream": True}, "text/event-stream"),
        (
            "llamacpp",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "stream": True},
            "text/event-stream",
        ),
        ("ollama", "/api/generate", {"model": "m", "prompt": "x"}, "application/x-ndjson"),
    ],
)
async def test_streams_relayed_chunk_by_chunk(
    http: aiohttp.ClientSession, kind: str, path: str, body: dict, ctype: str
) -> None:
    script = lambda _p, _b: Script(tokens=10, token_delay_s=0.05)  # noqa: E731
    async with FakeUpstream(kind=kind, slots=1, script=script) as fake, run_proxy(fake.url) as px:
        async with http.post(px.url + path, json=body) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith(ctype)
            first = await r.content.readline()
            assert first.strip()
            # the client saw data before the upstream sent its last chunk
            assert fake.completed == []
            rest = await r.read()
        direct = await http.post(fake.url + path, json=body)
        # byte for byte, except the per-request ids/counters the upstream puts in each chunk
        norm = lambda b: re.sub(rb'"(id|id_slot|created)":("[^"]*"|\d+)', b"", b)  # noqa: E731
        assert norm(first + rest) == norm(await direct.read())


@pytest.mark.parametrize("stream", [False, True])
async def test_response_body_exact_and_request_id_echoed(
    http: aiohttp.ClientSession, stream: bool
) -> None:
    # non-streamed: the whole body arrives at once and goes out as one response (relay.py)
    async with FakeUpstream(slots=1) as fake, run_proxy(fake.url) as px:
        body = {"prompt": "x", "stream": stream}
        async with http.post(
            px.url + "/completion", json=body, headers={"X-Request-Id": "rid-7"}
        ) as r:
            got = await r.read()
            assert r.status == 200 and r.headers["X-Request-Id"] == "rid-7"
            if not stream:
                assert r.headers["Content-Length"] == str(len(got))
        async with http.post(fake.url + "/completion", json=body) as d:
            direct = await d.read()
            assert r.headers["Content-Type"] == d.headers["Content-Type"]
        norm = lambda b: re.sub(rb'"(id|id_slot|created)":("[^"]*"|\d+)', b"", b)  # noqa: E731
        assert norm(got) == norm(direct) and got


@pytest.mark.parametrize(
    ("route", "body", "cut"),
    [
        ("/completion", {"prompt": "x", "stream": True}, True),
        ("/v1/completions", {"model": "m", "prompt": "x", "stream": True}, True),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True},
            False,
        ),
    ],
)
async def test_error_after_stream_start_is_an_event(
    http: aiohttp.ClientSession, route: str, body: dict[str, object], cut: bool
) -> None:
    """The proxy's error event ends the stream; on a completion route the connection then
    closes without the stream's terminator (an editor that keeps the text of a stream that
    ended whole must not take it for a suggestion); a chat stream ends whole."""
    script = lambda _p, _b: Script(tokens=10, token_delay_s=0.01, fail="reset_mid_stream")  # noqa: E731
    async with FakeUpstream(slots=1, script=script) as fake, run_proxy(fake.url) as px:
        async with http.post(px.url + route, json=body) as r:
            assert r.status == 200
            raw, whole = await read_all(r)
        last = [ln for ln in raw.decode().split("\n\n") if ln.strip()][-1]
        assert last.startswith("data: ")
        assert json.loads(last[6:])["error"]["src"] == "llmproxy"
        assert whole is not cut
        await asyncio.wait_for(px.state.pool.wait_quiescent(), 5)


async def test_error_after_ndjson_stream_start_is_an_ollama_error_line(
    http: aiohttp.ClientSession,
) -> None:
    """Ollama's own in-stream error is ``{"error": "<message>"}``; its clients throw
    ``Error(line.error)``, so the message must be the string there."""
    script = lambda _p, _b: Script(tokens=10, token_delay_s=0.01, fail="reset_mid_stream")  # noqa: E731
    async with (
        FakeUpstream(kind="ollama", slots=1, script=script) as fake,
        run_proxy(fake.url) as px,
    ):
        async with http.post(px.url + "/api/generate", json={"model": "m", "prompt": "x"}) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("application/x-ndjson")
            raw, whole = await read_all(r)
            lines = raw.decode().splitlines()
            assert not whole  # a completion route: cut after the error line
        await asyncio.wait_for(px.state.pool.wait_quiescent(), 5)
    tokens, last = [json.loads(ln) for ln in lines[:-1]], json.loads(lines[-1])
    assert tokens and all("response" in t and not t["done"] for t in tokens)  # relayed as sent
    assert isinstance(last["error"], str) and last["error"]
    assert last["src"] == "llmproxy" and last["code"] == 502 and last["type"] == "upstream_error"


def test_stream_error_bytes_formats() -> None:
    err = Superseded("superseded")
    sse = stream_error_bytes("text/event-stream; charset=utf-8", err)
    assert (
        sse is not None
        and sse.startswith(b"data: ")
        and sse.endswith(b"\n\n")
        and sse.count(b"\n") == 2
    )
    assert json.loads(sse[6:]) == err.envelope()
    for ctype, rs in [("application/x-ndjson", b""), ("application/json-seq", b"\x1e")]:
        line = stream_error_bytes(ctype, err)
        assert (
            line is not None
            and line.startswith(rs)
            and line.endswith(b"\n")
            and line.count(b"\n") == 1
        )
        assert json.loads(line[len(rs) :]) == {
            "error": "superseded",
            "type": "superseded",
            "code": 499,
            "src": "llmproxy",
        }
    # no event format: the relay closes instead
    assert stream_error_bytes("application/json", err) is None
    # after bytes that left an event or line open, it is ended first
    # "\r" + "\n" is one line end: two more are needed
    for tail, prefix in [
        (b"", b""),
        (b'"}\n\n', b""),
        (b"\r\n\r\n", b""),
        (b'"a"}\n', b"\n"),
        (b'"a', b"\n\n"),
        (b'"a"}\r', b"\n\n"),
    ]:
        assert stream_error_bytes("text/event-stream", err, tail) == prefix + sse, tail
    for tail, prefix in [(b"", b""), (b"}\n", b""), (b'{"a', b"\n")]:
        assert stream_error_bytes("application/x-ndjson", err, tail) == prefix + line.removeprefix(
            b"\x1e"
        ), tail


@pytest.mark.parametrize(
    ("ctype", "sent"),
    [
        ("text/event-stream", [b'data: {"content":"a"}\n\n', b'data: {"content":"b']),
        # cut after a line, inside the event
        ("text/event-stream", [b'data: {"content":"a"}\n', b"data: {"]),
        ("application/x-ndjson", [b'{"response":"a","done":false}\n', b'{"response":"b']),
    ],
    ids=["sse-mid-line", "sse-mid-event", "ndjson-mid-line"],
)
async def test_stream_cut_inside_an_event_ends_with_an_error_event_that_parses(
    http: aiohttp.ClientSession, ctype: str, sent: list[bytes]
) -> None:
    """The upstream dies in the middle of an event: the relayed part is as sent, then the
    open event or line is ended, and the proxy's error event stands on its own."""

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": ctype})
        await resp.prepare(request)
        for piece in sent:
            await resp.write(piece)
        assert request.transport is not None
        request.transport.abort()  # gone mid-event
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    async with serve_app(app) as upstream, run_proxy(upstream, upstream_kind="openai") as px:
        async with http.post(px.url + "/v1/completions", json={"prompt": "a", "stream": True}) as r:
            body, whole = await read_all(r)
        assert not whole  # a completion route: cut after the event
    relayed = b"".join(sent)
    assert body.startswith(relayed)
    if ctype == "text/event-stream":
        events = body.split(b"\n\n")  # as a client splits the stream into events
        # its own event, the last
        assert events[-1] == b"" and events[-2].startswith(b"data: {"), body
        error = json.loads(events[-2].removeprefix(b"data: "))["error"]
    else:
        error = json.loads(body.splitlines()[-1])
        assert body.splitlines()[:-1] == relayed.splitlines()
    assert error["src"] == "llmproxy" and error["code"] == 502, body
