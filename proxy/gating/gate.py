"""An upstream's gate: its permits (= its slots) and the requests that hold them.

No queue and no order between requests: the scheduler (pool/pool.py, the one admission
path, with one upstream or several) owns both and asks the gate of the upstream it
places a request on to ``grant`` at once. Pure asyncio logic, no sockets. Contract:

- ``grant`` never blocks: the caller checked ``free`` (and ``waits_for_its_slot``). A
  grant prefers the slot the session used last when it is free (prompt-cache affinity);
  a wide ticket (``permits`` > 1: llama-server's ``n_cmpl``) gets that one first and the
  lowest free ids as its extras, the ones llama-server gives a request's extra
  completions. Until its job has sent it, ``settle_extras`` may trade those for lower
  slots freed meanwhile (the job's adapter owns that wait; ``settled`` ends it); from then
  until it ends, a slot below its highest extra that comes back is held for it too
  (``Slots.settled``: the server may have put an extra completion there). An unpinned
  ticket (embeddings, rerank: the server runs them on its lowest idle slots) gets the
  lowest free ids, and all of them are extras, settled the same way.
- ``waits_for_its_slot``: when the slot a session used last is being stopped for the
  session's superseded request, its next request should wait for it, at most
  ``affinity_wait_s`` from admission, so it finds its prompt in that slot's cache; the
  gate calls ``on_advance`` when that wait is over.
- Once a permit is taken (``take``), the ticket belongs to an upstream job task; only that
  job calls ``release``, and only after the upstream is known idle. No client-side event
  releases a permit. A waiter that leaves between grant and take calls ``abandon``.
- ``supersede_inflight`` asks the session's requests holding permits here to stop (the
  job decides by policy); a granted one not taken yet is refused at ``take``.
- A slot whose stop could not be confirmed in time may still run its request: the job
  releases the ticket with that slot quarantined (``release(ticket, quarantine=...)``).
  It is then in no one's hands and out of the grants, and ``capacity`` counts it down,
  until the job sees it idle and calls ``unquarantine`` (slot ids stay 0..``total`` - 1).
  ``closing`` is set at ``close``: such a job stops watching then.
- ``wait_quiescent`` returns once no permit is held and no slot is quarantined: only then
  may the upstream's client and adapter be closed (a reload's drain, pool/lifecycle.py).
- ``on_advance`` is called whenever permits come back or grow (the scheduler's
  ``advance``); it must not call back into the gate synchronously in a way that recurses
  (the scheduler guards its own re-entry).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

from llmproxy.proxy.errors import SUPERSEDED, Superseded
from llmproxy.proxy.gating.routes import SLOT_ROUTES
from llmproxy.proxy.gating.slots import Slots
from llmproxy.proxy.gating.ticket import Ticket as Ticket  # upstream/ imports it from here
from llmproxy.proxy.twins import twins


class Gate:
    def __init__(self, capacity: int, *, affinity_wait_s: float = 0.0) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.affinity_wait_s = affinity_wait_s
        self._slots = Slots(capacity)
        self.closing = asyncio.Event()  # set by close()
        self._inflight: dict[int, Ticket] = {}  # ticket id -> ticket (granted/running/stopping)
        self._idle = asyncio.Event()
        self._idle.set()
        self.on_advance: Callable[[], None] | None = None  # permits came back (the scheduler)

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
    def inflight(self) -> int:
        """Requests holding permits (granted, running or being stopped)."""
        return len(self._inflight)

    @property
    def quiescent(self) -> bool:
        return not self._inflight and not self._slots.quarantined

    def inflight_snapshot(self) -> list[Ticket]:
        return list(self._inflight.values())

    async def wait_quiescent(self) -> None:
        """Return once no ticket holds a permit and no slot is quarantined."""
        await self._idle.wait()

    # -- the protocol ---------------------------------------------------------------
    def waits_for_its_slot(self, ticket: Ticket) -> bool:
        """Should ``ticket`` wait for the slot its session is being stopped on here (see the
        module's contract)? ``on_advance`` is called when that wait is over."""
        return self._slots.waits_for_affinity(
            ticket, self._inflight.values(), self.affinity_wait_s, self._advance
        )

    def grant(self, ticket: Ticket) -> None:
        """Give ``ticket`` its ``permits`` now (the caller checked ``free``)."""
        assert ticket.state == "queued" and 1 <= ticket.permits <= self.free, (
            ticket.state,
            ticket.permits,
            self.free,
        )
        pinned = ticket.route in SLOT_ROUTES
        ticket.slots = self._slots.take(ticket.session, ticket.permits, pinned)
        ticket.slot = slot = ticket.slots[0]
        ticket.state = "granted"
        ticket.granted_at = time.monotonic()
        ticket.waited_s += ticket.granted_at - ticket.queued_at
        self._inflight[ticket.id] = ticket
        self._idle.clear()
        if not ticket.future.done():
            ticket.future.set_result(slot)

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
        """Before a request is sent: see ``Slots.settle_extras`` (nothing to settle for a
        ticket the server runs on the one slot it names)."""
        if (len(ticket.slots) < 2 and pinned(ticket)) or ticket.state != "running":
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
        """The waiter gave up after the grant, before its job took the permit: it goes back."""
        if ticket.state == "granted":
            self.release(ticket)

    def release(self, ticket: Ticket, quarantine: Iterable[int] = ()) -> None:
        """End the ticket and return its permits, only once the upstream is idle for it;
        ``quarantine``: those of its slots that may still be busy upstream (a stop not
        confirmed in time), which stay out of the grants until ``unquarantine``."""
        if ticket.state not in ("granted", "running", "stopping"):
            return
        assert ticket.slots
        del self._inflight[ticket.id]
        self._slots.ended(ticket)
        ticket.state = "done"
        ticket.on_supersede = ticket.on_preempt = None
        kept = set(quarantine) & set(ticket.slots)
        self._slots.quarantine(kept)
        self._slots.put([s for s in ticket.slots if s not in kept])
        self._advance()

    def unquarantine(self, slot: int) -> None:
        """A quarantined slot was seen idle: a permit again."""
        if self._slots.unquarantine(slot):
            self._advance()

    def grow(self, capacity: int) -> None:
        """More slots (ids up to ``capacity`` - 1): the upstream's slot count became known
        after start, or a reload raised its capacity. Never shrinks."""
        if self._slots.grow(capacity):
            self._advance()

    def forget_affinity(self) -> None:
        """The upstream lost its prompt caches (a router unloaded the model): grants stop
        preferring a session's last slot until it is granted again."""
        self._slots.forget_affinity()

    def close(self) -> None:
        """Shutdown: quarantine watchers stop watching."""
        self.closing.set()

    # -- internals ----------------------------------------------------------------------
    def _advance(self) -> None:
        if self.quiescent:
            self._idle.set()
        if self.on_advance is not None:
            self.on_advance()
