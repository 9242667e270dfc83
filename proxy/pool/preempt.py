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
(its class). Never with classes off, never of a completion, never of a request older than
its class's ``class_max_wait_s`` (a resume keeps the age of its request: a chat preempted
again and again ages like any waiter, so none starves).

``victims`` only chooses; the scheduler (waits.py) asks the chosen tickets' jobs to stop
(``on_preempt``) and marks them ``preempted``. Event loop thread only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from llmproxy.proxy.gating.ticket import Ticket
from llmproxy.proxy.pool.member import Member


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


def _resumable(t: Ticket, now: float, max_wait: Mapping[str, float]) -> bool:
    if t.klass == "complete" or t.state != "running" or t.on_preempt is None:
        return False
    return now - t.created < max_wait.get(t.klass, float("inf"))
