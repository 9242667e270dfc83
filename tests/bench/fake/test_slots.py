"""The fake upstream's slot accounting over real loopback HTTP.

``id_slot`` waits for its slot, ``n_cmpl`` takes that many slots at once, ``concurrent``
and ``max_concurrent`` count waiting generations too, an abort keeps its slots busy for
``abort_linger_s``, and ``/slots`` can be turned off (501).
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from tests.helpers.fake import by_prompt, sse_events


async def test_id_slot_busy_defers_while_other_slot_free(session: aiohttp.ClientSession) -> None:
    scripts = {
        "slow": Script(tokens=1, token_delay_s=0.5),
        "fast": Script(tokens=1, token_delay_s=0),
    }
    async with FakeUpstream(slots=2, script=by_prompt(scripts)) as up:
        url = up.url + "/completion"
        a = asyncio.create_task(session.post(url, json={"prompt": "slow", "id_slot": 0}))
        await up.wait_for(lambda u: u.slot_busy == [True, False])
        b = asyncio.create_task(session.post(url, json={"prompt": "fast", "id_slot": 0}))
        await up.wait_for(lambda u: len(u.received) == 2)
        assert up.concurrent == 2 and up.slot_busy == [True, False]  # b waits for slot 0
        async with session.post(
            url, json={"prompt": "fast", "id_slot": -1}
        ) as r:  # any slot: runs now
            assert (await r.json())["id_slot"] == 1
        assert up.completed == [2]
        ra, rb = await a, await b
        assert (await ra.json())["id_slot"] == 0 and (await rb.json())["id_slot"] == 0
        ra.release(), rb.release()
        assert up.completed == [2, 0, 1] and up.max_concurrent == 3


async def test_n_cmpl_runs_on_that_many_slots_at_once(session: aiohttp.ClientSession) -> None:
    """llama-server's n_cmpl: id_slot's slot plus the lowest other idle ones, launched only
    when all are idle (the request is deferred until then), k generations in ``concurrent``."""
    scripts = {
        "slow": Script(tokens=2, token_delay_s=0.3),
        "fast": Script(tokens=2, token_delay_s=0),
    }
    async with FakeUpstream(slots=3, script=by_prompt(scripts), abort_linger_s=0.3) as up:
        url = up.url + "/infill"
        async with session.post(url, json={"prompt": "fast", "id_slot": 2, "n_cmpl": 2}) as r:
            both = await r.json()
        assert [(c["index"], c["id_slot"], c["content"]) for c in both] == [
            (0, 2, "t0 t1 "),
            (1, 0, "t0 t1 "),
        ]
        assert up.max_concurrent == 2 and up.deferred == []
        a = asyncio.create_task(session.post(url, json={"prompt": "slow", "id_slot": 1}))
        await up.wait_for(lambda u: u.slot_busy == [False, True, False])
        b = asyncio.create_task(
            session.post(url, json={"prompt": "fast", "id_slot": 0, "n_cmpl": 3})
        )
        await up.wait_for(lambda u: len(u.received) == 3)
        assert (
            up.slot_busy == [False, True, False] and up.concurrent == 4
        )  # all or nothing: b waits
        assert up.deferred == [2]
        rb = await b
        assert up.completed == [0, 1, 2] and [c["id_slot"] for c in await rb.json()] == [0, 1, 2]
        (await a).release()
        async with session.post(url, json={"prompt": "x", "n_cmpl": 4}) as r:  # more than the slots
            assert r.status == 400 and "n_cmpl" in (await r.json())["error"]["message"]
        async with session.post(up.url + "/v1/completions", json={"prompt": "fast", "n": 2}) as r:
            assert [c["index"] for c in (await r.json())["choices"]] == [0, 1]
        async with session.post(url, json={"prompt": "fast", "n_cmpl": 2, "stream": True}) as r:
            events = [json.loads(e) for e in sse_events(await r.read())]
        assert [(e["index"], e["content"], e["stop"]) for e in events] == [
            (0, "t0 ", False),
            (1, "t0 ", False),
            (0, "t1 ", False),
            (1, "t1 ", False),
            (0, "", True),
            (1, "", True),
        ]
        r = await session.post(url, json={"prompt": "slow", "n_cmpl": 2, "stream": True})
        await r.content.readline()
        r.close()  # an abort keeps every slot of the request busy for the linger
        await up.wait_for(lambda u: len(u.aborted) == 1)
        assert up.slot_busy == [True, True, False] and up.concurrent == 2
        await up.wait_for(lambda u: u.slot_busy == [False, False, False] and u.concurrent == 0)


async def test_max_concurrent_counts_waiting_generations(session: aiohttp.ClientSession) -> None:
    async with FakeUpstream(
        slots=2, script=lambda _p, _b: Script(tokens=4, token_delay_s=0.05)
    ) as up:

        async def one() -> str:
            async with session.post(up.url + "/completion", json={"prompt": "x"}) as r:
                return (await r.json())["content"]

        assert await asyncio.gather(*(one() for _ in range(5))) == ["t0 t1 t2 t3 "] * 5
        assert (
            up.max_concurrent == 5 and up.concurrent == 0 and sorted(up.completed) == list(range(5))
        )
        for _ in range(3):
            await one()
        assert up.max_concurrent == 5


async def test_abort_keeps_slot_busy_for_linger_then_idle(session: aiohttp.ClientSession) -> None:
    async with FakeUpstream(
        abort_linger_s=0.4, script=lambda _p, _b: Script(tokens=100, token_delay_s=0.05)
    ) as up:
        r = await session.post(up.url + "/completion", json={"prompt": "x", "stream": True})
        await r.content.readline()
        r.close()  # the client goes away mid-generation
        await up.wait_for(lambda u: u.aborted == [0])
        t_abort = time.monotonic()
        async with session.get(up.url + "/slots") as s:
            [slot] = await s.json()
        assert (
            slot["is_processing"] is True
            and slot["id_task"] == 0
            and slot["next_token"]["n_decoded"] >= 1
        )
        assert up.concurrent == 1 and up.slot_busy == [True]
        await up.wait_for(lambda u: u.slot_busy == [False])
        assert time.monotonic() - t_abort > 0.2
        assert (up.concurrent, up.completed, up.max_concurrent) == (0, [], 1)


async def test_nonstream_abort_and_waiting_request_abort(session: aiohttp.ClientSession) -> None:
    async with FakeUpstream(
        abort_linger_s=0.1, script=lambda _p, _b: Script(tokens=100, token_delay_s=0.05)
    ) as up:
        t1 = asyncio.create_task(session.post(up.url + "/completion", json={"prompt": "x"}))
        await up.wait_for(lambda u: u.slot_busy == [True])
        t2 = asyncio.create_task(session.post(up.url + "/completion", json={"prompt": "y"}))
        await up.wait_for(lambda u: u.concurrent == 2)
        t2.cancel()  # waiting for the slot: aborts without lingering anywhere
        await up.wait_for(lambda u: u.aborted == [1] and u.concurrent == 1)
        t1.cancel()
        await up.wait_for(lambda u: u.aborted == [1, 0] and u.slot_busy == [True])
        await up.wait_for(lambda u: u.concurrent == 0 and u.slot_busy == [False])
        for t in (t1, t2):
            with pytest.raises(asyncio.CancelledError):
                await t


async def test_slots_endpoint_disabled_501(session: aiohttp.ClientSession) -> None:
    async with FakeUpstream(slots_endpoint=False) as up:
        async with session.get(up.url + "/slots") as r:
            assert r.status == 501 and "message" in (await r.json())["error"]
        async with session.get(up.url + "/props") as r:
            assert (await r.json())["total_slots"] == 1
