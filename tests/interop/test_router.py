"""llama-server in router mode behind the proxy (``make interop``): the router is a pool of
its models, each with its own permits (its child's slots), stop confirmation by
``/slots?model=``, and a first request that waits for its model to load."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import aiohttp
import structlog

from llmproxy.proxy.pool.member import Member
from llmproxy.proxy.upstream.adapters.router import RouterModelAdapter
from tests.helpers.interop import LlamaServer, Server
from tests.helpers.net import wait_until
from tests.helpers.proxy import RunningProxy, request_events, run_proxy

PROMPT = "".join(f"def alpha_{i}(x):\n    return x * {i}\n\n" for i in range(20))


async def behind_proxy(
    stack: contextlib.AsyncExitStack, llama_router: LlamaServer, **options: Any
) -> tuple[Server, RunningProxy, list[dict[str, Any]], aiohttp.ClientSession]:
    router_options = {k: options.pop(k) for k in ("parallel", "models_max") if k in options}
    router = await stack.enter_async_context(llama_router(**router_options))
    logs = stack.enter_context(structlog.testing.capture_logs())
    px = await stack.enter_async_context(
        run_proxy(
            router.url,
            default_model={"complete": "fim", "chat": "chat"},
            health_interval_s=0.2,
            **options,
        )
    )
    http = await stack.enter_async_context(aiohttp.ClientSession())
    return router, px, logs, http


def members(px: RunningProxy) -> dict[str, Member]:
    pool = px.state.pool
    assert pool is not None
    return {m.models[0]: m for m in pool.members}


def status(m: Member) -> str:
    assert isinstance(m.adapter, RouterModelAdapter)
    return m.adapter.status


async def complete(
    http: aiohttp.ClientSession, url: str, typed: str = "", n_predict: int = 8, **extra: Any
) -> tuple[int, bytes]:
    body = {"prompt": PROMPT + typed, "n_predict": n_predict, "temperature": 0, **extra}
    headers = {"X-LLMProxy-Session": "editor", "X-Request-Id": f"k{len(typed)}"}
    async with http.post(url + "/completion", json=body, headers=headers) as r:
        return r.status, await r.read()


async def test_each_model_is_a_member_that_learns_its_slots_when_first_loaded(
    llama_router: LlamaServer,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        _, px, logs, http = await behind_proxy(stack, llama_router, parallel=2)
        ms = members(px)
        assert set(ms) == {"fim", "chat"}
        assert all(status(m) == "unloaded" and m.gate.total == 1 for m in ms.values())
        code, raw = await complete(http, px.url)  # no model field: complete's default, fim
        assert code == 200, raw
        assert json.loads(raw)["model"] == "fim"
        await wait_until(lambda: ms["fim"].gate.total == 2, 30, what="fim's two slots learnt")
        assert status(ms["fim"]) == "loaded" and status(ms["chat"]) == "unloaded"
        code, raw = await complete(http, px.url, "#")
        assert code == 200, raw
        px.flush_log()
        lines = request_events(logs)
        assert "model_load_ms" in lines["k0"] and lines["k0"]["upstream"].endswith("/fim")
        assert "model_load_ms" not in lines["k1"]
        assert ms["fim"].model_loads == 1 and ms["chat"].routed == 0


async def test_a_superseded_generation_is_stopped_and_confirmed_on_its_model(
    llama_router: LlamaServer,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        router, px, logs, http = await behind_proxy(stack, llama_router, affinity_wait_s=5)
        assert (await complete(http, px.url))[0] == 200  # loads fim
        fim = members(px)["fim"]
        long = asyncio.create_task(complete(http, px.url, "#", n_predict=2000, ignore_eos=True))
        await wait_until(lambda: fim.gate.inflight == 1, 30, what="the long generation running")
        await wait_until(lambda: fim.gate.inflight_snapshot()[0].state == "running", 30)
        code, raw = await complete(http, px.url, "# a")  # the next keystroke supersedes it
        assert code == 200, raw
        assert (await long)[0] == 499
        px.flush_log()
        lines = request_events(logs)
        stopped = lines["k1"]
        assert stopped["outcome"] == "superseded" and stopped["reached_upstream"] is True
        assert "confirm_wait_ms" in stopped and "confirm_timed_out" not in stopped
        async with http.get(router.url + "/slots", params={"model": "fim"}) as r:
            slots = await r.json()
        assert not any(s["is_processing"] for s in slots), slots


async def test_a_completion_never_waits_for_a_chat_on_the_other_model(
    llama_router: LlamaServer,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        _, px, logs, http = await behind_proxy(stack, llama_router)
        ms = members(px)
        chat_body = {
            "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 4000,
            "stream": True,
        }
        async with http.post(px.url + "/v1/chat/completions", json=chat_body) as chat:
            assert chat.status == 200
            await chat.content.readline()  # the chat runs on its model's one slot
            assert ms["chat"].gate.free == 0
            code, raw = await complete(http, px.url)
            assert code == 200, raw
            assert not chat.content.at_eof()  # the chat still runs: the completion never waited
        px.flush_log()
        line = request_events(logs)["k0"]
        assert line["upstream"].endswith("/fim") and line["queue_wait_ms"] < 1000, line


async def test_a_model_the_router_unloads_loses_its_caches_and_loads_again(
    llama_router: LlamaServer,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        _, px, logs, http = await behind_proxy(stack, llama_router, models_max=1)
        ms = members(px)
        assert (await complete(http, px.url))[0] == 200
        await wait_until(lambda: status(ms["fim"]) == "loaded", 30, what="fim loaded")
        assert len(ms["fim"].index) > 0  # the prompt it holds (route cache)
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        async with http.post(px.url + "/v1/chat/completions", json=chat) as r:
            assert r.status == 200, await r.text()  # the router unloads fim to load chat
        await wait_until(lambda: status(ms["fim"]) == "unloaded", 30, what="fim unloaded")
        assert len(ms["fim"].index) == 0
        code, raw = await complete(http, px.url, "#")  # fim loads again, chat goes
        assert code == 200, raw
        px.flush_log()
        assert "model_load_ms" in request_events(logs)["k1"]
        await wait_until(lambda: status(ms["chat"]) == "unloaded", 30, what="chat unloaded")
