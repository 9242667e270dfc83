"""The pool's queue without HTTP: admission, FIFO order, supersede, routing waits and
abandonment, over real gates (pool/pool.py's contract)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from llmproxy.proxy.errors import BadRequest, QueueFull, Superseded
from llmproxy.proxy.gating.breaker import UpstreamUnavailable
from llmproxy.proxy.pool.prefix import BLOCK_CHARS
from tests.helpers.scheduler import make_pool, submit


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:  # never used to connect here
        yield s


async def test_strict_fifo_a_wide_head_holds_up_the_queue(session: aiohttp.ClientSession) -> None:
    pool, (a, b) = make_pool(session, [2, 2])
    held = [submit(pool, f"s{i}") for i in range(3)]  # a: 2 free -> 1 ... b takes some
    placed = [await pool.acquire(e, 1) for e in held]
    assert sum(m.gate.held for m in (a, b)) == 3
    wide = submit(pool, "wide", permits=2)  # needs both slots of one upstream: waits
    small = submit(pool, "small")  # one slot is free, but it is behind the wide one
    assert not wide.future.done() and not small.future.done()
    for p in placed:  # the upstream job's release
        p.member.gate.release(p.ticket)
    assert (await pool.acquire(wide, 1)).ticket.permits == 2
    await pool.acquire(small, 1)
    with pytest.raises(BadRequest):
        submit(pool, "too-wide", permits=3)  # fits no upstream: refused at once


async def test_a_newer_request_takes_its_sessions_place(session: aiohttp.ClientSession) -> None:
    pool, (a,) = make_pool(session, [1])
    first = await pool.acquire(submit(pool, "other"), 1)
    old = submit(pool, "editor", "def f")
    new = submit(pool, "editor", "def fo")  # the next keystroke (an equal body is a twin)
    assert list(pool.queue) == [new]
    with pytest.raises(Superseded):
        await pool.acquire(old, 1)
    a.gate.release(first.ticket)
    assert (await pool.acquire(new, 1)).member is a


async def test_twins_keep_their_places_until_a_newer_request(
    session: aiohttp.ClientSession,
) -> None:
    """Equal bodies of one session (minuet's n_completions): all queued, none superseded,
    placed on the upstreams as any requests; the next keystroke supersedes them all, in the
    pool's queue and on the upstreams' gates, and takes the first one's place."""
    pool, (a, b) = make_pool(session, [1, 1], route="round-robin")
    running = [submit(pool, "minuet", "def f") for _ in range(2)]
    placed = [await pool.acquire(e, 1) for e in running]
    assert {p.member.name for p in placed} == {"u0", "u1"}  # a permit each
    other = submit(pool, "other")
    queued = [submit(pool, "minuet", "def f") for _ in range(2)]
    assert list(pool.queue) == [other, *queued]
    asked: list[str] = []
    for p in placed:
        p.member.gate.take(p.ticket, on_supersede=lambda m=p.member.name: asked.append(m))
    assert asked == []
    new = submit(pool, "minuet", "def fo")
    assert sorted(asked) == ["u0", "u1"]  # both running twins asked to stop
    assert list(pool.queue) == [other, new]
    for e in queued:
        with pytest.raises(Superseded):
            await pool.acquire(e, 1)


async def test_admission_refusals(session: aiohttp.ClientSession) -> None:
    pool, (a, b) = make_pool(session, [1, 1], max_queue=1)
    for i in range(2):
        await pool.acquire(submit(pool, f"s{i}"), 1)
    submit(pool, "queued")
    with pytest.raises(QueueFull):
        submit(pool, "one more")
    a.healthy = b.healthy = False  # both out of rotation: fail fast, and the queued too
    with pytest.raises(UpstreamUnavailable):
        submit(pool, "none left")
    pool.advance()
    assert list(pool.queue) == []


async def test_cache_waits_for_its_upstream_then_takes_a_free_one(
    session: aiohttp.ClientSession,
) -> None:
    pool, (a, b) = make_pool(session, [1, 1], affinity_wait_s=0.05)
    text = "x" * BLOCK_CHARS * 40  # a prefill worth the wait
    first = await pool.acquire(submit(pool, "e1", text), 1)
    next_one = submit(pool, "e2", text + "more")  # prefers first's upstream, busy: waits
    assert not next_one.future.done() and first.member.gate.free == 0
    start = time.monotonic()
    placed = await pool.acquire(next_one, 1)
    assert placed.member is not first.member and placed.decision == "fallback"
    assert time.monotonic() - start >= 0.04  # it waited for the busy one first
    first.member.gate.release(first.ticket)
    again = await pool.acquire(submit(pool, "e3", text + "again"), 1)
    assert again.decision == "cache_hit" and again.cached_chars >= len(text)


async def test_an_abandoned_entry_returns_its_permit(session: aiohttp.ClientSession) -> None:
    pool, (a,) = make_pool(session, [1])
    held = await pool.acquire(submit(pool, "s0"), 1)
    waiting = submit(pool, "s1")
    task = asyncio.ensure_future(pool.acquire(waiting, 5))
    await asyncio.sleep(0)
    a.gate.release(held.ticket)  # granted to s1 ...
    task.cancel()  # ... whose client left before its job took it
    with pytest.raises(asyncio.CancelledError):
        await task
    assert a.gate.free == 1 and list(pool.queue) == []
    await asyncio.wait_for(pool.wait_quiescent(), 1)
