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
        "proxy/test_supersede.py",
        "proxy/test_queue_limits.py",
        "proxy/test_disconnect_policy.py",
        "proxy/test_stop_confirmation.py",
        "proxy/test_upstream_failures.py",
        "proxy/test_slot_routes.py",
        "proxy/test_n_cmpl.py",
        "proxy/test_stress.py",
        "proxy/http/test_error_envelope.py",
        "proxy/http/test_streaming.py",
        "proxy/http/test_headers.py",
        "proxy/http/test_passthrough.py",
        "proxy/http/test_admin.py",
        "proxy/http/test_hostile.py",
        "proxy/http/test_fuzz.py",
        "proxy/gating/test_queue.py",
        "proxy/gating/test_slots.py",
        "proxy/gating/test_registry.py",
        "proxy/telemetry/test_request_log.py",
        "proxy/upstream/test_faults.py",
        "proxy/upstream/test_responder.py",
        "proxy/upstream/test_keep_alive.py",
        "proxy/upstream/test_request_head.py",
        "proxy/upstream/test_cancelled_exchanges.py",
        "proxy/upstream/test_response_reading.py",
        "proxy/upstream/test_connection_retry.py",
        "proxy/upstream/test_tls_upstream.py",
        "proxy/upstream/test_gate_disconnect_races.py",
        "proxy/reuse/test_type_through.py",
    }
)

_stale = sorted(p for p in BOTH_LOOPS if not (HERE / p).exists())
assert not _stale, f"BOTH_LOOPS names test files that do not exist: {_stale}"


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
