"""Circuit breaker: unit (fake clock) and against a real dead-then-alive upstream."""

from __future__ import annotations

import time

import aiohttp
import pytest

from llmproxy.proxy.bench.fake_upstream import FakeUpstream
from llmproxy.proxy.breaker import CircuitBreaker, UpstreamUnavailable
from tests.conftest import run_proxy
from tests.helpers import closed_port, wait_until


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


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
    b.failure()
    assert b.state == "open"  # probe failed: another cooldown
    clock.t = 20
    assert b.admit() is True
    b.neutral(True)  # client left before an answer: the probe slot is free again
    assert b.admit() is True
    b.success()
    assert b.state == "closed" and b.admit() is False


def test_success_resets_the_count() -> None:
    b = CircuitBreaker(2, 1, Clock())
    b.failure()
    b.success()
    b.failure()
    assert b.state == "closed"
    assert CircuitBreaker(0, 1, Clock()).state == "closed"


async def test_breaker_fails_fast_then_recovers(http: aiohttp.ClientSession) -> None:
    port = closed_port()
    async with run_proxy(f"http://127.0.0.1:{port}", upstream_kind="llamacpp", breaker_threshold=3,
                         breaker_cooldown_s=0.3) as px:
        for _ in range(3):
            async with http.post(px.url + "/completion", json={"prompt": "x"}) as r:
                assert r.status == 502
        t0 = time.monotonic()
        async with http.post(px.url + "/completion", json={"prompt": "x"}) as r:
            assert r.status == 503 and (await r.json())["error"]["type"] == "upstream_unavailable"
            assert "Retry-After" in r.headers
        assert time.monotonic() - t0 < 0.2
        async with FakeUpstream(slots=1, port=port) as fake:
            await wait_until(lambda: px.state.breaker.state == "half_open", 2, what="cooldown over")
            async with http.post(px.url + "/completion", json={"prompt": "x"}) as r:
                assert r.status == 200  # the probe
            assert px.state.breaker.state == "closed"
            assert len(fake.generations) == 1
        assert px.state.gate.free == 1
