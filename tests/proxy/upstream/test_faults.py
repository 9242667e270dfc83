"""Upstream faults against a real proxy and the fake upstream.

Each case checks the three things a fault must never cost: a prompt, clear answer to the
client; every permit back once quiet (``gate.free == capacity``); and one canonical
``request`` log line that says what happened.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from tests.helpers.net import wait_until
from tests.helpers.proxy import run_proxy
from tests.helpers.streams import read_all


def canonical(logs: list[dict[str, Any]], route: str = "/completion") -> list[dict[str, Any]]:
    return [e for e in logs if e.get("event") == "request" and e.get("route") == route]


def sse_events(text: str) -> list[str]:
    return [ev for ev in text.split("\n\n") if ev.strip()]


async def quiet(px: Any) -> None:
    await asyncio.wait_for(px.state.pool.wait_quiescent(), 5)
    assert px.member.gate.free == px.member.gate.capacity
    px.flush_log()


def outcome_count(px: Any, outcome: str, route: str = "/completion") -> float:
    return px.state.metrics.requests.labels(outcome=outcome, route=route)._value.get()


async def hung_mid_body(http: aiohttp.ClientSession) -> dict[str, Any]:
    """One streamed request whose upstream hangs after the first token (read_timeout_s 0.4)."""
    script = lambda _p, _b: Script(tokens=10, token_delay_s=0.001, fail="hang_mid_body")  # noqa: E731
    async with (
        FakeUpstream(slots=1, script=script, abort_linger_s=0.05) as fake,
        run_proxy(fake.url, read_timeout_s=0.4) as px,
    ):
        with structlog.testing.capture_logs() as logs:
            t0 = time.monotonic()
            async with http.post(px.url + "/completion", json={"prompt": "x", "stream": True}) as r:
                assert r.status == 200
                raw, whole = await read_all(r)
                text = raw.decode()
                assert not whole  # cut after the error event (a completion route)
            elapsed = time.monotonic() - t0
            await quiet(px)
        return {
            "text": text,
            "elapsed": elapsed,
            "logs": logs,
            "errors": outcome_count(px, "error"),
            "cut": fake.aborted == [g.id for g in fake.generations],
        }


async def test_hang_mid_body_ends_with_error_event(http: aiohttp.ClientSession) -> None:
    run = await hung_mid_body(http)
    events = sse_events(run["text"])
    assert json.loads(events[0][6:])["content"] == "t0 "  # what the upstream sent got through
    err = json.loads(events[-1][6:])["error"]
    assert err["type"] == "upstream_timeout" and err["src"] == "llmproxy" and err["code"] == 504
    assert 0.4 <= run["elapsed"] < 3
    assert run["cut"]  # the proxy closed the hung connection
    (line,) = canonical(run["logs"])
    assert line["outcome"] == "error" and line["status"] == 200 and line["upstream_status"] == 200
    assert any(
        e["event"] == "upstream request failed" and "timed out" in e["error"] for e in run["logs"]
    )
    assert run["errors"] == 1


async def test_canonical_line_names_a_mid_stream_error(http: aiohttp.ClientSession) -> None:
    """The canonical line of a request whose stream broke after the headers carries the error."""
    (line,) = canonical((await hung_mid_body(http))["logs"])
    assert "timed out" in line.get("error", "")


async def test_malformed_upstream_bytes_pass_through(http: aiohttp.ClientSession) -> None:
    script = lambda _p, _b: Script(tokens=4, token_delay_s=0.001, fail="malformed")  # noqa: E731
    async with (
        FakeUpstream(slots=1, script=script) as fake,
        run_proxy(fake.url, upstream_stream="off") as px,
    ):
        with structlog.testing.capture_logs() as logs:
            for stream in (True, False):
                body = {"prompt": "x", "stream": stream}
                async with http.post(fake.url + "/completion", json=body) as d:
                    direct = await d.read()
                async with http.post(px.url + "/completion", json=body) as r:
                    assert r.status == 200
                    relayed = await r.read()
                assert relayed == direct  # id_slot 0 either way: byte for byte
                if stream:
                    assert b'data: {"content":"t1 ",\n\n' in relayed  # the broken event got through
                else:
                    assert relayed.startswith(b"{") and not relayed.endswith(
                        b"}"
                    )  # half a JSON body
            await quiet(px)
            async with http.get(px.url + "/llmproxy/health") as h:
                assert h.status == 200
        lines = canonical(logs)
        assert [ln["outcome"] for ln in lines] == ["completed", "completed"]
        assert px.member.breaker.state == "closed"


async def test_malformed_stream_under_a_non_streaming_answer_is_a_502(
    http: aiohttp.ClientSession,
) -> None:
    """A non-streaming request the proxy sent as a stream (assemble.py) cannot pass a broken
    event through: nothing went out yet, so the client gets the envelope."""
    script = lambda _p, _b: Script(tokens=4, token_delay_s=0.001, fail="malformed")  # noqa: E731
    async with FakeUpstream(slots=1, script=script) as fake, run_proxy(fake.url) as px:
        with structlog.testing.capture_logs() as logs:
            async with http.post(px.url + "/completion", json={"prompt": "x"}) as r:
                assert r.status == 502
                error = (await r.json())["error"]
            assert (
                error["type"] == "upstream_error" and "malformed stream event" in error["message"]
            )
            await quiet(px)
        (line,) = canonical(logs)
        assert line["outcome"] == "error" and line["assembled"] is True
        assert px.member.gate.free == 1


async def test_upstream_5xx_relayed_counted_and_trips_breaker(http: aiohttp.ClientSession) -> None:
    script = lambda _p, _b: Script(status=500)  # noqa: E731
    async with (
        FakeUpstream(slots=1, script=script) as fake,
        run_proxy(fake.url, breaker_threshold=2, breaker_cooldown_s=30) as px,
    ):
        with structlog.testing.capture_logs() as logs:
            for _ in range(2):
                async with http.post(px.url + "/completion", json={"prompt": "x"}) as r:
                    assert r.status == 500
                    assert await r.json() == {
                        "error": {
                            "message": "scripted error 500",
                            "type": "server_error",
                            "code": 500,
                        }
                    }
            async with http.post(px.url + "/completion", json={"prompt": "x"}) as r:
                assert (
                    r.status == 503 and (await r.json())["error"]["type"] == "upstream_unavailable"
                )
            await quiet(px)
        assert len(fake.generations) == 2  # the third failed fast
        assert px.member.breaker.state == "open"
        lines = canonical(logs)
        assert [(ln["status"], ln["outcome"]) for ln in lines] == [
            (500, "error"),
            (500, "error"),
            (503, "rejected"),
        ]
        assert lines[0]["upstream_status"] == 500
        assert outcome_count(px, "error") == 2 and outcome_count(px, "rejected") == 1


async def test_upstream_restarted_while_requests_queued(http: aiohttp.ClientSession) -> None:
    script = lambda _p, _b: Script(tokens=500, token_delay_s=0.01)  # noqa: E731
    fast = lambda _p, _b: Script(tokens=3, token_delay_s=0.001)  # noqa: E731
    old = FakeUpstream(slots=1, script=script, abort_linger_s=0)
    await old.start()
    port = int(old.url.rsplit(":", 1)[1])
    new: FakeUpstream | None = None
    try:
        async with run_proxy(old.url, queue_timeout_s=20, confirm_timeout_s=10) as px:
            with structlog.testing.capture_logs() as logs:

                async def one(i: int) -> tuple[int, bytes]:
                    async with http.post(
                        px.url + "/completion",
                        json={"prompt": str(i), "stream": True},
                        headers={"X-LLMProxy-Session": f"s{i}"},
                    ) as r:
                        return r.status, (await read_all(r))[0]

                tasks = [asyncio.create_task(one(0))]
                await old.wait_for(lambda f: len(f.generations) == 1)
                tasks += [asyncio.create_task(one(i)) for i in range(1, 4)]
                await wait_until(lambda: len(px.state.pool.queue) >= 3, 15, what="three queued")
                await old.stop()
                new = FakeUpstream(slots=1, script=fast, port=port)
                await new.start()
                results = await asyncio.wait_for(asyncio.gather(*tasks), 15)
                await quiet(px)
            first_status, first_body = results[0]
            assert first_status == 200
            assert json.loads(sse_events(first_body.decode())[-1][6:])["error"]["src"] == "llmproxy"
            served = 0
            for status, body in results[1:]:
                if status == 200:
                    served += 1
                    assert body.endswith(b'"truncated":false}\n\n')
                else:
                    assert status == 502 and json.loads(body)["error"]["src"] == "llmproxy"
            assert served == len(new.generations)
            lines = canonical(logs)
            assert len(lines) == 4 and lines[0]["outcome"] == "error"
            assert sorted(ln["outcome"] for ln in lines[1:]) == sorted(
                "completed" if s == 200 else "error" for s, _ in results[1:]
            )
    finally:
        if new is not None:
            await new.stop()
        await old.stop()


class HangingSlots(FakeUpstream):
    """The fake, except that ``GET /slots`` hangs (never answers) once ``hang`` is set."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.hang = asyncio.Event()
        self.slot_polls = 0

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/slots" and self.hang.is_set():
            self.slot_polls += 1
            await self._stopping.wait()
        return await super()._dispatch(request)


