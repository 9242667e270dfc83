"""llama-server's router mode (upstream/adapters/router.py) against the fake router over
real loopback HTTP: the router is a pool of its models, each a member with its own permits
(its child's slots) and stop confirmation; a model loads on demand for the first request,
whose wait is shown; a request names its model upstream; an unload while requests wait
loses nothing; a router that comes up after the proxy still becomes its models."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import structlog

from llmproxy.bench.fake.router import FakeRouter
from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.proxy.pool.member import Member
from llmproxy.proxy.upstream.adapters.router import RouterModelAdapter
from tests.helpers.net import wait_until
from tests.helpers.proxy import RunningProxy, request_events, run_proxy

DEFAULTS = {"complete": "fim", "chat": "chat"}


@contextlib.asynccontextmanager
async def fronted(router: FakeRouter, **options: Any) -> AsyncIterator[RunningProxy]:
    settings = {"default_model": DEFAULTS, "health_interval_s": 0.05, **options}
    async with run_proxy(router.url, **settings) as px:
        yield px


def members(px: RunningProxy) -> dict[str, Member]:
    pool = px.state.pool
    assert pool is not None
    return {m.models[0]: m for m in pool.members if m.model is not None and not m.draining}


def status(m: Member) -> str:
    assert isinstance(m.adapter, RouterModelAdapter)
    return m.adapter.status


def child(router: FakeRouter, name: str) -> FakeUpstream:
    found = router.child(name)
    assert found is not None, name
    return found


async def complete(
    http: aiohttp.ClientSession, px: RunningProxy, rid: str, **body: Any
) -> tuple[int, Any]:
    body = {"prompt": "def f(", "n_predict": 4, **body}
    headers = {"X-LLMProxy-Session": "editor", "X-Request-Id": rid}
    async with http.post(px.url + "/completion", json=body, headers=headers) as r:
        return r.status, json.loads(await r.read())


async def test_each_model_is_a_member_and_learns_its_slots_once_loaded(
    http: aiohttp.ClientSession,
) -> None:
    hold = asyncio.Event()
    async with (
        FakeRouter({"fim": {"slots": 2}, "chat": {}}, load_hold=hold) as router,
        fronted(router) as px,
    ):
        ms = members(px)
        assert set(ms) == {"fim", "chat"}
        assert [m.name for m in px.state.pool.members] == [
            f"127.0.0.1:{router.url.rsplit(':', 1)[1]}/{n}" for n in ("fim", "chat")
        ]
        assert all(status(m) == "unloaded" and m.gate.total == 1 for m in ms.values())
        with structlog.testing.capture_logs() as logs:
            first = asyncio.create_task(complete(http, px, "k0"))  # no model: complete's, fim
            await wait_until(lambda: status(ms["fim"]) == "loading", what="the router loading")
            assert not first.done()  # it waits for the load, not refused
            hold.set()
            code, _ = await first
            assert code == 200
            await wait_until(lambda: ms["fim"].gate.total == 2, what="fim's two slots learnt")
            assert status(ms["fim"]) == "loaded" and status(ms["chat"]) == "unloaded"
            assert (await complete(http, px, "k1", prompt="def g("))[0] == 200
            px.flush_log()
        lines = request_events(logs)
        assert lines["k0"]["model_load_ms"] > 0 and lines["k0"]["upstream"].endswith("/fim")
        assert "model_load_ms" not in lines["k1"]
        (sent, _) = child(router, "fim").generations
        assert sent.body is not None and sent.body["model"] == "fim"  # named upstream
        assert router.loads == {"fim": 1, "chat": 0}
        assert px.state.pool.members[0].describe()["model_loads"] == 1


async def test_a_superseded_keystroke_is_stopped_and_confirmed_on_its_model(
    http: aiohttp.ClientSession,
) -> None:
    """Non-streaming keystrokes: the proxy sends them as streams, which the router stops."""

    def script(_path: str, body: dict[str, Any]) -> Script:
        return Script(tokens=400 if body["prompt"].endswith("(") else 3, token_delay_s=0.01)

    async with (
        FakeRouter(["fim", "chat"], script=script, abort_linger_s=0.02) as router,
        fronted(router, affinity_wait_s=5) as px,
    ):
        with structlog.testing.capture_logs() as logs:
            long = asyncio.create_task(complete(http, px, "k0"))
            await wait_until(lambda: router.child("fim") is not None, what="fim loaded")
            fim = child(router, "fim")
            await fim.wait_for(lambda f: f.slot_busy == [True])
            code, body = await complete(http, px, "k1", prompt="def f(x")
            assert code == 200 and body["content"] == "t0 t1 t2 "
            assert (await long)[0] == 499
            px.flush_log()
        stopped = request_events(logs)["k0"]
        assert stopped["outcome"] == "superseded" and stopped["confirm_wait_ms"] > 0
        assert "confirm_timed_out" not in stopped
        assert len(fim.aborted) == 1 and fim.max_concurrent == 1 and fim.deferred == []


async def test_a_completion_never_waits_for_a_chat_on_the_other_model(
    http: aiohttp.ClientSession,
) -> None:
    hold = asyncio.Event()
    chat_script = lambda _p, _b: Script(tokens=3, hold=hold)  # noqa: E731
    async with (
        FakeRouter({"fim": {}, "chat": {"script": chat_script}}) as router,
        fronted(router) as px,
    ):
        ms = members(px)
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with http.post(px.url + "/v1/chat/completions", json=body) as chat:
            assert chat.status == 200
            await child(router, "chat").wait_for(lambda f: f.slot_busy == [True])
            assert ms["chat"].gate.free == 0
            assert (await complete(http, px, "k0"))[0] == 200  # granted at once, on fim
            assert not chat.content.at_eof()  # the chat still runs
            hold.set()
            await chat.read()


async def test_an_unload_while_requests_wait_loses_none_of_them(
    http: aiohttp.ClientSession,
) -> None:
    """One fim request runs, another waits for fim's one slot; the router unloads fim: the
    running one fails (its child is gone), the slot counts as idle at once (the model does
    not run), the waiting one makes the router load fim again and is answered."""
    hold = asyncio.Event()
    script = lambda _p, b: Script(tokens=2, hold=hold if "held" in b["prompt"] else None)  # noqa: E731
    async with FakeRouter(["fim", "chat"], script=script) as router, fronted(router) as px:
        ms = members(px)
        assert (await complete(http, px, "warm", prompt="x" * 300))[0] == 200
        await wait_until(lambda: status(ms["fim"]) == "loaded", what="fim loaded")
        assert len(ms["fim"].index) > 0
        running = asyncio.create_task(complete(http, px, "r", prompt="held", stream=True))
        await child(router, "fim").wait_for(lambda f: f.slot_busy == [True])
        other = {"X-LLMProxy-Session": "other"}
        waiting = asyncio.create_task(
            http.post(px.url + "/completion", json={"prompt": "y", "n_predict": 2}, headers=other)
        )
        await wait_until(lambda: len(px.state.pool.queue) == 1, what="the second one queued")
        async with http.post(router.url + "/models/unload", json={"model": "fim"}) as r:
            assert r.status == 200
        async with await waiting as r:
            assert r.status == 200, await r.text()
        with contextlib.suppress(aiohttp.ClientPayloadError):  # its child went mid-answer
            await running
        assert router.unloads["fim"] == 1 and router.loads["fim"] == 2
        await wait_until(lambda: ms["fim"].gate.free == ms["fim"].gate.total, what="permits back")
        assert ms["fim"].gate.quarantined == []
        hold.set()


async def test_a_router_unloading_a_model_forgets_its_caches(
    http: aiohttp.ClientSession,
) -> None:
    async with FakeRouter(["fim", "chat"], models_max=1) as router, fronted(router) as px:
        ms = members(px)
        assert (await complete(http, px, "k0", prompt="x" * 300))[0] == 200
        await wait_until(lambda: status(ms["fim"]) == "loaded", what="fim loaded")
        assert len(ms["fim"].index) > 0  # the prompt it holds
        body = {"messages": [{"role": "user", "content": "hi"}]}
        async with http.post(px.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200  # the router unloads fim to load chat
        await wait_until(lambda: status(ms["fim"]) == "unloaded", what="fim unloaded")
        assert len(ms["fim"].index) == 0


async def test_an_unknown_model_is_a_404_naming_the_routers_models(
    http: aiohttp.ClientSession,
) -> None:
    async with FakeRouter(["fim", "chat"]) as router, fronted(router) as px:
        code, body = await complete(http, px, "k0", model="gpt-4")
        assert code == 404
        assert body["error"]["message"].endswith("models: chat, fim")
        assert [path for path, _ in router.received if path == "/completion"] == []


async def test_an_entrys_models_pick_which_of_the_routers_it_serves(
    http: aiohttp.ClientSession,
) -> None:
    async with FakeRouter(["fim", "chat", "embed"]) as router:
        spec = {"url": router.url, "models": ["fim", "chat"]}
        async with run_proxy(None, upstreams=[spec], default_model=DEFAULTS) as px:
            assert set(members(px)) == {"fim", "chat"}


async def test_a_router_that_comes_up_after_the_proxy_becomes_its_models(
    http: aiohttp.ClientSession,
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with run_proxy(f"http://127.0.0.1:{port}", default_model=DEFAULTS) as px:
        pool = px.state.pool
        assert [m.router for m in pool.members] == [False]  # nothing answered at start
        async with FakeRouter(["fim", "chat"], port=port):
            await wait_until(
                lambda: set(members(px)) == {"fim", "chat"}, 10, what="the router's models"
            )
            assert (await complete(http, px, "k0"))[0] == 200
            await wait_until(lambda: len(pool.members) == 2, 10, what="the whole router gone")
            assert not any(m.router for m in pool.members)


async def test_without_default_model_a_request_naming_none_goes_to_the_first_model(
    http: aiohttp.ClientSession,
) -> None:
    with structlog.testing.capture_logs() as logs:
        async with FakeRouter(["chat", "fim"]) as router, run_proxy(router.url) as px:
            for i in range(3):
                assert (await complete(http, px, f"k{i}", prompt=f"p{i}"))[0] == 200
            assert router.loads == {"chat": 1, "fim": 0}
    (warning,) = [e for e in logs if "set default_model" in e["event"]]
    assert warning["first"] == "chat" and warning["classes"] == ["complete", "chat"]


async def test_a_request_may_name_a_model_by_its_alias(http: aiohttp.ClientSession) -> None:
    async with (
        FakeRouter({"fim": {"aliases": ["qwen-fim"]}, "chat": {}}) as router,
        fronted(router) as px,
    ):
        assert members(px)["fim"].models == ("fim", "qwen-fim")
        assert (await complete(http, px, "k0", model="qwen-fim"))[0] == 200
        (sent,) = child(router, "fim").generations
        assert sent.body is not None and sent.body["model"] == "qwen-fim"  # as the client said
        assert router.loads == {"fim": 1, "chat": 0}


async def test_a_load_waits_rather_than_cut_another_models_generation(
    http: aiohttp.ClientSession,
) -> None:
    """``--models-max 1``: a chat for the unloaded model waits while a completion runs on
    the loaded one (the router would unload it mid-answer), then loads when it is idle;
    completions for the loaded model go on meanwhile."""
    hold = asyncio.Event()
    script = lambda _p, b: Script(tokens=2, hold=hold if b.get("prompt") == "held" else None)  # noqa: E731
    async with FakeRouter(["fim", "chat"], models_max=1, script=script) as router:
        async with fronted(router) as px:
            ms = members(px)
            assert ms["chat"].adapter.max_instances == 1  # type: ignore[attr-defined]
            assert (await complete(http, px, "warm", prompt="x"))[0] == 200
            running = asyncio.create_task(complete(http, px, "r", prompt="held"))
            await child(router, "fim").wait_for(lambda f: f.slot_busy == [True])
            body = {"messages": [{"role": "user", "content": "hi"}]}
            chat = asyncio.create_task(http.post(px.url + "/v1/chat/completions", json=body))
            await wait_until(lambda: len(px.state.pool.queue) == 1, what="the chat waiting")
            assert router.loads["chat"] == 0 and status(ms["chat"]) == "unloaded"
            hold.set()  # the completion ends: fim is idle, the chat may load chat
            assert (await running)[0] == 200
            async with await chat as r:
                assert r.status == 200
            fim = router.children("fim")[0]
            assert fim.aborted == [] and router.loads == {"fim": 1, "chat": 1}
            assert status(ms["fim"]) == "unloaded"
