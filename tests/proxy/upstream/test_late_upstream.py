"""An upstream that is not there during detection (nothing listens, or a gateway answers
502): served with one permit, then detected once it answers, its adapter swapped in and the
gate grown to fit. Real loopback servers throughout.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import structlog
from aiohttp import web

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from tests.helpers.net import closed_port, wait_until
from tests.helpers.proxy import run_proxy
from tests.helpers.scheduler import make_pool, submit


@pytest.mark.parametrize("capacity", [None, 4])
@pytest.mark.parametrize("kind", ["llamacpp", "ollama"])
async def test_upstream_that_listens_only_later_is_detected_then(
    http: aiohttp.ClientSession, kind: str, capacity: int | None
) -> None:
    """Kind auto and nothing listening for the whole detection window (a llama-server
    started after the proxy): served as openai with one permit, marked undetected and out of
    rotation (requests get 503 at once while it is down); once the server listens, the
    watcher detects it and swaps in its adapter: slot count, ``id_slot``, stop confirmation,
    and the gate grows to what it would have had at start (``capacity`` clamped to a
    llama-server's slots). A configured kind stays as is."""
    port = closed_port()
    async with run_proxy(f"http://127.0.0.1:{port}", capacity=capacity) as px:
        first, gate = px.member.adapter, px.member.gate
        assert (first.kind, first.undetected, first.pending(), gate.capacity) == (
            "openai",
            True,
            True,
            1,
        )
        assert not first.known.is_set() and px.policy("auto", "/completion") == "finish"
        async with http.post(px.url + "/completion", json={"prompt": "x"}) as r:
            assert r.status == 503 and (await r.json())["error"]["type"] == "upstream_unavailable"
        async with http.get(px.url + "/llmproxy/status") as r:
            assert (await r.json())["upstream"]["detected"] is False
        with structlog.testing.capture_logs() as logs:
            async with FakeUpstream(kind=kind, slots=2, port=port) as fake:  # type: ignore[arg-type]
                await asyncio.wait_for(first.known.wait(), 15)
                adapter = px.member.adapter
                assert adapter is not first and adapter.known.is_set() and not adapter.pending()
                assert (adapter.kind, adapter.undetected) == (kind, False)
                async with http.get(px.url + "/llmproxy/status") as r:
                    assert (await r.json())["upstream"]["detected"] is True
                route = "/completion" if kind == "llamacpp" else "/api/generate"
                async with http.post(
                    px.url + route, json={"model": "m", "prompt": "x", "stream": False}
                ) as r:
                    assert r.status == 200
                if kind == "llamacpp":  # never more permits than slots: permit i is slot i
                    assert (adapter.slots, adapter.can_confirm, gate.capacity, gate.free) == (
                        2,
                        True,
                        2,
                        2,
                    )
                    assert fake.generations[-1].body["id_slot"] == 0
                    assert px.policy("auto", "/completion") == "cancel"
                else:
                    assert (
                        gate.capacity == (capacity or 1)
                        and "id_slot" not in fake.generations[-1].body
                    )
        assert [e["kind"] for e in logs if e["event"] == "upstream detected"] == [kind]
    async with run_proxy(f"http://127.0.0.1:{closed_port()}", upstream_kind="openai") as px:
        assert not px.member.adapter.undetected and px.member.adapter.known.is_set()


async def test_a_gateway_answering_502_until_its_server_is_up_is_detected_later() -> None:
    """502 (or 504) on /props is a gateway whose server is not up yet, not an answer: the
    proxy stays undetected and finds the llama-server once it is behind that address."""
    port = closed_port()

    async def bad_gateway(_request: web.Request) -> web.Response:
        return web.Response(status=502, text="Bad Gateway")

    gateway = web.Application()
    gateway.router.add_route("*", "/{tail:.*}", bad_gateway)
    runner = web.AppRunner(gateway, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with run_proxy(f"http://127.0.0.1:{port}") as px:
            first = px.member.adapter
            assert (first.kind, first.undetected, px.member.gate.capacity) == ("openai", True, 1)
            await runner.cleanup()
            async with FakeUpstream(kind="llamacpp", slots=2, port=port):
                await asyncio.wait_for(first.known.wait(), 15)
                assert (
                    px.member.adapter.kind,
                    px.member.adapter.slots,
                    px.member.gate.capacity,
                ) == (
                    "llamacpp",
                    2,
                    2,
                )
    finally:
        await runner.cleanup()


async def test_configured_llamacpp_without_props_gets_its_capacity_once_it_answers() -> None:
    """``--upstream-kind llamacpp --capacity 3`` in front of a server that was down at start
    and has no /props when it comes up (404: an answer that will not change): the watcher
    stops waiting for a slot count and the gate grows from 1 to the configured 3."""
    port = closed_port()
    async with run_proxy(f"http://127.0.0.1:{port}", upstream_kind="llamacpp", capacity=3) as px:
        adapter = px.member.adapter
        assert (adapter.kind, adapter.capacity_pending(), px.member.gate.capacity) == (
            "llamacpp",
            True,
            1,
        )
        async with FakeUpstream(kind="openai", slots=3, port=port):
            await asyncio.wait_for(adapter.known.wait(), 15)
        assert (adapter.slots, adapter.capacity_pending(), px.member.gate.capacity) == (
            None,
            False,
            3,
        )


async def test_a_request_queued_across_the_swap_runs_with_the_adapter_in_use_at_its_grant(
    http: aiohttp.ClientSession,
) -> None:
    """A request that waited while the watcher swapped in the llama-server's adapter is
    counted and prepared by that adapter when it is granted: two permits for ``n_cmpl: 2``
    (the openai adapter in use when it arrived counted one), and ``id_slot`` in its body. So
    it waits for both slots in the proxy's queue instead of in the server's, and a stop of it
    is confirmed on the slot it really runs on. One granted before the swap keeps its own.
    (The health probe puts the server in rotation before the watcher's first look.)"""
    port = closed_port()
    hold = asyncio.Event()
    async with run_proxy(f"http://127.0.0.1:{port}", health_interval_s=0.05) as px:
        first, gate = px.member.adapter, px.member.gate
        fake = FakeUpstream(
            kind="llamacpp",
            slots=2,
            port=port,
            script=lambda _p, body: Script(
                tokens=2, hold=hold if body.get("prompt") == "a" else None
            ),
        )
        async with fake:
            await wait_until(lambda: px.member.healthy, what="the health probe")
            assert px.member.adapter is first  # the watcher's first look is 0.5 s away
            a = asyncio.ensure_future(
                http.post(
                    px.url + "/completion",
                    json={"prompt": "a"},
                    headers={"X-LLMProxy-Session": "a"},
                )
            )
            await fake.wait_for(lambda f: f.concurrent == 1)
            b = asyncio.ensure_future(
                http.post(
                    px.url + "/completion",
                    json={"prompt": "b", "n_cmpl": 2},
                    headers={"X-LLMProxy-Session": "b"},
                )
            )
            await wait_until(lambda: len(px.state.pool.queue) == 1, 5)
            await asyncio.wait_for(first.known.wait(), 15)  # swapped; the gate grew to 2
            assert px.member.adapter is not first and px.member.adapter.kind == "llamacpp"
            # b needs both slots now
            assert gate.capacity == 2 and len(px.state.pool.queue) == 1 and gate.free == 1
            assert len(fake.generations) == 1
            hold.set()
            for task in (a, b):
                async with await task as r:
                    assert r.status == 200
        assert [(g.body.get("id_slot"), g.body.get("n_cmpl")) for g in fake.generations] == [
            (None, None),
            (0, 2),
        ]
        assert fake.deferred == [] and fake.max_concurrent == 2
        assert gate.free == gate.capacity == 2


async def test_gate_grow_hands_new_permits_to_waiters_in_order(
    http: aiohttp.ClientSession,
) -> None:
    pool, (member,) = make_pool(http, [1], max_queue=8)
    gate = member.gate
    first = submit(pool, "a", supersedable=False)
    second = submit(pool, "b", supersedable=False)
    third = submit(pool, "c", supersedable=False)
    assert first.future.done() and len(pool.queue) == 2
    gate.grow(1)  # never shrinks or re-adds
    assert gate.capacity == 1 and len(pool.queue) == 2
    gate.grow(3)
    assert gate.capacity == 3 and len(pool.queue) == 0
    placed = (second.future.result(), third.future.result())
    assert tuple(p.ticket.slot for p in placed) == (1, 2)
    assert gate.free == 0 and gate.held == 3
