"""Room: may a waiting request be granted on an upstream now? One rule for the grant
(grant.py, which the router asks through ``Request.room``) and for admission's prediction
of it (admission.py ``Limits``: ``max_queued`` lets in a request that runs now), so the
two never differ.

A request has room on an upstream when:

- it fits there: the permits it needs there (``sized``, asked of that upstream's adapter
  in force now) are a count, not a ``BadRequest``, and that many are free;
- with classes on, it leaves the upstream's reserve for completions (order.py
  ``within_reserve``), and with ``preempt`` ``solo`` a chat or bulk request does not
  start beside a completion that lived ``preempt_after_ms`` (order.py
  ``beside_completion``);
- its grant would not make a router unload a model that runs requests (models.py
  ``may_load``);
- it need not wait for its session's slot being stopped there (the gate's
  ``waits_for_its_slot``).

A caller at its key's ``max_inflight`` is no matter of room: the queue's order passes
over its waiters (order.py ``head``), and admission's prediction asks that first.

A policy over the upstreams' gates and adapters. It changes only the request's ticket:
its ``permits`` become those it needs on the upstream asked about last that passed every
check but the slot wait (the gate reads them), and the gate may arm its slot wait's timer
(``on_advance`` when the wait is over). Event loop thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from llmproxy.proxy.errors import BadRequest
from llmproxy.proxy.gating.ticket import Ticket
from llmproxy.proxy.pool.member import Member
from llmproxy.proxy.pool.models import may_load
from llmproxy.proxy.pool.order import Order

#: the permits a request needs on each upstream, by the member's id() (a BadRequest: it
#: cannot run there)
Sized = Mapping[int, int | BadRequest]


def has_room(
    m: Member, ticket: Ticket, sized: Sized, members: Sequence[Member], order: Order | None
) -> bool:
    """Can ``ticket`` be granted on ``m`` now (see the module's docstring)? ``members``: the
    pool's (a router's other models); ``order``: whose reserve it leaves (None: classes
    off)."""
    n = sized.get(id(m))
    if not isinstance(n, int) or m.gate.free < n:
        return False
    if order is not None and not order.within_reserve(m, ticket.klass, n):
        return False
    if order is not None and order.beside_completion(m, ticket):
        return False
    if not may_load(m, members):  # a router's load cuts no generation
        return False
    ticket.permits = n
    return not m.gate.waits_for_its_slot(ticket)


def rule(
    ticket: Ticket, sized: Sized, members: Sequence[Member], order: Order | None
) -> Callable[[Member], bool]:
    """``has_room`` for ``ticket``, as the router asks it (``Request.room``)."""

    def room(m: Member) -> bool:
        return has_room(m, ticket, sized, members, order)

    return room
