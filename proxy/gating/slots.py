"""The gate's slot pool: which slot ids are free or quarantined, and which slots a grant gets.

Bookkeeping only: no waiting and no order between requests (the gate owns both; an
affinity wait only arms a loop timer that wakes the gate), no locks (the event loop's
thread only). Slot ids are 0..``total`` - 1; at any time each one is
free, quarantined, or held by exactly one ticket (the pool tracks the first two). A ticket
being settled (``settle`` .. ``settled``, see ``Gate.settle_extras``) gets the first pick
of slots put back meanwhile: its extras become the lowest of its own and the free ones;
sent before others that settle still, it takes the lowest of its extras and theirs.
A ticket's extras are the slots the server picks for it, the lowest idle ones: all but the
first of a request pinned to its first slot by ``id_slot`` (``SLOT_ROUTES``), all of an
unpinned one (embeddings, rerank).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from llmproxy.proxy.gating.routes import SLOT_ROUTES
from llmproxy.proxy.gating.ticket import Ticket

_AFFINITY_MAX = 4096  # sessions whose last slot is remembered (least recently granted dropped)


class Slots:
    def __init__(self, total: int) -> None:
        self.total = total
        self.free: list[int] = list(range(total))
        self.quarantined: set[int] = set()
        self._affinity: OrderedDict[str, int] = OrderedDict()
        self._settling: dict[int, Ticket] = {}  # ticket id -> wide ticket about to be sent
        self._sent: dict[int, Ticket] = {}  # ticket id -> ticket with extras sent, running

    @property
    def capacity(self) -> int:
        """Permits there are: the slots, less those quarantined."""
        return self.total - len(self.quarantined)

    def forget_affinity(self) -> None:
        """The upstream's prompt caches are gone (a router unloaded the model): no session's
        last slot holds its prompt any more."""
        self._affinity.clear()

    def take(self, session: str, permits: int, pinned: bool = True) -> tuple[int, ...]:
        """Take ``permits`` free slots (the caller checked there are that many), first slot
        first: for a request the server runs on the slot it names (``pinned``), the one
        ``session`` was granted last if it is free (prompt-cache affinity), else the lowest;
        the others are the lowest free ids, where llama-server puts a request's extra
        completions. An unpinned request (embeddings: the server runs it on idle slots of
        its choosing, the lowest) gets the lowest, and leaves the session's slot as it was."""
        preferred = self._affinity.get(session) if pinned else None
        self.free.sort()
        if preferred is not None and preferred in self.free:
            self.free.remove(preferred)
            slot = preferred
        else:
            slot = self.free.pop(0)
        extra = self.free[: permits - 1]
        del self.free[: permits - 1]
        if pinned:
            self._affinity[session] = slot
            self._affinity.move_to_end(session)
            if len(self._affinity) > _AFFINITY_MAX:
                self._affinity.popitem(last=False)
        return (slot, *extra)

    def waits_for_affinity(
        self, ticket: Ticket, inflight: Iterable[Ticket], wait_s: float, wake: Callable[[], None]
    ) -> bool:
        """Should ``ticket`` wait for the slot its session was granted last, which the
        session's superseded request is being stopped on? At most ``wait_s`` from the
        ticket's admission; ``wake`` is called when that time is up."""
        slot = self._affinity.get(ticket.session)
        if ticket.permits != 1 or slot is None or slot in self.free:
            return False
        left = ticket.created + wait_s - time.monotonic()
        stopping = any(
            t.state == "stopping" and t.session == ticket.session and slot in t.slots
            for t in inflight
        )
        if not stopping or left <= 0 or ticket.affinity_waited:
            return False
        if ticket.affinity_timer is None:

            def expire() -> None:
                # the loop's clock may run a little behind time.monotonic (uvloop keeps
                # milliseconds): once the timer fires the wait is over, whatever ``left`` says
                ticket.affinity_waited = True
                wake()

            ticket.affinity_timer = asyncio.get_running_loop().call_later(left, expire)
        return True

    def settle_extras(
        self, ticket: Ticket, inflight: Iterable[Ticket], pinned: Callable[[Ticket], bool]
    ) -> set[int]:
        """A ``ticket`` with extras (a wide one, or an unpinned one) about to be sent: its
        extras become the lowest among them and the free ones (a free permit is an idle
        slot, and llama-server puts extra completions, and embeddings, on the lowest idle
        slots), and until ``settled`` it gets the first pick of slots freed meanwhile (so
        two tickets settling at once never wait on each other: the later one's slots are
        all above the earlier one's extras). Returns the slots below its highest extra that
        other requests of ``inflight`` hold and the server runs there: ``pinned`` ones (on
        their own slot), and unpinned ones already sent (settled on their slots). Each must
        be busy at the server before the send, or the server, seeing it idle, would put an
        extra completion (an embeddings task) there."""
        self.settle(ticket)
        top = max(_extras(ticket))
        mine = set(ticket.slots)
        return {
            s
            for t in inflight
            if t is not ticket and (pinned(t) or t.id in self._sent)
            for s in t.slots
            if s < top and s not in mine
        }

    def settle(self, ticket: Ticket) -> None:
        """``ticket`` (holding several slots) lowers its extras now and whenever slots are
        put back, until ``settled``."""
        self._settling[ticket.id] = ticket
        self._lower_extras(ticket)

    def settled(self, ticket: Ticket) -> None:
        """The settling ticket was sent (or given up): its extras are fixed, but until it
        ends (``ended``) a slot below its highest extra put back is held for it too: the
        server, seeing that slot idle before the request arrived, may have put an extra
        completion there instead of where the gate put it. Held one permit too many for a
        while, never a slot granted twice.

        Sent before tickets that settle still (their slots idle at the server until they
        are sent), it takes the lowest of its extras and theirs, as the server will: an
        earlier one, with lower extras, may have waited longer (its own wait, or its poll
        of the slots came later); they get the others, oldest first, and, once their turn
        comes, wait for its slots below theirs to be busy (``settle_extras``)."""
        if self._settling.pop(ticket.id, None) is not None:
            self._before_settling(ticket)
            self._sent[ticket.id] = ticket

    def ended(self, ticket: Ticket) -> None:
        """The ticket's permits are coming back: no more slots are held for it."""
        self._settling.pop(ticket.id, None)
        self._sent.pop(ticket.id, None)

    def _before_settling(self, ticket: Ticket) -> None:
        """``ticket``, sent, takes the lowest of its extras and those of the tickets settling
        still; they get the others (see ``settled``)."""
        others = [t for t in self._settling.values() if _extras(t)]
        if not others:
            return
        pool = sorted([*_extras(ticket), *(s for t in others for s in _extras(t))])
        for t in (ticket, *others):
            extras = _extras(t)
            fixed = t.slots[: len(t.slots) - len(extras)]
            t.slots = (*fixed, *pool[: len(extras)])
            del pool[: len(extras)]

    def _lower_extras(self, ticket: Ticket) -> None:
        """Trade the ticket's extras for the lowest ids among them and the free slots; the
        ones given up are free again."""
        extras = _extras(ticket)
        fixed = ticket.slots[: len(ticket.slots) - len(extras)]
        pool = sorted([*self.free, *extras])
        lowest, self.free = pool[: len(extras)], pool[len(extras) :]
        ticket.slots = (*fixed, *lowest)

    def put(self, slots: Iterable[int]) -> None:
        """Held slots are free again (a sent ticket with extras holds those below its
        highest extra, see ``settled``; then settling tickets pick first, oldest first)."""
        back = list(slots)
        for ticket in self._sent.values():
            top = max(_extras(ticket))
            kept = [s for s in back if s < top]
            if kept:
                ticket.slots = (*ticket.slots, *kept)
                back = [s for s in back if s >= top]
        self.free.extend(back)
        for ticket in self._settling.values():
            self._lower_extras(ticket)

    def quarantine(self, slots: Iterable[int]) -> None:
        """Held slots leave the pool until ``unquarantine``."""
        self.quarantined |= set(slots)

    def unquarantine(self, slot: int) -> bool:
        """A quarantined slot is free again (as ``put``); False if it was not quarantined."""
        if slot not in self.quarantined:
            return False
        self.quarantined.discard(slot)
        self.put([slot])
        return True

    def grow(self, total: int) -> bool:
        """New free slots up to ``total`` - 1; False (and nothing changes) if not more."""
        if total <= self.total:
            return False
        self.free.extend(range(self.total, total))
        self.total = total
        return True


def _extras(ticket: Ticket) -> tuple[int, ...]:
    """The slots of ``ticket`` the server picks (see the module's docstring)."""
    return ticket.slots[1:] if ticket.route in SLOT_ROUTES else ticket.slots
