"""Two rules of the scheduler's grant (pool/pool.py), without HTTP, over real gates:

- a request's permit count is asked of its upstream's adapter at the grant, not at
  admission (an upstream re-detected while it waited may run it on more slots);
- a keystroke sent to the head of the queue (type-through: it waited on its session's
  generation already) is granted at once beside a free permit, even when the request it
  goes before cannot be granted yet (a wide one).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from llmproxy.proxy.gating.gate import Gate
from llmproxy.proxy.pool.member import Member
from llmproxy.proxy.pool.pool import Entry, Pool, Sizing
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.upstream.adapters.base import Adapter
from llmproxy.proxy.upstreams import UpstreamSpec


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
