"""Clients that leave while their request waits in the gate's queue, in the same loop
iteration as its grant or as a newer request from the same session: no InvalidStateError
(which would be a 500), every permit back, nothing left queued.
"""

from __future__ import annotations

import asyncio

from llmproxy.proxy.gating.gate import Gate
from llmproxy.proxy.gating.ticket import Ticket


async def _waiter(gate: Gate, ticket: Ticket) -> int:
    """What handlers._wait_for_permit does with a ticket."""
    try:
        return await ticket.wait()
    except asyncio.CancelledError:
        gate.abandon(ticket)
        raise


async def test_two_clients_leaving_at_once_while_one_is_granted() -> None:
    gate = Gate(capacity=1, max_queue=10)
    running = gate.submit("busy", supersedable=False)
    gate.take(running)
    t1, t2 = gate.submit("a", supersedable=False), gate.submit("b", supersedable=False)
    w1, w2 = asyncio.create_task(_waiter(gate, t1)), asyncio.create_task(_waiter(gate, t2))
    await asyncio.sleep(0)  # both wait in the queue
    gate.release(running)  # t1 granted; its task will resume with the slot...
    w1.cancel()  # ...but both clients disconnect in this same loop iteration
    w2.cancel()
    results = await asyncio.gather(w1, w2, return_exceptions=True)
    for r in results:
        if isinstance(r, asyncio.InvalidStateError):
            raise r
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    assert gate.free == 1 and gate.queued == 0


async def test_supersede_of_a_queued_request_whose_client_just_left() -> None:
    gate = Gate(capacity=1, max_queue=10)
    gate.take(gate.submit("busy", supersedable=False))
    old = gate.submit("editor", supersedable=True)
    w_old = asyncio.create_task(_waiter(gate, old))
    await asyncio.sleep(0)
    w_old.cancel()  # the editor aborts its request (future cancelled now, abandon runs later)...
    new = gate.submit("editor", supersedable=True)  # ...and its next keystroke arrives first
    assert gate.queue_snapshot() == [new]
    await asyncio.gather(w_old, return_exceptions=True)
