"""Gate admission without sockets: FIFO, limits, supersede, abandon, shutdown, permit counts."""

from __future__ import annotations

import asyncio

import pytest

from llmproxy.proxy.errors import QueueFull, ShuttingDown, Superseded
from llmproxy.proxy.gating.gate import Gate
from llmproxy.proxy.gating.ticket import Ticket


async def test_grants_up_to_capacity_then_queues_fifo() -> None:
    gate = Gate(2, 10)
    a, b, c, d = (gate.submit(f"s{i}", supersedable=True) for i in range(4))
    assert {await a.wait(), await b.wait()} == {0, 1}
    assert not c.future.done() and not d.future.done()
    assert gate.free == 0 and gate.queued == 2
    gate.take(a)
    gate.release(a)
    assert await c.wait() == a.slot  # the head waiter gets the freed permit
    assert not d.future.done()


async def test_queue_full_raises_with_retry_after() -> None:
    gate = Gate(1, 1, retry_after_s=3)
    gate.submit("a", supersedable=False)
    gate.submit("b", supersedable=False)
    with pytest.raises(QueueFull) as info:
        gate.submit("c", supersedable=False)
    assert info.value.status == 429 and info.value.headers["Retry-After"] == "3"


async def test_supersede_queued_takes_position_and_fails_old() -> None:
    gate = Gate(1, 3)
    running = gate.submit("x", supersedable=False)
    old = gate.submit("editor", supersedable=True)
    other = gate.submit("other", supersedable=True)
    new = gate.submit("editor", supersedable=True)
    with pytest.raises(Superseded):
        await old.wait()
    assert gate.queue_snapshot() == [new, other]  # newcomer took the old position
    gate.take(running)
    gate.release(running)
    assert await new.wait() == 0


async def test_supersede_does_not_need_queue_room() -> None:
    gate = Gate(1, 1)
    gate.submit("x", supersedable=False)
    gate.submit("editor", supersedable=True)
    gate.submit("editor", supersedable=True)  # replaces, so no QueueFull


async def test_warmups_and_other_sessions_are_not_superseded() -> None:
    gate = Gate(1, 5)
    gate.submit("x", supersedable=False)
    warm = gate.submit("editor", supersedable=False)
    gate.submit("editor", supersedable=True)
    assert not warm.future.done() and gate.queued == 2


async def test_inflight_supersede_calls_back_and_holds_permit() -> None:
    gate = Gate(1, 5)
    first = gate.submit("editor", supersedable=True)
    await first.wait()
    calls: list[str] = []
    gate.take(first, on_supersede=lambda: calls.append("stop"))
    second = gate.submit("editor", supersedable=True)
    assert calls == ["stop"]
    assert gate.free == 0 and not second.future.done()  # permit held until release
    gate.release(first)
    assert await second.wait() == 0


async def test_superseded_between_grant_and_take_never_runs() -> None:
    gate = Gate(1, 5)
    first = gate.submit("editor", supersedable=True)
    second = gate.submit("editor", supersedable=True)
    with pytest.raises(Superseded):
        gate.take(first)
    assert await second.wait() == 0


async def test_abandon_queued_and_granted() -> None:
    gate = Gate(1, 5)
    a = gate.submit("a", supersedable=False)
    b = gate.submit("b", supersedable=False)
    c = gate.submit("c", supersedable=False)
    gate.abandon(b)
    assert gate.queue_snapshot() == [c]
    gate.abandon(a)  # granted, never taken: permit goes to c
    assert await c.wait() == 0
    gate.take(c)
    gate.release(c)
    await asyncio.wait_for(gate.wait_quiescent(), 1)
    assert gate.free == 1


async def test_cancelled_waiter_abandons_cleanly() -> None:
    gate = Gate(1, 5)
    holder = gate.submit("h", supersedable=False)
    waiter = gate.submit("w", supersedable=False)
    task = asyncio.create_task(waiter.wait())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gate.abandon(waiter)
    gate.take(holder)
    gate.release(holder)
    assert gate.free == 1 and gate.queued == 0


async def test_close_fails_queued_and_refuses_new() -> None:
    gate = Gate(1, 5)
    gate.submit("a", supersedable=False)
    q = gate.submit("b", supersedable=False)
    gate.close()
    with pytest.raises(ShuttingDown):
        await q.wait()
    with pytest.raises(ShuttingDown):
        gate.submit("c", supersedable=False)


# -- requests on several slots at once (llama-server's n_cmpl) ------------------------------


async def test_wide_request_gets_all_its_permits_together_or_waits() -> None:
    gate = Gate(3, 5)
    one = gate.submit("a", supersedable=False)
    assert await one.wait() == 0 and one.slots == (0,)
    gate.take(one)
    wide = gate.submit("b", supersedable=False, permits=3)
    assert not wide.future.done() and gate.free == 2  # two free is not enough: nothing taken
    gate.release(one)
    assert await wide.wait() == 0 and wide.slots == (0, 1, 2) and gate.free == 0
    gate.take(wide)
    gate.release(wide)
    assert gate.free == 3
    await asyncio.wait_for(gate.wait_quiescent(), 1)


def holder_wide_narrow() -> tuple[Gate, Ticket, Ticket, Ticket]:
    """Two permits: one held (slot 0), then a request for both, then one for one: both wait."""
    gate = Gate(2, 5)
    holder = gate.submit("h", supersedable=False)
    gate.take(holder)
    return (
        gate,
        holder,
        gate.submit("w", supersedable=False, permits=2),
        gate.submit("n", supersedable=False),
    )