async def test_slots_never_answering_hits_confirm_timeout(http: aiohttp.ClientSession) -> None:
    script = lambda _p, _b: Script(tokens=500, token_delay_s=0.01)  # noqa: E731
    async with (
        HangingSlots(slots=1, script=script, abort_linger_s=0) as fake,
        run_proxy(fake.url, confirm_timeout_s=0.5) as px,
    ):
        assert px.member.adapter.can_confirm
        with structlog.testing.capture_logs() as logs:
            fake.hang.set()
            task = asyncio.create_task(http.post(px.url + "/completion", json={"prompt": "x"}))
            await fake.wait_for(lambda f: len(f.generations) == 1)
            t0 = time.monotonic()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await quiet(px)
            waited = time.monotonic() - t0
            fake.hang.clear()
            async with http.post(px.url + "/completion", json={"prompt": "y", "n_predict": 2}) as r:
                assert r.status == 200  # the proxy works on after the timeout
        assert fake.slot_polls >= 1
        assert 0.5 <= waited < 3
        assert px.state.metrics.confirm_timeouts._value.get() == 1
        assert any(
            e["log_level"] == "error" and "confirmation timed out" in e["event"] for e in logs
        )
        first = canonical(logs)[0]
        assert first["outcome"] == "cancelled_inflight" and first["confirm_timed_out"] is True
        assert first["confirm_wait_ms"] >= 500
