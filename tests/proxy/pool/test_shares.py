"""Fair shares between callers (pool/shares.py) in the scheduler: turns, weights and the
caps of a caller's key."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from llmproxy.proxy.errors import QueueFull
from llmproxy.proxy.pool.entry import Entry
from llmproxy.proxy.pool.pool import Pool
from tests.helpers.scheduler import make_pool, submit


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:  # never used to connect here
        yield s


def keys(**specs: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"name": name, "key": f"key-{name}", **spec} for name, spec in specs.items()]


async def finish(pool: Pool, entry: Entry) -> None:
    placement = await pool.acquire(entry, 1)
    placement.member.gate.take(placement.ticket)
    placement.member.gate.release(placement.ticket)


async def served_order(pool: Pool, entries: list[Entry], running: Entry) -> list[str]:
    """Finish ``running``, then each request as it is granted: the callers in grant order."""
    order = []
    await finish(pool, running)
    waiting = list(entries)
    while waiting:
        granted = [e for e in waiting if e.future.done()]
        assert len(granted) == 1, [e.ticket.caller for e in granted]
        order.append(granted[0].ticket.caller)
        waiting.remove(granted[0])
        await finish(pool, granted[0])
    return order


async def test_a_caller_with_one_request_is_not_behind_another_callers_eight(
    session: aiohttp.ClientSession,
) -> None:
    pool, _ = make_pool(session, [1])
    running = submit(pool, "x", "x", caller="x")
    agent = [submit(pool, f"a{i}", f"a{i}", caller="A") for i in range(8)]
    editor = submit(pool, "b", "b", caller="B")
    order = await served_order(pool, [*agent, editor], running)
    assert order[:2] == ["A", "B"] and order.count("A") == 8


async def test_shares_follow_the_keys_weights(session: aiohttp.ClientSession) -> None:
    pool, _ = make_pool(session, [1], keys=keys(A={"weight": 2}, B={}))
    running = submit(pool, "x", "x", caller="x")
    a = [submit(pool, f"a{i}", f"a{i}", caller="A") for i in range(6)]
    b = [submit(pool, f"b{i}", f"b{i}", caller="B") for i in range(6)]
    order = await served_order(pool, [*a, *b], running)
    assert order[:6].count("A") == 4 and order[:6].count("B") == 2


async def test_a_caller_past_its_max_queued_gets_429(session: aiohttp.ClientSession) -> None:
    pool, _ = make_pool(session, [1], keys=keys(A={"max_queued": 2}))
    running = submit(pool, "x", "x", caller="x")
    waiting = [submit(pool, f"a{i}", f"a{i}", caller="A") for i in range(2)]
    with pytest.raises(QueueFull, match="max_queued") as refused:
        submit(pool, "a2", "a2", caller="A")
    assert refused.value.headers["Retry-After"] == "1"
    other = submit(pool, "b", "b", caller="B")  # others still queue
    await served_order(pool, [*waiting, other], running)


async def test_a_caller_at_its_max_inflight_waits_while_others_run(
    session: aiohttp.ClientSession,
) -> None:
    pool, (m,) = make_pool(session, [3], keys=keys(A={"max_inflight": 1}))
    first = submit(pool, "a0", "a0", caller="A")
    second = submit(pool, "a1", "a1", caller="A")
    other = submit(pool, "b", "b", caller="B")
    assert first.future.done() and not second.future.done() and other.future.done()
    assert m.gate.free == 1  # a free permit, yet A's second waits
    await finish(pool, first)
    assert second.future.done()
    await finish(pool, second)
    await finish(pool, other)


async def test_aging_never_puts_a_callers_old_requests_ahead_of_anothers_turn(
    session: aiohttp.ClientSession,
) -> None:
    """Aging lifts a class, not a caller: A's chats that waited past ``class_max_wait_s``
    still take turns with B's fresh one within their class."""
    pool, _ = make_pool(session, [1])
    running = submit(pool, "x", "x", caller="x")
    agent = [submit(pool, f"a{i}", f"a{i}", caller="A", klass="chat") for i in range(4)]
    for entry in agent:
        entry.created -= 60.0  # long past the chat class's bound (10 s)
        entry.ticket.queued_at -= 60.0
    other = submit(pool, "b", "b", caller="B", klass="chat")
    order = await served_order(pool, [*agent, other], running)
    assert order[:2] == ["A", "B"], order


async def test_a_request_in_place_of_its_callers_failover_is_held_to_max_queued(
    session: aiohttp.ClientSession,
) -> None:
    """A's request failed on u1 and waits as a failover (not held to ``max_queued``: it was
    when first admitted), every upstream busy; the session's next keystroke would take its
    place. Let in, it waited, uncounted in place of an uncounted one (A's ``max_queued`` 0
    with a request waiting: the stress test's finding). It gets 429, the failover keeps its
    place; once u1 is free the keystroke runs at once there, and is let in."""
    pool, (u0, u1) = make_pool(session, [1, 1], keys=keys(A={"max_queued": 0}))
    busy = [submit(pool, s, s, caller="x") for s in ("x0", "x1")]
    assert all(e.future.done() for e in busy)
    failover = submit(pool, "s", "def f", caller="A", exclude=u1)
    assert not failover.future.done()
    with pytest.raises(QueueFull, match="max_queued"):
        submit(pool, "s", "def g", caller="A")
    assert failover in pool.queue and not failover.future.done()
    await finish(pool, busy[1])  # u1 free: the failover, not for u1, still waits
    assert not failover.future.done()
    keystroke = submit(pool, "s", "def g", caller="A")  # in its place, granted on u1 at once
    assert keystroke.future.done() and keystroke.future.result().member is u1
    assert failover.future.done() and failover not in pool.queue  # superseded
    await finish(pool, keystroke)
    await finish(pool, busy[0])


async def test_a_callers_failover_waiting_is_not_held_to_its_max_queued(
    session: aiohttp.ClientSession,
) -> None:
    """A failover is no waiter ``max_queued`` counts (it was counted when first admitted):
    with A's failover waiting and ``max_queued`` 1, A's next request may wait."""
    pool, (u0, u1) = make_pool(session, [1, 1], keys=keys(A={"max_queued": 1}))
    busy = [submit(pool, s, s, caller="x") for s in ("x0", "x1")]
    failover = submit(pool, "s", "def f", caller="A", exclude=u1)
    other = submit(pool, "t", "def h", caller="A")
    with pytest.raises(QueueFull, match="max_queued"):
        submit(pool, "v", "def k", caller="A")
    for e in busy:
        await finish(pool, e)
    await finish(pool, failover)
    await finish(pool, other)
