"""The Gate: N permits (= upstream slots), a bounded FIFO wait queue, and sessions.

Pure asyncio logic, no sockets (tested directly). Concurrency contract:

- ``submit`` never blocks: it enqueues a ``Ticket`` (or grants a free permit at once),
  supersedes the older queued tickets of the same session (their waiters get
  ``Superseded`` and the newcomer takes the first one's queue position, as it takes the
  position a ticket of the session that left the queue holds for ``hold_s``:
  waitlist.py), asks in-flight tickets of the same session to stop
  (``Ticket.on_supersede``; the job decides by policy), and raises ``QueueFull`` or
  ``ShuttingDown``. A ticket whose ``twin`` key equals the newcomer's is its twin
  (proxy/twins.py: the same body, at the same time) and is neither superseded nor
  replaced: the newcomer queues (or is granted) beside it as any request.
- ``Ticket.wait`` blocks until a permit (slot id) is granted. The waiter's task may be
  cancelled (client disconnect, queue timeout): it must then call ``abandon``, which removes
  a queued ticket or returns a permit that was granted but never taken.
- Once a permit is taken, the ticket belongs to an upstream job task; only that job calls
  ``release``, and only after the upstream is known idle. No client-side event releases a
  permit.
- Permits are slot ids 0..N-1. A grant prefers the slot the session used last when it is
  free (prompt-cache affinity). When that slot is being stopped for the session's own
  superseded request, the grant waits for it, at most ``affinity_wait_s`` from admission
  (the queue behind waits too): the new request then finds its prompt in that slot's
  cache instead of prefilling it on another. FIFO order between waiters never changes.
- A ticket may need several permits at once (``permits``: llama-server's ``n_cmpl``, which
  runs one request on that many slots). It is granted all of them together or waits; the
  queue stays strictly FIFO, so a smaller request behind it waits too (no overtaking, so a
  wide request cannot starve). Its first slot is the affinity choice; the others are the
  lowest free ids, the ones llama-server gives a request's extra completions. Until its job
  has sent it, ``settle_extras`` may trade those for lower slots freed meanwhile (the job's
  adapter owns that wait; ``settled`` ends it).
- A queued ticket's permit count is decided when it is granted: its ``sizer`` (if any) is
  called then, with the slot count (``total``) at that moment, and its answer is the count
  granted (what the request needs may change while it waits: the upstream's adapter is
  replaced once it is detected, see upstream/watch.py). A sizer that raises a ProxyError
  fails the ticket with it: its waiter raises that error. Sizers run synchronously inside
  the gate's calls and must not call back into the gate.
- A slot whose stop could not be confirmed in time may still run its request: the job
  ``quarantine``s it instead of releasing it. It is then in no one's hands and out of the
  grants, and ``capacity`` (the permits there are) counts it down, until the job sees it
  idle and calls ``unquarantine`` (slot ids stay 0..``total`` - 1). ``closing`` is set at
  ``close``: such a job stops watching then.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterable

from llmproxy.proxy.errors import SUPERSEDED, ProxyError, QueueFull, ShuttingDown, Superseded
from llmproxy.proxy.gating.slots import Slots
from llmproxy.proxy.gating.ticket import Ticket as Ticket  # upstream/ imports it from here
from llmproxy.proxy.gating.waitlist import WaitList
from llmproxy.proxy.twins import twins


class Gate:
    def __init__(
        self,
        capacity: int,
        max_queue: int,
        *,
        retry_after_s: int = 1,
        affinity_wait_s: float = 0.0,
        hold_s: float = 0.0,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.max_queue, self.retry_after_s = max_queue, retry_after_s
        self.affinity_wait_s = affinity_wait_s
        self._slots = Slots(capacity)
        self.closing = asyncio.Event()  # set by close()
        self._queue: WaitList[Ticket] = WaitList(hold_s, max_queue)
        self._inflight: dict[int, Ticket] = {}  # ticket id -> ticket (granted/running/stopping)
        self._ids = itertools.count(1)
        self._closed = False
        self._idle = asyncio.Event()
        self._idle.set()
        self.on_advance: Callable[[], None] | None = None  # after permits came back (pool.py)

    # -- observation --------------------------------------------------------------
    @property
    def total(self) -> int:
        """Slot ids are 0..total - 1, quarantined ones included."""
        return self._slots.total

    @property
    def capacity(self) -> int:
        """Permits there are: the slots, less those quarantined."""
        return self._slots.capacity

    @property
    def quarantined(self) -> list[int]:
        """Slots kept out of the grants until they are seen idle (see the module's contract)."""
        return sorted(self._slots.quarantined)

    @property
    def free(self) -> int:
        return len(self._slots.free)

    @property
    def held(self) -> int:
        """Permits held (a request on several slots holds several)."""
        return self.capacity - len(self._slots.free)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def inflight(self) -> int:
        """Requests holding permits (granted, running or being stopped)."""
        return len(self._inflight)

    def queue_snapshot(self) -> list[Ticket]:
        return list(self._queue)

    def places(self) -> list[tuple[str, Ticket | None]]:
        """The queue in order, live holds included (WaitList.places); read-only."""
        return self._queue.places()

    def inflight_snapshot(self) -> list[Ticket]:
        return list(self._inflight.values())

    async def wait_quiescent(self) -> None:
        """Return once no ticket is queued or holds a permit."""
        await self._idle.wait()

    # -- the protocol ---------------------------------------------------------------
    def submit(
        self,
        session: str,
        *,
        supersedable: bool,
        route: str = "",
        permits: int = 1,
        sizer: Callable[[int], int] | None = None,
        supersedes: bool | None = None,
        first: bool = False,
        twin: str | None = None,
    ) -> Ticket:
        """Admit a new request (never blocks). Admission is decided first; only an admitted
        newcomer supersedes anything, so a 429 never costs the session its running request.

        ``permits``: how many slots the request runs on at once (1 to ``total``; the
        handler answers 400 above that, as the upstream would). ``sizer``: if the ticket has
        to wait, its count is asked again when it reaches the head of the queue (see the
        module's contract). ``supersedes`` (default ``supersedable``): it supersedes the
        session's other requests here (a pool of upstreams did that already). ``first``: it
        waits at the head of the queue, not its tail (a keystroke that waited on its
        session's generation already, type-through); the queue's bound does not refuse it.
        ``twin``: its body's twin key (proxy/twins.py); the session's tickets with the same
        key are its twins, which it leaves alone."""
        if not 1 <= permits <= self.total:
            raise ValueError(f"permits must be 1..{self.total}, got {permits}")
        if self._closed:
            raise ShuttingDown("llmproxy is shutting down")
        placed, replaced = self._queue.place_of(session, twin) if supersedable else (False, None)
        grant_now = replaced is None and self.free >= permits and not self._queue
        if replaced is None and not grant_now and not first and len(self._queue) >= self.max_queue:
            retry = {"Retry-After": str(self.retry_after_s)}
            raise QueueFull(f"queue full ({self.max_queue} waiting)", headers=retry)
        future = asyncio.get_running_loop().create_future()
        ticket = Ticket(next(self._ids), session, supersedable, route, future, permits, sizer, twin)
        self._idle.clear()
        if supersedable if supersedes is None else supersedes:
            self.supersede_inflight(session, twin)
        if grant_now and not self._waits_for_its_slot(ticket):
            if placed:
                self._queue.drop_hold(session)
            self._grant(ticket)
        elif placed:
            rivals = self._queue.rivals(session, twin)  # all superseded
            self._queue.take_place(session, ticket, twin)  # the first one's place (or a hold's)
            for rival in rivals:
                if rival is not replaced:
                    self._queue.discard(rival)
                rival.end(Superseded(SUPERSEDED))
            self._grant_waiters()  # the newcomer may need fewer permits than those it replaced
        elif first:
            self._queue.push_front(ticket)
        else:
            self._queue.append(ticket)
        return ticket

    def supersede_queued(self, session: str, twin: str | None = None) -> None:
        """End the session's supersedable tickets waiting here that are not twins of a
        newcomer with key ``twin`` (a pool placed it elsewhere)."""
        if self._end_rivals(session, twin):
            self._advance()

    def supersede_inflight(self, session: str, twin: str | None = None) -> None:
        """Ask the session's supersedable requests holding permits here to stop, but for
        twins of a newcomer with key ``twin``."""
        for old in list(self._inflight.values()):
            if old.supersedable and old.session == session and not twins(old.twin, twin):
                if old.state == "granted":
                    old.superseded = True  # take() refuses it: it never reaches upstream
                elif old.on_supersede is not None:
                    old.on_supersede()

    def take(self, ticket: Ticket, on_supersede: Callable[[], None] | None = None) -> int:
        """The upstream job takes ownership of a granted permit (Superseded if replaced
        meanwhile)."""
        assert ticket.state == "granted" and ticket.slot is not None, ticket.state
        if ticket.superseded:
            self.release(ticket)
            raise Superseded(SUPERSEDED)
        ticket.state = "running"
        ticket.on_supersede = on_supersede
        return ticket.slot

    def settle_extras(self, ticket: Ticket, pinned: Callable[[Ticket], bool]) -> set[int]:
        """Before a wide ticket's request is sent: see ``Slots.settle_extras``."""
        if len(ticket.slots) < 2 or ticket.state != "running":
            self._slots.settled(ticket)
            return set()
        return self._slots.settle_extras(ticket, self._inflight.values(), pinned)

    def settled(self, ticket: Ticket) -> None:
        """The settling ticket's request was sent (or given up): its slots are fixed now."""
        self._slots.settled(ticket)

    def mark_stopping(self, ticket: Ticket) -> None:
        if ticket.state == "running":
            ticket.state = "stopping"

    def abandon(self, ticket: Ticket) -> None:
        """The waiter gave up (disconnect/timeout): leave the queue or return an untaken permit."""
        if ticket.state == "queued":
            self._queue.remove(ticket)  # a supersedable one leaves a hold (see waitlist.py)
            ticket.state = "done"
            if not ticket.future.done():
                ticket.future.cancel()
            self._advance()  # a wide head leaving may let the next waiters through
        elif ticket.state == "granted":
            self.release(ticket)

    def release(self, ticket: Ticket) -> None:
        """Return the ticket's permits; only once the upstream is idle for it."""
        self.quarantine(ticket, ())

    def quarantine(self, ticket: Ticket, slots: Iterable[int]) -> None:
        """End the ticket like ``release``, except that ``slots`` (of its own) may still be
        busy upstream: they stay out of the grants until ``unquarantine``."""
        if ticket.state not in ("granted", "running", "stopping"):
            return
        assert ticket.slots
        del self._inflight[ticket.id]
        self._slots.settled(ticket)
        ticket.state = "done"
        ticket.on_supersede = None
        kept = set(slots) & set(ticket.slots)
        self._slots.quarantine(kept)
        self._slots.put([s for s in ticket.slots if s not in kept])
        self._advance()

    def unquarantine(self, slot: int) -> None:
        """A quarantined slot was seen idle: a permit again."""
        if self._slots.unquarantine(slot):
            self._advance()

    def _advance(self) -> None:
        """Grant what the waiters can get now (after slots were put back, settling tickets
        picked first: see ``Slots.put``)."""
        self._grant_waiters()
        self._check_idle()
        if self.on_advance is not None:
            self.on_advance()  # a pool's queue may place its head here now

    def grow(self, capacity: int) -> None:
        """More slots (ids up to ``capacity`` - 1): the upstream's slot count became known
        after start (see watch.py). Waiters get them at once, in FIFO order; never shrinks."""
        if self._slots.grow(capacity):
            self._advance()

    def close(self) -> None:
        """Shutdown: refuse new tickets and answer every queued one with ShuttingDown."""
        self._closed = True
        self.closing.set()
        for t in self._queue.clear():
            t.end(ShuttingDown("llmproxy is shutting down"))
        self._check_idle()

    # -- internals ----------------------------------------------------------------------
    def _grant_waiters(self) -> None:
        """Hand free permits to waiters in FIFO order.

        The head's permit count is its ``sizer``'s answer now, if it has one.
        Cancelling a task that awaits ``Ticket.wait`` cancels the ticket's future at once,
        while its ``abandon`` runs only when that task resumes; such tickets are dropped
        here (state "done", so the later ``abandon`` is a no-op), never granted.
        """
        while (ticket := self._queue.head()) is not None:
            if ticket.future.done():
                self._queue.remove(ticket)  # its waiter left: as ``abandon`` would
                ticket.state = "done"
                continue
            if ticket.sizer is not None:
                try:
                    ticket.permits = ticket.sizer(self.total)
                except ProxyError as exc:  # cannot run here any more (too wide for this upstream)
                    self._queue.discard(ticket)
                    ticket.end(exc)
                    continue
            if self.free < ticket.permits or self._waits_for_its_slot(ticket):
                return  # strict FIFO: nobody overtakes the head
            self._queue.discard(ticket)
            self._grant(ticket)

    def _end_rivals(self, session: str, twin: str | None) -> bool:
        """End the session's queued tickets that a newcomer with key ``twin`` supersedes
        (their places go with them); whether there were any."""
        rivals = self._queue.rivals(session, twin)
        for rival in rivals:
            self._queue.discard(rival)
            rival.end(Superseded(SUPERSEDED))
        return bool(rivals)

    def _waits_for_its_slot(self, ticket: Ticket) -> bool:
        return self._slots.waits_for_affinity(
            ticket, self._inflight.values(), self.affinity_wait_s, self._advance
        )

    def _grant(self, ticket: Ticket) -> None:
        ticket.slots = self._slots.take(ticket.session, ticket.permits)
        ticket.slot = slot = ticket.slots[0]
        ticket.state = "granted"
        ticket.granted_at = time.monotonic()
        self._inflight[ticket.id] = ticket
        ticket.future.set_result(slot)

    def _check_idle(self) -> None:
        if not self._queue and not self._inflight:
            self._idle.set()
