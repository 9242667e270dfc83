"""``llmproxy bench soak --minutes M``: mixed editors against ``llmproxy serve`` for a
while, then check invariants.

Starts ``llmproxy serve`` as a child (embedded backend by default, ``--upstream URL``
otherwise) with ``--capacity N``, and drives ``--editors`` simulated editors, each its own
session, doing at random: keystroke bursts on ``/infill`` (half of them abort the previous
request, like llm-ls; the others leave the superseding to the proxy, like Continue),
``n_predict: 0`` warm-ups, streamed chat completions and non-streamed completions.
Meanwhile ``GET /slots`` (through the proxy's passthrough) is polled to record how many
generations the backend ran at once. At the end, once the proxy is quiet, it reports
requests by outcome (from ``/llmproxy/metrics``), the maximum upstream concurrency
observed, the proxy's RSS after warm-up and at the end, and the free permits; it exits 1
when an invariant fails: max concurrency == N, free permits == N, RSS growth < 10 %, no
request with outcome ``error``, and every request a client sent (aborted ones included) counted
exactly once by the proxy.

Concurrency contract: editors and the /slots poller run in one TaskGroup until the
deadline; an editor's in-flight requests are tasks it owns and cancels (abort) or awaits
before returning. The proxy child is terminated (SIGTERM, then SIGKILL) when ``run_soak``
exits, whatever happened.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from llmproxy.bench.burst.slots import SlotsPoller
from llmproxy.bench.child import child
from llmproxy.bench.progress import Steps
from llmproxy.bench.soak.editor import Editor
from llmproxy.bench.soak.result import (
    SoakResult,
    error_lines,
    format_table,
    outcomes_from_metrics,
    rss_kb,
)
from llmproxy.bench.soak.settings import SoakSettings, proxy_argv
from llmproxy.common.config import add_settings_arguments, settings_from_args
from llmproxy.common.logs import configure_logging


async def _quiet(http: aiohttp.ClientSession, url: str, timeout_s: float) -> dict[str, Any]:
    """Wait until no request is queued or in flight; returns /llmproxy/status."""
    deadline = time.monotonic() + timeout_s
    while True:
        async with http.get(url + "/llmproxy/status") as r:
            status: dict[str, Any] = await r.json()
        if (
            status["queue"]["depth"] == 0 and not status["inflight"] and status["jobs"] == 0
        ) or time.monotonic() > deadline:
            return status
        await asyncio.sleep(0.05)


async def _progress(minutes: float, end: float, stop: asyncio.Event) -> None:
    """One progress step a minute (on stderr, with the time left) until ``end`` or ``stop``."""
    total = max(1, math.ceil(minutes))
    with Steps(total, "bench soak") as steps:
        for minute in range(1, total + 1):
            steps.step(f"minute {minute} of {total}")
            left = end - time.monotonic()
            if left <= 0:
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(60.0, left)):
                    await stop.wait()
            if stop.is_set():
                return


async def run_soak(settings: SoakSettings) -> SoakResult:
    result = SoakResult(capacity=settings.capacity)
    with tempfile.TemporaryDirectory(prefix="llmproxy-soak-") as tmp:
        async with (
            child("proxy", proxy_argv(settings), Path(tmp), settings.start_timeout_s, 30) as (
                pid,
                url,
            ),
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http,
        ):
            deadline = time.monotonic() + settings.start_timeout_s
            while True:  # the port file comes before the embedded backend is ready
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(url + "/llmproxy/health") as r:
                        if r.status == 200:
                            break
                if time.monotonic() > deadline:
                    raise RuntimeError("proxy not healthy in time")
                await asyncio.sleep(0.1)
            editors = [Editor(http, url, i, settings, result) for i in range(settings.editors)]
            for e in editors:  # warm-up: every kind of request once, then the RSS baseline
                for path, body in (
                    ("/infill", {"input_prefix": "x", "n_predict": 2}),
                    (
                        "/v1/chat/completions",
                        {
                            "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 2,
                            "stream": True,
                        },
                    ),
                ):
                    await e.request(path, body)
            await _quiet(http, url, 30)
            result.rss_start_kb = rss_kb(pid)
            poller = SlotsPoller(http, url, settings.poll_ms / 1000)
            stop = asyncio.Event()
            t0 = time.monotonic()
            end = t0 + settings.minutes * 60
            async with asyncio.TaskGroup() as tg:
                tg.create_task(poller.run(stop))
                runs = [tg.create_task(e.run(end)) for e in editors]
                tg.create_task(_progress(settings.minutes, end, stop))
                await asyncio.wait(runs)
                stop.set()
            result.seconds = time.monotonic() - t0
            result.max_concurrency = poller.max_busy
            status = await _quiet(http, url, 60)
            result.permits_free = status["permits"]["free"]
            async with http.get(url + "/llmproxy/metrics") as r:
                result.outcomes = outcomes_from_metrics(await r.text())
            result.rss_end_kb = rss_kb(pid)
        result.error_lines = error_lines(Path(tmp) / "proxy.log")
    return result


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(SoakSettings, args)
    configure_logging(settings.log_level)
    result = asyncio.run(run_soak(settings))
    sys.stdout.write(format_table(result))
    return 1 if result.failures() else 0


def register(bench_sub: argparse._SubParsersAction) -> None:
    parser = bench_sub.add_parser(
        "soak",
        help="Mixed editors against llmproxy serve for M minutes; check nothing leaks or overruns",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_settings_arguments(parser, SoakSettings)
    parser.set_defaults(func=run)
