"""Admission without sockets, on the scheduler (pool/pool.py) over one upstream's real gate:
FIFO, limits, supersede, abandon, shutdown, permit counts."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from llmproxy.proxy.errors import BadRequest, QueueFull, ShuttingDown, Superseded
from llmproxy.proxy.gating.gate import Gate
from llmproxy.proxy.pool.entry import Entry
from llmproxy.proxy.pool.member import Member
from llmproxy.proxy.pool.pool import Pool
from tests.helpers.scheduler import granted_slot, make_pool, submit


def one(http: aiohttp.ClientSession, capacity: int, **overrides: object) -> tuple[Pool, Gate]:
    """A pool of one upstream with ``capacity`` slots; places are not held unless asked."""
    pool, (member,) = make_pool(http, [capacity], **{"queue_hold_s": 0.0, **overrides})
    return pool, member.gate


async def test_grants_up_to_capacity_then_queues_fifo(http: aiohttp.ClientSession) -> None:
    pool, gate = one(http, 2, max_queue=10)
    a, b, c, d = (submit(pool, f"s{i}") for i in range(4))
    assert {await granted_slot(pool, a), await granted_slot(pool, b)} == {0, 1}
    assert not c.future.done() and not d.future.done()
    assert gate.free == 0 and len(pool.queue) == 2
    gate.take(a.ticket)
    gate.release(a.ticket)
    assert await granted_slot(pool, c) == a.ticket.slot  # the head waiter gets the freed permit
    assert not d.future.done()


async def test_queue_full_raises_with_retry_after(http: aiohttp.ClientSession) -> None:
    pool, _gate = one(http, 1, max_queue=1, retry_after_s=3)
    submit(pool, "a", supersedable=False)
    submit(pool, "b", supersedable=False)
    with pytest.raises(QueueFull) as info:
        submit(pool, "c", supersedable=False)
    assert info.value.status == 429 and info.value.headers["Retry-After"] == "3"


async def test_supersede_queued_takes_position_and_fails_old(http: aiohttp.ClientSession) -> None:
    pool, gate = one(http, 1, max_queue=3)
    running = submit(pool, "x", supersedable=False)
    old = submit(pool, "editor", "def f")
    other = submit(pool, "other")
    new = submit(pool, "editor", "def fo")  # the next keystroke (an equal body is a twin)
    with pytest.raises(Superseded):
        await pool.acquire(old, 1)
    assert list(pool.queue) == [new, other]  # newcomer took the old position
    gate.take(running.ticket)
    gate.release(running.ticket)
    assert await granted_slot(pool, new) == 0


async def test_supersede_does_not_need_queue_room(http: aiohttp.ClientSession) -> None:
    pool, _gate = one(http, 1, max_queue=1)
    submit(pool, "x", supersedable=False)
    submit(pool, "editor", "def f")
    submit(pool, "editor", "def fo")  # replaces, so no QueueFull


async def test_warmups_and_other_sessions_are_not_superseded(http: aiohttp.ClientSession) -> None:
    pool, _gate = one(http, 1, max_queue=5)
    submit(pool, "x", supersedable=False)
    warm = submit(pool, "editor", "def f", supersedable=False)
    submit(pool, "editor", "def fo")
    assert not warm.future.done() and len(pool.queue) == 2


async def test_inflight_supersede_calls_back_and_holds_permit(http: aiohttp.ClientSession) -> None:
    pool, gate = one(http, 1, max_queue=5)
    first = submit(pool, "editor", "def f")
    await granted_slot(pool, first)
    calls: list[str] = []
    gate.take(first.ticket, on_supersede=lambda: calls.append("stop"))
    second = submit(pool, "editor", "def fo")
    assert calls == ["stop"]
    assert gate.free == 0 and not second.future.done()  # permit held until release
    gate.release(first.ticket)
    assert await granted_slot(pool, second) == 0


async def test_superseded_between_grant_and_take_never_runs(http: aiohttp.ClientSession) -> None:
    pool, gate = one(http, 1, max_queue=5)
    first = submit(pool, "editor", "def f")
    second = submit(pool, "editor", "def fo")
    with pytest.raises(Superseded):
        gate.take(first.ticket)
    assert await granted_slot(pool, second) == 0


async def test_abandon_queued_and_granted(http: aiohttp.ClientSession) -> None:
    pool, gate = one(http, 1, max_queue=5)
    a = submit(pool, "a", supersedable=False)
    b = submit(pool, "b", supersedable=False)
    c = submit(pool, "c", supersedable=False)
    pool.abandon(b)
    assert list(pool.queue) == [c]
    pool.abandon(a)  # granted, never taken: permit goes to c
    assert await granted_slot(pool, c) == 0
    gate.take(c.ticket)
    gate.release(c.ticket)
    await asyncio.wait_for(pool.wait_quiescent(), 1)
    await asyncio.wait_for(gate.wait_quiescent(), 1)
    assert gate.free == 1


async def test_cancelled_waiter_abandons_cleanly(http: aiohttp.ClientSession) -> None:
    pool, gate = one(http, 1, max_queue=5)
    holder = submit(pool, "h", supersedable=False)
    waiter = submit(pool, "w", supersedable=False)
    task = asyncio.create_task(pool.acquire(waiter, 5))
    await asyncio.sleep(0)  # it waits in the queue
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    pool.abandon(waiter)  # again (the handler's own abandon ran already): a no-op
    gate.take(holder.ticket)
    gate.release(holder.ticket)
    assert gate.free == 1 and len(pool.queue) == 0


async def test_close_fails_queued_and_refuses_new(http: aiohttp.ClientSession) -> None:
    pool, _gate = one(http, 1, max_queue=5)
    submit(pool, "a", supersedable=False)
    q = submit(pool, "b", supersedable=False)
    pool.close()
    with pytest.raises(ShuttingDown):
        await pool.acquire(q, 1)
    with pytest.raises(ShuttingDown):
        submit(pool, "c", supersedable=False)


# -- requests on several slots at once (llama-server's n_cmpl) ------------------------------


async def test_wide_request_gets_all_its_permits_together_or_waits(
    http: aiohttp.ClientSession,
) -> None:
    pool, gate = one(http, 3, max_queue=5)
    first = submit(pool, "a", supersedable=False)
    assert await granted_slot(pool, first) == 0 and first.ticket.slots == (0,)
    gate.take(first.ticket)
    wide = submit(pool, "b", supersedable=False, permits=3)
    assert not wide.future.done() and gate.free == 2  # two free is not enough: nothing taken
    gate.release(first.ticket)
    assert await granted_slot(pool, wide) == 0
    assert wide.ticket.slots == (0, 1, 2) and gate.free == 0
    gate.take(wide.ticket)
    gate.release(wide.ticket)
    assert gate.free == 3
    await asyncio.wait_for(pool.wait_quiescent(), 1)
    await asyncio.wait_for(gate.wait_quiescent(), 1)


def holder_wide_narrow(http: aiohttp.ClientSession) -> tuple[Pool, Gate, Entry, Entry, Entry]:
    """Two permits: one held (slot 0), then a request for both, then one for one: both wait."""
    pool, gate = one(http, 2, max_queue=5)
    holder = submit(pool, "h", supersedable=False)
    gate.take(holder.ticket)
    return (
        pool,
        gate,
        holder,
        submit(pool, "w", supersedable=False, permits=2),
        submit(pool, "n", supersedable=False),
    )


async def test_queue_stays_fifo_behind_a_wide_waiter(http: aiohttp.ClientSession) -> None:
    pool, gate, holder, wide, narrow = holder_wide_narrow(http)
    assert gate.free == 1 and not wide.future.done()
    assert not narrow.future.done()  # one permit is free, but the wide request is first in line
    gate.release(holder.ticket)
    assert await granted_slot(pool, wide) == 0 and not narrow.future.done()
    gate.take(wide.ticket)
    gate.release(wide.ticket)
    assert await granted_slot(pool, narrow) == 0


async def test_wide_waiter_leaving_lets_the_next_one_through(http: aiohttp.ClientSession) -> None:
    pool, _gate, _holder, wide, narrow = holder_wide_narrow(http)
    pool.abandon(wide)
    assert await granted_slot(pool, narrow) == 1


async def test_cancelled_wide_waiter_is_skipped_when_permits_return(
    http: aiohttp.ClientSession,
) -> None:
    pool, gate, holder, wide, narrow = holder_wide_narrow(http)
    wide.future.cancel()  # its waiter was cancelled; its abandon() has not run yet
    gate.release(holder.ticket)
    assert narrow.future.done() and narrow.future.result().ticket.slot == 0 and gate.free == 1
    pool.abandon(wide)  # late: a no-op
    assert gate.free == 1 and len(pool.queue) == 0


async def test_narrow_newcomer_replacing_a_wide_waiter_is_granted_at_once(
    http: aiohttp.ClientSession,
) -> None:
    pool, gate = one(http, 2, max_queue=5)
    holder = submit(pool, "h", supersedable=False)
    gate.take(holder.ticket)
    wide = submit(pool, "editor", "def f", permits=2)
    newer = submit(pool, "editor", "def fo")
    with pytest.raises(Superseded):
        await pool.acquire(wide, 1)
    assert newer.future.done() and await granted_slot(pool, newer) == 1
    assert len(pool.queue) == 0


async def test_more_permits_than_capacity_is_refused(http: aiohttp.ClientSession) -> None:
    """The permits a request asks for are its upstream adapter's answer (``sizing``): more
    than the upstream's slots is refused at admission (BadRequest, a 400)."""
    pool, gate = one(http, 2, max_queue=5)
    with pytest.raises(BadRequest):
        submit(pool, "a", supersedable=False, permits=3)
    assert len(pool.queue) == 0 and gate.free == 2
    await asyncio.wait_for(pool.wait_quiescent(), 1)
    await asyncio.wait_for(gate.wait_quiescent(), 1)


