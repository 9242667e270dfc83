"""Supersede end to end: an editor's newer request replaces its older one, queued or in flight."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
import structlog
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.proxy.errors import Superseded
from llmproxy.proxy.pool.entry import Placement
from llmproxy.proxy.relay.responder import Responder
from llmproxy.proxy.request import GatedRequest
from llmproxy.proxy.state import ProxyState
from llmproxy.proxy.telemetry.record import RequestRecord
from llmproxy.proxy.upstream.job import UpstreamJob
from tests.helpers.net import dechunk, serve_app, wait_until
from tests.helpers.proxy import request_events, run_proxy
from tests.helpers.scheduler import granted_slot, submit
from tests.helpers.streams import read_all


def infill(seq: int, **extra: Any) -> dict[str, Any]:
    return {
        "id_slot": 0,
        "input_prefix": "def f():\n",
        "input_suffix": "",
        "prompt": "    re",
        "n_predict": 128,
        "stream": False,
        "cache_prompt": True,
        "seq": seq,
        **extra,
    }


async def test_runs_on_the_loop_its_id_names(request: pytest.FixtureRequest) -> None:
    """This suite runs on both loops (conftest.BOTH_LOOPS): each run is on the one it names."""
    loop_id = request.node.name.rsplit("[", 1)[1].rstrip("]")
    assert loop_id in ("asyncio", "uvloop")
    assert type(asyncio.get_running_loop()).__module__.split(".")[0] == loop_id


async def test_editor_burst_one_session(http: aiohttp.ClientSession) -> None:
    """20 keystrokes 50 ms apart, each abandoning the previous request, N=1."""
    script = lambda _p, _b: Script(tokens=20, token_delay_s=0.02)  # noqa: E731  ~0.4 s per generation
    async with (
        FakeUpstream(slots=1, abort_linger_s=0.15, script=script) as fake,
        run_proxy(fake.url) as px,
    ):
        with structlog.testing.capture_logs() as logs:

            async def one(i: int) -> tuple[int, bytes]:
                async with http.post(
                    px.url + "/infill",
                    json=infill(i),
                    headers={"X-Request-Id": f"k{i}", "User-Agent": "curl/8.5.0"},
                ) as r:
                    return r.status, await r.read()

            tasks: list[asyncio.Task[tuple[int, bytes]]] = []
            for i in range(20):
                if tasks:
                    tasks[-1].cancel()  # the editor closes the previous connection
                tasks.append(asyncio.create_task(one(i)))
                await asyncio.sleep(0.05)  # the keystroke interval being simulated
            status, body = await tasks[-1]
            await asyncio.gather(*tasks[:-1], return_exceptions=True)
            await asyncio.wait_for(px.state.pool.wait_quiescent(), 10)
            await wait_until(lambda: len(request_events(logs)) == 20, what="20 canonical log lines")

        assert status == 200
        assert json.loads(body)["content"] == "".join(f"t{i} " for i in range(20))
        assert fake.max_concurrent == 1
        events = request_events(logs)
        reached = {r.body["seq"] for r in fake.generations}
        sent = {seq for seq in range(20) if events[f"k{seq}"]["reached_upstream"]}
        assert sent == reached  # the proxy's own view matches what the upstream saw
        for seq in set(range(20)) - reached:  # dropped before the upstream: never "completed"
            assert events[f"k{seq}"]["outcome"] in ("superseded", "cancelled_queued"), events[
                f"k{seq}"
            ]
        for seq in reached - {19}:  # abandoned by the editor while running
            assert events[f"k{seq}"]["outcome"] in ("superseded", "cancelled_inflight"), events[
                f"k{seq}"
            ]
        assert events["k19"]["outcome"] == "completed"
        assert 19 in reached and len(reached) < 10, reached
        assert all(r.body["id_slot"] == 0 for r in fake.generations)
        assert px.member.gate.free == 1


async def test_supersede_inflight_cancels_and_holds_permit_until_idle(
    http: aiohttp.ClientSession,
) -> None:
    script = lambda _p, _b: Script(tokens=200, token_delay_s=0.01)  # noqa: E731
    async with (
        FakeUpstream(slots=1, script=script, abort_linger_s=0.3) as fake,
        run_proxy(fake.url) as px,
    ):
        hdr = {"X-LLMProxy-Session": "ed"}
        first = asyncio.create_task(
            http.post(px.url + "/completion", json={"prompt": "a", "seq": 1}, headers=hdr)
        )
        await fake.wait_for(lambda f: len(f.generations) == 1)
        second = asyncio.create_task(
            http.post(
                px.url + "/completion", json={"prompt": "b", "seq": 2, "n_predict": 3}, headers=hdr
            )
        )
        r1 = await first
        assert r1.status == 499
        assert (await r1.json())["error"]["type"] == "superseded"
        await fake.wait_for(lambda f: len(f.aborted) == 1)
        r2 = await second
        assert r2.status == 200 and (await r2.json())["content"] == "t0 t1 t2 "
        assert fake.max_concurrent == 1  # second started only after the abort linger ended
        await asyncio.wait_for(px.state.pool.wait_quiescent(), 5)


async def test_warmup_is_not_superseded(http: aiohttp.ClientSession) -> None:
    script = lambda _p, _b: Script(tokens=30, token_delay_s=0.01)  # noqa: E731
    async with FakeUpstream(slots=1, script=script) as fake, run_proxy(fake.url) as px:
        hdr = {"X-LLMProxy-Session": "ed"}
        busy = asyncio.create_task(http.post(px.url + "/infill", json=infill(0), headers=hdr))
        await fake.wait_for(lambda f: len(f.generations) == 1)
        warm = asyncio.create_task(
            http.post(px.url + "/infill", json=infill(1, n_predict=0), headers=hdr)
        )
        await wait_until(lambda: len(px.state.pool.queue) == 1, what="warm-up queued")
        real = asyncio.create_task(http.post(px.url + "/infill", json=infill(2), headers=hdr))
        statuses = [(await t).status for t in (busy, warm, real)]
        assert statuses[1] == 200 and statuses[2] == 200
        assert sorted(r.body["seq"] for r in fake.generations) == [0, 1, 2]


def infill_job(
    st: ProxyState,
    placement: Placement,
    rec: RequestRecord,
    body: dict[str, Any],
    session: str = "S",
    **extra: Any,
) -> UpstreamJob:
    """The upstream job of an ``/infill`` request with ``body``, granted at ``placement``
    (as granted.py builds it)."""
    member = placement.member
    return UpstreamJob(
        gate=member.gate,
        ticket=placement.ticket,
        adapter=placement.adapter,
        request=GatedRequest(
            method="POST",
            route="/infill",
            raw_path="/infill",
            raw=json.dumps(body, separators=(",", ":")).encode(),
            body=body,
            session=session,
            klass="complete",
            caller="",
            continuable=True,
            twin=None,
        ),
        headers=CIMultiDict({"Content-Type": "application/json"}),
        out=Responder(make_mocked_request("POST", "/infill"), rec.request_id),
        record=rec,
        metrics=st.metrics,
        breaker=member.breaker,
        breaker_probe=placement.probe,
        supersede_policy="cancel",
        disconnect_policy="cancel",
        unconfirmed_hold_s=0,
        **extra,
    )


async def test_stop_before_the_job_starts_never_sends() -> None:
    script = lambda _p, _b: Script(tokens=20, token_delay_s=0.01)  # noqa: E731
    async with (
        FakeUpstream(slots=1, abort_linger_s=0, script=script) as fake,
        run_proxy(fake.url) as px,
    ):
        st = px.state
        before = len(fake.received)
        placement = await st.pool.acquire(submit(st.pool, "S", "a", route="/infill"), 1)
        assert placement.member is px.member
        rec = RequestRecord("r1", "POST", "/infill")
        job = infill_job(st, placement, rec, {"prompt": "a"})
        rec.add_ref()
        task = st.jobs.spawn(job.run())
        newer = submit(st.pool, "S", "b", route="/infill")  # same step as the spawn
        await task
        assert len(fake.received) == before  # the superseded request never left the proxy
        assert rec.outcome == "superseded" and not rec.sent
        assert await granted_slot(st.pool, newer) == 0
        st.pool.abandon(newer)


async def test_a_job_superseded_before_it_takes_its_permit_records_no_generation() -> None:
    """Type-through: a job whose ticket was superseded between its grant and the job's
    start never runs, so no later keystroke may find its generation as the session's."""
    async with FakeUpstream(slots=1) as fake, run_proxy(fake.url) as px:
        st = px.state
        assert st.generations is not None
        placement = await st.pool.acquire(submit(st.pool, "S", "a", route="/infill"), 1)
        newer = submit(st.pool, "S", "b", route="/infill")
        rec = RequestRecord("r1", "POST", "/infill")
        with pytest.raises(Superseded):
            infill_job(
                st, placement, rec, {"prompt": "a", "stream": True}, "S", generations=st.generations
            )
        assert st.generations.latest("S") is None
        assert newer.future.done()  # the permit went back at once
        assert await granted_slot(st.pool, newer) == 0
        st.pool.abandon(newer)


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
            body_a, whole = await read_all(ra)
            (await tb).release()
            await asyncio.wait_for(px.state.pool.wait_quiescent(), 5)
            await wait_until(
                lambda: sum(e.get("event") == "request" for e in logs) == 2, what="two log lines"
            )
        assert b'"type":"superseded"' in body_a  # the stream ended with our error event
        assert not whole  # and then without its terminator: no client takes it as complete
        outcome = {e["request_id"]: e["outcome"] for e in logs if e.get("event") == "request"}
        assert outcome == {"A": "superseded", "B": "completed"}
        assert len(fake.aborted) == 1


