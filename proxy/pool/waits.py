"""The queue's head while it cannot be granted yet (grant.py): what it waits for, and the
timers that end those waits.

- ``waits_for_its_slot``: the slot its session used last is being stopped, on one of the
  upstreams it fits, for the session's superseded request. Its prompt is cached there:
  it waits for that slot (at most ``affinity_wait_s`` from its admission; the gate arms
  that timer) rather than prefill it on another slot or upstream.
- ``Waits.wake_in``: a routing wait (router.py ``Wait``): advance again after it, or
  sooner if already asked.
- ``Waits.preempt``: a completion at the head that found no room, once it waited
  ``preempt_after_ms``, stops the generations preempt.py picks for it (their jobs resume
  them later); until then a timer advances again when that wait is over, and after it
  every ``RECHECK_S`` while none qualifies only because one has yet to offer its resume
  (an agent's next chat in its prefill). Never with
  ``preempt`` or ``classes`` off, never for a request that is not a completion.
- ``Waits.solo``: with ``preempt`` ``solo``, at the end of every pass, the generations a
  completion that came of age shares its upstream with are stopped (preempt.py ``solo``);
  a timer advances again when the next one comes of age, when a request held back beside
  one comes to its class's ``class_max_wait_s``, and every ``RECHECK_S`` (20 ms) while a
  generation there has yet to offer its resume.

Event loop thread only. ``Waits`` owns its three timers (loop handles that call the pool's
``advance``); the pool cancels them when a pass over the queue begins and at close.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence

from llmproxy.proxy.gating.ticket import Ticket
from llmproxy.proxy.pool.entry import Entry
from llmproxy.proxy.pool.member import Member
from llmproxy.proxy.pool.preempt import RECHECK_S, offers_soon, solo, victims
from llmproxy.proxy.pool.room import Sized
from llmproxy.proxy.settings import ProxySettings


def waits_for_its_slot(ticket: Ticket, fits: Sequence[Member], sized: Sized) -> bool:
    """Does ``ticket`` wait for its session's slot on one of ``fits`` (those it fits,
    needing ``sized`` there; see the module's docstring)?"""
    for m in fits:
        n = sized[id(m)]
        assert isinstance(n, int)  # it fits there
        ticket.permits = n
        if m.gate.waits_for_its_slot(ticket):
            return True
    return False


class Waits:
    def __init__(self, settings: ProxySettings, advance: Callable[[], None]) -> None:
        self.settings, self.advance = settings, advance
        self._timer: asyncio.TimerHandle | None = None  # a routing wait
        self._preempt_timer: asyncio.TimerHandle | None = None  # a completion's wait for it
        self._solo_timer: asyncio.TimerHandle | None = None  # a completion comes of age
        self.preemptions = 0  # generations stopped for a completion (resumed after it)

    def cancel(self) -> None:
        """No timer armed any more (a pass over the queue arms those it still needs)."""
        for timer in (self._timer, self._preempt_timer, self._solo_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._preempt_timer = self._solo_timer = None

    def wake_in(self, delay_s: float) -> None:
        """Advance again in ``delay_s`` (a routing wait), or sooner if already asked."""
        loop = asyncio.get_running_loop()
        if self._timer is None or self._timer.when() > loop.time() + delay_s:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_later(delay_s, self.advance)

    def preempt(self, head: Entry, fits: Sequence[Member], sized: Sized) -> None:
        """``head`` found no room on ``fits`` (needing ``sized`` there): see the module's
        docstring."""
        s = self.settings
        if s.preempt == "off" or s.classes == "off" or head.ticket.klass != "complete":
            return
        left = head.created + s.preempt_after_ms / 1000 - time.monotonic()
        if left > 0:
            self._preempt_in(left)
            return
        now = time.monotonic()
        need = [(m, n) for m in fits if isinstance(n := sized[id(m)], int)]
        chosen = victims(need, now, s.class_max_wait_s)
        self._stop(chosen)
        if not chosen and offers_soon(m for m, _n in need):  # one's first event is coming
            self._preempt_in(RECHECK_S)

    def _preempt_in(self, delay_s: float) -> None:
        """Advance again in ``delay_s`` for a completion's preemption, or sooner if asked."""
        loop = asyncio.get_running_loop()
        timer = self._preempt_timer
        if timer is None or timer.when() > loop.time() + delay_s:
            if timer is not None:
                timer.cancel()
            self._preempt_timer = loop.call_later(delay_s, self.advance)

    def solo(self, members: Sequence[Member], waiting: Iterable[Entry]) -> None:
        """With ``preempt`` ``solo`` (and classes on): see the module's docstring;
        ``waiting``: the queue."""
        s = self.settings
        if s.preempt != "solo" or s.classes == "off":
            return
        now = time.monotonic()
        tickets = [e.ticket for e in waiting]
        found = solo(members, tickets, now, s.preempt_after_ms / 1000, s.class_max_wait_s)
        self._stop(found.stop)
        if found.again_at is not None:
            loop = asyncio.get_running_loop()
            delay = max(0.0, found.again_at - now)
            self._solo_timer = loop.call_later(delay, self.advance)

    def _stop(self, tickets: Sequence[Ticket]) -> None:
        for t in tickets:
            t.preempted = True
            self.preemptions += 1
            assert t.on_preempt is not None
            t.on_preempt()
