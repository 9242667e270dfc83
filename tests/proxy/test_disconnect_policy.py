"""A client that leaves: queued, it never reaches the upstream; in flight, its request is
cancelled or finished by policy."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from tests.helpers.net import wait_until
from tests.helpers.proxy import run_proxy


async def test_disconnect_while_queued_never_reaches_upstream(http: aiohttp.ClientSession) -> None:
    gate_open = asyncio.Event()

    def script(_p: str, body: dict[str, Any]) -> Script:
        return Script(tokens=3, token_delay_s=0.01)

    async with (
        FakeUpstream(slots=1, script=script, abort_linger_s=0.05) as fake,
        run_proxy(fake.url) as px,
    ):
        first = asyncio.create_task(
            http.post(
                px.url + "/completion",
                json={"prompt": "a", "seq": 1, "n_predict": 400},
                headers={"X-LLMProxy-Session": "one"},
            )
        )
        await fake.wait_for(lambda f: len(f.generations) == 1)
        second = asyncio.create_task(
            http.post(
                px.url + "/completion",
                json={"prompt": "b", "seq": 2},
                headers={"X-LLMProxy-Session": "two"},
            )
        )
        await wait_until(lambda: len(px.state.pool.queue) == 1, what="second request queued")
        second.cancel()
        await asyncio.gather(second, return_exceptions=True)
        await wait_until(lambda: len(px.state.pool.queue) == 0, what="queued request dropped")
        gate_open.set()
        resp = await first
        assert resp.status == 200
        resp.release()
        await asyncio.wait_for(px.state.pool.wait_quiescent(), 5)
        assert [r.body["seq"] for r in fake.generations] == [1]


async def test_finish_policy_drains_without_cancelling(http: aiohttp.ClientSession) -> None:
    script = lambda _p, _b: Script(tokens=20, token_delay_s=0.01)  # noqa: E731
    async with (
        FakeUpstream(kind="openai", slots=1, script=script) as fake,
        run_proxy(fake.url, upstream_stream="off") as px,  # sent as it is: nothing stops it
    ):
        assert px.policy(px.state.settings.on_disconnect) == "finish"
        task = asyncio.create_task(
            http.post(px.url + "/v1/completions", json={"prompt": "x", "seq": 1})
        )
        await fake.wait_for(lambda f: len(f.generations) == 1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await fake.wait_for(lambda f: len(f.completed) == 1)
        assert fake.aborted == []
        await asyncio.wait_for(px.state.pool.wait_quiescent(), 5)


async def test_no_slots_endpoint_falls_back_to_finish(http: aiohttp.ClientSession) -> None:
    async with FakeUpstream(slots=1, slots_endpoint=False) as fake, run_proxy(fake.url) as px:
        assert not px.member.adapter.can_confirm
        assert px.policy("auto") == "finish"
