"""Which waiting request the scheduler (pool.py) serves next, and what it may take.

- ``head``: each request class (gating/classes.py) offers its next waiter: the first of
  the caller whose fair share comes first (shares.py; ties: the earlier in the queue),
  passing over callers that hold their key's ``max_inflight`` permits already. The best
  class's goes, a class counted one better for each ``class_max_wait_s`` its longest
  waiter has waited (``Ticket.waited``: queued, and paused by earlier preemptions; a
  resumed long answer is not aged by the time it ran): so no class starves, and aging
  never lets one caller's old requests overtake another caller's turn within their class
  (ties between classes: the earlier fair share, then the earlier in the queue).
- ``within_reserve``: a request that is not a completion leaves ``reserve`` of the
  upstream's permits free (default 1 where it has 2 or more), or as many as it can while
  it still fits (a wide one on a small upstream, a reserve as large as the upstream).
- ``beside_completion``: with ``preempt`` ``solo``, a chat or bulk request is not started
  on an upstream where a completion that lived ``preempt_after_ms`` holds permits
  (preempt.py ``beside``).

Pure functions of the queue, the upstreams' gates and the settings; event loop thread
only. With ``classes`` off the scheduler does not ask (one FIFO queue).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from llmproxy.proxy.gating.classes import RANK
from llmproxy.proxy.gating.ticket import Ticket
from llmproxy.proxy.pool.entry import Entry
from llmproxy.proxy.pool.member import Member
from llmproxy.proxy.pool.preempt import beside
from llmproxy.proxy.pool.shares import Shares
from llmproxy.proxy.settings import ProxySettings


class Order:
    def __init__(self, settings: ProxySettings, shares: Shares) -> None:
        self.max_wait, self.reserve, self.shares = (
            settings.class_max_wait_s,
            settings.reserve,
            shares,
        )
        self.solo = settings.preempt == "solo"
        self.after_s = settings.preempt_after_ms / 1000

    def head(
        self, queue: Iterable[Entry], members: Sequence[Member], classes: bool = True
    ) -> Entry | None:
        """See the module's docstring; ``classes`` off: the first waiter whose caller is
        not at its ``max_inflight``."""
        capped = self.capped(members)
        if not classes:
            return next((e for e in queue if e.ticket.caller not in capped), None)
        offers: dict[str, tuple[float, int, Entry]] = {}  # class -> (tag, place, its waiter)
        longest: dict[str, float] = {}  # class -> its longest waiter's time waited
        now = time.monotonic()
        for place, entry in enumerate(queue):
            ticket = entry.ticket
            if ticket.caller in capped:
                continue
            klass = ticket.klass
            longest[klass] = max(longest.get(klass, 0.0), ticket.waited(now))
            tag = self.shares.start(ticket.caller)
            if klass not in offers or tag < offers[klass][0]:  # ties: the earlier in the queue
                offers[klass] = (tag, place, entry)
        if not offers:
            return None

        def rank(klass: str) -> int:
            rank = RANK[klass]
            if rank:
                rank = max(0, rank - int(longest[klass] // self.max_wait[klass]))
            return rank

        best = min(offers, key=lambda k: (rank(k), *offers[k][:2]))
        return offers[best][2]

    def capped(self, members: Sequence[Member]) -> set[str]:
        """Callers with ``max_inflight`` requests holding permits now."""
        if not self.shares.caps:  # no key caps its caller: nobody (on every grant's path)
            return set()
        running: dict[str, int] = {}
        for m in members:
            for t in m.gate.inflight_snapshot():
                running[t.caller] = running.get(t.caller, 0) + 1
        return {
            caller
            for caller, n in running.items()
            if (cap := self.shares.max_inflight(caller)) is not None and n >= cap
        }

    def within_reserve(self, m: Member, klass: str, permits: int) -> bool:
        """May a request of ``klass`` take ``permits`` of ``m``'s now (the reserve is for
        completions)?"""
        if klass == "complete":
            return True
        capacity = m.gate.capacity
        reserve = self.reserve if self.reserve is not None else (1 if capacity >= 2 else 0)
        reserve = min(reserve, capacity - permits)  # never so much that it could not run
        others = sum(len(t.slots) for t in m.gate.inflight_snapshot() if t.klass != "complete")
        return others + permits <= capacity - reserve

    def beside_completion(self, m: Member, ticket: Ticket) -> bool:
        """Would ``ticket`` start beside a completion on ``m`` that runs alone (``preempt``
        ``solo``: it waits)?"""
        return self.solo and beside(m, ticket, time.monotonic(), self.after_s, self.max_wait)
