"""The batched canonical request log (request_log.py): when lines are written, and with which time."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import aiohttp
import structlog

from llmproxy.proxy.bench.fake_upstream import FakeUpstream
from llmproxy.proxy.request_log import RequestLog
from tests.conftest import run_proxy
from tests.helpers import wait_until


def _lines(logs: list[dict[str, Any]]) -> list[str]:
    return [e["request_id"] for e in logs if e.get("event") == "request"]


async def test_lines_wait_for_the_timer_then_are_written_in_order() -> None:
    rl = RequestLog(flush_s=0.02)
    with structlog.testing.capture_logs() as logs:
        for rid in ("a", "b", "c"):
            rl.write({"request_id": rid})
        assert _lines(logs) == []  # nothing written inside the request's own loop turn
        await wait_until(lambda: len(_lines(logs)) == 3, what="the timer's flush")
        assert _lines(logs) == ["a", "b", "c"]
        rl.write({"request_id": "d"})  # a new batch arms a new timer
        await wait_until(lambda: len(_lines(logs)) == 4, what="the second flush")
    rl.close()


async def test_a_full_batch_is_written_at_once_and_close_writes_the_rest() -> None:
    rl = RequestLog(flush_s=3600, max_lines=3)
    with structlog.testing.capture_logs() as logs:
        rl.write({"request_id": "a"})
        rl.write({"request_id": "b"})
        assert _lines(logs) == []
        rl.write({"request_id": "c"})
        assert _lines(logs) == ["a", "b", "c"]  # bounded: max_lines waiting -> written now
        rl.write({"request_id": "d"})
        rl.close()
        assert _lines(logs) == ["a", "b", "c", "d"]
        rl.write({"request_id": "e"})  # after close: at once (requests that end during cleanup)
        assert _lines(logs) == ["a", "b", "c", "d", "e"]


async def test_flush_s_zero_writes_each_line_at_once() -> None:
    rl = RequestLog(flush_s=0)
    with structlog.testing.capture_logs() as logs:
        rl.write({"request_id": "a"})
        assert _lines(logs) == ["a"]


async def test_the_proxy_flushes_waiting_lines_when_it_stops(http: aiohttp.ClientSession, fake: FakeUpstream) -> None:
    with structlog.testing.capture_logs() as logs:
        async with run_proxy(fake.url, log_flush_s=3600) as px:
            async with http.post(px.url + "/completion", json={"prompt": "x", "n_predict": 2},
                                 headers={"X-Request-Id": "r1"}) as r:
                assert r.status == 200
                await r.read()
            await px.state.gate.wait_quiescent()
            assert _lines(logs) == []  # finished, but its line waits for the flush
        assert _lines(logs) == ["r1"]  # cleanup closed the log after the last request ended
        assert next(e for e in logs if e.get("event") == "request")["outcome"] == "completed"


_SNIPPET = """
import asyncio, json, time
from llmproxy.proxy.logs import configure_logging
from llmproxy.proxy.bench.fake_upstream import FakeUpstream
from llmproxy.proxy.request_log import RequestLog
configure_logging("info", json=True)

async def main():
    rl = RequestLog(flush_s=3600)
    line = {"request_id": "a"}
    rl.write(line)
    print(json.dumps(line["timestamp"]), flush=True)
    time.sleep(0.05)  # written well after it happened
    rl.close()

asyncio.run(main())
"""


def test_a_written_line_keeps_the_time_its_request_ended() -> None:
    # a fresh process: logging configuration is process-wide
    out = subprocess.run([sys.executable, "-c", _SNIPPET], capture_output=True, text=True, timeout=60, check=True)
    stamped = json.loads(out.stdout)
    (line,) = [json.loads(ln) for ln in out.stderr.splitlines()]
    assert line["event"] == "request" and line["level"] == "info" and line["request_id"] == "a"
    assert line["timestamp"] == stamped and stamped.endswith("Z")
