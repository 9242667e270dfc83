"""A pool whose upstreams fail: failover before sending, an upstream killed mid-burst, health
probes taking one out and back, and a pool with none left (fake llama-servers, loopback)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import aiohttp
import structlog

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from tests.helpers.net import wait_until
from tests.helpers.proxy import request_events, run_proxy


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def slow(_path: str, _body: dict[str, Any]) -> Script:
    return Script(tokens=30, token_delay_s=0.05)  # longer than the fake's 0.5 s shutdown grace


async def post(http: aiohttp.ClientSession, url: str, i: int) -> int:
    headers = {"X-LLMProxy-Session": f"s{i}", "X-Request-Id": f"r{i}"}
    async with http.post(url + "/completion", json={"prompt": f"p{i}"}, headers=headers) as r:
        await r.read()
        return r.status


async def test_a_request_its_upstream_refuses_goes_to_another_once(
    http: aiohttp.ClientSession,
) -> None:
    dead = f"http://127.0.0.1:{closed_port()}"
    async with FakeUpstream(slots=1) as good:
        specs = [{"url": dead, "name": "dead", "kind": "llamacpp"}, {"url": good.url, "name": "ok"}]
        with structlog.testing.capture_logs() as logs:
            async with run_proxy(None, upstreams=specs, route="round-robin") as px:
                assert [m.healthy for m in px.state.pool.members] == [True, True]  # not probed yet
                assert await post(http, px.url, 0) == 200  # round robin's first turn: dead
                await asyncio.wait_for(px.state.pool.wait_quiescent(), 5)  # permits back
                px.flush_log()
        line = request_events(logs)["r0"]
        assert (line["failover_from"], line["upstream"], line["outcome"]) == (
            "dead",
            "ok",
            "completed",
        )
        assert len(good.generations) == 1


async def test_a_pool_with_no_upstream_left_fails_fast(http: aiohttp.ClientSession) -> None:
    specs = [{"url": f"http://127.0.0.1:{closed_port()}", "name": f"d{i}"} for i in range(2)]
    async with run_proxy(None, upstreams=specs, queue_timeout_s=30) as px:
        assert not any(m.healthy for m in px.state.pool.members)  # detection found none
        async with http.post(px.url + "/completion", json={"prompt": "x"}) as r:
            body = await r.json()
            assert r.status == 503 and body["error"]["type"] == "upstream_unavailable"
            assert int(r.headers["Retry-After"]) >= 1


async def test_killing_one_upstream_mid_burst_loses_nothing_and_it_rejoins(
    http: aiohttp.ClientSession,
) -> None:
    fakes = [FakeUpstream(slots=1, script=slow) for _ in range(3)]
    for f in fakes:
        await f.start()
    victim = fakes[1]
    port = int(victim.url.rsplit(":", 1)[1])
    try:
        specs = [{"url": f.url, "name": f"u{i}"} for i, f in enumerate(fakes)]
        async with run_proxy(
            None, upstreams=specs, route="least-busy", health_interval_s=0.05
        ) as px:
            burst = [asyncio.create_task(post(http, px.url, i)) for i in range(6)]
            await victim.wait_for(lambda f: f.concurrent == 1)
            await victim.stop()  # its generation is cut mid-body; the queued go elsewhere
            statuses = await asyncio.wait_for(asyncio.gather(*burst), 30)
            assert sorted(statuses) == [200] * 5 + [502], statuses  # only the one it ran
            member = px.state.pool.members[1]
            await wait_until(lambda: not member.healthy, what="the dead one out of rotation")
            assert await post(http, px.url, 9) == 200
            await asyncio.wait_for(px.state.pool.wait_quiescent(), 5)
            assert all(m.gate.free == m.gate.capacity for m in px.state.pool.members)
            back = FakeUpstream(slots=1, script=slow, port=port)
            await back.start()
            fakes.append(back)
            await wait_until(lambda: member.healthy, what="the upstream back in rotation")
            statuses = await asyncio.gather(*(post(http, px.url, 10 + i) for i in range(3)))
            assert statuses == [200] * 3 and back.generations  # it takes requests again
            assert all(f.max_concurrent <= 1 for f in fakes)
    finally:
        for f in fakes:
            await f.stop()
