"""Upstream detection when the upstream is not ready yet, or wants an API key.

llama-server listens before its model is loaded and answers every API route with 503
"Loading model" until then; with ``--api-key`` it refuses /props and /slots without the key.
A proxy started beside it (systemd, a script) must still drive it as llama.cpp: N permits,
``id_slot`` injected, stops confirmed through /slots. Real loopback servers throughout.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import structlog
from aiohttp import web
from pydantic import ValidationError

from llmproxy.bench.fake.shapes import json_response
from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.proxy.settings import ProxySettings
from tests.helpers.net import closed_port, wait_until
from tests.helpers.proxy import run_proxy

_LOADING = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
_PUBLIC = (
    "/health",
    "/v1/health",
    "/models",
    "/v1/models",
    "/api/tags",
)  # llama-server's, with --api-key


class LoadingFake(FakeUpstream):
    """A llama-server still loading its model: 503 on every API route until ``ready`` is
    set, or until it has answered ``loading_answers`` requests that way."""

    def __init__(self, *, loading_answers: int | None = None, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.ready = asyncio.Event()
        self.loading_answers = loading_answers
        self.answered_loading = 0

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        if self.loading_answers is not None and self.answered_loading >= self.loading_answers:
            self.ready.set()
        if not self.ready.is_set() and request.path not in _PUBLIC:
            await request.read()
            self.answered_loading += 1
            return json_response(_LOADING, 503)
        return await super()._dispatch(request)


class KeyedFake(FakeUpstream):
    """A llama-server started with ``--api-key K``."""

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        if request.path not in _PUBLIC and request.headers.get("Authorization") != "Bearer K":
            await request.read()
            return json_response(
                {
                    "error": {
                        "code": 401,
                        "message": "Invalid API Key",
                        "type": "authentication_error",
                    }
                },
                401,
            )
        return await super()._dispatch(request)


class SlotsLaterFake(FakeUpstream):
    """/slots answers ``first`` until ``ready`` is set (a 503, or 501 as with --no-slots), or
    with ``first`` None does not answer until then (llama-server answers /slots from its
    main loop: during a long prompt, later than the proxy's probe timeout)."""

    def __init__(self, *, first: int | None, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.first = first
        self.ready = asyncio.Event()
        self.slots_asked = 0

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        self.slots_asked += request.path == "/slots"
        if request.path == "/slots" and not self.ready.is_set():
            if self.first is None:
                await self.ready.wait()
            else:
                return json_response(
                    {"error": {"code": self.first, "message": "not now", "type": "x"}}, self.first
                )
        return await super()._dispatch(request)


async def test_detection_waits_while_llama_server_loads(http: aiohttp.ClientSession) -> None:
    async with LoadingFake(kind="llamacpp", slots=2, loading_answers=3) as fake:
        async with run_proxy(fake.url, detect_timeout_s=30) as px:
            assert fake.answered_loading == 3  # detection asked again until the model was loaded
            adapter = px.state.adapter
            assert (adapter.kind, adapter.slots, adapter.can_confirm) == ("llamacpp", 2, True)
            assert adapter.known.is_set() and not adapter.pending()
            assert px.state.gate.capacity == 2
            async with http.post(
                px.url + "/infill", json={"input_prefix": "def f(", "n_predict": 2}
            ) as r:
                assert r.status == 200
            assert fake.generations[-1].body["id_slot"] == 0
            assert px.state.policy("auto", "/infill") == "cancel"


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
        adapter, gate = px.state.adapter, px.state.gate
        assert (adapter.kind, adapter.slots, adapter.can_confirm, gate.capacity) == (
            "llamacpp",
            None,
            False,
            1,
        )
        assert adapter.pending() and not adapter.known.is_set()
        assert px.state.policy("auto", "/infill") == "finish"  # no /slots yet: cannot confirm
        async with http.post(
            px.url + "/completion", json={"prompt": "x", "n_cmpl": 2}
        ) as r:  # 2 slots: unknown yet
            assert r.status == 400 and "not known yet" in (await r.json())["error"]["message"]
        with structlog.testing.capture_logs() as logs:
            fake.ready.set()
            await asyncio.wait_for(adapter.known.wait(), 10)
        assert (adapter.slots, adapter.can_confirm) == (2, True)
        assert px.state.policy("auto", "/infill") == "cancel"
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
        async with asyncio.timeout(10):
            while gate.queued + gate.inflight < 2:  # the second request reaches the gate
                await asyncio.sleep(0)
        assert gate.queued == 2 - expected
        hold.set()
        assert await asyncio.gather(*posts) == [200, 200]
        assert sorted(g.body["id_slot"] for g in fake.generations) == (
            [0, 1] if expected == 2 else [0, 0]
        )
        assert gate.free == gate.capacity
        assert fake.max_concurrent == expected and fake.deferred == []


@pytest.mark.parametrize("capacity", [None, 4])
@pytest.mark.parametrize("kind", ["llamacpp", "ollama"])
async def test_upstream_that_listens_only_later_is_detected_then(
    http: aiohttp.ClientSession, kind: str, capacity: int | None
) -> None:
    """Kind auto and nothing listening for the whole detection window (a llama-server
    started after the proxy): served as openai with one permit (requests get 502 while it is
    down), marked undetected; once the server listens, the watcher detects it and swaps in
    its adapter: slot count, ``id_slot``, stop confirmation, and the gate grows to what it
    would have had at start (``capacity`` clamped to a llama-server's slots). A configured
    kind stays as is."""
    port = closed_port()
    async with run_proxy(f"http://127.0.0.1:{port}", capacity=capacity) as px:
        first, gate = px.state.adapter, px.state.gate
        assert (first.kind, first.undetected, first.pending(), gate.capacity) == (
            "openai",
            True,
            True,
            1,
        )
        assert not first.known.is_set() and px.state.policy("auto", "/completion") == "finish"
        async with http.post(px.url + "/completion", json={"prompt": "x"}) as r:
            assert r.status == 502
        async with http.get(px.url + "/llmproxy/status") as r:
            assert (await r.json())["upstream"]["detected"] is False
        with structlog.testing.capture_logs() as logs:
            async with FakeUpstream(kind=kind, slots=2, port=port) as fake:  # type: ignore[arg-type]
                await asyncio.wait_for(first.known.wait(), 15)
                adapter = px.state.adapter
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
                    assert px.state.policy("auto", "/completion") == "cancel"
                else:
                    assert (
                        gate.capacity == (capacity or 1)
                        and "id_slot" not in fake.generations[-1].body
                    )
        assert [e["kind"] for e in logs if e["event"] == "upstream detected"] == [kind]
    async with run_proxy(f"http://127.0.0.1:{closed_port()}", upstream_kind="openai") as px:
        assert not px.state.adapter.undetected and px.state.adapter.known.is_set()


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
            first = px.state.adapter
            assert (first.kind, first.undetected, px.state.gate.capacity) == ("openai", True, 1)
            await runner.cleanup()
            async with FakeUpstream(kind="llamacpp", slots=2, port=port):
                await asyncio.wait_for(first.known.wait(), 15)
                assert (px.state.adapter.kind, px.state.adapter.slots, px.state.gate.capacity) == (
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
        adapter = px.state.adapter
        assert (adapter.kind, adapter.capacity_pending(), px.state.gate.capacity) == (
            "llamacpp",
            True,
            1,
        )
        async with FakeUpstream(kind="openai", slots=3, port=port):
            await asyncio.wait_for(adapter.known.wait(), 15)
        assert (adapter.slots, adapter.capacity_pending(), px.state.gate.capacity) == (
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
    is confirmed on the slot it really runs on. One granted before the swap keeps its own."""
    port = closed_port()
    hold = asyncio.Event()
    async with run_proxy(f"http://127.0.0.1:{port}") as px:
        first, gate = px.state.adapter, px.state.gate
        fake = FakeUpstream(
            kind="llamacpp",
            slots=2,
            port=port,
            script=lambda _p, body: Script(
                tokens=2, hold=hold if body.get("prompt") == "a" else None
            ),
        )
        async with fake:
            assert px.state.adapter is first  # the watcher's first look is 0.5 s away
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
            await wait_until(lambda: gate.queued == 1, 5)
            await asyncio.wait_for(first.known.wait(), 15)  # swapped; the gate grew to 2
            assert px.state.adapter is not first and px.state.adapter.kind == "llamacpp"
            assert (
                gate.capacity == 2 and gate.queued == 1 and gate.free == 1
            )  # b needs both slots now
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


async def test_gate_grow_hands_new_permits_to_waiters_in_order() -> None:
    from llmproxy.proxy.gating.gate import Gate

    gate = Gate(1, 8)
    first = gate.submit("a", supersedable=False)
    second = gate.submit("b", supersedable=False)
    third = gate.submit("c", supersedable=False)
    assert first.future.done() and gate.queued == 2
    gate.grow(1)  # never shrinks or re-adds
    assert gate.capacity == 1 and gate.queued == 2
    gate.grow(3)
    assert gate.capacity == 3 and gate.queued == 0
    assert (second.future.result(), third.future.result()) == (1, 2)
    assert gate.free == 0 and gate.held == 3


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
        adapter = px.state.adapter
        assert adapter.slots == 2 and not adapter.can_confirm and px.state.gate.capacity == 2
        assert adapter.pending() is retried and adapter.known.is_set() is not retried
        fake.ready.set()
        if retried:
            await asyncio.wait_for(adapter.known.wait(), 10)
            assert adapter.can_confirm and px.state.policy("auto", "/completion") == "cancel"
        else:
            assert px.state.policy("auto", "/completion") == "finish"


async def test_clamp_warning_is_said_once_not_at_every_poll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--capacity 4`` before a 2-slot llama-server whose /slots fails for a while: clamped
    to 2 at start, with one warning; the watcher's polls for /slots do not repeat it."""
    from llmproxy.proxy.upstream.forward import watch

    monkeypatch.setattr(watch, "WATCH_FIRST_S", 0.01)
    monkeypatch.setattr(watch, "WATCH_MAX_S", 0.02)
    with structlog.testing.capture_logs() as logs:
        async with (
            SlotsLaterFake(kind="llamacpp", slots=2, first=503) as fake,
            run_proxy(fake.url, capacity=4) as px,
        ):
            await wait_until(
                lambda: fake.slots_asked >= 5, 10
            )  # detection's, then the watcher's polls
            fake.ready.set()
            await asyncio.wait_for(px.state.adapter.known.wait(), 10)
            assert px.state.gate.capacity == 2
    assert sum(e["event"].startswith("capacity exceeds the upstream's slots") for e in logs) == 1


async def test_upstream_api_key_drives_a_keyed_llama_server(http: aiohttp.ClientSession) -> None:
    async with (
        KeyedFake(kind="llamacpp", slots=2) as fake,
        run_proxy(fake.url, upstream_api_key="K") as px,
    ):
        adapter = px.state.adapter
        assert (adapter.kind, adapter.slots, adapter.can_confirm) == ("llamacpp", 2, True)
        for headers in (
            {},
            {"Authorization": "Bearer editors-own"},
        ):  # the configured key replaces a client's
            async with http.post(
                px.url + "/completion", json={"prompt": "x", "n_predict": 1}, headers=headers
            ) as r:
                assert r.status == 200
            assert fake.received[-1].headers.getall("Authorization") == ["Bearer K"]
        async with http.get(px.url + "/slots") as r:  # passthrough too
            assert r.status == 200
        assert fake.received[-1].headers["Authorization"] == "Bearer K"


async def test_a_keyed_llama_server_without_the_key_is_named_in_the_log() -> None:
    async with KeyedFake(kind="llamacpp", slots=2) as fake:
        with structlog.testing.capture_logs() as logs:
            async with run_proxy(fake.url) as px:
                assert (
                    px.state.adapter.kind == "openai"
                )  # cannot tell without the key: the safe default
        refused = [e for e in logs if e["event"].startswith("upstream refused /props")]
        assert (
            refused and refused[0]["status"] == 401 and refused[0]["hint"] == "set upstream_api_key"
        )


def test_upstream_key_and_url_credentials_are_exclusive() -> None:
    with pytest.raises(ValidationError, match="not both"):
        ProxySettings(upstream="http://u:p@127.0.0.1:1", upstream_api_key="K")
    assert (
        ProxySettings(upstream="http://127.0.0.1:1", upstream_api_key="K").upstream_api_key
        is not None
    )
