"""Admission's refusals (pool.py ``submit``): what a request needs on each upstream, and
whether it may wait.

- ``size``: the permits a request needs on an upstream, asked of that upstream's adapter
  in force now with its slot count (``Sizing``); a ``BadRequest``: it cannot run there.
- ``unavailable``: the error for a request that no upstream in rotation serving its model
  can take: an open breaker's own, else ``UpstreamUnavailable``.
- ``Limits.check``: ``QueueFull`` (429, with Retry-After) for a request whose caller
  has its key's ``max_queued`` requests waiting already (shares.py; those held to the
  cap: not failovers nor resumes, and not the one whose place it takes, which leaves),
  unless it would be granted at once (``runs_now``: nothing else waits, its caller is
  under ``max_inflight`` and the router picks an upstream with room for it, room.py);
  a failover or a resume is never refused so (counted when first admitted), a ``first``
  one is as any other (never counted). And for one that finds ``max_queue`` requests
  waiting, unless it takes a waiter's place, is a failover or goes first, or nothing
  waits and an upstream has its permits free.

``Limits`` reads the pool's members, queue and policies, which the pool shares with it
and changes; it changes nothing the pool holds (``runs_now`` asks the room rule for a
probe ticket of its own). Event loop thread only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from llmproxy.proxy.errors import BadRequest, ProxyError, QueueFull
from llmproxy.proxy.gating.breaker import UpstreamUnavailable
from llmproxy.proxy.gating.ticket import Ticket
from llmproxy.proxy.gating.waitlist import WaitList
from llmproxy.proxy.pool.entry import Entry, Sizing
from llmproxy.proxy.pool.member import Member
from llmproxy.proxy.pool.models import serving
from llmproxy.proxy.pool.order import Order
from llmproxy.proxy.pool.room import Sized, rule
from llmproxy.proxy.pool.router import Choice, Request, Router
from llmproxy.proxy.pool.shares import Shares
from llmproxy.proxy.settings import ProxySettings


def size(sizing: Sizing, m: Member) -> int | BadRequest:
    try:
        n = sizing(m, m.gate.total)
    except BadRequest as exc:
        return exc
    if n < 1:
        raise ValueError(f"a request needs at least one permit, not {n}")
    return n


def unavailable(
    members: Sequence[Member],
    exclude: Member | None,
    model: str | None,
    health_interval_s: float,
    sizing: Sizing,
) -> ProxyError:
    """The error for a request (``sizing``) no upstream of ``members`` in rotation serving
    ``model`` can take: its ``BadRequest`` when it fits none of those upstreams, in
    rotation or not (the client's error first: waiting for one would not mend it); an open
    breaker's own (its cooldown as Retry-After) when that is what keeps the upstreams out;
    else 'no upstream is available' until the next health probe."""
    away = [size(sizing, m) for m in serving(members, model) if m is not exclude]
    if away and all(isinstance(n, BadRequest) for n in away):
        return next(n for n in away if isinstance(n, BadRequest))
    up = [m for m in serving(members, model) if m is not exclude and m.healthy]
    if up and all(not m.breaker.admissible for m in up):
        try:
            up[0].breaker.admit()
        except ProxyError as exc:
            return exc
    retry = {"Retry-After": str(max(1, round(health_interval_s)))}
    return UpstreamUnavailable("no upstream is available", headers=retry)


class Limits:
    """The queue's limits of one pool (see the module's docstring)."""

    def __init__(
        self,
        members: list[Member],
        settings: ProxySettings,
        router: Router,
        order: Order,
        shares: Shares,
        queue: WaitList[Entry],
    ) -> None:
        self.members, self.settings, self.router = members, settings, router
        self.order, self.shares, self.queue = order, shares, queue

    def check(
        self,
        session: str,
        route: str,
        klass: str,
        caller: str,
        hashes: list[bytes],
        sized: Sized,
        members: list[Member],
        *,
        replaced: Entry | None,
        exclude: Member | None,
        first: bool,
        since: float | None,
    ) -> bool:
        """Raise ``QueueFull`` if the request may not wait (see the module's docstring) on
        ``members`` (those serving its model, in rotation), needing ``sized`` there; else
        whether it was let in at its caller's ``max_queued`` because it runs now (then it
        must not wait for its session's slot either)."""
        retry = {"Retry-After": str(self.settings.retry_after_s)}
        cap = self.shares.max_queued(caller)
        if cap is not None and exclude is None and since is None:
            waiting = sum(
                e.counted and e.ticket.caller == caller and e is not replaced for e in self.queue
            )
            runs = self.runs_now(session, route, klass, caller, hashes, sized, members, replaced)
            if waiting >= cap and not runs:
                raise QueueFull(
                    f"caller {caller!r} has {waiting} requests waiting (max_queued {cap})",
                    headers=retry,
                )
            at_cap = waiting >= cap  # let in because it runs now: it must not wait then
        else:
            at_cap = False
        max_queue = self.settings.max_queue
        if replaced is None and exclude is None and not first and len(self.queue) >= max_queue:
            free = any(isinstance(n := sized[id(m)], int) and m.gate.free >= n for m in members)
            if self.queue or not free:
                raise QueueFull(f"queue full ({max_queue} waiting)", headers=retry)
        return at_cap

    def runs_now(
        self,
        session: str,
        route: str,
        klass: str,
        caller: str,
        hashes: list[bytes],
        sized: Sized,
        members: list[Member],
        replaced: Entry | None = None,
    ) -> bool:
        """Would a request with these traits be granted at once, as the queue's head now
        (nothing waits but ``replaced``, whose place it takes, its caller is under
        ``max_inflight``, and the router picks an upstream with room for it)?"""
        if any(e is not replaced for e in self.queue) or caller in self.order.capped(self.members):
            return False
        probe = Ticket(0, session, False, route, asyncio.get_running_loop().create_future())
        probe.klass = klass
        order = self.order if self.settings.classes == "on" else None
        room = rule(probe, sized, self.members, order)  # room.py: as the grant asks it
        fits = [m for m in members if isinstance(sized.get(id(m)), int)]
        request = Request(session, hashes, time.monotonic(), room=room)
        return isinstance(self.router.choose(request, fits), Choice)
