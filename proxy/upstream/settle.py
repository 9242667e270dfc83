"""Settling the slots of a request on several of them before it is sent (llama-server).

An ``n_cmpl`` request's extra completions, and an embeddings or rerank request's tasks, run
on the lowest idle slots at llama-server, which the proxy cannot pin. ``settle`` makes the
server's choice the gate's: it takes lower free permits in exchange (``Gate.settle_extras``)
and waits, looking at the upstream's slots (``Adapter.busy_map``) for at most
``settle_timeout_s``, until every lower slot another request runs on is busy at the server.
A request granted just before this one but not there yet (a large body still on its way)
would otherwise lose its slot to an extra completion or an embeddings task and wait in the
server's queue. A look that finds them busy is trusted only if nothing changed in the gate
meanwhile. What is left is a narrower race (a lower slot freed and granted again between
``settle`` and the arrival): the count of generations still never exceeds the permits; only
that other request waits in the server.

Concurrency contract: runs in the job's transfer scope and is cancelled with it; a refused
connection (the server is down) ends the wait at once; on an upstream that lists its
slots, the gate hears ``settled`` however it ends.
"""

from __future__ import annotations

import asyncio

from llmproxy.proxy.gating.gate import Gate
from llmproxy.proxy.gating.routes import SLOT_ROUTES
from llmproxy.proxy.gating.ticket import Ticket
from llmproxy.proxy.upstream.adapters.base import Adapter, log


def _pinned(ticket: Ticket) -> bool:
    """Does the request run on the slot its permit names (``id_slot``)?"""
    return ticket.route in SLOT_ROUTES


async def settle(gate: Gate, ticket: Ticket, adapter: Adapter) -> None:
    """Settle ``ticket``'s slots on ``adapter``'s upstream (see the module's docstring);
    nothing to do on an upstream that does not list its slots."""
    if not adapter.lists_slots:
        return
    s = adapter.settings
    try:
        watch = gate.settle_extras(ticket, _pinned)
        if not watch or not adapter.can_confirm or s.settle_timeout_s <= 0:
            return
        interval = s.confirm_poll_min_s
        async with asyncio.timeout(s.settle_timeout_s):
            while True:
                before = (ticket.slots, watch)
                busy = await adapter.busy_map()
                if busy == "down":
                    return
                watch = gate.settle_extras(ticket, _pinned)
                if not watch:
                    return
                if (
                    isinstance(busy, dict)
                    and all(busy.get(slot) for slot in watch)
                    and (ticket.slots, watch) == before
                ):
                    return
                await asyncio.sleep(interval)
                interval = min(interval * 2, s.confirm_poll_max_s)
    except TimeoutError:
        log.warning(
            "sending a request on several slots before the lower slots held by others "
            "were busy: an extra completion may take one of them",
            slots=list(ticket.slots),
        )
    finally:
        gate.settled(ticket)
