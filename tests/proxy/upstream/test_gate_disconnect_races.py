"""Clients that leave while their request waits in the scheduler's queue (pool/pool.py), in
the same loop iteration as its grant or as a newer request from the same session: no
InvalidStateError (which would be a 500), every permit back, nothing left queued.
"""

from __future__ import annotations

import asyncio

import aiohttp

from tests.helpers.scheduler import make_pool, submit


async def test_two_clients_leaving_at_once_while_one_is_granted(
    http: aiohttp.ClientSession,
) -> None:
    pool, (member,) = make_pool(http, [1], max_queue=10)
    gate = member.gate
    running = submit(pool, "busy", supersedable=False)
    gate.take(running.ticket)
    e1, e2 = submit(pool, "a", supersedable=False), submit(pool, "b", supersedable=False)
    # what the handlers do with an entry (pooled.py): wait for its grant, abandon on cancel
    w1 = asyncio.create_task(pool.acquire(e1, 10))
    w2 = asyncio.create_task(pool.acquire(e2, 10))
    await asyncio.sleep(0)  # both wait in the queue
    gate.release(running.ticket)  # e1 granted; its task will resume with the slot...
    assert e1.future.done() and not e2.future.done()
    w1.cancel()  # ...but both clients disconnect in this same loop iteration
    w2.cancel()
    results = await asyncio.gather(w1, w2, return_exceptions=True)
    for r in results:
        if isinstance(r, asyncio.InvalidStateError):
            raise r
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    assert gate.free == 1 and len(pool.queue) == 0
    await asyncio.wait_for(pool.wait_quiescent(), 1)


async def test_supersede_of_a_queued_request_whose_client_just_left(
    http: aiohttp.ClientSession,
) -> None:
    pool, (member,) = make_pool(http, [1], max_queue=10)
    member.gate.take(submit(pool, "busy", supersedable=False).ticket)
    old = submit(pool, "editor", "def f")
    w_old = asyncio.create_task(pool.acquire(old, 10))
    await asyncio.sleep(0)
    w_old.cancel()  # the editor aborts its request (future cancelled now, abandon runs later)...
    new = submit(pool, "editor", "def fo")  # ...and its next keystroke arrives first
    assert list(pool.queue) == [new]
    results = await asyncio.gather(w_old, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    assert list(pool.queue) == [new]
