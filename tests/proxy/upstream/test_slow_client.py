"""A client that stops reading (a suspended editor, a stuck socket): the upstream is read to
its end into the client's buffer, so the permit comes back when the upstream is done, and
a client that takes nothing for ``client_write_timeout_s`` is dropped."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import structlog

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from tests.helpers.net import wait_until
from tests.helpers.proxy import run_proxy
from tests.helpers.slow_client import dropped, stalled

TOKENS, PADDING = (
    512,
    16384,
)  # 8 MiB of stream: more than a loopback connection's kernel buffers hold (4 MiB)


async def test_a_client_that_stops_reading_does_not_keep_the_permit(
    http: aiohttp.ClientSession,
) -> None:
    def script(_path: str, body: dict[str, Any]) -> Script:
        padding = PADDING if body["prompt"] == "a" else 0
        return Script(tokens=TOKENS, token_delay_s=0, padding=padding)

    async with (
        FakeUpstream(slots=1, script=script) as fake,
        run_proxy(fake.url, client_buffer_bytes=16 << 20, client_write_timeout_s=0.5) as px,
    ):
        gate = px.member.gate
        with structlog.testing.capture_logs() as logs:
            async with stalled(px.url, "/completion", {"prompt": "a", "stream": True}) as reader:
                await fake.wait_for(
                    lambda f: len(f.completed) == 1, timeout=10
                )  # the backend is done...
                await wait_until(
                    lambda: gate.free == 1, what="the permit back while the client still stalls"
                )
                async with http.post(
                    px.url + "/completion", json={"prompt": "b", "n_predict": 2}
                ) as r:
                    assert r.status == 200  # ...and the next request runs meanwhile
                await wait_until(
                    lambda: len(px.state.jobs) == 0,
                    what="the client dropped: it took nothing for 0.5 s",
                )
                assert await asyncio.wait_for(dropped(reader), 5)
            px.flush_log()
        line = next(e for e in logs if e.get("event") == "request" and e["request_id"] == "stalled")
        assert "dropped" in line["error"] and line["reached_upstream"] is True
        assert fake.aborted == [] and fake.max_concurrent == 1


async def test_a_client_stalled_mid_stream_is_dropped_and_its_generation_stopped() -> None:
    """The response is larger than ``client_buffer_bytes``: the job waits for the client, for
    ``client_write_timeout_s`` at most; then the client is dropped, and ``on_disconnect``
    (auto: cancel, confirmed by /slots) stops the generation and returns the permit."""
    script = lambda _p, _b: Script(tokens=TOKENS * 4, token_delay_s=0, padding=PADDING)  # noqa: E731
    async with (
        FakeUpstream(slots=1, script=script, abort_linger_s=0.05) as fake,
        run_proxy(fake.url, client_buffer_bytes=65536, client_write_timeout_s=0.5) as px,
    ):
        async with stalled(px.url, "/completion", {"prompt": "a", "stream": True}) as reader:
            await fake.wait_for(lambda f: len(f.aborted) == 1, timeout=10)
            assert await asyncio.wait_for(dropped(reader), 5)
        await asyncio.wait_for(px.state.pool.wait_quiescent(), 5)
        assert fake.completed == [] and px.member.gate.free == 1
