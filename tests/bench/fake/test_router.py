"""The fake llama-server router over real loopback HTTP: its own routes, model loads and
unloads (autoload, one load for many waiters, eviction over ``models_max``), and the
relay to each model's child FakeUpstream (streamed piece by piece; a client leaving a
stream aborts it at the child, one leaving a whole answer goes unnoticed)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from llmproxy.bench.fake.router import FakeRouter
from llmproxy.bench.fake.upstream import Script

MISSING = {
    "error": {
        "code": 400,
        "message": "model name is missing from the request",
        "type": "invalid_request_error",
    }
}
NOT_LOADED = {
    "error": {"code": 400, "message": "model is not loaded", "type": "invalid_request_error"}
}


def not_found(name: str) -> dict[str, Any]:
    message = f"model '{name}' not found"
    return {"error": {"code": 400, "message": message, "type": "invalid_request_error"}}


async def get(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as r:
        return r.status, await r.json()


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with session.post(url, json=body) as r:
        return r.status, await r.json()


async def statuses(session: aiohttp.ClientSession, router: FakeRouter) -> dict[str, str]:
    status, listing = await get(session, router.url + "/v1/models")
    assert status == 200 and listing["object"] == "list"
    return {m["id"]: m["status"]["value"] for m in listing["data"]}


async def test_router_props_health_and_model_list(session: aiohttp.ClientSession) -> None:
    async with FakeRouter(["chat", "code"], models_max=3) as router:
        assert await get(session, router.url + "/props") == (
            200,
            {
                "role": "router",
                "max_instances": 3,
                "models_autoload": True,
                "model_alias": "llama-server",
                "model_path": "none",
                "default_generation_settings": {"params": None, "n_ctx": 0},
                "ui_settings": {},
                "build_info": "b0-unknown",
            },
        )
        assert await get(session, router.url + "/health") == (200, {"status": "ok"})
        status, listing = await get(session, router.url + "/models")
        assert status == 200
        chat = listing["data"][0]
        assert isinstance(chat.pop("created"), int)
        assert chat == {
            "id": "chat",
            "object": "model",
            "owned_by": "llamacpp",
            "aliases": [],
            "tags": [],
            "status": {"value": "unloaded", "args": []},
        }
        assert [m["id"] for m in listing["data"]] == ["chat", "code"]
        assert router.loads == {"chat": 0, "code": 0}


async def test_load_and_unload_change_the_listed_status(session: aiohttp.ClientSession) -> None:
    hold = asyncio.Event()
    async with FakeRouter(["chat", "code"], load_hold=hold) as router:
        url = router.url
        assert await post(session, url + "/models/load", {"model": "chat"}) == (
            200,
            {"success": True},
        )  # at once, the load goes on
        assert await statuses(session, router) == {"chat": "loading", "code": "unloaded"}
        assert router.child("chat") is None
        hold.set()
        await router.wait_for(lambda r: r.status("chat") == "loaded")
        assert await statuses(session, router) == {"chat": "loaded", "code": "unloaded"}
        child = router.child("chat")
        assert child is not None and router.children("chat") == [child]
        assert await post(session, url + "/models/unload", {"model": "chat"}) == (
            200,
            {"success": True},
        )
        assert await statuses(session, router) == {"chat": "unloaded", "code": "unloaded"}
        assert router.child("chat") is None and router.children("chat") == [child]
        assert router.loads["chat"] == 1 and router.unloads["chat"] == 1
        with pytest.raises(aiohttp.ClientConnectionError):  # the child's port is closed
            await session.get(child.url + "/health")


async def test_load_unload_errors(session: aiohttp.ClientSession) -> None:
    async with FakeRouter(["chat"]) as router:
        for route in ("/models/load", "/models/unload"):
            assert await post(session, router.url + route, {"model": "nosuch"}) == (
                400,
                not_found("nosuch"),
            )
            assert await post(session, router.url + route, {}) == (400, MISSING)
        assert router.loads["chat"] == 0


async def test_child_gets_need_a_model(session: aiohttp.ClientSession) -> None:
    async with FakeRouter(["chat"]) as router:
        for route in ("/slots", "/metrics"):
            assert await get(session, router.url + route) == (400, MISSING)
        for route in ("/slots", "/props", "/metrics"):
            assert await get(session, router.url + route + "?model=nosuch") == (
                400,
                not_found("nosuch"),
            )
        assert router.loads == {"chat": 0} and router.status("chat") == "unloaded"


async def test_child_gets_autoload_unless_told_not_to(session: aiohttp.ClientSession) -> None:
    async with FakeRouter({"chat": {"slots": 3}, "code": {}}, slots=2) as router:
        url = router.url
        for query in ("autoload=false", "autoload=0"):
            for route in ("/slots", "/props", "/metrics"):
                got = await get(session, f"{url}{route}?model=chat&{query}")
                assert got == (400, NOT_LOADED)
        assert router.loads["chat"] == 0
        status, slots = await get(session, url + "/slots?model=chat")  # waits for the load
        assert status == 200 and [s["id"] for s in slots] == [0, 1, 2]
        assert router.status("chat") == "loaded" and router.loads["chat"] == 1
        status, props = await get(session, url + "/props?model=chat&autoload=false")
        assert status == 200 and props["total_slots"] == 3
        status, props = await get(session, url + "/props?model=code")
        assert status == 200 and props["total_slots"] == 2
        child = router.child("chat")
        assert child is not None and [r.path for r in child.received] == ["/slots", "/props"]


async def test_a_generation_loads_its_model_and_waits(session: aiohttp.ClientSession) -> None:
    hold = asyncio.Event()
    async with FakeRouter(["chat"], load_hold=hold) as router:
        body = {"model": "chat", "prompt": "p", "n_predict": 3}
        ask = asyncio.create_task(post(session, router.url + "/completion", body))
        await router.wait_for(lambda r: r.status("chat") == "loading")
        assert not ask.done()
        hold.set()
        status, answer = await ask
        assert status == 200 and answer["content"] == "t0 t1 t2 "
        assert router.status("chat") == "loaded" and router.loads["chat"] == 1
        child = router.child("chat")
        assert child is not None and child.completed == [0]
        assert child.received[0].body == body  # forwarded unchanged


async def test_generations_need_a_known_model(session: aiohttp.ClientSession) -> None:
    async with FakeRouter(["chat"]) as router:
        for route in ("/completion", "/v1/chat/completions", "/v1/embeddings", "/tokenize"):
            assert await post(session, router.url + route, {"prompt": "p"}) == (400, MISSING)
            got = await post(session, router.url + route, {"model": "nosuch", "prompt": "p"})
            assert got == (400, not_found("nosuch"))
        assert router.loads["chat"] == 0


async def test_a_stream_is_relayed_piece_by_piece(session: aiohttp.ClientSession) -> None:
    """The child sends its first token and then nothing (hang_mid_body): the token reaches
    the client all the same, so the router does not wait for the whole answer."""
    script = Script(tokens=4, token_delay_s=0, fail="hang_mid_body")
    async with FakeRouter(["chat"], script=lambda _p, _b: script) as router:
        body = {"model": "chat", "prompt": "p", "stream": True}
        async with session.post(router.url + "/completion", json=body) as r:
            assert r.status == 200 and r.content_type == "text/event-stream"
            first = await r.content.readline()
            assert json.loads(first.removeprefix(b"data: "))["content"] == "t0 "
            child = router.child("chat")
            assert child is not None and child.completed == []


async def test_a_client_leaving_a_stream_aborts_it_at_the_child(
    session: aiohttp.ClientSession,
) -> None:
    hold = asyncio.Event()
    script = Script(tokens=4, hold=hold)
    async with FakeRouter(["chat"], script=lambda _p, _b: script) as router:
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        r = await session.post(router.url + "/v1/chat/completions", json=body)
        assert r.status == 200  # the head comes before the held tokens
        r.close()
        child = router.child("chat")
        assert child is not None
        await child.wait_for(lambda u: u.aborted == [0])
        assert child.completed == [] and router.abandoned == ["/v1/chat/completions"]


async def test_a_client_leaving_a_whole_answer_goes_unnoticed(
    session: aiohttp.ClientSession,
) -> None:
    hold = asyncio.Event()
    script = Script(tokens=4, hold=hold)
    async with FakeRouter(["chat"], script=lambda _p, _b: script) as router:
        body = {"model": "chat", "prompt": "p"}
        ask = asyncio.create_task(post(session, router.url + "/completion", body))
        await router.wait_for(lambda r: r.status("chat") == "loaded")
        child = router.child("chat")
        assert child is not None
        await child.wait_for(lambda u: u.slot_busy == [True])
        ask.cancel()  # the client's connection closes
        await router.wait_for(lambda r: r.abandoned == ["/completion"])
        hold.set()
        await child.wait_for(lambda u: u.completed == [0])
        assert child.aborted == []


async def test_models_max_evicts_the_least_recently_used(
    session: aiohttp.ClientSession,
) -> None:
    hold = asyncio.Event()
    scripts = {"held": Script(tokens=2, hold=hold), "p": Script(tokens=2, token_delay_s=0)}
    async with FakeRouter(
        ["a", "b"], models_max=1, script=lambda _p, b: scripts[b["prompt"]]
    ) as router:
        url = router.url + "/completion"
        assert (await post(session, url, {"model": "a", "prompt": "p"}))[0] == 200
        held = await session.post(url, json={"model": "a", "prompt": "held", "stream": True})
        assert held.status == 200
        a = router.child("a")
        assert a is not None
        status, answer = await post(session, url, {"model": "b", "prompt": "p"})
        assert status == 200 and answer["content"] == "t0 t1 "
        assert router.status("a") == "unloaded" and router.status("b") == "loaded"
        assert router.unloads == {"a": 1, "b": 0} and router.children("a") == [a]
        with pytest.raises(aiohttp.ClientPayloadError):  # its connection dropped
            await held.read()
        held.release()
        assert a.completed == [0]
        status, _ = await post(session, url, {"model": "a", "prompt": "p"})  # evicts b
        assert status == 200 and router.loads == {"a": 2, "b": 1}
        assert router.unloads == {"a": 1, "b": 1} and len(router.children("a")) == 2


async def test_requests_for_a_loading_model_share_one_load(
    session: aiohttp.ClientSession,
) -> None:
    hold = asyncio.Event()
    async with FakeRouter(["chat"], slots=2, load_hold=hold) as router:
        asks = [
            asyncio.create_task(
                post(session, router.url + "/completion", {"model": "chat", "prompt": "p"})
            )
            for _ in range(3)
        ] + [asyncio.create_task(get(session, router.url + "/slots?model=chat"))]
        await router.wait_for(lambda r: len(r.received) == 4)
        assert router.status("chat") == "loading" and not any(a.done() for a in asks)
        hold.set()
        answers = await asyncio.gather(*asks)
        assert [status for status, _ in answers] == [200] * 4
        assert router.loads["chat"] == 1 and len(router.children("chat")) == 1
        child = router.child("chat")
        assert child is not None and len(child.completed) == 3 and len(child.received) == 4


async def test_a_load_unloaded_meanwhile_fails_its_waiters(
    session: aiohttp.ClientSession,
) -> None:
    hold = asyncio.Event()
    async with FakeRouter(["chat"], load_hold=hold) as router:
        ask = asyncio.create_task(
            post(session, router.url + "/completion", {"model": "chat", "prompt": "p"})
        )
        await router.wait_for(lambda r: len(r.received) == 1)
        assert await post(session, router.url + "/models/unload", {"model": "chat"}) == (
            200,
            {"success": True},
        )
        status, answer = await ask
        assert status == 500 and answer["error"]["type"] == "server_error"
        assert router.children("chat") == [] and router.unloads["chat"] == 1
