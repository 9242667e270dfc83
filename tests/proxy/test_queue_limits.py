"""A full queue answers 429, a wait past queue_timeout_s 503; neither costs a running request."""

from __future__ import annotations

import asyncio

import aiohttp

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from tests.helpers.net import wait_until
from tests.helpers.proxy import run_proxy


async def test_queue_full_429_and_queue_timeout_503(http: aiohttp.ClientSession) -> None:
    script = lambda _p, _b: Script(tokens=100, token_delay_s=0.01)  # noqa: E731
    async with (
        FakeUpstream(slots=1, script=script) as fake,
        run_proxy(fake.url, max_queue=1, queue_timeout_s=0.3, retry_after_s=2) as px,
    ):
        hold = asyncio.create_task(
            http.post(
                px.url + "/completion", json={"prompt": "a"}, headers={"X-LLMProxy-Session": "a"}
            )
        )
        await fake.wait_for(lambda f: len(f.generations) == 1)
        queued = asyncio.create_task(
            http.post(
                px.url + "/completion", json={"prompt": "b"}, headers={"X-LLMProxy-Session": "b"}
            )
        )
        await wait_until(lambda: len(px.state.pool.queue) == 1, what="one queued")
        async with http.post(
            px.url + "/completion", json={"prompt": "c"}, headers={"X-LLMProxy-Session": "c"}
        ) as r:
            assert r.status == 429 and r.headers["Retry-After"] == "2"
            assert (await r.json())["error"]["src"] == "llmproxy"
        r = await queued
        assert r.status == 503 and (await r.json())["error"]["type"] == "queue_timeout"
        (await hold).release()
        await asyncio.wait_for(px.state.pool.wait_quiescent(), 5)
        assert len(fake.generations) == 1


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
        await wait_until(lambda: len(px.state.pool.queue) == 1, what="queue full")
        async with http.post(
            px.url + "/infill", json={"prompt": "b"}, headers={"X-LLMProxy-Session": "S"}
        ) as rb:
            assert rb.status == 429
        ra, rc = await a, await c
        assert ra.status == 200 and rc.status == 200  # A was not superseded by a rejected B
        assert fake.aborted == []
