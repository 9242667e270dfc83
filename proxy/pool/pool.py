"""The scheduler: the one admission path, with one upstream (a pool of one) or several.

It owns the wait queue and every ordering rule: FIFO within a request class (complete
before chat before bulk, with aging, and a reserve of each upstream's permits for
completions: gating/classes.py), queue-full, held places, supersede and twins, the head of
the queue for a keystroke that waited, the breaker's probe, and where the head goes
(router.py). Each upstream's gate (gating/gate.py) keeps only its slot state: permits,
slot affinity, quarantine.

Its parts: admission.py (what a request needs on each upstream, and the refusals:
``max_queued``, the queue's bound, no upstream), grant.py (one pass of ``advance``),
room.py (the one rule of room on an upstream, for the grant and for admission's
prediction of it), waits.py (the head's waits: its session's slot, a routing wait, a
completion's preemption; and solo's sweep after each pass); the policies: order.py,
shares.py, router.py, models.py and preempt.py. Concurrency contract:

- ``submit`` never blocks. It admits a request (``QueueFull``, ``ShuttingDown``;
  ``UpstreamUnavailable`` when no upstream is in rotation, so a dead upstream fails fast;
  ``BadRequest`` when it fits no upstream, in rotation or not: the client's error
  first), supersedes the session's queued requests (the newcomer takes the first one's
  place, or the place its last one left: gating/waitlist.py) and asks the session's
  requests in flight on every upstream to stop, then queues an ``Entry``. Twins
  (proxy/twins.py: the session's requests whose body equals the newcomer's) are left
  alone, in the queue and on every gate. Only an admitted newcomer supersedes anything,
  so a 429 never costs the session its running request.
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
- ``again`` queues a request stopped after its grant to let a completion run (its job
  asks, from the upstream side) once more: at the head of its class, with its age, and
  superseding nothing; it waits as ``acquire`` does.
- ``supersede_queued`` ends the session's queued requests that a newer one answered
  elsewhere (type-through) supersedes.

This module is over 300 lines because it is the one place where a request enters, waits
and leaves the queue; each rule it applies lives in one of the parts named above.

Event loop thread only; the timers (a routing wait, a completion's wait before it
preempts, and with ``preempt`` ``solo`` the next moment a completion comes of age or a
request held back beside one is exempt: waits.py) are loop handles owned by the
scheduler, cancelled when a pass over the queue begins and at close.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

from llmproxy.proxy.errors import SUPERSEDED, BadRequest, QueueTimeout, ShuttingDown, Superseded
from llmproxy.proxy.gating.ticket import Ticket
from llmproxy.proxy.gating.waitlist import WaitList
from llmproxy.proxy.pool.admission import Limits, Sizing, size
from llmproxy.proxy.pool.entry import Entry, Placement
from llmproxy.proxy.pool.grant import Grants
from llmproxy.proxy.pool.member import Member
from llmproxy.proxy.pool.order import Order
from llmproxy.proxy.pool.prefix import block_hashes, prompt_text
from llmproxy.proxy.pool.router import Request, Router
from llmproxy.proxy.pool.shares import Shares
from llmproxy.proxy.request import Body
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
        self._grants = Grants(*shared, self.advance)  # grant.py
        self._ids = itertools.count(1)
        self._closed = False
        self._advancing = False
        self._again = False
        self._idle = asyncio.Event()
        self._idle.set()
        self.listeners: list[Callable[[Any, bool], None]] = []  # (member, joined): metrics
        for m in self.members:
            m.gate.on_advance = self.advance

    @property
    def preemptions(self) -> int:
        """Generations stopped for a completion (resumed after it): waits.py."""
        return self._grants.waits.preemptions

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
        parsed: Body,
        sizing: Sizing,
        exclude: Member | None = None,
        first: bool = False,
        klass: str = "complete",
        caller: str = "",
        since: float | None = None,
        model: str | None = None,
        twin: str | None = None,
        waited_s: float = 0.0,
    ) -> Entry:
        """Admit a request (see the module's contract; its refusals: admission.py);
        ``klass``: its request class (gating/classes.py); ``caller``: who sent it (its
        key's fair share and limits: shares.py); ``exclude``: a failover, which goes to the
        head of the queue and to another upstream than the one it failed on. ``first``: to
        the head of the queue too (a keystroke that waited on its session's generation,
        type-through). ``since``: when the request first came: a preempted one's resume,
        which keeps its age (order.py, preempt.py) and supersedes nothing (though a newer
        request may supersede it). ``model``: the model it asks for (models.py ``asked``;
        None: any upstream). ``twin``: its twin key (twins.py), if it was computed.
        ``waited_s``: a resume's time waited so far (preempt.py's exemption)."""
        if self._closed:
            raise ShuttingDown("llmproxy is shutting down")
        members = self._grants.serving(model, exclude)  # or UnknownModel
        if not members:  # none in rotation (a 400 first where it fits none anyway)
            raise self._grants.unavailable(exclude, model, sizing)
        sized = {id(m): size(sizing, m) for m in members}
        if not any(isinstance(n, int) for n in sized.values()):
            raise next(n for n in sized.values() if isinstance(n, BadRequest))
        if supersedable and twin is None:
            twin = twin_key(route, parsed)
        elif not supersedable:
            twin = None
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
            waited_s=waited_s,
        )
        entry = Entry(
            ident,
            session,
            supersedable,
            route,
            parsed,
            sizing,
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
                self._grants.end(rival, Superseded(SUPERSEDED))
        elif exclude is not None or first:
            self.queue.push_front(entry)
        else:
            self.queue.append(entry)
        self.advance()
        return entry

    async def again(self, entry: Entry, stopped: Ticket) -> Placement:
        """Permits again for ``entry``'s request, stopped after its grant (on ``stopped``,
        its latest ticket) to let a completion run (preemption: waits.py,
        upstream/job.py): at the head of its class's waiters, with its age (``since``:
        order.py) and the time it waited so far (``waited_s``: preempt.py), superseding
        nothing, waiting at most ``queue_timeout_s`` as any request. Cancelled by its job
        (its client left), which gives its place up."""
        again = self.submit(
            entry.session,
            supersedable=entry.supersedable,
            route=entry.route,
            parsed=entry.parsed,
            sizing=entry.sizing,
            klass=entry.ticket.klass,
            caller=entry.ticket.caller,
            model=entry.model,
            twin=entry.twin,
            first=True,
            since=entry.created,
            waited_s=stopped.waited_s,
        )
        return await self.acquire(again, self.settings.queue_timeout_s)

    def supersede_queued(self, session: str, twin: str | None) -> None:
        """A newer request of ``session`` (twin key ``twin``) was answered without queueing
        (type-through): it supersedes the session's queued requests, but for its twins."""
        rivals = self.queue.rivals(session, twin)
        for rival in rivals:
            self.queue.discard(rival)
            self._grants.end(rival, Superseded(SUPERSEDED))
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
            self._grants.forget(entry)
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
                self._grants.run()
        finally:
            self._advancing = False
        self._check_idle()

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
            self._grants.end(entry, ShuttingDown("llmproxy is shutting down"))
        for m in self.members:
            m.gate.close()
        self._grants.waits.cancel()
        self._check_idle()
