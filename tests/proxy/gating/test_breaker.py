"""Circuit breaker: unit (fake clock) and against a real dead-then-alive upstream."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.proxy.gating.breaker import CircuitBreaker, UpstreamUnavailable
from tests.helpers.clock import Clock
from tests.helpers.net import closed_port, wait_until
from tests.helpers.proxy import run_proxy


def test_breaker_opens_probes_and_closes() -> None:
    clock = Clock()
    b = CircuitBreaker(3, 10, clock)
    for _ in range(2):
        assert b.admit() is False
        b.failure()
    assert b.state == "closed"
    b.failure()
    assert b.state == "open"
    with pytest.raises(UpstreamUnavailable) as info:
        b.admit()
    assert info.value.status == 503 and int(info.value.headers["Retry-After"]) >= 1
    clock.t = 10
    assert b.state == "half_open"
    assert b.admit() is True  # the one probe
    with pytest.raises(UpstreamUnavailable):
        b.admit()  # only one probe at a time
    b.failure(probe=True)
    assert b.state == "open"  # probe failed: another cooldown
    clock.t = 20
    assert b.admit() is True
    b.neutral(True)  # client left before an answer: the probe slot is free again
    assert b.admit() is True
    b.success(probe=True)
    assert b.state == "closed" and b.admit() is False


def test_only_the_probe_frees_the_probe_slot() -> None:
    """An older request that fails while the probe is out re-opens the breaker, but the probe
    slot stays the probe's: no second probe until the first one reports."""
    clock = Clock()
    b = CircuitBreaker(1, 10, clock)
    assert b.admit() is False  # an older request, let through while closed
    b.failure()  # another request failed: open
    clock.t = 10
    assert b.admit() is True  # the probe
    b.failure()  # the older request fails now
    assert b.state == "open"
    clock.t = 20
    assert b.state == "half_open"
    with pytest.raises(UpstreamUnavailable):
        b.admit()  # the first probe is still out
    b.success()  # an older request's success closes the breaker...
    assert b.state == "closed"
    b.failure()
    clock.t = 30
    with pytest.raises(UpstreamUnavailable):
        b.admit()  # ...but the probe slot is still the first probe's
    b.neutral(True)  # the probe's own report frees it
    assert b.admit() is True


def test_success_resets_the_count() -> None:
    b = CircuitBreaker(2, 1, Clock())
    b.failure()
    b.success()
    b.failure()
    assert b.state == "closed"
    assert CircuitBreaker(0, 1, Clock()).state == "closed"


async def test_breaker_fails_fast_then_recovers(http: aiohttp.ClientSession) -> None:
    port = closed_port()
    async with run_proxy(
        f"http://127.0.0.1:{port}",
        upstream_kind="llamacpp",
        breaker_threshold=3,
        breaker_cooldown_s=0.3,
    ) as px:
        for _ in range(3):
            async with http.post(px.url + "/completion", json={"prompt": "x"}) as r:
                assert r.status == 502
        t0 = time.monotonic()
        async with http.post(px.url + "/completion", json={"prompt": "x"}) as r:
            assert r.status == 503 and (await r.json())["error"]["type"] == "upstream_unavailable"
            assert "Retry-After" in r.headers
        assert time.monotonic() - t0 < 0.2
        async with FakeUpstream(slots=1, port=port) as fake:
            breaker = px.member.breaker
            await wait_until(lambda: breaker.state == "half_open", 2, what="cooldown over")
            async with http.post(px.url + "/completion", json={"prompt": "x"}) as r:
                assert r.status == 200  # the probe
            assert px.member.breaker.state == "closed"
            assert len(fake.generations) == 1
        assert px.member.gate.free == 1


async def test_the_probe_closes_the_breaker_as_soon_as_its_head_arrives(
    http: aiohttp.ClientSession,
) -> None:
    """The half-open probe is a success once the upstream's head says so: a probe that
    streams on does not keep every other request out (503) for the rest of its life."""
    failing = True
    hold = asyncio.Event()

    def script(_p: str, body: dict[str, Any]) -> Script:
        if failing:
            return Script(status=500)
        return Script(tokens=3, hold=hold if body.get("prompt") == "probe" else None)

    async with (
        FakeUpstream(slots=2, script=script) as fake,
        run_proxy(fake.url, breaker_threshold=1, breaker_cooldown_s=0.2) as px,
    ):
        breaker = px.member.breaker
        async with http.post(px.url + "/completion", json={"prompt": "x"}) as r:
            assert r.status == 500
        assert breaker.state == "open"
        failing = False
        await wait_until(lambda: breaker.state == "half_open", 2, what="cooldown over")
        probe = asyncio.create_task(
            http.post(
                px.url + "/completion",
                json={"prompt": "probe", "stream": True},
                headers={"X-LLMProxy-Session": "probe"},
            )
        )
        # on its slot: llama-server's head goes out now
        await fake.wait_for(lambda f: f.concurrent == 1)
        await wait_until(
            lambda: breaker.state == "closed", 2, what="the probe's head closing the breaker"
        )
        async with http.post(
            px.url + "/completion",
            json={"prompt": "other", "n_predict": 2},
            headers={"X-LLMProxy-Session": "other"},
        ) as r:
            assert r.status == 200
        hold.set()
        async with await probe as r:
            assert r.status == 200
            await r.read()
        assert breaker.state == "closed"
        await asyncio.wait_for(px.state.pool.wait_quiescent(), 5)
