"""The scheduler: the one admission path, with one upstream (a pool of one) or several.

It owns the wait queue and every ordering rule: FIFO within a request class (complete
before chat before bulk, with aging, and a reserve of each upstream's permits for
completions: gating/classes.py), queue-full, held places, supersede and twins, the head of
the queue for a keystroke that waited, the breaker's probe, and where the head goes
(router.py). Each upstream's gate (gating/gate.py) keeps only its slot state: permits,
slot affinity, quarantine.

Its parts: admission.py (what a request needs on each upstream, and the refusals:
``max_queued``, the queue's bound, no upstream), room.py (the one rule of room on an
upstream, for the grant and for admission's prediction of it), waits.py (the head's
waits: its session's slot, a routing wait, a completion's preemption). Concurrency
contract:

- ``submit`` never blocks. It admits a request (``QueueFull``, ``ShuttingDown``;
  ``UpstreamUnavailable`` when no upstream is in rotation, so a dead upstream fails fast;
  ``BadRequest`` when it fits no upstream), supersedes the session's queued requests (the
  newcomer takes the first one's place, or the place its last one left:
  gating/waitlist.py) and asks the session's requests in flight on every upstream to
  stop, then queues an ``Entry``. Twins (proxy/twins.py: the session's requests whose body
  equals the newcomer's) are left alone, in the queue and on every gate. Only an admitted
  newcomer supersedes anything, so a 429 never costs the session its running request.
- ``advance`` (on every submit, and whenever a gate gives permits back, a health probe or
  a re-detection changes an upstream, a reload applies, or a routing or affinity wait
  ends) grants the queue's head on the upstream the router picks, at once: the permits it
  needs there are asked of that upstream's adapter in force now (never counted earlier),
  and it must not be waiting for its session's slot being stopped there. Strict FIFO: a
  head that cannot go anywhere yet holds up the queue behind it (a wide request cannot
  starve). A breaker's half-open probe is the request granted on that upstream while its
  probe is free; the probe is returned by the request's report, or when it leaves before
  its job took the permits.
- Models first (models.py): a request goes only to the upstreams that serve its model,
  and everything below (routing, the reserve, room, ``UpstreamUnavailable``) is among
  those; a model no upstream serves is ``UnknownModel`` (404). A router's model it does
  not run has no room while the router runs as many models as it may and each holds
  requests (``may_load``: its load would cut their generations). A head that cannot be
  granted yet holds up the queue behind it only on the upstreams it waits for: a waiter
  for another model goes past it to its own upstreams (so strict FIFO holds among the
  waiters that want the same upstreams, and with one model it is the whole queue's).
- ``acquire`` blocks the request's handler until it is granted, at most the queue timeout
  (``QueueTimeout``). A cancelled or timed-out waiter abandons its entry: out of the queue
  (a supersedable one leaves a held place), or its untaken permits and probe back. From
  the grant on, the upstream's gate, breaker and adapter are the request's job's.
- ``supersede_queued`` ends the session's queued requests that a newer one answered
  elsewhere (type-through) supersedes.

Event loop thread only; the timers (a routing wait, a completion's wait before it
preempts: waits.py) are loop handles owned by the scheduler, cancelled when a pass over
the queue begins and at close.
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
    QueueTimeout,
    ShuttingDown,
    Superseded,
    UnknownModel,
)
from llmproxy.proxy.gating.ticket import Ticket
from llmproxy.proxy.gating.waitlist import WaitList
from llmproxy.proxy.pool.admission import Limits, Sizing, size, unavailable
from llmproxy.proxy.pool.entry import Entry, Placement
from llmproxy.proxy.pool.member import Member
from llmproxy.proxy.pool.models import Held, loading, serving
from llmproxy.proxy.pool.order import Order
from llmproxy.proxy.pool.prefix import block_hashes, prompt_text
from llmproxy.proxy.pool.room import rule
from llmproxy.proxy.pool.router import Choice, Request, Router, Wait
from llmproxy.proxy.pool.shares import Shares
from llmproxy.proxy.pool.waits import Waits, waits_for_its_slot
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.twins import twin_key


class Pool:
    def __init__(self, members: Sequence[Member], settings: ProxySettings) -> None:
        self.members = list(members)
        self.settings = settings
        self.router = Router(settings.route, settings.affinity_wait_s)
        self.max_queue = settings.max_queue
        self.shares = Shares(settings.keys)
        self.order = Order(settings, self.shares)
        self.queue: WaitList[Entry] = WaitList(settings.queue_hold_s, settings.max_queue)
        shared = (self.members, settings, self.router, self.order, self.shares, self.queue)
        self._limits = Limits(*shared)  # admission.py
        self._sizing: dict[int, Sizing] = {}  # entry id -> its sizing
        self._ids = itertools.count(1)
        self._closed = False
        self._advancing = False
        self._again = False
        self._waits = Waits(settings, self.advance)  # the head's timers (waits.py)
        self._idle = asyncio.Event()
        self._idle.set()
        self.listeners: list[Callable[[Any, bool], None]] = []  # (member, joined): metrics
        for m in self.members:
            m.gate.on_advance = self.advance

    @property
    def preemptions(self) -> int:
        """Generations stopped for a completion (resumed after it): waits.py."""
        return self._waits.preemptions

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
        """A drained upstream leaves (reload): nothing holds its permits or slots."""
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
        klass: str = "complete",
        caller: str = "",
        since: float | None = None,
        model: str | None = None,
    ) -> Entry:
        """Admit a request (see the module's contract; its refusals: admission.py);
        ``klass``: its request class (gating/classes.py); ``caller``: who sent it (its
        key's fair share and limits: shares.py); ``exclude``: a failover, which goes to the
        head of the queue and to another upstream than the one it failed on. ``first``: to
        the head of the queue too (a keystroke that waited on its session's generation,
        type-through). ``since``: when the request first came: a preempted one's resume,
        which keeps its age (order.py, preempt.py) and supersedes nothing (though a newer
        request may supersede it). ``model``: the model it asks for (models.py ``asked``;
        None: any upstream)."""
        if self._closed:
            raise ShuttingDown("llmproxy is shutting down")
        members = self._serving(model, exclude)  # or UnknownModel
        if not members:
            raise self._unavailable(exclude, model)
        sized = {id(m): size(sizing, m) for m in members}
        if not any(isinstance(n, int) for n in sized.values()):
            raise next(n for n in sized.values() if isinstance(n, BadRequest))
        twin = twin_key(route, parsed) if supersedable else None
        # a resume (``since``) is no newcomer: it supersedes nothing
        newcomer = supersedable and since is None
        placed, replaced = self.queue.place_of(session, twin) if newcomer else (False, None)
        text = prompt_text(route, parsed) if self.settings.route == "cache" else ""
        hashes = block_hashes(text)
        at_cap = self._limits.check(  # or QueueFull
            session,
            route,
            klass,
            caller,
            hashes,
            sized,
            members,
            replaced=replaced,
            exclude=exclude,
            first=first,
            since=since,
        )
        loop = asyncio.get_running_loop()
        ident = next(self._ids)
        created = time.monotonic() if since is None else since
        ticket = Ticket(
            ident,
            session,
            supersedable,
            route,
            loop.create_future(),
            twin=twin,
            klass=klass,
            caller=caller,
            created=created,
        )
        entry = Entry(
            ident,
            session,
            supersedable,
            route,
            Request(session, hashes, time.monotonic()),
            ticket,
            exclude,
            loop.create_future(),
            prompt_chars=len(text),
            twin=twin,
            created=created,
            model=model,
            counted=exclude is None and since is None,
        )
        ticket.affinity_waited = at_cap  # no wait for its session's slot either
        self._sizing[ident] = sizing
        self._idle.clear()
        if newcomer:
            for m in self.members:
                m.gate.supersede_inflight(session, twin)
        if placed:  # the first rival's position (or its hold's: see gating/waitlist.py)
            rivals = self.queue.rivals(session, twin)  # all superseded
            self.queue.take_place(session, entry, twin)
            for rival in rivals:
                if rival is not replaced:
                    self.queue.discard(rival)
                self._end(rival, Superseded(SUPERSEDED))
        elif exclude is not None or first:
            self.queue.push_front(entry)
        else:
            self.queue.append(entry)
        self.advance()
        return entry

    def supersede_queued(self, session: str, twin: str | None) -> None:
        """A newer request of ``session`` (twin key ``twin``) was answered without queueing
        (type-through): it supersedes the session's queued requests, but for its twins."""
        rivals = self.queue.rivals(session, twin)
        for rival in rivals:
            self.queue.discard(rival)
            self._end(rival, Superseded(SUPERSEDED))
        if rivals:
            self.advance()

    async def acquire(self, entry: Entry, timeout_s: float) -> Placement:
        """Wait until ``entry`` holds its permits on an upstream (see the module's contract)."""
        try:
            if entry.future.done():  # granted at submit (the common case): no timer to arm
                return entry.future.result()
            async with asyncio.timeout(timeout_s):
                return await entry.future
        except TimeoutError:
            self.abandon(entry)
            raise QueueTimeout(f"no permit within {timeout_s:g}s") from None
        except BaseException:
            self.abandon(entry)
            raise

    def abandon(self, entry: Entry) -> None:
        """The waiter gave up: out of the queue, or its untaken permits and probe back."""
        if entry in self.queue:
            self.queue.remove(entry)  # a supersedable one leaves a hold
            self._forget(entry)
            entry.ticket.state = "done"
            if not entry.future.done():
                entry.future.cancel()
            self.advance()
        elif entry.placement is not None and entry.ticket.state == "granted":
            p = entry.placement
            p.member.breaker.neutral(p.probe)
            p.member.gate.abandon(p.ticket)

    # -- granting ---------------------------------------------------------------------
    def advance(self) -> None:
        """Grant the queue's head while an upstream takes it (see the contract)."""
        if self._advancing:
            self._again = True  # a gate gave permits back meanwhile: look once more
            return
        self._advancing = True
        try:
            self._again = True
            while self._again:
                self._again = False
                self._advance()
        finally:
            self._advancing = False
        self._check_idle()

    def _advance(self) -> None:
        self._waits.cancel()
        held = Held()  # upstreams kept for the waiters passed over (models.py)
        while (head := self._head(held.passed)) is not None:
            if head.future.done():  # its waiter left: as ``abandon`` would
                self.queue.remove(head)
                self._forget(head)
                continue
            try:
                members = self._serving(head.model, head.exclude)
            except UnknownModel as exc:  # a reload took its model away
                self.queue.discard(head)
                self._end(head, exc)
                continue
            if not members:
                self.queue.discard(head)
                self._end(head, self._unavailable(head.exclude, head.model))
                continue
            sizing = self._sizing[head.id]
            sized = {id(m): size(sizing, m) for m in members}
            fits = [m for m in members if isinstance(sized[id(m)], int)]
            if not fits:  # cannot run on any upstream in rotation now
                self.queue.discard(head)
                self._end(head, next(e for e in sized.values() if isinstance(e, ProxyError)))
                continue

            if waits_for_its_slot(head.ticket, fits, sized):
                if held.hold(head, fits, self.rotation()):
                    return  # strict FIFO: the queue behind waits too (the gate wakes it)
                continue
            order = self.order if self.settings.classes == "on" else None
            head.request.room = rule(head.ticket, sized, self.members, order)  # room.py
            free = [m for m in fits if m not in held]
            choice = self.router.choose(head.request, free) if free else None
            if isinstance(choice, Wait):
                self._waits.wake_in(choice.delay_s)
            if not isinstance(choice, Choice):
                if choice is None and free:  # no room where it may run now
                    self._waits.preempt(head, free, sized)
                if held.hold(head, fits, self.rotation()):
                    return
                continue
            self.queue.discard(head)
            permits = sized[id(choice.member)]
            assert isinstance(permits, int)  # the router picks where it has room
            self._place(head, choice, permits)

    def _serving(self, model: str | None, exclude: Member | None) -> list[Member]:
        """The upstreams in rotation, ``exclude`` aside, that serve ``model`` (models.py;
        ``UnknownModel`` if none in the pool does)."""
        return [m for m in serving(self.members, model) if m.in_rotation and m is not exclude]

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
        self._forget(entry)
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

    def _end(self, entry: Entry, error: ProxyError) -> None:
        self._forget(entry)
        entry.end(error)

    def _forget(self, entry: Entry) -> None:
        self._sizing.pop(entry.id, None)
        timer = entry.ticket.affinity_timer
        if timer is not None:
            timer.cancel()

    def _unavailable(self, exclude: Member | None, model: str | None = None) -> ProxyError:
        return unavailable(self.members, exclude, model, self.settings.health_interval_s)

    # -- observation and shutdown ------------------------------------------------------
    def _check_idle(self) -> None:
        if not self.queue and all(not m.gate.inflight for m in self.members):
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
            self._end(entry, ShuttingDown("llmproxy is shutting down"))
        for m in self.members:
            m.gate.close()
        self._waits.cancel()
        self._check_idle()
