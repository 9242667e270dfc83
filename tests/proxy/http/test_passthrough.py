"""Ungated routes: straight through without a permit, ended like a gated stream on failure."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import structlog
from aiohttp import web

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.proxy.relay.responder import Responder
from tests.helpers.net import serve_app
from tests.helpers.proxy import run_proxy


async def test_passthrough_is_ungated(http: aiohttp.ClientSession) -> None:
    script = lambda _p, _b: Script(tokens=100, token_delay_s=0.01)  # noqa: E731
    async with FakeUpstream(slots=1, script=script) as fake, run_proxy(fake.url) as px:
        busy = asyncio.create_task(http.post(px.url + "/completion", json={"prompt": "x"}))
        await fake.wait_for(lambda f: len(f.generations) == 1)
        with structlog.testing.capture_logs() as logs:
            for path in ("/health", "/props", "/slots", "/v1/models"):
                async with http.get(px.url + path) as r, http.get(fake.url + path) as d:
                    assert r.status == d.status
                    assert r.headers["Content-Type"] == d.headers["Content-Type"]
            px.flush_log()
        (await busy).release()
    lines = [e for e in logs if e.get("event") == "request"]
    assert [(e["route"], e["reached_upstream"], e["upstream_status"]) for e in lines] == [
        (p, True, 200) for p in ("/health", "/props", "/slots", "/v1/models")
    ]


async def test_passthrough_bug_after_the_start_ends_the_stream_not_the_wire(
    http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unexpected exception in an ungated relay once the response started (a fault
    injected into the second piece's write) ends the stream with the error event, as an
    upstream failure does, never with the middleware's 500 as a second status line inside
    the chunked body."""

    async def events(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in (1, 2):
            await resp.write(b"data: %d\n\n" % i)
            await asyncio.sleep(0.05)  # read apart at the proxy: pieces 1 and 2, then the last
        await resp.write_eof(b"data: 3\n\n")
        return resp

    upstream = web.Application()
    upstream.router.add_get("/events", events)
    real_piece = Responder.piece
    pieces = 0

    async def faulty_piece(self: Responder, data: bytes) -> None:
        nonlocal pieces
        pieces += 1
        if pieces == 2:
            raise RuntimeError("injected bug")
        await real_piece(self, data)

    monkeypatch.setattr(Responder, "piece", faulty_piece)
    async with serve_app(upstream) as up, run_proxy(up, upstream_kind="openai") as px:
        with structlog.testing.capture_logs() as logs:
            async with http.get(px.url + "/events") as r:
                assert r.status == 200
                body = await r.read()
            px.flush_log()
    events_out = [e for e in body.split(b"\n\n") if e]
    assert events_out[0] == b"data: 1" and len(events_out) == 2, body
    error = json.loads(events_out[1].removeprefix(b"data: "))["error"]
    assert error["src"] == "llmproxy" and error["code"] == 500 and error["type"] == "server_error"
    [line] = [e for e in logs if e.get("event") == "request"]
    assert line["outcome"] == "error" and line["route"] == "/events"
