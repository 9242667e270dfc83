"""Which slots a grant gets, without sockets: affinity, a wide ticket's extras, settling,
quarantine."""

from __future__ import annotations

import asyncio

from llmproxy.proxy.gating.gate import Gate
from llmproxy.proxy.gating.ticket import Ticket


async def test_affinity_prefers_last_slot() -> None:
    gate = Gate(3, 5)
    t = [gate.submit(s, supersedable=False) for s in ("a", "b", "c")]
    slots = {tk.session: await tk.wait() for tk in t}
    for tk in t:
        gate.take(tk)
    gate.release(t[0])
    gate.release(t[2])
    again = gate.submit("c", supersedable=False)
    assert await again.wait() == slots["c"]


async def test_wide_request_first_slot_keeps_affinity_others_are_lowest_free() -> None:
    """llama-server runs n_cmpl on ``id_slot``'s slot plus the lowest idle ids: the gate's
    choice must be the same slots, or the server's picture and the proxy's drift apart."""
    gate = Gate(4, 5)
    first = [gate.submit(s, supersedable=False) for s in ("a", "b", "c", "d")]
    for tk in first:
        await tk.wait()
        gate.take(tk)
    for tk in first[1:]:
        gate.release(tk)  # slots 1, 2, 3 free; session "c" last used slot 2
    wide = gate.submit("c", supersedable=False, permits=2)
    assert await wide.wait() == 2 and wide.slots == (2, 1)


def pinned(_t: Ticket) -> bool:
    return True


async def test_settle_extras_watches_lower_slots_of_others_and_takes_lower_free_ones() -> None:
    """Before a wide request is sent: slots below its highest extra that others hold must be
    busy at the server first; one freed meanwhile is swapped in (the server would pick it)."""
    gate = Gate(3, 5)
    x = gate.submit("x", supersedable=False)
    gate.take(x)
    wide = gate.submit("w", supersedable=False, permits=2)
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
    await asyncio.wait_for(gate.wait_quiescent(), 1)


async def test_two_wide_requests_settling_never_wait_on_each_other() -> None:
    """A (settling) has first pick of slots freed meanwhile, so B, granted after, gets only
    slots above A's extras: A waits on nothing of B's, B waits for A's to be busy. (Had B
    taken the freed slot 0, each would wait for the other's unsent slot to be busy.)"""
    gate = Gate(4, 5)
    warm = [gate.submit(f"s{i}", supersedable=False) for i in range(3)] + [
        gate.submit("a", supersedable=False)
    ]
    for t in warm:
        gate.take(t)
    for t in warm:
        gate.release(t)  # session "a" last used slot 3
    c = gate.submit("c", supersedable=False)
    gate.take(c)
    a = gate.submit("a", supersedable=False, permits=2)
    gate.take(a)
    assert (c.slots, a.slots) == ((0,), (3, 1))
    assert gate.settle_extras(a, pinned) == {0}  # c not at the server yet
    b = gate.submit("b", supersedable=False, permits=2)
    assert not b.future.done()  # one slot free, b needs two
    gate.release(c)  # slot 0 freed while a settles: a takes it, b gets the rest
    assert a.slots == (3, 0) and b.future.done() and b.slots == (1, 2)
    gate.take(b)
    assert gate.settle_extras(a, pinned) == set()  # a waits on nothing
    assert gate.settle_extras(b, pinned) == {0}  # b waits for a's extra to be busy
    for t in (a, b):
        gate.settled(t)
        gate.release(t)
    assert gate.free == 4


async def test_a_quarantined_slot_is_out_of_the_grants_until_given_back() -> None:
    gate = Gate(2, 5)
    wide = gate.submit("w", supersedable=False, permits=2)
    gate.take(wide)
    waiter = gate.submit("x", supersedable=False)
    gate.quarantine(wide, [1])  # slot 0 is idle, slot 1 may still run
    assert await waiter.wait() == 0
    assert (gate.total, gate.capacity, gate.free, gate.held, gate.quarantined) == (2, 1, 0, 1, [1])
    # fits the slots, waits for the quarantined one
    two = gate.submit("y", supersedable=False, permits=2)
    gate.take(waiter)
    gate.release(waiter)
    assert not two.future.done() and gate.free == 1
    gate.unquarantine(1)
    assert (
        await two.wait() == 0
        and two.slots == (0, 1)
        and gate.quarantined == []
        and gate.capacity == 2
    )


def superseding(gate: Gate) -> Ticket:
    """Session "a" runs on slot 0 while slot 1 is free; its job stops when superseded."""
    old = gate.submit("a", supersedable=True)
    assert old.slot == 0
    gate.take(old, on_supersede=lambda: gate.mark_stopping(old))
    return old


async def test_a_superseding_request_waits_for_its_sessions_stopping_slot() -> None:
    """Slot 0 holds session a's prompt: the request that supersedes a's running one gets it
    once the old one is confirmed stopped, not the free slot 1 with a cold cache."""
    gate = Gate(2, 5, affinity_wait_s=30)
    old = superseding(gate)
    new = gate.submit("a", supersedable=True)
    assert old.state == "stopping" and not new.future.done() and gate.free == 1
    other = gate.submit("b", supersedable=True)  # strict FIFO: behind the waiting head
    assert not other.future.done()
    gate.release(old)  # confirmed stopped
    assert await new.wait() == 0 and await other.wait() == 1


async def test_the_wait_for_a_stopping_slot_is_bounded() -> None:
    gate = Gate(2, 5, affinity_wait_s=0.05)
    old = superseding(gate)
    new = gate.submit("a", supersedable=True)
    assert await asyncio.wait_for(new.wait(), 5) == 1  # the stop took too long: slot 1
    gate.release(old)


class _EarlyLoop(asyncio.SelectorEventLoop):
    """A loop whose timers fire a little early by ``time.monotonic``, as uvloop's can (it
    counts from a millisecond clock read at the start of the loop iteration)."""

    def call_later(self, delay, callback, *args, context=None):  # type: ignore[no-untyped-def]
        return super().call_later(max(0.0, delay - 0.005), callback, *args, context=context)


def test_the_wait_ends_when_its_timer_fires_even_a_little_early() -> None:
    async def scenario() -> int:
        gate = Gate(2, 5, affinity_wait_s=0.05)
        old = superseding(gate)
        slot = await asyncio.wait_for(gate.submit("a", supersedable=True).wait(), 5)
        gate.release(old)
        return slot

    with asyncio.Runner(loop_factory=_EarlyLoop) as runner:
        assert runner.run(scenario()) == 1


async def test_no_wait_without_a_stop_or_without_the_setting() -> None:
    gate = Gate(2, 5, affinity_wait_s=30)
    old = gate.submit("a", supersedable=True)
    gate.take(old)  # policy finish: superseding does not stop it
    assert await gate.submit("a", supersedable=True).wait() == 1
    gate = Gate(2, 5)  # affinity_wait_s 0
    superseding(gate)
    assert await gate.submit("a", supersedable=True).wait() == 1
