"""WaitList: a departed waiter's place is held for its session (gating/waitlist.py)."""

from __future__ import annotations

from dataclasses import dataclass

from llmproxy.proxy.gating.waitlist import WaitList
from tests.helpers.clock import Clock


@dataclass(eq=False)
class W:
    session: str
    supersedable: bool = True
    twin: str | None = None


def test_a_departed_waiters_place_goes_to_its_sessions_next_one() -> None:
    clock = Clock()
    q: WaitList[W] = WaitList(1.0, 8, clock)
    a, b, c = W("a"), W("b"), W("c")
    for w in (a, b, c):
        q.append(w)
    q.remove(a)  # a's editor closed it
    assert (len(q), q.holds, q.head()) == (2, 1, b)  # a hold is not a waiter, nor the head
    clock.t = 0.9
    assert q.place_of("a") == (True, None)
    a2 = W("a")
    assert q.take_place("a", a2) is None
    assert list(q) == [a2, b, c] and q.holds == 0


def test_a_hold_expires_and_then_the_session_queues_at_the_tail() -> None:
    clock = Clock()
    q: WaitList[W] = WaitList(1.0, 8, clock)
    a, b = W("a"), W("b")
    q.append(a)
    q.append(b)
    q.remove(a)
    clock.t = 1.0
    assert q.place_of("a") == (False, None) and q.holds == 0


def test_only_supersedable_waiters_leave_a_hold_and_only_while_holding_is_on() -> None:
    q: WaitList[W] = WaitList(1.0, 8)
    warmup = W("a", supersedable=False)
    q.append(warmup)
    q.remove(warmup)
    assert q.holds == 0
    off: WaitList[W] = WaitList(0.0, 8)
    w = W("a")
    off.append(w)
    off.remove(w)
    assert off.holds == 0 and off.place_of("a") == (False, None)


def test_holds_are_bounded_the_oldest_goes_first() -> None:
    clock = Clock()
    q: WaitList[W] = WaitList(1.0, 2, clock)
    ws = [W(s) for s in "xyz"]
    for w in reversed(ws):  # queued z, y, x: x leaves last but sits last
        q.append(w)
    for t, w in enumerate(ws):
        clock.t = t / 10
        q.remove(w)  # x at 0.0, y at 0.1, z at 0.2
    assert q.holds == 2 and [q.place_of(s)[0] for s in "xyz"] == [False, True, True]


def test_a_queued_waiter_of_the_session_is_replaced_in_place() -> None:
    q: WaitList[W] = WaitList(1.0, 8)
    a, b, a2 = W("a"), W("b"), W("a")
    q.append(a)
    q.append(b)
    assert q.place_of("a") == (True, a)
    assert q.take_place("a", a2) is a and list(q) == [a2, b]


def test_discard_and_clear_leave_no_hold() -> None:
    q: WaitList[W] = WaitList(1.0, 8)
    a, b = W("a"), W("b")
    q.append(a)
    q.append(b)
    q.discard(a)  # granted
    assert q.holds == 0 and q.pop_head() is b
    q.append(a)
    q.remove(a)
    assert q.clear() == [] and q.holds == 0
