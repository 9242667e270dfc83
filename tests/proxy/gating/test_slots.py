"""Which slots a grant gets, without sockets, on the scheduler (pool/pool.py) over one
upstream's real gate: affinity, a wide ticket's extras, settling, quarantine."""

from __future__ import annotations

import asyncio

import aiohttp

from llmproxy.proxy.gating.gate import Gate
from llmproxy.proxy.gating.ticket import Ticket
from llmproxy.proxy.pool.entry import Entry
from llmproxy.proxy.pool.pool import Pool
from tests.helpers.scheduler import granted_slot, make_pool, submit


def one(
    http: aiohttp.ClientSession, capacity: int, affinity_wait_s: float = 0.0
) -> tuple[Pool, Gate]:
    """A pool of one upstream with ``capacity`` slots."""
    pool, (member,) = make_pool(http, [capacity], max_queue=5, affinity_wait_s=affinity_wait_s)
    return pool, member.gate


async def test_affinity_prefers_last_slot(http: aiohttp.ClientSession) -> None:
    pool, gate = one(http, 3)
    t = [submit(pool, s, supersedable=False) for s in ("a", "b", "c")]
    slots = {e.session: await granted_slot(pool, e) for e in t}
    for e in t:
        gate.take(e.ticket)
    gate.release(t[0].ticket)
    gate.release(t[2].ticket)
    again = submit(pool, "c", supersedable=False)
    assert await granted_slot(pool, again) == slots["c"]


async def test_wide_request_first_slot_keeps_affinity_others_are_lowest_free(
    http: aiohttp.ClientSession,
) -> None:
    """llama-server runs n_cmpl on ``id_slot``'s slot plus the lowest idle ids: the gate's
    choice must be the same slots, or the server's picture and the proxy's drift apart."""
    pool, gate = one(http, 4)
    first = [submit(pool, s, supersedable=False) for s in ("a", "b", "c", "d")]
    for e in first:
        await granted_slot(pool, e)
        gate.take(e.ticket)
    for e in first[1:]:
        gate.release(e.ticket)  # slots 1, 2, 3 free; session "c" last used slot 2
    wide = submit(pool, "c", supersedable=False, permits=2)
    assert await granted_slot(pool, wide) == 2 and wide.ticket.slots == (2, 1)


def pinned(_t: Ticket) -> bool:
    return True


async def test_settle_extras_watches_lower_slots_of_others_and_takes_lower_free_ones(
    http: aiohttp.ClientSession,
) -> None:
    """Before a wide request is sent: slots below its highest extra that others hold must be
    busy at the server first; one freed meanwhile is swapped in (the server would pick it)."""
    pool, gate = one(http, 3)
    x = submit(pool, "x", supersedable=False).ticket
    gate.take(x)
    wide = submit(pool, "w", supersedable=False, permits=2).ticket
    gate.take(wide)
    assert (x.slots, wide.slots) == ((0,), (1, 2))
    assert gate.settle_extras(wide, pinned) == {0}  # x's slot: idle at the server until x is there
    assert gate.settle_extras(wide, lambda t: t is not x) == set()  # x not pinned (say, embeddings)
    gate.release(x)  # while settling, the wide ticket gets the freed lower slot at once
    assert wide.slots == (1, 0) and gate.free == 1
    assert gate.settle_extras(wide, pinned) == set()
    gate.settled(wide)
    gate.release(wide)
    assert gate.free == 3
    await asyncio.wait_for(pool.wait_quiescent(), 1)
    await asyncio.wait_for(gate.wait_quiescent(), 1)


async def test_two_wide_requests_settling_never_wait_on_each_other(
    http: aiohttp.ClientSession,
) -> None:
    """A (settling) has first pick of slots freed meanwhile, so B, granted after, gets only
    slots above A's extras: A waits on nothing of B's, B waits for A's to be busy. (Had B
    taken the freed slot 0, each would wait for the other's unsent slot to be busy.)"""
    pool, gate = one(http, 4)
    warm = [submit(pool, f"s{i}", supersedable=False) for i in range(3)] + [
        submit(pool, "a", supersedable=False)
    ]
    for e in warm:
        gate.take(e.ticket)
    for e in warm:
        gate.release(e.ticket)  # session "a" last used slot 3
    c = submit(pool, "c", supersedable=False).ticket
    gate.take(c)
    a = submit(pool, "a", supersedable=False, permits=2).ticket
    gate.take(a)
    assert (c.slots, a.slots) == ((0,), (3, 1))
    assert gate.settle_extras(a, pinned) == {0}  # c not at the server yet
    b_entry = submit(pool, "b", supersedable=False, permits=2)
    b = b_entry.ticket
    assert not b_entry.future.done()  # one slot free, b needs two
    gate.release(c)  # slot 0 freed while a settles: a takes it, b gets the rest
    assert a.slots == (3, 0) and b_entry.future.done() and b.slots == (1, 2)
    gate.take(b)
    assert gate.settle_extras(a, pinned) == set()  # a waits on nothing
    assert gate.settle_extras(b, pinned) == {0}  # b waits for a's extra to be busy
    for t in (a, b):
        gate.settled(t)
        gate.release(t)
    assert gate.free == 4