async def test_queue_stays_fifo_behind_a_wide_waiter() -> None:
    gate, holder, wide, narrow = holder_wide_narrow()
    assert gate.free == 1 and not wide.future.done()
    assert not narrow.future.done()  # one permit is free, but the wide request is first in line
    gate.release(holder)
    assert await wide.wait() == 0 and not narrow.future.done()
    gate.take(wide)
    gate.release(wide)
    assert await narrow.wait() == 0


async def test_wide_waiter_leaving_lets_the_next_one_through() -> None:
    gate, holder, wide, narrow = holder_wide_narrow()
    gate.abandon(wide)
    assert await asyncio.wait_for(narrow.wait(), 1) == 1


async def test_cancelled_wide_waiter_is_skipped_when_permits_return() -> None:
    gate, holder, wide, narrow = holder_wide_narrow()
    wide.future.cancel()  # its waiter was cancelled; its abandon() has not run yet
    gate.release(holder)
    assert narrow.future.done() and narrow.future.result() == 0 and gate.free == 1
    gate.abandon(wide)  # late: a no-op
    assert gate.free == 1 and gate.queued == 0


async def test_narrow_newcomer_replacing_a_wide_waiter_is_granted_at_once() -> None:
    gate = Gate(2, 5)
    holder = gate.submit("h", supersedable=False)
    gate.take(holder)
    wide = gate.submit("editor", supersedable=True, permits=2)
    newer = gate.submit("editor", supersedable=True)
    with pytest.raises(Superseded):
        await wide.wait()
    assert await asyncio.wait_for(newer.wait(), 1) == 1 and gate.queued == 0


async def test_more_permits_than_capacity_is_refused() -> None:
    gate = Gate(2, 5)
    for bad in (0, 3):
        with pytest.raises(ValueError):
            gate.submit("a", supersedable=False, permits=bad)
    assert gate.queued == 0 and gate.free == 2
    await asyncio.wait_for(gate.wait_quiescent(), 1)


async def test_a_queued_tickets_permits_are_counted_when_it_is_granted() -> None:
    """The sizer answers at the grant (with the capacity then), not at admission; one that
    raises a ProxyError fails its ticket and the next waiter goes on."""
    from llmproxy.proxy.errors import BadRequest

    gate = Gate(1, 5)
    running = gate.submit("x", supersedable=False)
    gate.take(running)
    needs = {"wide": 1}

    def too_wide(capacity: int) -> int:
        raise BadRequest(f"needs more than {capacity}")

    wide = gate.submit("w", supersedable=False, sizer=lambda capacity: needs["wide"])
    bad = gate.submit("b", supersedable=False, sizer=too_wide)
    last = gate.submit("l", supersedable=False, sizer=lambda capacity: 1)
    needs["wide"] = 2
    gate.grow(2)  # one more permit: not enough for the wide one any more
    assert not wide.future.done() and gate.queued == 3
    gate.release(running)
    assert await wide.wait() == 0 and wide.slots == (0, 1) and wide.permits == 2
    gate.take(wide)
    gate.release(wide)
    with pytest.raises(BadRequest):
        await bad.wait()
    assert await last.wait() == 0 and gate.queued == 0


def busy_gate() -> tuple[Gate, Ticket]:
    """One permit, held by a running request; places are held for a second."""
    gate = Gate(1, 10, hold_s=1.0)
    running = gate.submit("x", supersedable=False)
    gate.take(running)
    return gate, running


async def test_a_sessions_place_is_held_after_its_request_leaves_the_queue() -> None:
    gate, running = busy_gate()
    first = gate.submit("editor", supersedable=True)
    other = gate.submit("other", supersedable=True)
    gate.abandon(first)  # its client closed it
    assert gate.queued == 1 and gate.queue_snapshot() == [other]
    again = gate.submit("editor", supersedable=True)  # the next keystroke
    assert gate.queue_snapshot() == [again, other]
    gate.release(running)
    assert await again.wait() == 0 and not other.future.done()


async def test_a_held_place_blocks_nobody_and_a_free_permit_ends_it() -> None:
    gate, running = busy_gate()
    first = gate.submit("editor", supersedable=True)
    other = gate.submit("other", supersedable=True)
    gate.abandon(first)
    gate.release(running)  # the hold is at the head: the waiter behind gets the permit
    assert await other.wait() == 0
    gate.take(other)
    gate.release(other)
    again = gate.submit("editor", supersedable=True)  # a free permit: granted at once
    assert again.future.done() and gate.queued == 0
    gate.take(again)
    gate.release(again)
    await asyncio.wait_for(gate.wait_quiescent(), 1)


async def test_a_waiter_cancelled_before_its_abandon_still_leaves_a_hold() -> None:
    """The waiter's task is cancelled (its future at once); the gate meets the ticket before
    the task runs ``abandon``."""
    gate, running = busy_gate()
    first = gate.submit("editor", supersedable=True)
    other = gate.submit("other", supersedable=True)
    third = gate.submit("third", supersedable=True)
    first.future.cancel()
    gate.release(running)  # skips first (leaving its hold), grants other
    assert await other.wait() == 0
    gate.abandon(first)  # late: a no-op
    again = gate.submit("editor", supersedable=True)
    assert gate.queue_snapshot() == [again, third]
