"""The proxy's own endpoints: status, metrics, and the health check's API-key exemption."""

from __future__ import annotations

import aiohttp

from llmproxy.bench.fake.upstream import FakeUpstream
from tests.helpers.net import wait_until
from tests.helpers.proxy import run_proxy


async def test_status_and_metrics(fake: FakeUpstream, http: aiohttp.ClientSession) -> None:
    async with run_proxy(fake.url) as px:
        async with http.post(px.url + "/completion", json={"prompt": "x"}) as r:
            assert r.status == 200
        async with http.post(px.url + "/completion", data=b"{") as r:
            assert r.status == 400
        await wait_until(lambda: px.member.gate.inflight == 0)
        async with http.get(px.url + "/llmproxy/status") as r:
            st = await r.json()
        assert st["permits"] == {"total": 1, "free": 1, "held": 0}
        assert st["queue"]["depth"] == 0 and st["upstream"]["kind"] == "llamacpp"
        async with http.get(px.url + "/llmproxy/metrics") as r:
            text = await r.text()
        for name in (
            "llmproxy_queue_depth",
            "llmproxy_inflight",
            "llmproxy_permits_free",
            "llmproxy_upstream_latency_seconds_bucket",
            "llmproxy_upstream_ttfb_seconds_bucket",
            "llmproxy_permit_hold_seconds_bucket",
            "llmproxy_confirm_wait_seconds_bucket",
        ):
            assert name in text, name
        assert 'llmproxy_requests_total{outcome="completed",route="/completion"} 1.0' in text
        assert 'llmproxy_requests_total{outcome="rejected",route="/completion"} 1.0' in text


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