async def test_fewer_than_one_permit_is_refused(http: aiohttp.ClientSession) -> None:
    pool, gate = one(http, 2, max_queue=5)
    with pytest.raises(ValueError):
        submit(pool, "a", supersedable=False, permits=0)
    assert len(pool.queue) == 0 and gate.free == 2
    await asyncio.wait_for(pool.wait_quiescent(), 1)
    await asyncio.wait_for(gate.wait_quiescent(), 1)


async def test_a_queued_requests_permits_are_counted_when_it_is_granted(
    http: aiohttp.ClientSession,
) -> None:
    """The sizing answers at the grant (with the capacity then) for the permits the request
    gets, not at admission; one that raises a ProxyError then fails its request and the
    next waiter goes on."""
    pool, gate = one(http, 1, max_queue=5)
    running = submit(pool, "x", supersedable=False)
    gate.take(running.ticket)
    needs = {"wide": 1, "bad": 1}

    def wide_sizing(_m: Member, capacity: int) -> int:
        return needs["wide"]

    def bad_sizing(_m: Member, capacity: int) -> int:
        if needs["bad"] > capacity:
            raise BadRequest(f"needs more than {capacity}")
        return needs["bad"]

    wide = submit(pool, "w", supersedable=False, sizing=wide_sizing)
    bad = submit(pool, "b", supersedable=False, sizing=bad_sizing)
    last = submit(pool, "l", supersedable=False)
    needs["wide"], needs["bad"] = 2, 3  # say, the upstream's adapter was swapped meanwhile
    gate.grow(2)  # one more permit: not enough for the wide one any more
    assert not wide.future.done() and len(pool.queue) == 3
    gate.release(running.ticket)
    assert await granted_slot(pool, wide) == 0
    assert wide.ticket.slots == (0, 1) and wide.ticket.permits == 2
    gate.take(wide.ticket)
    gate.release(wide.ticket)
    with pytest.raises(BadRequest):
        await pool.acquire(bad, 1)
    assert await granted_slot(pool, last) == 0 and len(pool.queue) == 0


