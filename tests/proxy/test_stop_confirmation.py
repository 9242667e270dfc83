"""A cancelled request's permits come back only once /slots shows its slots idle; a slot
whose stop is not confirmed in time is quarantined."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
import structlog

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from tests.helpers.net import wait_until
from tests.helpers.proxy import run_proxy


async def test_confirm_timeout_releases_loudly(http: aiohttp.ClientSession) -> None:
    script = lambda _p, _b: Script(tokens=200, token_delay_s=0.01)  # noqa: E731
    async with (
        FakeUpstream(slots=1, script=script, abort_linger_s=30) as fake,
        run_proxy(fake.url, confirm_timeout_s=0.3) as px,
    ):
        with structlog.testing.capture_logs() as logs:
            task = asyncio.create_task(http.post(px.url + "/completion", json={"prompt": "x"}))
            await fake.wait_for(lambda f: len(f.generations) == 1)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await asyncio.wait_for(px.state.pool.wait_quiescent(), 5)
        assert any(
            e["log_level"] == "error" and "confirmation timed out" in e["event"] for e in logs
        )
        assert px.state.metrics.confirm_timeouts._value.get() == 1


async def test_a_slot_whose_stop_was_not_confirmed_stays_out_of_the_gate_until_idle(
    http: aiohttp.ClientSession,
) -> None:
    """After ``confirm_timeout_s`` the slot may still run the stopped request: it is
    quarantined (shown in status and metrics, capacity counted down) instead of released,
    and a request pinned to it waits in the proxy's queue, not in the server's, until /slots
    shows it idle."""
    script = lambda _p, _b: Script(tokens=200, token_delay_s=0.01)  # noqa: E731
    async with (
        FakeUpstream(slots=1, script=script, abort_linger_s=1.0) as fake,
        run_proxy(fake.url, confirm_timeout_s=0.2) as px,
    ):
        gate = px.member.gate
        task = asyncio.create_task(
            http.post(
                px.url + "/completion", json={"prompt": "x"}, headers={"X-LLMProxy-Session": "a"}
            )
        )
        await fake.wait_for(lambda f: len(f.generations) == 1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await wait_until(
            lambda: px.state.metrics.confirm_timeouts._value.get() == 1, what="the confirm timeout"
        )
        assert fake.slot_busy == [True]  # still lingering after the abort
        async with http.get(px.url + "/llmproxy/status") as r:
            status = await r.json()
        assert status["upstreams"][0]["quarantine"] == [0] and status["permits"] == {
            "total": 0,
            "free": 0,
            "held": 0,
        }
        async with http.get(px.url + "/llmproxy/metrics") as r:
            text = await r.text()
        assert "llmproxy_permits_quarantined 1.0" in text and "llmproxy_permits_total 0.0" in text
        async with http.post(
            px.url + "/completion",
            json={"prompt": "y", "n_predict": 2},
            headers={"X-LLMProxy-Session": "b"},
        ) as r:
            assert r.status == 200
        assert fake.deferred == [] and fake.max_concurrent == 1
        assert gate.quarantined == [] and gate.capacity == gate.free == 1
        await asyncio.wait_for(gate.wait_quiescent(), 5)


async def test_cancelled_n_cmpl_holds_its_permits_until_every_slot_is_idle(
    http: aiohttp.ClientSession,
) -> None:
    """The client leaves a two-slot request: both permits stay held until /slots shows both
    slots idle (the upstream keeps aborted slots busy for a while), so the next request
    never waits inside the upstream."""
    script = lambda _p, _b: Script(tokens=200, token_delay_s=0.01)  # noqa: E731
    async with (
        FakeUpstream(slots=2, script=script, abort_linger_s=0.3) as fake,
        run_proxy(fake.url) as px,
    ):
        r = await http.post(
            px.url + "/completion",
            json={"prompt": "a", "n_cmpl": 2, "stream": True},
            headers={"X-LLMProxy-Session": "one"},
        )
        await r.content.readline()
        r.close()
        await fake.wait_for(lambda f: len(f.aborted) == 1)
        assert fake.slot_busy == [True, True]
        async with http.post(
            px.url + "/completion",
            json={"prompt": "b", "n_predict": 2},
            headers={"X-LLMProxy-Session": "two"},
        ) as r2:
            assert r2.status == 200
        assert fake.deferred == [] and fake.max_concurrent == 2
        await asyncio.wait_for(px.state.pool.wait_quiescent(), 5)


async def test_stop_confirmation_waits_for_every_slot_of_the_request(
    http: aiohttp.ClientSession,
) -> None:
    hold = asyncio.Event()
    script = lambda _p, _b: Script(tokens=3, hold=hold)  # noqa: E731
    async with (
        FakeUpstream(slots=2, script=script) as fake,
        run_proxy(fake.url, confirm_timeout_s=0.1) as px,
    ):
        adapter = px.member.adapter
        busy = asyncio.create_task(
            http.post(fake.url + "/completion", json={"prompt": "x", "id_slot": 1})
        )
        await fake.wait_for(lambda f: f.slot_busy == [False, True])
        assert await adapter.confirm_stopped((0,)) is True
        assert await adapter.confirm_stopped((0, 1)) is False  # slot 1 still busy: timed out
        hold.set()
        (await busy).release()
        await fake.wait_for(lambda f: f.slot_busy == [False, False])
        assert await adapter.confirm_stopped((0, 1)) is True
        assert await adapter.confirm_stopped((0, 5)) is False  # a slot the server does not list


class _NoNames(aiohttp.abc.AbstractResolver):
    """A resolver that fails like a name that does not resolve (no network needed)."""

    async def resolve(self, host: str, port: int = 0, family: int = 0) -> list[Any]:
        raise OSError(-2, "Name or service not known")

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("failure", ["refused", "no-name"])
async def test_only_a_refused_connection_confirms_a_stop_at_once(failure: str) -> None:
    """Refused: nothing listens, so nothing runs: confirmed. A failure that says nothing about
    the server (a name that does not resolve now, no file descriptors) is not: the stop is
    polled until confirm_timeout_s, which then logs and counts the timeout."""
    from llmproxy.proxy.settings import ProxySettings
    from llmproxy.proxy.upstream.adapters.llamacpp import LlamaCppAdapter
    from tests.helpers.net import closed_port

    base = (
        f"http://127.0.0.1:{closed_port()}"
        if failure == "refused"
        else "http://backend.internal:8012"
    )
    settings = ProxySettings(upstream=base, confirm_timeout_s=0.2)
    connector = aiohttp.TCPConnector(resolver=_NoNames()) if failure == "no-name" else None
    async with aiohttp.ClientSession(connector=connector) as session:
        adapter = LlamaCppAdapter(base, session, settings, slots=1)
        try:
            assert await adapter.busy_map() == ("down" if failure == "refused" else "unknown")
            assert await adapter.confirm_stopped([0]) is (failure == "refused")
        finally:
            adapter.close()
