"""One pass over the scheduler's queue (pool.py ``advance``): grant the head on the upstream
the router picks, while one takes it.

Each head in turn (order.py ``head``; with classes off and no key's ``max_inflight``, the
queue's first), the waiters held back in this pass aside. A pass sees one rotation: the
upstreams in rotation when it begins, less those that leave it meanwhile (a breaker's
probe taken); one that comes into it during the pass (a breaker's cooldown over, which the
clock alone decides) waits for the next pass, so a waiter that found it out of rotation
never has it taken by one behind it:

- its waiter left: out of the queue, as ``abandon`` would;
- its model is no longer served (a reload took it away: ``UnknownModel``), no upstream
  in rotation serves it (admission.py ``unavailable``), or it fits none of those that do
  (their adapters' ``BadRequest``): it ends with that error;
- it waits for its session's slot (waits.py), or the router finds no room for it
  (room.py) on the upstreams not held back or asks it to wait for its preferred one (a
  timer: waits.py): the upstreams it may run on are held back for it (models.py
  ``Held``), so no one behind it is granted there (strict FIFO among the waiters that
  want the same upstreams); with no room anywhere, a completion may preempt (waits.py).
  The pass ends once every upstream in rotation is held back;
- else it is granted there: the breaker admits it (its half-open probe, if any), the
  gate grants it the permits it needs there (asked of that upstream's adapter in force
  now), its caller's fair share (shares.py), the prompt index, the counters and the
  router model's load (models.py ``loading``) record it, and its waiter gets its
  ``Placement``.

After the pass, with ``preempt`` ``solo``, the generations that share an upstream with a
completion of age are stopped (waits.py ``Waits.solo``).

``Grants`` owns the timers (waits.py); the pool
shares its members, queue and policies with it and calls ``run`` never re-entrantly.
Event loop thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from llmproxy.proxy.errors import ProxyError, UnknownModel
from llmproxy.proxy.gating.waitlist import WaitList
from llmproxy.proxy.pool.admission import Sizing, size, unavailable
from llmproxy.proxy.pool.entry import Entry, Placement
from llmproxy.proxy.pool.member import Member
from llmproxy.proxy.pool.models import Held, loading, serving
from llmproxy.proxy.pool.order import Order
from llmproxy.proxy.pool.room import rule
from llmproxy.proxy.pool.router import Choice, Router, Wait
from llmproxy.proxy.pool.shares import Shares
from llmproxy.proxy.pool.waits import Waits, waits_for_its_slot
from llmproxy.proxy.settings import ProxySettings


class Grants:
    def __init__(
        self,
        members: list[Member],
        settings: ProxySettings,
        router: Router,
        order: Order,
        shares: Shares,
        queue: WaitList[Entry],
        advance: Callable[[], None],
    ) -> None:
        self.members, self.settings, self.router = members, settings, router
        self.order, self.shares, self.queue = order, shares, queue
        self.waits = Waits(settings, advance)  # the head's timers, and solo's
        self._pass: set[int] | None = None  # id() of the upstreams in this pass's rotation

    def run(self) -> None:
        """One pass (see the module's docstring)."""
        self.waits.cancel()
        self._pass = {id(m) for m in self.members if m.in_rotation}  # this pass's rotation
        try:
            self._run()
        finally:
            self._pass = None
        self.waits.solo(self.members, self.queue)  # completions that run alone (waits.py)

    def _run(self) -> None:
        held = Held()  # upstreams kept for the waiters passed over (models.py)
        while (head := self._head(held.passed)) is not None:
            if head.future.done():  # its waiter left: as ``abandon`` would
                self.queue.remove(head)
                self.forget(head)
                continue
            try:
                members = self.serving(head.model, head.exclude)
            except UnknownModel as exc:  # a reload took its model away
                self.queue.discard(head)
                self.end(head, exc)
                continue
            if not members:
                self.queue.discard(head)
                self.end(head, self.unavailable(head.exclude, head.model, head.sizing))
                continue
            sized = {id(m): size(head.sizing, m) for m in members}
            fits = [m for m in members if isinstance(sized[id(m)], int)]
            if not fits:  # cannot run on any upstream in rotation now
                self.queue.discard(head)
                self.end(head, next(e for e in sized.values() if isinstance(e, ProxyError)))
                continue

            if waits_for_its_slot(head.ticket, fits, sized):
                if held.hold(head, fits, self._rotation()):
                    return  # strict FIFO: the queue behind waits too (the gate wakes it)
                continue
            order = self.order if self.settings.classes == "on" else None
            head.request.room = rule(head.ticket, sized, self.members, order)  # room.py
            free = [m for m in fits if m not in held]
            choice = self.router.choose(head.request, free) if free else None
            if isinstance(choice, Wait):
                self.waits.wake_in(choice.delay_s)
            if not isinstance(choice, Choice):
                if choice is None and free:  # no room where it may run now
                    self.waits.preempt(head, free, sized)
                if held.hold(head, fits, self._rotation()):
                    return
                continue
            self.queue.discard(head)
            permits = sized[id(choice.member)]
            assert isinstance(permits, int)  # the router picks where it has room
            self._place(head, choice, permits)

    def serving(self, model: str | None, exclude: Member | None) -> list[Member]:
        """The upstreams in rotation (during a pass: in its rotation), ``exclude`` aside,
        that serve ``model`` (models.py; ``UnknownModel`` if none in the pool does)."""
        return [m for m in serving(self.members, model) if self._in(m) and m is not exclude]

    def unavailable(self, exclude: Member | None, model: str | None, sizing: Sizing) -> ProxyError:
        return unavailable(self.members, exclude, model, self.settings.health_interval_s, sizing)

    def end(self, entry: Entry, error: ProxyError) -> None:
        self.forget(entry)
        entry.end(error)

    def forget(self, entry: Entry) -> None:
        timer = entry.ticket.affinity_timer
        if timer is not None:
            timer.cancel()

    def _rotation(self) -> list[Member]:
        return [m for m in self.members if self._in(m)]

    def _in(self, m: Member) -> bool:
        """Is ``m`` in rotation, and during a pass in the rotation it began with?"""
        return m.in_rotation and (self._pass is None or id(m) in self._pass)

    def _head(self, passed: set[Any] | frozenset[Any] = frozenset()) -> Entry | None:
        """The waiter served next (order.py), ``passed`` (held back this pass) aside."""
        if self.settings.classes == "off" and not self.shares.caps:
            head = self.queue.head()
            if head is None or not passed:
                return head
            return next((e for e in self.queue if e not in passed), None)
        self.queue.head()  # drops expired holds
        waiting = [e for e in self.queue if e not in passed] if passed else self.queue
        return self.order.head(waiting, self.members, self.settings.classes == "on")

    def _place(self, entry: Entry, choice: Choice, permits: int) -> None:
        m = choice.member
        self.forget(entry)
        try:
            probe = m.breaker.admit()
        except ProxyError as exc:
            entry.end(exc)
            return
        entry.ticket.permits = permits
        m.gate.grant(entry.ticket)
        self.shares.granted(entry.ticket.caller, permits)
        m.index.add(entry.request.hashes)
        m.routed += 1
        m.last_granted = time.monotonic()
        loading(m, self.members)  # a router's model it does not run: loaded for this one
        m.prompt_chars += entry.prompt_chars
        m.cached_chars += choice.cached_chars
        entry.placement = Placement(
            m, entry.ticket, probe, choice.decision, choice.cached_chars, m.adapter
        )
        entry.future.set_result(entry.placement)
