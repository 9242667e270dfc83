"""An upstream that fails (unreachable, black-holed, hanging) never keeps a permit, and its
requests are logged as errors."""

from __future__ import annotations

import asyncio
import socket
import time

import aiohttp
import structlog

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from tests.helpers.net import wait_until
from tests.helpers.proxy import run_proxy
from tests.helpers.streams import read_all


async def test_unreachable_upstream_does_not_hold_the_permit(http: aiohttp.ClientSession) -> None:
    fake = FakeUpstream(slots=1)
    await fake.start()
    async with run_proxy(fake.url, confirm_timeout_s=5, queue_timeout_s=10) as px:
        assert px.member.adapter.can_confirm
        await fake.stop()  # the llama-server went away
        with structlog.testing.capture_logs() as logs:
            async with http.post(
                px.url + "/infill", json={"prompt": "a"}, headers={"X-Request-Id": "a"}
            ) as r:
                assert r.status == 502
            t0 = time.monotonic()
            async with http.post(
                px.url + "/infill", json={"prompt": "b"}, headers={"X-LLMProxy-Session": "z"}
            ) as r:
                assert r.status == 502
            assert time.monotonic() - t0 < 2  # not confirm_timeout_s behind a held permit
            await asyncio.wait_for(px.state.pool.wait_quiescent(), 2)
            px.flush_log()
        first = next(e for e in logs if e.get("event") == "request" and e["request_id"] == "a")
        assert first["reached_upstream"] is False and "confirm_timed_out" not in first


async def test_connect_timeout_does_not_hold_the_permit(http: aiohttp.ClientSession) -> None:
    """A black-holed upstream (SYNs dropped) times out while connecting: nothing was sent,
    so the permit comes back at once instead of after confirm_timeout_s of /slots polls."""
    fake = FakeUpstream(slots=1)
    await fake.start()
    async with run_proxy(fake.url, connect_timeout_s=0.3, confirm_timeout_s=30) as px:
        assert px.member.adapter.can_confirm
        port = int(fake.url.rsplit(":", 1)[1])
        await fake.stop()
        with socket.socket() as hole, socket.socket() as filler:
            hole.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            hole.bind(("127.0.0.1", port))
            hole.listen(0)  # never accepts; one queued connection fills it ...
            filler.connect(("127.0.0.1", port))  # ... so the kernel drops every later SYN
            with structlog.testing.capture_logs() as logs:
                async with http.post(
                    px.url + "/infill", json={"prompt": "a"}, headers={"X-Request-Id": "a"}
                ) as r:
                    assert (
                        r.status == 504 and (await r.json())["error"]["type"] == "upstream_timeout"
                    )
                await asyncio.wait_for(px.state.pool.wait_quiescent(), 5)
                px.flush_log()
        line = next(e for e in logs if e.get("event") == "request" and e["request_id"] == "a")
        assert line["reached_upstream"] is False and "confirm_timed_out" not in line


async def test_a_failed_job_cut_at_shutdown_keeps_its_error_outcome(
    http: aiohttp.ClientSession,
) -> None:
    """A job whose upstream already failed and that is still waiting for the stop to be
    confirmed when the shutdown deadline comes is an error, not a request we cut."""
    script = lambda _p, _b: Script(tokens=8, token_delay_s=0.001, fail="hang_mid_body")  # noqa: E731
    # the slot stays busy: no confirmation
    fake = FakeUpstream(slots=1, abort_linger_s=30, script=script)
    await fake.start()
    try:
        with structlog.testing.capture_logs() as logs:
            async with run_proxy(
                fake.url, read_timeout_s=0.3, confirm_timeout_s=30, shutdown_timeout_s=0.3
            ) as px:
                async with http.post(
                    px.url + "/completion",
                    json={"prompt": "a", "stream": True},
                    headers={"X-Request-Id": "f"},
                ) as r:
                    # the error event ends the stream
                    raw, whole = await read_all(r)  # cut after its error event
                    assert b'"type":"upstream_timeout"' in raw and not whole
                await wait_until(
                    lambda: px.member.gate.free == 0 and len(px.state.jobs) == 1, what="confirming"
                )
            # leaving run_proxy shut it down: the job was cut at the deadline while confirming
        line = next(e for e in logs if e.get("event") == "request" and e["request_id"] == "f")
        assert line["outcome"] == "error" and line["error"] == "upstream timed out", line
    finally:
        await fake.stop()