async def test_superseded_while_its_job_waits_on_a_client_that_lags() -> None:
    """A streamed request whose client stopped reading is superseded (policy cancel) while
    its job waits to write: the client still gets what was sent, then the superseded event,
    standing on its own, then the connection closes without the chunked body's end (a
    completion route: relay/error_event.py); the request is logged superseded with its
    200, not as a client
    that left (the job's cancel must not reach the handler through aiohttp's shared
    flow-control future)."""
    piece = b"data: " + b"x" * (64 << 10) + b"\n\n"

    async def endless(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        while True:
            await resp.write(piece)

    def ask(session: str, prompt: str) -> bytes:
        # a newer keystroke differs: equal bodies at the same time are twins (no supersede)
        body = b'{"prompt":"%s","stream":true}' % prompt.encode()
        return (
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nX-LLMProxy-Session: {session}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
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
            # the newer request streams for ever too: closing it ends it
            unconfirmed_cancel_hold_s=0,
        ) as px,
    ):
        host, port = px.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port), limit=1 << 26)
        writer.write(ask("S", "a"))
        await wait_until(lambda: px.member.gate.inflight == 1, what="the stream in flight")
        job = px.member.gate.inflight_snapshot()[0].on_supersede.__self__  # type: ignore[union-attr]
        await wait_until(
            lambda: job.out._request.protocol.writing_paused,
            timeout=20,
            what="the job waiting for the client to read",
        )
        _, newer = await asyncio.open_connection(host, int(port))
        newer.write(ask("S", "b"))
        await wait_until(lambda: job.record.outcome == "superseded", what="the stream superseded")
        got = bytearray()
        while data := await asyncio.wait_for(reader.read(1 << 20), 30):  # all now, to the close
            got += data
        assert not got.endswith(b"\r\n0\r\n\r\n"), "a cut stream must not end whole"
        writer.close()
        newer.close()
        await asyncio.wait_for(px.state.pool.wait_quiescent(), 5)
        await wait_until(
            lambda: job.record.total_s is not None, what="the request to be accounted for"
        )
    body = dechunk(bytes(got[got.index(b"\r\n\r\n") + 4 :]) + b"0\r\n\r\n")
    before, sep, event = body.rpartition(b'data: {"error"')
    # an event of its own
    assert sep and before.endswith(b"\n\n") and event.endswith(b"}\n\n"), body[-200:]
    assert json.loads(sep.removeprefix(b"data: ") + event)["error"]["type"] == "superseded"
    assert job.record.status == 200 and not job.record.client_gone
