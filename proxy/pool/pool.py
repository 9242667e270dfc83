"""The pool: one FIFO wait queue in front of several upstreams, each with its own permits.

Concurrency contract (the Gate's, gating/gate.py, with the upstream chosen at the grant):

- ``submit`` never blocks. It admits a request (``QueueFull``, ``ShuttingDown``;
  ``UpstreamUnavailable`` when no upstream is in rotation, so a dead pool fails fast;
  ``BadRequest`` when it fits no upstream), supersedes the session's queued requests (the
  newcomer takes the first one's place, or the place its last one left:
  gating/waitlist.py) and asks the session's requests in flight on every upstream to
  stop, then queues an ``Entry``. Twins (proxy/twins.py: the session's requests whose body
  equals the newcomer's) are left alone, here and on every upstream's gate, as by the
  gate itself.
- ``advance`` (on every submit, and whenever an upstream's gate gives permits back, a
  health probe changes, or a routing wait ends) hands the queue's head to the upstream the
  router picks (router.py): it submits the request to that upstream's gate, which grants
  it at once or (waiting for the session's slot being stopped there) soon. Strict FIFO: a
  head that cannot go anywhere yet holds up the queue behind it.
- ``acquire`` blocks the request's handler until its permit is granted there, at most the
  queue timeout (``QueueTimeout``). A cancelled or timed-out waiter abandons its entry:
  out of the queue, or its upstream's permit returned. From the grant on, the upstream's
  gate, breaker and adapter are the request's, exactly as with one upstream.

Event loop thread only; the one timer (a routing wait) is a loop handle owned by the pool.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

from llmproxy.proxy.errors import (
    SUPERSEDED,
    BadRequest,
    ProxyError,
    QueueFull,
    QueueTimeout,
    ShuttingDown,
    Superseded,
)
from llmproxy.proxy.gating.breaker import UpstreamUnavailable
from llmproxy.proxy.gating.waitlist import WaitList
from llmproxy.proxy.pool.entry import Entry, Placement
from llmproxy.proxy.pool.member import Member
from llmproxy.proxy.pool.prefix import block_hashes, prompt_text
from llmproxy.proxy.pool.router import Choice, Request, Router, Wait
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.twins import twin_key

#: permits a request needs on an upstream (BadRequest: it cannot run there)
Sizing = Callable[[Member, int], int]


class Pool:
    def __init__(self, members: Sequence[Member], settings: ProxySettings) -> None:
        self.members = list(members)
        self.settings = settings
        self.router = Router(settings.route, settings.affinity_wait_s)
        self.max_queue = settings.max_queue
        self.queue: WaitList[Entry] = WaitList(settings.queue_hold_s, settings.max_queue)
        self._ids = itertools.count(1)
        self._closed = False
        self._advancing = False
        self._timer: asyncio.TimerHandle | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self.listeners: list[Callable[[Any, bool], None]] = []  # (member, joined): metrics
        for m in self.members:
            m.gate.on_advance = self.advance

    def rotation(self) -> list[Member]:
        return [m for m in self.members if m.in_rotation]

    def add(self, member: Member) -> None:
        """An upstream joins (reload): in rotation once healthy."""
        member.gate.on_advance = self.advance
        self.members.append(member)
        for listener in self.listeners:
            listener(member, True)
        self.advance()

    def remove(self, member: Member) -> None:
        """A drained upstream leaves (reload): nothing of it is queued or in flight."""
        self.members.remove(member)
        member.gate.on_advance = None
        for listener in self.listeners:
            listener(member, False)

    # -- admission --------------------------------------------------------------------
    def submit(
        self,
        session: str,
        *,
        supersedable: bool,
        route: str,
        parsed: Any,
        sizing: Sizing,
        exclude: Member | None = None,
        first: bool = False,
    ) -> Entry:
        """Admit a request (see the module's contract); ``exclude``: a failover, which goes
        to the head of the queue and to another upstream than the one it failed on.
        ``first``: to the head of the queue too (a keystroke that waited on its session's
        generation, type-through)."""
        if self._closed:
            raise ShuttingDown("llmproxy is shutting down")
        members = [m for m in self.rotation() if m is not exclude]
        if not members:
            retry = {"Retry-After": str(max(1, round(self.settings.health_interval_s)))}
            raise UpstreamUnavailable("no upstream is available", headers=retry)
        sized: dict[int, int | None] = {}
        first_error: BadRequest | None = None

        def permits(m: Member) -> int | None:
            nonlocal first_error
            if id(m) not in sized:
                try:
                    sized[id(m)] = sizing(m, m.gate.total)
                except BadRequest as exc:
                    first_error = first_error or exc
                    sized[id(m)] = None
            return sized[id(m)]

        if all(permits(m) is None for m in members) and first_error is not None:
            raise first_error
        twin = twin_key(route, parsed) if supersedable else None
        placed, replaced = self.queue.place_of(session, twin) if supersedable else (False, None)
        if replaced is None and exclude is None and not first and len(self.queue) >= self.max_queue:
            if self.queue or not any(m.has_room(permits(m) or 1) for m in members):
                raise QueueFull(
                    f"queue full ({self.max_queue} waiting)",
                    headers={"Retry-After": str(self.settings.retry_after_s)},
                )
        text = prompt_text(route, parsed) if self.settings.route == "cache" else ""
        entry = Entry(
            next(self._ids),
            session,
            supersedable,
            route,
            Request(session, block_hashes(text), permits, time.monotonic()),
            lambda m: lambda capacity: sizing(m, capacity),
            exclude,
            asyncio.get_running_loop().create_future(),
            prompt_chars=len(text),
            twin=twin,
        )
        self._idle.clear()
        if supersedable:
            for m in self.members:
                m.gate.supersede_queued(session, twin)
                m.gate.supersede_inflight(session, twin)
        if placed:  # the first rival's position (or its hold's: see gating/waitlist.py)
            rivals = self.queue.rivals(session, twin)  # all superseded
            self.queue.take_place(session, entry, twin)
            for rival in rivals:
                if rival is not replaced:
                    self.queue.discard(rival)
                rival.end(Superseded(SUPERSEDED))
        elif exclude is not None or first:
            self.queue.push_front(entry)
        else:
            self.queue.append(entry)
        self.advance()
        return entry

    async def acquire(self, entry: Entry, timeout_s: float) -> Placement:
        """Wait until ``entry`` holds its permits on an upstream (see the module's contract)."""
        try:
            async with asyncio.timeout(timeout_s):
                placement = await entry.future
                if not placement.ticket.future.done():
                    await placement.ticket.wait()
                placement.ticket.future.result()  # Superseded or ShuttingDown, if so
        except TimeoutError:
            self.abandon(entry)
            raise QueueTimeout(f"no permit within {timeout_s:g}s") from None
        except BaseException:
            self.abandon(entry)
            raise
        return placement

    def abandon(self, entry: Entry) -> None:
        """The waiter gave up: out of the queue, or its untaken permits back."""
        if entry in self.queue:
            self.queue.remove(entry)  # a supersedable one leaves a hold
            if not entry.future.done():
                entry.future.cancel()
            self.advance()
        elif entry.placement is not None:
            p = entry.placement
            if p.ticket.state in ("queued", "granted"):
                p.member.breaker.neutral(p.probe)
                p.member.gate.abandon(p.ticket)

    # -- granting ---------------------------------------------------------------------
    def advance(self) -> None:
        """Hand the queue's head to an upstream while one takes it (see the contract)."""
        if self._advancing:
            return
        self._advancing = True
        try:
            self._advance()
        finally:
            self._advancing = False
        self._check_idle()

    def _advance(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while (head := self.queue.head()) is not None:
            if head.future.done():  # its waiter left: as ``abandon`` would
                self.queue.remove(head)
                continue
            members = [m for m in self.rotation() if m is not head.exclude]
            if not members:
                self.queue.discard(head)
                head.end(UpstreamUnavailable("no upstream is available"))
                continue
            fits = [m for m in members if head.request.permits(m) is not None]
            if not fits:  # only upstreams out of rotation could run it
                self.queue.discard(head)
                head.end(UpstreamUnavailable("no upstream that can run this request is available"))
                continue
            choice = self.router.choose(head.request, fits)
            if isinstance(choice, Wait):
                loop = asyncio.get_running_loop()
                self._timer = loop.call_later(choice.delay_s, self.advance)
                return
            if choice is None:
                return
            self.queue.discard(head)
            self._place(head, choice)

    def _place(self, entry: Entry, choice: Choice) -> None:
        m = choice.member
        permits = entry.request.permits(m)
        assert permits is not None
        try:
            probe = m.breaker.admit()
            ticket = m.gate.submit(
                entry.session,
                supersedable=entry.supersedable,
                route=entry.route,
                permits=permits,
                sizer=entry.sizer(m),
                supersedes=False,
                twin=entry.twin,
            )
        except ProxyError as exc:
            entry.end(exc)
            return
        m.index.add(entry.request.hashes)
        m.routed += 1
        m.prompt_chars += entry.prompt_chars
        m.cached_chars += choice.cached_chars
        entry.placement = Placement(m, ticket, probe, choice.decision, choice.cached_chars)
        entry.future.set_result(entry.placement)

    # -- observation and shutdown ------------------------------------------------------
    def _check_idle(self) -> None:
        if not self.queue and all(not m.gate.inflight and not m.gate.queued for m in self.members):
            self._idle.set()
        else:
            self._idle.clear()

    async def wait_quiescent(self) -> None:
        """Return once nothing is queued or holds a permit on any upstream."""
        self._check_idle()
        await self._idle.wait()

    def close(self) -> None:
        """Shutdown: refuse new requests, answer the queued ones with ShuttingDown."""
        self._closed = True
        for entry in self.queue.clear():
            entry.end(ShuttingDown("llmproxy is shutting down"))
        for m in self.members:
            m.gate.close()
        if self._timer is not None:
            self._timer.cancel()
        self._check_idle()
