"""Regressions for defects found in review (each reproduced before its fix)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp
import structlog
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.proxy.telemetry.record import RequestRecord
from llmproxy.proxy.upstream.job import UpstreamJob, UpstreamRequest
from llmproxy.proxy.upstream.responder import Responder
from tests.helpers.net import dechunk, serve_app, wait_until
from tests.helpers.proxy import run_proxy


async def test_unreachable_upstream_does_not_hold_the_permit(http: aiohttp.ClientSession) -> None:
    fake = FakeUpstream(slots=1)
    await fake.start()
    async with run_proxy(fake.url, confirm_timeout_s=5, queue_timeout_s=10) as px:
        assert px.state.adapter.can_confirm
        await fake.stop()  # the llama-server went away
        with structlog.testing.capture_logs() as logs:
            async with http.post(
                px.url + "/infill", json={"prompt": "a"}, headers={"X-Request-Id": "a"}
            ) as r:
                assert r.status == 502
            t0 = time.monotonic()
            async with http.post(
                px.url + "/infill", json={"prompt": "b"}, headers={"X-LLMProxy-Session": "z"}
            ) as r:
                assert r.status == 502
            assert time.monotonic() - t0 < 2  # not confirm_timeout_s behind a held permit
            await asyncio.wait_for(px.state.gate.wait_quiescent(), 2)
            px.flush_log()
        first = next(e for e in logs if e.get("event") == "request" and e["request_id"] == "a")
        assert first["reached_upstream"] is False and "confirm_timed_out" not in first


async def test_connect_timeout_does_not_hold_the_permit(http: aiohttp.ClientSession) -> None:
    """A black-holed upstream (SYNs dropped) times out while connecting: nothing was sent,
    so the permit comes back at once instead of after confirm_timeout_s of /slots polls."""
    fake = FakeUpstream(slots=1)
    await fake.start()
    async with run_proxy(fake.url, connect_timeout_s=0.3, confirm_timeout_s=30) as px:
        assert px.state.adapter.can_confirm
        port = int(fake.url.rsplit(":", 1)[1])
        await fake.stop()
        with socket.socket() as hole, socket.socket() as filler:
            hole.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            hole.bind(("127.0.0.1", port))
            hole.listen(0)  # never accepts; one queued connection fills it ...
            filler.connect(("127.0.0.1", port))  # ... so the kernel drops every later SYN
            with structlog.testing.capture_logs() as logs:
                async with http.post(
                    px.url + "/infill", json={"prompt": "a"}, headers={"X-Request-Id": "a"}
                ) as r:
                    assert (
                        r.status == 504 and (await r.json())["error"]["type"] == "upstream_timeout"
                    )
                await asyncio.wait_for(px.state.gate.wait_quiescent(), 5)
                px.flush_log()
        line = next(e for e in logs if e.get("event") == "request" and e["request_id"] == "a")
        assert line["reached_upstream"] is False and "confirm_timed_out" not in line


async def test_a_failed_job_cut_at_shutdown_keeps_its_error_outcome(
    http: aiohttp.ClientSession,
) -> None:
    """A job whose upstream already failed and that is still waiting for the stop to be
    confirmed when the shutdown deadline comes is an error, not a request we cut."""
    script = lambda _p, _b: Script(tokens=8, token_delay_s=0.001, fail="hang_mid_body")  # noqa: E731
    fake = FakeUpstream(
        slots=1, abort_linger_s=30, script=script
    )  # the slot stays busy: no confirmation
    await fake.start()
    try:
        with structlog.testing.capture_logs() as logs:
            async with run_proxy(
                fake.url, read_timeout_s=0.3, confirm_timeout_s=30, shutdown_timeout_s=0.3
            ) as px:
                async with http.post(
                    px.url + "/completion",
                    json={"prompt": "a", "stream": True},
                    headers={"X-Request-Id": "f"},
                ) as r:
                    assert (
                        b'"type":"upstream_timeout"' in await r.read()
                    )  # the error event ends the stream
                await wait_until(
                    lambda: px.state.gate.free == 0 and len(px.state.jobs) == 1, what="confirming"
                )
            # leaving run_proxy shut it down: the job was cut at the deadline while confirming
        line = next(e for e in logs if e.get("event") == "request" and e["request_id"] == "f")
        assert line["outcome"] == "error" and line["error"] == "upstream timed out", line
    finally:
        await fake.stop()


async def test_rejected_newcomer_does_not_kill_the_running_request(
    http: aiohttp.ClientSession,
) -> None:
    script = lambda _p, _b: Script(tokens=30, token_delay_s=0.01)  # noqa: E731
    async with (
        FakeUpstream(slots=1, abort_linger_s=0, script=script) as fake,
        run_proxy(fake.url, max_queue=1) as px,
    ):
        a = asyncio.create_task(
            http.post(px.url + "/infill", json={"prompt": "a"}, headers={"X-LLMProxy-Session": "S"})
        )
        await fake.wait_for(lambda f: f.concurrent == 1)
        c = asyncio.create_task(
            http.post(px.url + "/infill", json={"prompt": "c"}, headers={"X-LLMProxy-Session": "T"})
        )
        await wait_until(lambda: px.state.gate.queued == 1, what="queue full")
        async with http.post(
            px.url + "/infill", json={"prompt": "b"}, headers={"X-LLMProxy-Session": "S"}
        ) as rb:
            assert rb.status == 429
        ra, rc = await a, await c
        assert ra.status == 200 and rc.status == 200  # A was not superseded by a rejected B
        assert fake.aborted == []


async def test_stop_before_the_job_starts_never_sends() -> None:
    script = lambda _p, _b: Script(tokens=20, token_delay_s=0.01)  # noqa: E731
    async with (
        FakeUpstream(slots=1, abort_linger_s=0, script=script) as fake,
        run_proxy(fake.url) as px,
    ):
        st = px.state
        before = len(fake.received)
        ticket = st.gate.submit("S", supersedable=True, route="/infill")
        await ticket.wait()
        rec = RequestRecord("r1", "POST", "/infill")
        rec.parsed_body = {"prompt": "a"}
        job = UpstreamJob(
            gate=st.gate,
            ticket=ticket,
            adapter=st.adapter,
            request=UpstreamRequest(
                "POST",
                "/infill",
                "/infill",
                CIMultiDict({"Content-Type": "application/json"}),
                b'{"prompt":"a"}',
            ),
            out=Responder(make_mocked_request("POST", "/infill"), "r1"),
            record=rec,
            metrics=st.metrics,
            breaker=st.breaker,
            breaker_probe=False,
            supersede_policy="cancel",
            disconnect_policy="cancel",
            unconfirmed_hold_s=0,
        )
        rec.add_ref()
        task = st.jobs.spawn(job.run())
        newer = st.gate.submit("S", supersedable=True, route="/infill")  # same step as the spawn
        await task
        assert len(fake.received) == before  # the superseded request never left the proxy
        assert rec.outcome == "superseded" and not rec.sent
        assert await newer.wait() == 0
        st.gate.abandon(newer)


async def test_superseded_mid_stream_is_counted_superseded(http: aiohttp.ClientSession) -> None:
    script = lambda _p, _b: Script(tokens=100, token_delay_s=0.01)  # noqa: E731
    async with (
        FakeUpstream(slots=1, abort_linger_s=0, script=script) as fake,
        run_proxy(fake.url) as px,
    ):
        with structlog.testing.capture_logs() as logs:
            ra = await http.post(
                px.url + "/completion",
                json={"prompt": "a", "stream": True},
                headers={"X-LLMProxy-Session": "S", "X-Request-Id": "A"},
            )
            await ra.content.readline()
            tb = asyncio.create_task(
                http.post(
                    px.url + "/completion",
                    json={"prompt": "b"},
                    headers={"X-LLMProxy-Session": "S", "X-Request-Id": "B"},
                )
            )
            body_a = await ra.read()
            (await tb).release()
            await asyncio.wait_for(px.state.gate.wait_quiescent(), 5)
            await wait_until(
                lambda: sum(e.get("event") == "request" for e in logs) == 2, what="two log lines"
            )
        assert b'"type":"superseded"' in body_a  # the stream ended with our error event
        outcome = {e["request_id"]: e["outcome"] for e in logs if e.get("event") == "request"}
        assert outcome == {"A": "superseded", "B": "completed"}
        assert len(fake.aborted) == 1


async def test_bom_and_utf16_bodies_are_400(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    async with run_proxy(fake.url) as px:
        for body in (b'\xef\xbb\xbf{"prompt":"a"}', '{"prompt":"a"}'.encode("utf-16")):
            async with http.post(px.url + "/infill", data=body) as r:
                assert r.status == 400
                assert (await r.json())["error"]["src"] == "llmproxy"
        assert not fake.generations


async def test_health_exemption_is_get_only(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    async with run_proxy(fake.url, api_key="k3y") as px:
        before = len(fake.received)
        async with http.post(px.url + "/llmproxy/health", data=b"x") as r:
            assert r.status == 401
        async with http.get(px.url + "/llmproxy/health") as r:
            assert r.status == 200
        assert len(fake.received) == before


async def test_superseded_while_its_job_waits_on_a_client_that_lags() -> None:
    """A streamed request whose client stopped reading is superseded (policy cancel) while
    its job waits to write: the client still gets what was sent, then the superseded event,
    standing on its own; the request is logged superseded with its 200, not as a client
    that left (the job's cancel used to surface in the handler through aiohttp's shared
    flow-control future)."""
    piece = b"data: " + b"x" * (64 << 10) + b"\n\n"

    async def endless(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        while True:
            await resp.write(piece)

    def ask(session: str) -> bytes:
        body = b'{"prompt":"a","stream":true}'
        return (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"X-LLMProxy-Session: {session}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body

    app = web.Application()
    app.router.add_post("/v1/completions", endless)
    async with (
        serve_app(app) as upstream,
        run_proxy(
            upstream,
            upstream_kind="openai",
            capacity=2,
            supersede_inflight="cancel",
            on_disconnect="cancel",
            unconfirmed_cancel_hold_s=0,  # the newer request streams for ever too: closing it ends it
        ) as px,
    ):
        host, port = px.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port), limit=1 << 26)
        writer.write(ask("S"))
        await wait_until(lambda: px.state.gate.inflight == 1, what="the stream in flight")
        job = px.state.gate.inflight_snapshot()[0].on_supersede.__self__  # type: ignore[union-attr]
        await wait_until(
            lambda: job.out._request.protocol.writing_paused,
            timeout=20,
            what="the job waiting for the client to read",
        )
        _, newer = await asyncio.open_connection(host, int(port))
        newer.write(ask("S"))
        await wait_until(lambda: job.record.outcome == "superseded", what="the stream superseded")
        got = bytearray()
        while not got.endswith(b"\r\n0\r\n\r\n"):  # read it all now, to the chunked body's end
            data = await asyncio.wait_for(reader.read(1 << 20), 30)
            assert data, f"closed before the body's end: {bytes(got[-100:])!r}"
            got += data
        writer.close()
        newer.close()
        await asyncio.wait_for(px.state.gate.wait_quiescent(), 5)
        await wait_until(
            lambda: job.record.total_s is not None, what="the request to be accounted for"
        )
    body = dechunk(bytes(got[got.index(b"\r\n\r\n") + 4 :]))
    before, sep, event = body.rpartition(b'data: {"error"')
    assert sep and before.endswith(b"\n\n") and event.endswith(b"}\n\n"), body[
        -200:
    ]  # an event of its own
    assert json.loads(sep.removeprefix(b"data: ") + event)["error"]["type"] == "superseded"
    assert job.record.status == 200 and not job.record.client_gone
