"""Preemption: which running generations a waiting completion stops (a pure policy).

A completion at the head of the queue (pool.py) that found no room and has waited
``preempt_after_ms`` takes slots from generations that can be resumed exactly
(upstream/resume.py): on an upstream among those it may run on where every permit held is
a running chat or bulk request whose job offered to resume it (``Ticket.on_preempt``),
the youngest such requests, as many as it needs permits. The wait is the request's own:
an editor's keystroke replaced by the next within ``preempt_after_ms`` never preempts,
only the one the user then waits on does (the chat runs on while they type, and pauses
for the suggestion they wait for). While a request it asked is still stopping, nothing
more is asked: its permits come back to the queue, where the completion is served first
(its class). Never with classes off, never of a completion, never of a request that has
waited its class's ``class_max_wait_s`` in all (``Ticket.waited``: queued, and paused by
earlier preemptions until its resume was granted), so none starves however often it is
preempted, while a long answer that simply runs stays preemptible to its end.

With ``preempt`` ``solo`` (a server whose generations share one compute, as a CPU's do:
a free slot is no free server there), a completion also runs alone: once a completion
holding permits on an upstream has lived ``preempt_after_ms`` (again its own age: a
keystroke replaced sooner never counts), every chat or bulk generation there that can be
resumed exactly is stopped (``solo``), and none is granted there while such a completion
holds permits (``beside``: order.py asks it), but for a request that has waited its
class's ``class_max_wait_s`` in all, which is neither stopped nor held back. While the
user types, each keystroke's completion is replaced sooner: the chats run on beside them.

``victims`` and ``solo`` only choose; the scheduler (waits.py) asks the chosen tickets'
jobs to stop (``on_preempt``) and marks them ``preempted``. Event loop thread only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from llmproxy.proxy.gating.ticket import Ticket
from llmproxy.proxy.pool.member import Member

#: how soon ``solo`` looks again at a generation whose resume is not offered yet
RECHECK_S = 0.02


def victims(
    members: Sequence[tuple[Member, int]], now: float, max_wait: Mapping[str, float]
) -> list[Ticket]:
    """The tickets to stop for a completion that needs ``n`` permits on one of ``members``
    (pairs of an upstream and ``n`` there); empty when none qualifies or a stop asked
    earlier is still under way (see the module's docstring)."""
    best: list[Ticket] = []
    best_age = 0.0
    for m, n in members:
        held = m.gate.inflight_snapshot()
        if any(t.preempted for t in held):
            return []  # one is stopping: its permits come to the completion
        if m.gate.quarantined or n > m.gate.capacity:
            continue
        if not held or not all(_resumable(t, now, max_wait) for t in held):
            continue
        need = n - m.gate.free
        chosen: list[Ticket] = []
        for t in sorted(held, key=lambda t: t.granted_at or 0.0, reverse=True):
            if need <= 0:
                break
            chosen.append(t)
            need -= len(t.slots)
        if need > 0:
            continue
        age = max(t.granted_at or 0.0 for t in chosen)
        if not best or age > best_age:  # the youngest
            best, best_age = chosen, age
    return best


@dataclass(frozen=True)
class Solo:
    """What ``solo`` found: the tickets to stop now, and when to look again (None: no
    completion there will come of age, or nothing shares its upstream)."""

    stop: list[Ticket]
    again_at: float | None


def solo(
    members: Iterable[Member],
    waiting: Iterable[Ticket],
    now: float,
    after_s: float,
    max_wait: Mapping[str, float],
) -> Solo:
    """The chat and bulk generations to stop so that completions run alone (see the
    module's docstring): on each upstream where a completion that lived ``after_s`` holds
    permits, every resumable one not stopping yet. ``again_at``: the next moment this
    may change by the clock alone: a younger completion comes of age there; a generation
    there that will offer its resume (``Ticket.may_offer``) has not yet (it does from its
    first event on), for which it looks again after ``RECHECK_S``; or, while a completion
    of age runs, a chat or bulk request of ``waiting`` (the queue's) that ``beside`` holds
    back has waited its class's ``class_max_wait_s``."""
    stop: list[Ticket] = []
    again: list[float] = []
    held_back = False  # a completion of age somewhere: ``beside`` may hold requests back
    for m in members:
        held = m.gate.inflight_snapshot()
        born = [t.created for t in held if _completes(t)]
        if not born:
            continue
        others = [t for t in held if t.klass != "complete" and not t.preempted]
        others = [t for t in others if t.waited(now) < max_wait.get(t.klass, float("inf"))]
        if now < (of_age := min(born) + after_s):
            if others:
                again.append(of_age)
            continue
        held_back = True
        stop += [t for t in others if _resumable(t, now, max_wait)]
        if any(_offers_soon(t) for t in others):
            again.append(now + RECHECK_S)  # not resumable yet: its first event is coming
    if held_back:
        for t in waiting:  # held back by ``beside`` until it waited its class's bound
            left = max_wait.get(t.klass, 1e30) - t.waited(now)
            if t.klass != "complete" and left > 0:
                again.append(now + left)
    return Solo(stop, min(again, default=None))


def beside(
    m: Member, ticket: Ticket, now: float, after_s: float, max_wait: Mapping[str, float]
) -> bool:
    """Would ``ticket`` (a chat or bulk request) start beside a completion that lived
    ``after_s`` and holds permits on ``m`` (``solo``: it waits; not once it has waited its
    class's ``class_max_wait_s`` in all)?"""
    if ticket.klass == "complete" or ticket.waited(now) >= max_wait.get(ticket.klass, 1e30):
        return False
    return any(_completes(t) and now - t.created >= after_s for t in m.gate.inflight_snapshot())


def offers_soon(members: Iterable[Member]) -> bool:
    """Does a generation on ``members`` not offer its resume yet, though it will (from its
    first event on: ``Ticket.may_offer``)? A completion that found no victim then looks
    again after ``RECHECK_S`` (waits.py), as ``solo`` does: an agent's next chat still in
    its prefill is no reason to wait out its whole answer."""
    return any(_offers_soon(t) for m in members for t in m.gate.inflight_snapshot())


def _offers_soon(t: Ticket) -> bool:
    return t.may_offer and t.on_preempt is None and not t.preempted


def _completes(t: Ticket) -> bool:
    """A completion that holds permits and is not being stopped."""
    return t.klass == "complete" and t.state in ("granted", "running") and not t.superseded


def _resumable(t: Ticket, now: float, max_wait: Mapping[str, float]) -> bool:
    if t.klass == "complete" or t.state != "running" or t.on_preempt is None:
        return False
    return t.waited(now) < max_wait.get(t.klass, float("inf"))
