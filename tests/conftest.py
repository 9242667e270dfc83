"""Shared fixtures: the fake upstream and an in-process proxy on real loopback sockets.

The in-process proxy suites run twice, on asyncio's loop and on uvloop (what ``llmproxy
serve`` runs on by default; see proxy/loops.py); the rest run on asyncio's. Subprocess
tests check the served process's own loop (tests/test_loops.py).

A process a test starts gets ``child_preexec()`` (llmproxy.proxy.children: it dies with
pytest) and is stopped by its test; a run that ends with one still running fails
(tests/leftovers.py, whose hooks are imported here).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import uvloop
from aiohttp import web
from leftovers import pytest_configure, pytest_sessionfinish  # noqa: F401 - hooks: the end-of-session check

from llmproxy.proxy import parse_errors
from llmproxy.proxy.app import build_app
from llmproxy.proxy.bench.fake_upstream import FakeUpstream
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.state import REQUEST_LOG, STATE, ProxyState


BOTH_LOOPS = frozenset({
    "test_proxy_gating", "test_proxy_wire", "test_hostile", "test_faults", "test_review_regressions",
    "test_stress", "test_fuzz", "test_request_log", "test_registry", "test_relay", "test_gate",
    "test_upstream_client",
})


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    if item.path.stem in BOTH_LOOPS:
        return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}


@dataclass
class RunningProxy:
    url: str
    app: web.Application

    @property
    def state(self) -> ProxyState:
        return self.app[STATE]

    def flush_log(self) -> None:
        """Write the canonical lines of the requests that ended (request_log.py batches them)."""
        self.app[REQUEST_LOG].flush()


@asynccontextmanager
async def run_proxy(upstream: str, **overrides: Any) -> AsyncIterator[RunningProxy]:
    settings = ProxySettings(**{"upstream": upstream, "port": 0, "detect_timeout_s": 0, **overrides})
    app = build_app(settings)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2,
                           keepalive_timeout=settings.idle_timeout_s)
    await runner.setup()
    parse_errors.install(runner)
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield RunningProxy(f"http://127.0.0.1:{port}", app)
    finally:
        await runner.cleanup()


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream(kind="llamacpp", slots=1, abort_linger_s=0.2) as f:
        yield f


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s
