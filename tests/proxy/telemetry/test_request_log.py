"""The batched request accounting (request_log.py): when lines are written and metrics
observed, with which time."""

from __future__ import annotations

import asyncio
import datetime
import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import aiohttp
import structlog

from llmproxy.bench.fake.upstream import FakeUpstream
from llmproxy.proxy.telemetry.request_log import RequestLog
from tests.helpers.net import wait_until
from tests.helpers.proxy import run_proxy


def _lines(logs: list[dict[str, Any]]) -> list[str]:
    return [e["request_id"] for e in logs if e.get("event") == "request"]


def line(rid: str) -> Callable[[RequestLog], dict[str, Any]]:
    """An entry as a record hands it over: accounted for (here: its line built) only when called."""
    return lambda _log: {"request_id": rid}


async def test_lines_wait_for_the_timer_then_are_written_in_order() -> None:
    rl = RequestLog(flush_s=0.02)
    with structlog.testing.capture_logs() as logs:
        for rid in ("a", "b", "c"):
            rl.write(line(rid))
        assert _lines(logs) == []  # nothing written inside the request's own loop turn
        await wait_until(lambda: len(_lines(logs)) == 3, what="the timer's flush")
        assert _lines(logs) == ["a", "b", "c"]
        rl.write(line("d"))  # a new batch arms a new timer
        await wait_until(lambda: len(_lines(logs)) == 4, what="the second flush")
    rl.close()


async def test_the_timer_flush_takes_a_few_per_loop_turn() -> None:
    """A large batch does not hold the loop: other callbacks run between its slices."""
    rl = RequestLog(flush_s=0.01, per_turn=2)
    turns: list[str] = []
    loop = asyncio.get_running_loop()

    def entry(rid: str) -> Callable[[RequestLog], None]:
        def account(_log: RequestLog) -> None:
            turns.append(rid)
            # queued while the first slice runs: behind the second slice, ahead of the third
            if rid == "a":
                loop.call_soon(turns.append, "other")

        return account

    for rid in "abcde":
        rl.write(entry(rid))
    await wait_until(lambda: len(turns) == 6, what="the whole batch")
    assert turns == ["a", "b", "c", "d", "other", "e"]  # all in one turn: a b c d e other
    rl.close()


async def test_an_entry_that_fails_loses_nothing_else() -> None:
    rl = RequestLog(flush_s=3600)

    def broken(_log: RequestLog) -> None:
        raise RuntimeError("bug in one entry")

    with structlog.testing.capture_logs() as logs:
        rl.write(line("a"))
        rl.write(broken)
        rl.write(line("c"))
        rl.flush()  # does not raise
    assert _lines(logs) == ["a", "c"]
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["request accounting failed"]
    rl.close()


async def test_a_full_batch_is_written_at_once_and_close_writes_the_rest() -> None:
    rl = RequestLog(flush_s=3600, max_lines=3)
    with structlog.testing.capture_logs() as logs:
        rl.write(line("a"))
        rl.write(line("b"))
        assert _lines(logs) == []
        rl.write(line("c"))
        assert _lines(logs) == ["a", "b", "c"]  # bounded: max_lines waiting -> written now
        rl.write(line("d"))
        rl.close()
        assert _lines(logs) == ["a", "b", "c", "d"]
        rl.write(line("e"))  # after close: at once (requests that end during cleanup)
        assert _lines(logs) == ["a", "b", "c", "d", "e"]


async def test_flush_s_zero_writes_each_line_at_once() -> None:
    rl = RequestLog(flush_s=0)
    with structlog.testing.capture_logs() as logs:
        rl.write(line("a"))
        assert _lines(logs) == ["a"]


async def test_an_entry_is_accounted_for_only_at_the_flush() -> None:
    rl = RequestLog(flush_s=3600)
    calls: list[str] = []
    rl.write(lambda _log: calls.append("a") or None)  # None: metrics only, no line
    assert calls == []
    rl.flush()
    assert calls == ["a"]
    rl.close()


async def test_metrics_wait_in_the_batch_until_they_are_read(
    http: aiohttp.ClientSession, fake: FakeUpstream
) -> None:
    """A finished request is counted at the flush, and reading /llmproxy/metrics flushes first."""
    async with run_proxy(fake.url, log_flush_s=3600) as px:
        async with http.post(px.url + "/completion", json={"prompt": "x", "n_predict": 2}) as r:
            assert r.status == 200
            await r.read()
        await px.state.pool.wait_quiescent()
        completed = px.state.metrics.requests.labels(outcome="completed", route="/completion")
        assert completed._value.get() == 0  # finished, accounted for at the next flush
        async with http.get(px.url + "/llmproxy/metrics") as r:
            text = await r.text()
        assert 'llmproxy_requests_total{outcome="completed",route="/completion"} 1.0' in text
        assert (
            "llmproxy_permit_hold_seconds_count 1.0" in text
            and "llmproxy_upstream_ttfb_seconds_count 1.0" in text
        )


async def test_the_proxy_flushes_waiting_lines_when_it_stops(
    http: aiohttp.ClientSession, fake: FakeUpstream
) -> None:
    with structlog.testing.capture_logs() as logs:
        async with run_proxy(fake.url, log_flush_s=3600) as px:
            async with http.post(
                px.url + "/completion",
                json={"prompt": "x", "n_predict": 2},
                headers={"X-Request-Id": "r1"},
            ) as r:
                assert r.status == 200
                await r.read()
            await px.state.pool.wait_quiescent()
            assert _lines(logs) == []  # finished, but its line waits for the flush
        assert _lines(logs) == ["r1"]  # cleanup closed the log after the last request ended
        assert next(e for e in logs if e.get("event") == "request")["outcome"] == "completed"


_SNIPPET = """
import asyncio, json, time
from llmproxy.common.logs import configure_logging
from llmproxy.proxy.telemetry.record import RequestRecord
from llmproxy.proxy.telemetry.request_log import RequestLog
configure_logging("info", json=True)

async def main():
    rl = RequestLog(flush_s=3600)
    before = time.time()
    RequestRecord("a", "POST", "/completion", request_log=rl).end_ref()
    after = time.time()
    print(json.dumps([before, after]), flush=True)
    time.sleep(0.2)  # written well after it happened
    rl.close()

asyncio.run(main())
"""


def test_a_written_line_keeps_the_time_its_request_ended() -> None:
    # a fresh process: logging configuration is process-wide
    out = subprocess.run(
        [sys.executable, "-c", _SNIPPET], capture_output=True, text=True, timeout=60, check=True
    )
    before, after = json.loads(out.stdout)
    (entry,) = [json.loads(ln) for ln in out.stderr.splitlines()]
    assert entry["event"] == "request" and entry["level"] == "info" and entry["request_id"] == "a"
    stamped = datetime.datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00")).timestamp()
    # not the flush's time, 0.2 s later
    assert entry["timestamp"].endswith("Z") and before <= stamped <= after
