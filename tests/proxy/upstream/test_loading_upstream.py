"""Detection beside a llama-server that is not ready: one that loads its model (503 on
every API route until then) or whose ``/slots`` fails or is slow at first. The proxy must
still drive it as llama.cpp once it is: N permits, ``id_slot`` injected, stops confirmed
through /slots; what detection could not learn, the watcher (watch.py) learns later.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import structlog

from llmproxy.bench.fake.upstream import Script
from llmproxy.proxy.upstream import watch
from tests.helpers.llama_fakes import LoadingFake, SlotsLaterFake
from tests.helpers.net import wait_until
from tests.helpers.proxy import run_proxy


async def test_detection_waits_while_llama_server_loads(http: aiohttp.ClientSession) -> None:
    async with LoadingFake(kind="llamacpp", slots=2, loading_answers=3) as fake:
        async with run_proxy(fake.url, detect_timeout_s=30) as px:
            assert fake.answered_loading == 3  # detection asked again until the model was loaded
            adapter = px.member.adapter
            assert (adapter.kind, adapter.slots, adapter.can_confirm) == ("llamacpp", 2, True)
            assert adapter.known.is_set() and not adapter.pending()
            assert px.member.gate.capacity == 2
            async with http.post(
                px.url + "/infill", json={"input_prefix": "def f(", "n_predict": 2}
            ) as r:
                assert r.status == 200
            assert fake.generations[-1].body["id_slot"] == 0
            assert px.policy("auto", "/infill") == "cancel"


@pytest.mark.parametrize("capacity", [None, 1, 4])
async def test_slot_count_and_slots_learnt_after_detection_gave_up(
    http: aiohttp.ClientSession, capacity: int | None
) -> None:
    """Still loading at the detection deadline: llamacpp with one permit at first (nothing
    runs there while it loads), then the watcher reads /props and /slots once the model is
    loaded, and the gate grows to what it would have had at start: the slot count, or
    ``capacity`` clamped to it (a warning), so no permit ever names a slot it lacks."""
    async with (
        LoadingFake(kind="llamacpp", slots=2) as fake,
        run_proxy(fake.url, capacity=capacity) as px,
    ):
        adapter, gate = px.member.adapter, px.member.gate
        assert (adapter.kind, adapter.slots, adapter.can_confirm, gate.capacity) == (
            "llamacpp",
            None,
            False,
            1,
        )
        assert adapter.pending() and not adapter.known.is_set()
        assert px.policy("auto", "/infill") == "finish"  # no /slots yet: cannot confirm
        async with http.post(
            px.url + "/completion", json={"prompt": "x", "n_cmpl": 2}
        ) as r:  # 2 slots: unknown yet
            assert r.status == 400 and "not known yet" in (await r.json())["error"]["message"]
        with structlog.testing.capture_logs() as logs:
            fake.ready.set()
            await asyncio.wait_for(adapter.known.wait(), 10)
        assert (adapter.slots, adapter.can_confirm) == (2, True)
        assert px.policy("auto", "/infill") == "cancel"
        over = [e for e in logs if e["event"].startswith("capacity exceeds the upstream's slots")]
        assert [(e["capacity"], e["slots"], e["log_level"]) for e in over] == (
            [(4, 2, "warning")] if capacity == 4 else []
        )
        assert gate.capacity == gate.free == min(capacity or 2, 2)
        expected = min(2, gate.capacity)  # generations at once
        async with http.get(px.url + "/llmproxy/metrics") as r:
            assert f"llmproxy_permits_total {float(gate.capacity)}" in await r.text()
        hold = asyncio.Event()
        fake.script = lambda _p, _b: Script(tokens=2, hold=hold)

        async def post(session: str) -> int:
            async with http.post(
                px.url + "/completion",
                json={"prompt": "x"},
                headers={"X-LLMProxy-Session": session},
            ) as r:
                await r.read()
                return r.status

        posts = [asyncio.create_task(post(f"s{i}")) for i in range(2)]
        await fake.wait_for(lambda f: f.concurrent == expected)
        await wait_until(
            lambda: len(px.state.pool.queue) + gate.inflight >= 2,
            10,
            what="the second request in the proxy",
        )
        assert len(px.state.pool.queue) == 2 - expected
        hold.set()
        assert await asyncio.gather(*posts) == [200, 200]
        assert sorted(g.body["id_slot"] for g in fake.generations) == (
            [0, 1] if expected == 2 else [0, 0]
        )
        assert gate.free == gate.capacity
        assert fake.max_concurrent == expected and fake.deferred == []


@pytest.mark.parametrize(
    ("first", "retried"),
    [(503, True), (None, True), (501, False)],
    ids=["503", "no-answer-in-time", "501"],
)
async def test_slots_failing_at_start(first: int | None, retried: bool) -> None:
    """A 503 or no answer in time may pass: /slots is asked again and confirmation turns on.
    A 501 (llama-server --no-slots) is final: nothing to watch, the policies stay ``finish``."""
    async with (
        SlotsLaterFake(kind="llamacpp", slots=2, first=first) as fake,
        run_proxy(fake.url) as px,
    ):
        adapter = px.member.adapter
        assert adapter.slots == 2 and not adapter.can_confirm and px.member.gate.capacity == 2
        assert adapter.pending() is retried and adapter.known.is_set() is not retried
        fake.ready.set()
        if retried:
            await asyncio.wait_for(adapter.known.wait(), 10)
            assert adapter.can_confirm and px.policy("auto", "/completion") == "cancel"
        else:
            assert px.policy("auto", "/completion") == "finish"


async def test_clamp_warning_is_said_once_not_at_every_poll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--capacity 4`` before a 2-slot llama-server whose /slots fails for a while: clamped
    to 2 at start, with one warning; the watcher's polls for /slots do not repeat it."""
    monkeypatch.setattr(watch, "WATCH_FIRST_S", 0.01)
    monkeypatch.setattr(watch, "WATCH_MAX_S", 0.02)
    with structlog.testing.capture_logs() as logs:
        async with (
            SlotsLaterFake(kind="llamacpp", slots=2, first=503) as fake,
            run_proxy(fake.url, capacity=4) as px,
        ):
            # detection's, then the watcher's polls
            await wait_until(lambda: fake.slots_asked >= 5, 10)
            fake.ready.set()
            await asyncio.wait_for(px.member.adapter.known.wait(), 10)
            assert px.member.gate.capacity == 2
    assert sum(e["event"].startswith("capacity exceeds the upstream's slots") for e in logs) == 1
