"""Requests on several slots at once (llama-server's n_cmpl): permits, FIFO order, settling."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
import structlog

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.proxy.upstream.settle import settle
from tests.helpers.net import wait_until
from tests.helpers.proxy import request_events, run_proxy
from tests.helpers.scheduler import make_pool, submit


async def test_n_cmpl_holds_one_permit_per_slot_it_runs_on(http: aiohttp.ClientSession) -> None:
    """llama.vscode's ``n_cmpl: 2`` runs on two llama-server slots at once: it must hold two
    permits, so that the upstream never has to defer a request the gate let through (its
    queue is unbounded and blind to supersede) and never runs more than N generations."""
    holds = {0: asyncio.Event(), 1: asyncio.Event()}  # the first two generations run until released
    script = lambda _p, b: Script(tokens=6, token_delay_s=0.001, hold=holds.get(b["seq"]))  # noqa: E731
    async with FakeUpstream(slots=2, script=script) as fake, run_proxy(fake.url) as px:
        gate = px.member.gate
        with structlog.testing.capture_logs() as logs:

            async def post(seq: int, session: str, **extra: Any) -> tuple[int, Any]:
                body = {"input_prefix": "x", "prompt": "", "seq": seq, **extra}
                async with http.post(
                    px.url + "/infill",
                    json=body,
                    headers={"X-LLMProxy-Session": session, "X-Request-Id": f"n{seq}"},
                ) as r:
                    return r.status, await r.json()

            first = asyncio.create_task(post(0, "a"))
            await fake.wait_for(lambda f: f.slot_busy == [True, False])
            wide = asyncio.create_task(post(1, "b", n_cmpl=2))
            await wait_until(lambda: len(px.state.pool.queue) == 1, what="the wide request queued")
            third = asyncio.create_task(post(2, "c"))
            await wait_until(
                lambda: len(px.state.pool.queue) == 2, what="the third request queued behind it"
            )
            # free, but the wide request needs two and is first
            assert gate.free == 1 and gate.held == 1
            holds[0].set()
            await fake.wait_for(lambda f: len(f.generations) == 2 and f.slot_busy == [True, True])
            async with http.get(px.url + "/llmproxy/status") as r:
                status = await r.json()
            assert (
                status["permits"] == {"total": 2, "free": 0, "held": 2}
                and len(px.state.pool.queue) == 1
            )
            [running] = status["inflight"]
            assert running["slots"] == [0, 1]
            holds[1].set()
            results = await asyncio.gather(first, wide, third)
            await asyncio.wait_for(gate.wait_quiescent(), 5)
            px.flush_log()
            assert {"n0", "n1", "n2"} <= request_events(logs).keys()

        assert [s for s, _ in results] == [200, 200, 200]
        assert [(c["index"], c["id_slot"]) for c in results[1][1]] == [(0, 0), (1, 1)]
        assert fake.deferred == [] and fake.max_concurrent == 2
        # FIFO: nobody overtook the wide one
        assert [g.body["seq"] for g in fake.generations] == [0, 1, 2]
        assert fake.generations[1].body["id_slot"] == running["slot"] == 0
        events = request_events(logs)
        assert events["n1"]["permits"] == 2 and "permits" not in events["n0"]
        assert gate.free == 2


@pytest.mark.parametrize(
    ("extra", "permits"),
    [
        ({"n_cmpl": 2}, 2),
        ({"n": 2}, 2),
        ({"n_cmpl": None, "n": 2}, 2),
        ({"n_cmpl": "x", "n": 2}, 2),
        ({"n_cmpl": 2.7}, 2),
        ({"n_cmpl": 1, "n": 2}, 1),
        ({"n_cmpl": True}, 1),
        ({"n_cmpl": 0}, 1),
        ({}, 1),
        ({"n_cmpl": float("inf"), "n": 2}, 2),  # Python's json reads Infinity, NaN
        ({"n_cmpl": float("nan")}, 1),
    ],
)
async def test_n_cmpl_is_read_as_llama_server_reads_it(
    http: aiohttp.ClientSession, extra: dict[str, Any], permits: int
) -> None:
    """``json_value(data, "n_cmpl", json_value(data, "n", 1))``: whatever makes the server run
    k completions makes the proxy hold k permits; the fake upstream runs them on k slots."""
    hold = asyncio.Event()
    async with (
        FakeUpstream(slots=2, script=lambda _p, _b: Script(tokens=1, hold=hold)) as fake,
        run_proxy(fake.url) as px,
    ):
        task = asyncio.create_task(http.post(px.url + "/completion", json={"prompt": "x", **extra}))
        await fake.wait_for(lambda f: len(f.generations) == 1)
        assert px.member.gate.held == permits and fake.slot_busy.count(True) == permits
        hold.set()
        async with await task as r:
            assert r.status == 200
        assert fake.deferred == []


async def test_n_cmpl_over_capacity_is_refused_before_the_upstream(
    http: aiohttp.ClientSession,
) -> None:
    async with FakeUpstream(slots=2) as fake, run_proxy(fake.url) as px:
        for path, body, field in (
            ("/infill", {"input_prefix": "x", "n_cmpl": 3}, "n_cmpl"),
            ("/v1/completions", {"prompt": "x", "n": 3}, "n"),
        ):
            async with http.post(px.url + path, json=body) as r:
                assert r.status == 400, path
                err = (await r.json())["error"]
            assert err["type"] == "invalid_request_error"
            assert err["message"].startswith(
                f"'{field}' = 3 needs 3 slots at once, llmproxy has 2: "
            ), err
        async with http.post(
            px.url + "/infill", json={"input_prefix": "x", "n_cmpl": 2, "n_predict": 2}
        ) as r:
            assert r.status == 200 and len(await r.json()) == 2
        assert len(fake.generations) == 1 and px.member.gate.free == 2
    async with FakeUpstream(slots=2) as fake, run_proxy(fake.url, capacity=1) as px:
        async with http.post(px.url + "/infill", json={"input_prefix": "x", "n_cmpl": 2}) as r:
            assert r.status == 400
            assert (
                "--capacity is below the upstream's 2 slots" in (await r.json())["error"]["message"]
            )
        assert fake.generations == []


async def test_n_cmpl_waits_for_a_lower_slot_granted_just_before_it_to_be_taken(
    http: aiohttp.ClientSession,
) -> None:
    """Two grants at once: x (a large body, still on its way) gets slot 0, the wide request
    slots 1 and 2. Sent at once, the small wide request would reach the server first and its
    extra completion would take slot 0, still idle there, so x would wait in the server's
    queue. The wide request is sent only once slot 0 is busy with x."""
    # x stays on its slot until the wide one is done
    holds = {0: asyncio.Event(), 1: asyncio.Event()}
    script = lambda _p, b: Script(tokens=2, token_delay_s=0.001, hold=holds.get(b["seq"]))  # noqa: E731
    async with (
        FakeUpstream(slots=3, script=script) as fake,
        run_proxy(fake.url, settle_timeout_s=30) as px,
    ):
        gate = px.member.gate

        async def post(seq: int, session: str, **extra: Any) -> tuple[int, Any]:
            async with http.post(
                px.url + "/completion",
                json={"prompt": "p", "seq": seq, **extra},
                headers={"X-LLMProxy-Session": session},
            ) as r:
                return r.status, await r.json()

        first = asyncio.create_task(post(0, "h", n_cmpl=3))  # holds every slot until released
        await fake.wait_for(lambda f: f.slot_busy == [True, True, True])
        x = asyncio.create_task(post(1, "x", pad="y" * 900_000))
        await wait_until(lambda: len(px.state.pool.queue) == 1, what="x queued")
        wide = asyncio.create_task(post(2, "w", n_cmpl=2))
        await wait_until(lambda: len(px.state.pool.queue) == 2, what="the wide request queued")
        holds[0].set()
        (s2, bw) = await wide
        holds[1].set()
        (s0, _), (s1, bx) = await asyncio.gather(first, x)
        assert (s0, s1, s2) == (200, 200, 200)
        assert bx["id_slot"] == 0 and [c["id_slot"] for c in bw] == [1, 2]
        assert fake.deferred == [] and fake.max_concurrent == 3
        await asyncio.wait_for(gate.wait_quiescent(), 5)


async def test_settle_gives_up_loudly_and_is_cancellable(http: aiohttp.ClientSession) -> None:
    """A lower slot held for a pinned request that never shows busy: the wide request is sent
    after ``settle_timeout_s`` with a warning; a stop while settling ends it at once; a slot
    held for a request the server does not pin (embeddings) is not waited for."""
    async with FakeUpstream(slots=3) as fake, run_proxy(fake.url, settle_timeout_s=0.2) as px:
        adapter = px.member.adapter
        # a scheduler of our own, over a gate of 3 slots: nothing of it reaches the fake
        pool, (own,) = make_pool(http, [3], max_queue=5)
        gate = own.gate
        x = submit(pool, "x", supersedable=False).ticket
        gate.take(x)
        wide = submit(pool, "w", supersedable=False, permits=2).ticket
        gate.take(wide)
        with structlog.testing.capture_logs() as logs:
            start = asyncio.get_running_loop().time()
            await settle(gate, wide, adapter)
        # uvloop's clock counts whole milliseconds: 4373.767 - 4373.567 is 0.19999... in floats
        assert round(asyncio.get_running_loop().time() - start, 3) >= 0.2
        assert [e["slots"] for e in logs if e["log_level"] == "warning"] == [[1, 2]]
        polls = sum(r.path == "/slots" for r in fake.received)
        task = asyncio.create_task(settle(gate, wide, adapter))
        await fake.wait_for(lambda f: sum(r.path == "/slots" for r in f.received) > polls)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert wide.slots == (1, 2) and gate.settle_extras(wide, lambda _t: True) == {0}
        gate.settled(wide)
        gate.release(wide)
        gate.release(x)
        emb = submit(pool, "e", supersedable=False, route="/v1/embeddings").ticket
        gate.take(emb)  # slot 0 again, on any slot at the server: not waited for
        wide = submit(pool, "w2", supersedable=False, permits=2).ticket
        gate.take(wide)
        assert (emb.slots, wide.slots) == ((0,), (1, 2))
        polls = sum(r.path == "/slots" for r in fake.received)
        await asyncio.wait_for(settle(gate, wide, adapter), 0.1)
        assert sum(r.path == "/slots" for r in fake.received) == polls


@pytest.mark.parametrize("how", ["client_left", "superseded"])
async def test_a_request_stopped_before_it_was_sent_never_reaches_the_upstream(
    http: aiohttp.ClientSession, how: str
) -> None:
    """Policy ``finish`` lets a request that was sent run to its end; one stopped between its
    grant and its send (here: while it waits to settle its ``n_cmpl`` slots behind a lower
    slot granted to a request still on its way) is never sent, whatever the policy."""
    async with (
        FakeUpstream(slots=3) as fake,
        run_proxy(
            fake.url, settle_timeout_s=1, on_disconnect="finish", supersede_inflight="finish"
        ) as px,
    ):
        gate = px.member.gate
        # slot 0, never busy upstream
        on_its_way = px.state.pool.submit(
            "x", supersedable=False, route="/completion", parsed={}, sizing=lambda _m, _c: 1
        ).ticket
        gate.take(on_its_way)
        polls = sum(r.path == "/slots" for r in fake.received)
        hdr = {"X-LLMProxy-Session": "editor", "X-Request-Id": "wide"}
        with structlog.testing.capture_logs() as logs:
            wide = asyncio.create_task(
                http.post(px.url + "/completion", json={"prompt": "p", "n_cmpl": 2}, headers=hdr)
            )
            # settling
            await fake.wait_for(lambda f: sum(r.path == "/slots" for r in f.received) > polls)
            assert gate.inflight == 2 and fake.generations == []
            if how == "client_left":
                wide.cancel()
                await asyncio.gather(wide, return_exceptions=True)
            else:
                async with http.post(
                    px.url + "/completion",
                    json={"prompt": "q", "n_predict": 2},
                    headers={**hdr, "X-Request-Id": "newer"},
                ) as r:
                    assert r.status == 200
                async with await wide as r:
                    assert r.status == 499 and (await r.json())["error"]["type"] == "superseded"
            await wait_until(lambda: gate.inflight == 1, what="the stopped request's permits back")
            gate.release(on_its_way)
            await asyncio.wait_for(gate.wait_quiescent(), 5)
            px.flush_log()
        assert all("n_cmpl" not in g.body for g in fake.generations), fake.snapshot()
        line = request_events(logs)["wide"]
        assert line["reached_upstream"] is False
        assert line["outcome"] == ("cancelled_queued" if how == "client_left" else "superseded")


async def test_a_lower_slot_freed_before_a_wide_request_arrives_is_held_for_it(
    http: aiohttp.ClientSession,
) -> None:
    """The settle saw slot 0 busy, but its request ends before the wide one reaches the
    server, which then puts the extra completion on slot 0, not on slot 2 as the gate did.
    Slot 0 coming back while the wide request runs is held for it: the next request waits
    in the proxy's queue, never in the server's (it was granted slot 0 and deferred)."""
    finish_a = asyncio.Event()
    settling = asyncio.Event()

    def script(_path: str, body: dict[str, Any]) -> Script:
        if body.get("prompt") == "a":
            return Script(tokens=1, token_delay_s=0, hold=finish_a)
        return Script(tokens=20, token_delay_s=0.005)

    async with (
        FakeUpstream(slots=3, script=script, abort_linger_s=0.01) as fake,
        run_proxy(fake.url) as px,
    ):
        answer = fake._slots_response

        def slots_response() -> Any:
            resp = answer()
            if settling.is_set():  # the wide request's settle poll: A ends right after it
                finish_a.set()
            return resp

        fake._slots_response = slots_response  # type: ignore[method-assign]

        async def post(body: dict[str, Any], session: str) -> int:
            async with http.post(
                px.url + "/completion",
                json={**body, "stream": True},
                headers={"X-LLMProxy-Session": session},
            ) as r:
                await r.read()
                return r.status

        a = asyncio.create_task(post({"prompt": "a"}, "a"))  # slot 0, held at the fake
        await fake.wait_for(lambda f: f.slot_busy[0])
        settling.set()
        wide = asyncio.create_task(post({"prompt": "w", "n_cmpl": 2}, "w"))
        await fake.wait_for(lambda f: len(f.generations) == 2)
        b = asyncio.create_task(post({"prompt": "b"}, "b"))
        assert await asyncio.gather(a, wide, b) == [200, 200, 200]
        assert fake.deferred == [] and fake.max_concurrent <= 3, fake.snapshot()
        gate = px.member.gate
        await asyncio.wait_for(gate.wait_quiescent(), 5)
        assert gate.free == gate.capacity == 3