# -- a departed waiter's place, held for its session (gating/waitlist.py) -------------------


def busy_pool(http: aiohttp.ClientSession) -> tuple[Pool, Gate, Entry]:
    """One permit, held by a running request; places are held for a second."""
    pool, gate = one(http, 1, max_queue=10, queue_hold_s=1.0)
    running = submit(pool, "x", supersedable=False)
    gate.take(running.ticket)
    return pool, gate, running


async def test_a_sessions_place_is_held_after_its_request_leaves_the_queue(
    http: aiohttp.ClientSession,
) -> None:
    pool, gate, running = busy_pool(http)
    first = submit(pool, "editor", "def f")
    other = submit(pool, "other")
    pool.abandon(first)  # its client closed it
    assert len(pool.queue) == 1 and list(pool.queue) == [other]
    assert pool.queue.places() == [("editor", None), ("other", other)]
    again = submit(pool, "editor", "def fo")  # the next keystroke
    assert list(pool.queue) == [again, other]
    gate.release(running.ticket)
    assert await granted_slot(pool, again) == 0 and not other.future.done()


async def test_a_held_place_blocks_nobody_and_a_free_permit_ends_it(
    http: aiohttp.ClientSession,
) -> None:
    pool, gate, running = busy_pool(http)
    first = submit(pool, "editor", "def f")
    other = submit(pool, "other")
    pool.abandon(first)
    gate.release(running.ticket)  # the hold is at the head: the waiter behind gets the permit
    assert await granted_slot(pool, other) == 0
    gate.take(other.ticket)
    gate.release(other.ticket)
    again = submit(pool, "editor", "def fo")  # a free permit: granted at once
    assert again.future.done() and len(pool.queue) == 0
    gate.take(again.ticket)
    gate.release(again.ticket)
    await asyncio.wait_for(pool.wait_quiescent(), 1)
    await asyncio.wait_for(gate.wait_quiescent(), 1)


async def test_a_waiter_cancelled_before_its_abandon_still_leaves_a_hold(
    http: aiohttp.ClientSession,
) -> None:
    """The waiter's task is cancelled (its future at once); the scheduler meets the entry
    before the task runs ``abandon``."""
    pool, gate, running = busy_pool(http)
    first = submit(pool, "editor", "def f")
    other = submit(pool, "other")
    third = submit(pool, "third")
    first.future.cancel()
    gate.release(running.ticket)  # skips first (leaving its hold), grants other
    assert await granted_slot(pool, other) == 0
    pool.abandon(first)  # late: a no-op
    again = submit(pool, "editor", "def fo")
    assert list(pool.queue) == [again, third]