async def test_embeddings_sent_before_earlier_ones_settling_take_their_lower_slots(
    http: aiohttp.ClientSession,
) -> None:
    """Embeddings e1 (slot 1) and e2 (slot 2), granted behind a completion x (slot 0, not at
    the server yet), both wait for slot 0 to be busy; e2's poll sees it first and e2 is
    sent while e1 still settles. The server puts e2's task on its lowest idle slot, 1 (e1's
    in the gate), and e1's, later, on slot 2: the gate must say the same, or a completion
    granted slot 2 once e2 ends would find e1's task there (the stress test's deferral)."""
    pool, gate = one(http, 3)
    x = submit(pool, "x", supersedable=False).ticket
    gate.take(x)
    e1, e2 = (
        submit(pool, s, supersedable=False, route="/v1/embeddings").ticket for s in ("e1", "e2")
    )
    for t in (e1, e2):
        gate.take(t)
    assert (x.slots, e1.slots, e2.slots) == ((0,), (1,), (2,))
    unpinned = lambda t: t is x  # noqa: E731  (embeddings run where the server puts them)
    assert gate.settle_extras(e1, unpinned) == {0}
    assert gate.settle_extras(e2, unpinned) == {0}
    gate.settled(e2)  # slot 0 busy at its poll: sent
    assert (e1.slots, e2.slots) == ((2,), (1,))
    assert gate.settle_extras(e1, unpinned) == {0, 1}  # e1 waits for e2's task to be busy too
    gate.settled(e1)
    gate.release(e2)  # slot 1 back: below e1's slot 2, held for e1 (the server may use it)
    assert gate.free == 0 and e1.slots == (2, 1)
    after = submit(pool, "y", supersedable=False)
    gate.release(e1)  # e1's task ran on slot 2: both of its slots come back
    assert await granted_slot(pool, after) == 1 and gate.free == 1
    gate.take(after.ticket)
    for t in (x, after.ticket):
        gate.release(t)
    assert gate.free == 3


async def test_a_quarantined_slot_is_out_of_the_grants_until_given_back(
    http: aiohttp.ClientSession,
) -> None:
    pool, gate = one(http, 2)
    wide = submit(pool, "w", supersedable=False, permits=2).ticket
    gate.take(wide)
    waiter = submit(pool, "x", supersedable=False)
    gate.release(wide, quarantine=[1])  # slot 0 is idle, slot 1 may still run
    assert await granted_slot(pool, waiter) == 0
    assert (gate.total, gate.capacity, gate.free, gate.held, gate.quarantined) == (2, 1, 0, 1, [1])
    # fits the slots, waits for the quarantined one
    two = submit(pool, "y", supersedable=False, permits=2)
    gate.take(waiter.ticket)
    gate.release(waiter.ticket)
    assert not two.future.done() and gate.free == 1
    gate.unquarantine(1)
    assert (
        await granted_slot(pool, two) == 0
        and two.ticket.slots == (0, 1)
        and gate.quarantined == []
        and gate.capacity == 2
    )


def superseding(pool: Pool, gate: Gate) -> Entry:
    """Session "a" runs on slot 0 while slot 1 is free; its job stops when superseded."""
    old = submit(pool, "a", "def f")
    assert old.ticket.slot == 0
    gate.take(old.ticket, on_supersede=lambda: gate.mark_stopping(old.ticket))
    return old


async def test_a_superseding_request_waits_for_its_sessions_stopping_slot(
    http: aiohttp.ClientSession,
) -> None:
    """Slot 0 holds session a's prompt: the request that supersedes a's running one gets it
    once the old one is confirmed stopped, not the free slot 1 with a cold cache."""
    pool, gate = one(http, 2, affinity_wait_s=30)
    old = superseding(pool, gate)
    new = submit(pool, "a", "def fo")
    assert old.ticket.state == "stopping" and not new.future.done() and gate.free == 1
    other = submit(pool, "b")  # strict FIFO: behind the waiting head
    assert not other.future.done()
    gate.release(old.ticket)  # confirmed stopped
    assert await granted_slot(pool, new) == 0 and await granted_slot(pool, other) == 1


async def test_the_wait_for_a_stopping_slot_is_bounded(http: aiohttp.ClientSession) -> None:
    pool, gate = one(http, 2, affinity_wait_s=0.05)
    old = superseding(pool, gate)
    new = submit(pool, "a", "def fo")
    assert await granted_slot(pool, new, 5) == 1  # the stop took too long: slot 1
    gate.release(old.ticket)


class _EarlyLoop(asyncio.SelectorEventLoop):
    """A loop whose timers fire a little early by ``time.monotonic``, as uvloop's can (it
    counts from a millisecond clock read at the start of the loop iteration)."""

    def call_later(self, delay, callback, *args, context=None):  # type: ignore[no-untyped-def]
        return super().call_later(max(0.0, delay - 0.005), callback, *args, context=context)


def test_the_wait_ends_when_its_timer_fires_even_a_little_early() -> None:
    async def scenario() -> int:
        async with aiohttp.ClientSession() as http:  # never used to connect
            pool, gate = one(http, 2, affinity_wait_s=0.05)
            old = superseding(pool, gate)
            slot = await granted_slot(pool, submit(pool, "a", "def fo"), 5)
            gate.release(old.ticket)
            return slot

    with asyncio.Runner(loop_factory=_EarlyLoop) as runner:
        assert runner.run(scenario()) == 1


async def test_no_wait_without_a_stop_or_without_the_setting(http: aiohttp.ClientSession) -> None:
    pool, gate = one(http, 2, affinity_wait_s=30)
    old = submit(pool, "a", "def f")
    gate.take(old.ticket)  # policy finish: superseding does not stop it
    assert await granted_slot(pool, submit(pool, "a", "def fo")) == 1
    pool, gate = one(http, 2)  # affinity_wait_s 0
    superseding(pool, gate)
    assert await granted_slot(pool, submit(pool, "a", "def fo")) == 1
