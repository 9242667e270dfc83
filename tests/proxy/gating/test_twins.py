"""Twins in the scheduler's queue and at the gates, without sockets: a session's requests
with equal bodies (proxy/twins.py) never supersede one another; a different one supersedes
them all."""

from __future__ import annotations

import aiohttp
import pytest

from llmproxy.proxy.errors import Superseded
from llmproxy.proxy.gating.gate import Gate
from llmproxy.proxy.pool.entry import Entry
from llmproxy.proxy.pool.pool import Pool
from llmproxy.proxy.twins import twin_key, twins
from tests.helpers.scheduler import granted_slot, make_pool
from tests.helpers.scheduler import submit as submit_to

ROUTE = "/v1/completions"
BODY = {"model": "PLACEHOLDER", "prompt": "<|fim_prefix|>def f", "max_tokens": 56, "stream": True}
NEWER = {**BODY, "prompt": "<|fim_prefix|>def fo"}
K = twin_key(ROUTE, BODY)
OTHER = twin_key(ROUTE, NEWER)


def test_the_key_is_the_body_less_what_the_proxy_sets() -> None:
    assert K is not None and twins(K, twin_key(ROUTE, dict(reversed(BODY.items()))))
    assert twins(K, twin_key(ROUTE, {**BODY, "id_slot": 0}))  # the proxy's field
    assert not twins(K, OTHER)
    assert not twins(K, twin_key("/completions", BODY))  # another route
    assert not twins(K, twin_key(ROUTE, {**BODY, "stream": False}))
    assert twin_key(ROUTE, ["not", "an", "object"]) is None
    assert not twins(None, None)  # a body that is no object has no twins


def one(http: aiohttp.ClientSession, capacity: int) -> tuple[Pool, Gate]:
    """A pool of one upstream with ``capacity`` slots."""
    pool, (member,) = make_pool(http, [capacity], max_queue=8)
    return pool, member.gate


def submit(pool: Pool, session: str, body: object, *, supersedable: bool = True) -> Entry:
    """A request of ``session`` on ``ROUTE`` with ``body`` (its twin key is the pool's)."""
    return submit_to(pool, session, supersedable=supersedable, route=ROUTE, parsed=body)


def stops(gate: Gate, entry: Entry, asked: list[int]) -> None:
    """Take ``entry``'s permit as its job does, noting when it is asked to stop."""
    gate.take(entry.ticket, on_supersede=lambda: asked.append(entry.id))


@pytest.mark.parametrize("n", [2, 3])
async def test_twins_in_flight_run_side_by_side_until_a_different_request(
    http: aiohttp.ClientSession, n: int
) -> None:
    pool, gate = one(http, 3)
    asked: list[int] = []
    entries = [submit(pool, "minuet", BODY) for _ in range(n)]
    assert all(e.twin == K for e in entries)
    assert sorted([await granted_slot(pool, e) for e in entries]) == list(range(n))  # a permit each
    for e in entries:
        stops(gate, e, asked)
    assert asked == []  # none stopped another
    newer = submit(pool, "minuet", NEWER)
    assert newer.twin == OTHER
    assert sorted(asked) == sorted(e.id for e in entries)  # all of them, together
    if n < 3:
        assert await granted_slot(pool, newer) == n  # the slot left free
    else:
        assert not newer.future.done()  # it waits for theirs (being stopped)


async def test_queued_twins_keep_their_places_and_a_different_request_takes_the_first(
    http: aiohttp.ClientSession,
) -> None:
    pool, gate = one(http, 1)
    running = submit(pool, "other", {"prompt": "x"}, supersedable=False)
    first = submit(pool, "minuet", BODY)
    between = submit(pool, "other", {"prompt": "y"})
    second = submit(pool, "minuet", BODY)
    third = submit(pool, "minuet", BODY)
    assert list(pool.queue) == [first, between, second, third]  # queued as any request
    newer = submit(pool, "minuet", NEWER)
    for twin in (first, second, third):
        with pytest.raises(Superseded):
            await pool.acquire(twin, 1)
    assert list(pool.queue) == [newer, between]  # the first twin's place
    gate.take(running.ticket)
    gate.release(running.ticket)
    assert await granted_slot(pool, newer) == 0


async def test_a_granted_twin_is_not_refused_its_permit_by_its_sibling(
    http: aiohttp.ClientSession,
) -> None:
    pool, gate = one(http, 2)
    a = submit(pool, "minuet", BODY)
    await granted_slot(pool, a)
    b = submit(pool, "minuet", BODY)  # before a's job took the permit
    await granted_slot(pool, b)
    assert gate.take(a.ticket) == a.ticket.slot  # neither is Superseded
    assert gate.take(b.ticket) == b.ticket.slot


async def test_requests_without_a_key_supersede_as_before(http: aiohttp.ClientSession) -> None:
    pool, _gate = one(http, 1)
    no_object = ["not", "an", "object"]  # equal bodies, but no key: not twins
    submit(pool, "x", {"prompt": "x"}, supersedable=False)
    old = submit(pool, "editor", no_object)
    new = submit(pool, "editor", no_object)
    assert old.twin is None and new.twin is None
    with pytest.raises(Superseded):
        await pool.acquire(old, 1)
    assert list(pool.queue) == [new]


async def test_a_pool_supersedes_all_of_a_sessions_queued_twins_but_its_own(
    http: aiohttp.ClientSession,
) -> None:
    """``supersede_queued`` (a newer request answered elsewhere: type-through) and the
    gates' ``supersede_inflight`` spare the newcomer's twins and end every other request of
    the session."""
    pool, gate = one(http, 1)
    asked: list[int] = []
    running = submit(pool, "minuet", BODY)
    await granted_slot(pool, running)
    stops(gate, running, asked)
    queued = [submit(pool, "minuet", BODY) for _ in range(2)]
    pool.supersede_queued("minuet", K)
    gate.supersede_inflight("minuet", K)
    assert asked == [] and list(pool.queue) == queued
    pool.supersede_queued("minuet", OTHER)
    gate.supersede_inflight("minuet", OTHER)
    assert asked == [running.id] and list(pool.queue) == []
    for e in queued:
        with pytest.raises(Superseded):
            await pool.acquire(e, 1)
