"""Which waiting request the scheduler (pool.py) serves next, and what it may take.

- ``head``: among the waiters of the best request class (gating/classes.py; a class
  counted one better for each ``class_max_wait_s`` its request waited), the first of the
  caller whose fair share comes first (shares.py), passing over callers that hold their
  key's ``max_inflight`` permits already. Ties: the earlier in the queue.
- ``within_reserve``: a request that is not a completion leaves ``reserve`` of the
  upstream's permits free (default 1 where it has 2 or more), or as many as it can while
  it still fits (a wide one on a small upstream, a reserve as large as the upstream).

Pure functions of the queue, the upstreams' gates and the settings; event loop thread
only. With ``classes`` off the scheduler does not ask (one FIFO queue).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from llmproxy.proxy.gating.classes import RANK
from llmproxy.proxy.pool.entry import Entry
from llmproxy.proxy.pool.member import Member
from llmproxy.proxy.pool.shares import Shares
from llmproxy.proxy.settings import ProxySettings


class Order:
    def __init__(self, settings: ProxySettings, shares: Shares) -> None:
        self.max_wait, self.reserve, self.shares = (
            settings.class_max_wait_s,
            settings.reserve,
            shares,
        )

    def head(
        self, queue: Iterable[Entry], members: Sequence[Member], classes: bool = True
    ) -> Entry | None:
        """See the module's docstring; ``classes`` off: the first waiter whose caller is
        not at its ``max_inflight``."""
        capped = self.capped(members)
        if not classes:
            return next((e for e in queue if e.ticket.caller not in capped), None)
        now = time.monotonic()
        best: Entry | None = None
        best_key = (len(RANK), 0.0)
        for entry in queue:
            ticket = entry.ticket
            if ticket.caller in capped:
                continue
            rank = RANK[ticket.klass]
            if rank:
                waited = now - entry.created
                rank = max(0, rank - int(waited // self.max_wait[ticket.klass]))
            key = (rank, self.shares.start(ticket.caller))
            if key < best_key:  # ties: the earlier in the queue
                best, best_key = entry, key
        return best

    def capped(self, members: Sequence[Member]) -> set[str]:
        """Callers with ``max_inflight`` requests holding permits now."""
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
