"""Two rules of the scheduler's grant (pool/pool.py), without HTTP, over real gates:

- a request's permit count is asked of its upstream's adapter at the grant, not at
  admission (an upstream re-detected while it waited may run it on more slots);
- a keystroke sent to the head of the queue (type-through: it waited on its session's
  generation already) is granted at once beside a free permit, even when the request it
  goes before cannot be granted yet (a wide one);
- one pass over the queue sees one rotation: an upstream that comes back into it during
  the pass (a breaker's cooldown over, by the clock) waits for the next pass, so a waiter
  that found it out never has it taken by one behind it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from llmproxy.proxy.errors import BadRequest
from llmproxy.proxy.gating.breaker import CircuitBreaker, UpstreamUnavailable
from llmproxy.proxy.gating.gate import Gate
from llmproxy.proxy.pool.member import Member
from llmproxy.proxy.pool.pool import Entry, Pool, Sizing
from llmproxy.proxy.pool.router import Choice, Request, Wait
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.upstream.adapters.base import Adapter
from llmproxy.proxy.upstreams import UpstreamSpec
from tests.helpers.scheduler import make_pool
from tests.helpers.scheduler import submit as submit_to


@pytest.fixture
async def pool() -> AsyncIterator[tuple[Pool, Member]]:
    async with aiohttp.ClientSession() as session:  # never used to connect here
        settings = ProxySettings()
        spec = UpstreamSpec(url="http://127.0.0.1:9000", name="a")
        adapter = Adapter(spec.url, session, settings)
        member = Member(spec, settings, session, adapter, Gate(2))
        yield Pool([member], settings), member


def submit(pool: Pool, session: str, sizing: Sizing, *, first: bool = False) -> Entry:
    return pool.submit(
        session,
        supersedable=True,
        route="/completion",
        parsed={"prompt": session},
        sizing=sizing,
        first=first,
    )


def one(_m: Member, _capacity: int) -> int:
    return 1


def two(_m: Member, _capacity: int) -> int:
    return 2


async def done(pool: Pool, entry: Entry) -> None:
    placement = await pool.acquire(entry, 1)
    placement.member.gate.take(placement.ticket)
    placement.member.gate.release(placement.ticket)


async def test_the_permit_count_is_the_adapters_at_the_grant(
    pool: tuple[Pool, Member],
) -> None:
    p, member = pool
    busy = [submit(p, f"x{i}", one) for i in range(2)]
    needs = {"n": 1}
    waiting = submit(p, "w", lambda _m, _c: needs["n"])
    assert len(p.queue) == 1
    needs["n"] = 2  # re-detected meanwhile: it runs on two slots there
    await done(p, busy[0])
    assert not waiting.future.done() and member.gate.free == 1  # one is not enough
    await done(p, busy[1])
    placement = await p.acquire(waiting, 1)
    assert placement.ticket.permits == 2 and len(placement.ticket.slots) == 2
    assert member.gate.free == 0


async def test_a_keystroke_at_the_head_takes_a_free_permit_beside_a_wide_request(
    pool: tuple[Pool, Member],
) -> None:
    p, member = pool
    running = submit(p, "x", one)
    wide = submit(p, "wide", two)  # needs both slots: waits for the running one
    keystroke = submit(p, "k", one, first=True)
    assert keystroke.future.done() and not wide.future.done()
    assert keystroke.future.result().ticket.slots == (1,) and member.gate.free == 0
    await done(p, running)
    await done(p, keystroke)
    assert (await p.acquire(wide, 1)).ticket.permits == 2


async def test_an_upstream_back_in_rotation_during_a_pass_waits_for_the_next_pass() -> None:
    """u1's breaker is open; its cooldown ends (by its clock) just after the pass has found
    no room for the head ``a`` on u0, the one upstream in rotation then: ``b``, behind it,
    must not take u1 in that pass; the next pass gives it to ``a``."""
    async with aiohttp.ClientSession() as session:  # never used to connect here
        p, (u0, u1) = make_pool(session, [1, 1])
        now = [0.0]
        u1.breaker = CircuitBreaker(1, 1.0, clock=lambda: now[0])
        u1.breaker.failure()  # open until now[0] >= 1.0
        running = submit_to(p, "x", "x")
        assert running.future.result().member is u0
        a = submit_to(p, "a", "a")
        choose = p.router.choose

        def choosing(req: Request, members: list[Member]) -> Choice | Wait | None:
            choice = choose(req, members)
            if req is a.request:
                now[0] = 2.0  # u1's cooldown is over from here on
            return choice

        p.router.choose = choosing  # type: ignore[method-assign]
        b = submit_to(p, "b", "b")  # its pass: a first, no room on u0
        assert not a.future.done() and not b.future.done()
        assert u1.in_rotation and u1.gate.free == 1
        p.advance()  # the next pass (a health round, a permit back...)
        assert a.future.result().member is u1 and not b.future.done()


async def test_a_request_too_wide_for_every_upstream_is_a_400_even_with_none_in_rotation() -> None:
    """No upstream in rotation (its breaker open) answers 503 at once, but a request that
    fits no upstream anyway (more slots at once than any has) is the client's error: 400,
    which no retry would mend (found by test_stress.py: an ``n_cmpl`` of 2 on one slot got
    503 while the breaker was open after upstream failures)."""
    async with aiohttp.ClientSession() as session:  # never used to connect here
        p, (u0,) = make_pool(session, [1])
        u0.breaker = CircuitBreaker(1, 60.0)
        u0.breaker.failure()  # open for a minute
        assert not u0.in_rotation
        with pytest.raises(BadRequest):
            submit_to(p, "w", "w", permits=2)
        with pytest.raises(UpstreamUnavailable):
            submit_to(p, "n", "n", permits=1)
