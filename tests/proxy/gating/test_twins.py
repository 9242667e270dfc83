"""Twins at the gate and in its wait list, without sockets: a session's requests with equal
bodies (proxy/twins.py) never supersede one another; a different one supersedes them all."""

from __future__ import annotations

import pytest

from llmproxy.proxy.errors import Superseded
from llmproxy.proxy.gating.gate import Gate
from llmproxy.proxy.gating.ticket import Ticket
from llmproxy.proxy.twins import twin_key, twins

BODY = {"model": "PLACEHOLDER", "prompt": "<|fim_prefix|>def f", "max_tokens": 56, "stream": True}
K = twin_key("/v1/completions", BODY)
OTHER = twin_key("/v1/completions", {**BODY, "prompt": "<|fim_prefix|>def fo"})


def test_the_key_is_the_body_less_what_the_proxy_sets() -> None:
    assert K is not None and twins(K, twin_key("/v1/completions", dict(reversed(BODY.items()))))
    assert twins(K, twin_key("/v1/completions", {**BODY, "id_slot": 0}))  # the proxy's field
    assert not twins(K, OTHER)
    assert not twins(K, twin_key("/completions", BODY))  # another route
    assert not twins(K, twin_key("/v1/completions", {**BODY, "stream": False}))
    assert twin_key("/v1/completions", ["not", "an", "object"]) is None
    assert not twins(None, None)  # a body that is no object has no twins


def stops(gate: Gate, ticket: Ticket, asked: list[int]) -> None:
    """Take ``ticket``'s permit as its job does, noting when it is asked to stop."""
    gate.take(ticket, on_supersede=lambda: asked.append(ticket.id))


@pytest.mark.parametrize("n", [2, 3])
async def test_twins_in_flight_run_side_by_side_until_a_different_request(n: int) -> None:
    gate = Gate(3, 8)
    asked: list[int] = []
    tickets = [gate.submit("minuet", supersedable=True, twin=K) for _ in range(n)]
    assert sorted([await t.wait() for t in tickets]) == list(range(n))  # a permit each
    for t in tickets:
        stops(gate, t, asked)
    assert asked == []  # none stopped another
    newer = gate.submit("minuet", supersedable=True, twin=OTHER)
    assert sorted(asked) == sorted(t.id for t in tickets)  # all of them, together
    if n < 3:
        assert await newer.wait() == n  # the slot left free
    else:
        assert not newer.future.done()  # it waits for theirs (being stopped)


async def test_queued_twins_keep_their_places_and_a_different_request_takes_the_first() -> None:
    gate = Gate(1, 8)
    running = gate.submit("other", supersedable=False)
    first = gate.submit("minuet", supersedable=True, twin=K)
    between = gate.submit("other", supersedable=True)
    second = gate.submit("minuet", supersedable=True, twin=K)
    third = gate.submit("minuet", supersedable=True, twin=K)
    assert gate.queue_snapshot() == [first, between, second, third]  # queued as any request
    newer = gate.submit("minuet", supersedable=True, twin=OTHER)
    for twin in (first, second, third):
        with pytest.raises(Superseded):
            await twin.wait()
    assert gate.queue_snapshot() == [newer, between]  # the first twin's place
    gate.take(running)
    gate.release(running)
    assert await newer.wait() == 0


async def test_a_granted_twin_is_not_refused_its_permit_by_its_sibling() -> None:
    gate = Gate(2, 8)
    a = gate.submit("minuet", supersedable=True, twin=K)
    await a.wait()
    b = gate.submit("minuet", supersedable=True, twin=K)  # before a's job took the permit
    await b.wait()
    assert gate.take(a) == a.slot and gate.take(b) == b.slot  # neither is Superseded


async def test_requests_without_a_key_supersede_as_before() -> None:
    gate = Gate(1, 8)
    gate.submit("x", supersedable=False)
    old = gate.submit("editor", supersedable=True)
    new = gate.submit("editor", supersedable=True)
    with pytest.raises(Superseded):
        await old.wait()
    assert gate.queue_snapshot() == [new]


async def test_a_pool_supersedes_all_of_a_sessions_queued_twins_but_its_own() -> None:
    """``supersede_queued``/``supersede_inflight`` (what a pool asks of every upstream's
    gate) spare the newcomer's twins and end every other request of the session."""
    gate = Gate(1, 8)
    asked: list[int] = []
    running = gate.submit("minuet", supersedable=True, twin=K)
    await running.wait()
    stops(gate, running, asked)
    queued = [gate.submit("minuet", supersedable=True, twin=K) for _ in range(2)]
    gate.supersede_queued("minuet", K)
    gate.supersede_inflight("minuet", K)
    assert asked == [] and gate.queue_snapshot() == queued
    gate.supersede_queued("minuet", OTHER)
    gate.supersede_inflight("minuet", OTHER)
    assert asked == [running.id] and gate.queue_snapshot() == []
    for t in queued:
        with pytest.raises(Superseded):
            await t.wait()
