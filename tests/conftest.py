"""Shared fixtures: the fake upstream and an in-process proxy on real loopback sockets.

The in-process proxy suites run twice, on asyncio's loop and on uvloop (what ``llmproxy
serve`` runs on by default; see common/loops.py); the rest run on asyncio's. Subprocess
tests check the served process's own loop (tests/common/test_loops.py).

A process a test starts gets ``child_preexec()`` (llmproxy.common.children: it dies with
pytest) and is stopped by its test; a run that ends with one still running fails
(tests/helpers/leftovers.py, whose hooks are imported here).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path

import aiohttp
import pytest
import uvloop

from llmproxy.bench.fake.upstream import FakeUpstream
from tests.helpers.leftovers import pytest_configure, pytest_sessionfinish  # noqa: F401 - the end-of-session check

HERE = Path(__file__).parent
BOTH_LOOPS = frozenset(
    {
        "proxy/test_gating.py",
        "proxy/http/test_wire.py",
        "proxy/http/test_hostile.py",
        "proxy/upstream/test_faults.py",
        "proxy/test_review_regressions.py",
        "proxy/test_stress.py",
        "proxy/http/test_fuzz.py",
        "proxy/telemetry/test_request_log.py",
        "proxy/gating/test_registry.py",
        "proxy/upstream/test_responder.py",
        "proxy/gating/test_gate.py",
        "proxy/upstream/test_client.py",
    }
)


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    if item.path.relative_to(HERE).as_posix() in BOTH_LOOPS:
        return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream(kind="llamacpp", slots=1, abort_linger_s=0.2) as f:
        yield f


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s
