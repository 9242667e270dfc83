"""/llmproxy/health: liveness stays 200; ``degraded``, saying why, while the upstream cannot be
reached (as far as the proxy knows without sending anything itself)."""

from __future__ import annotations

from typing import Any

import aiohttp

from llmproxy.bench.fake.upstream import FakeUpstream
from tests.helpers.net import closed_port, wait_until
from tests.helpers.proxy import run_proxy


async def health(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/llmproxy/health") as r:
        assert r.status == 200  # liveness: the proxy serves
        body: dict[str, Any] = await r.json()
        return body


async def test_health_is_degraded_until_the_upstream_answers(http: aiohttp.ClientSession) -> None:
    port = closed_port()
    body = {"input_prefix": "x", "input_suffix": "", "n_predict": 2}
    async with run_proxy(f"http://127.0.0.1:{port}", log_flush_s=0) as px:
        first = await health(http, px.url)
        assert first["status"] == "degraded"
        assert first["reasons"] == [
            f"upstream 127.0.0.1:{port}: it has not answered yet (detection goes on)"
        ]
        async with http.post(px.url + "/infill", json=body) as r:  # out of rotation: fast
            assert r.status == 503 and (await r.json())["error"]["type"] == "upstream_unavailable"
        second = await health(http, px.url)
        assert second["reasons"] == first["reasons"]

        async with FakeUpstream(port=port):
            await wait_until(lambda: not px.member.adapter.undetected, 15, "detection")
            async with http.post(px.url + "/infill", json=body) as r:
                assert r.status == 200
            px.flush_log()
            assert await health(http, px.url) == {"status": "ok", "upstream": "llamacpp"}

        async with http.post(px.url + "/infill", json=body) as r:  # it went away again
            assert r.status == 502
        px.flush_log()
        assert (await health(http, px.url))["status"] == "degraded"
