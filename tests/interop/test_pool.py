"""Two real llama-servers behind one proxy (``--route cache``), in ``make interop``: each
editor's requests go to the server that holds its prompt, which then evaluates only what
was typed since (its own ``timings.prompt_n`` says so), and a superseded generation is
stopped and confirmed on the server it runs on."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import aiohttp
import structlog

from tests.helpers.interop import LlamaServer
from tests.helpers.net import wait_until
from tests.helpers.proxy import RunningProxy, request_events, run_proxy

FILES = [  # two editors, each in a file of its own (about 400 tokens each)
    "".join(f"def alpha_{i}(x):\n    return x * {i} + {i * 7}\n\n" for i in range(40)),
    "".join(f"class Bravo{i}:\n    size = {i * 3}\n    name = 'b{i}'\n\n" for i in range(40)),
]


async def two_servers(
    stack: contextlib.AsyncExitStack, llama_server: LlamaServer, **proxy: Any
) -> tuple[RunningProxy, list[dict[str, Any]], aiohttp.ClientSession]:
    """Two one-slot llama-servers behind a proxy with ``--route cache`` (closed with
    ``stack``): the proxy, its captured log and a client session."""
    servers = [await stack.enter_async_context(llama_server(parallel=1)) for _ in range(2)]
    specs = [{"url": s.url, "name": f"s{i}"} for i, s in enumerate(servers)]
    logs = stack.enter_context(structlog.testing.capture_logs())
    px = await stack.enter_async_context(run_proxy(None, upstreams=specs, route="cache", **proxy))
    http = await stack.enter_async_context(aiohttp.ClientSession())
    return px, logs, http


async def complete(
    http: aiohttp.ClientSession, url: str, editor: int, typed: str, n_predict: int = 8
) -> dict[str, object]:
    body = {"prompt": FILES[editor] + typed, "n_predict": n_predict, "temperature": 0}
    headers = {"X-LLMProxy-Session": f"editor{editor}", "X-Request-Id": f"e{editor}-{len(typed)}"}
    async with http.post(url + "/completion", json=body, headers=headers) as r:
        raw = await r.read()
        assert r.status == 200, raw
        return dict(json.loads(raw))


async def test_cache_routing_lands_on_the_server_holding_the_prompt(
    llama_server: LlamaServer,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        px, logs, http = await two_servers(stack, llama_server)
        first = [await complete(http, px.url, e, "") for e in (0, 1)]
        later = [await complete(http, px.url, e, typed) for typed in ("#", "# a") for e in (0, 1)]
        px.flush_log()
        for answer in first:  # cold: the whole file evaluated
            assert answer["timings"]["prompt_n"] > 300, answer["timings"]  # type: ignore[index]
        for answer in later:  # warm: only what was typed since (and the last token again)
            assert answer["timings"]["prompt_n"] < 10, answer["timings"]  # type: ignore[index]
        lines = request_events(logs)
        homes = {e: {lines[k]["upstream"] for k in lines if k.startswith(f"e{e}-")} for e in (0, 1)}
        assert len(homes[0]) == len(homes[1]) == 1 and homes[0] != homes[1], homes
        assert sorted(line["route_decision"] for line in lines.values()) == (
            ["cache_hit"] * 4 + ["cache_miss"] * 2
        )


async def test_a_superseded_generation_is_confirmed_stopped_on_its_server(
    llama_server: LlamaServer,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        # long enough a wait for the stop's confirmation: the next keystroke's prompt is there
        px, logs, http = await two_servers(stack, llama_server, affinity_wait_s=5)
        pool = px.state.pool
        assert pool is not None
        long = asyncio.create_task(complete(http, px.url, 0, "", n_predict=512))
        await wait_until(lambda: any(m.gate.inflight for m in pool.members), 60, what="running")
        (member,) = [m for m in pool.members if m.gate.inflight]
        await _decoding(http, str(member.adapter.base_url))  # a stop is seen at its next token
        old_answer, new_answer = await asyncio.gather(
            long, complete(http, px.url, 0, "#"), return_exceptions=True
        )
        assert isinstance(old_answer, AssertionError) and "superseded" in str(old_answer)
        assert isinstance(new_answer, dict), new_answer
        await asyncio.wait_for(pool.wait_quiescent(), 60)
        px.flush_log()
        lines = request_events(logs)
        old, new = lines["e0-0"], lines["e0-1"]
        assert old["outcome"] == "superseded" and "confirm_wait_ms" in old
        # the next keystroke waited for that stop and went where its prompt is
        assert old["upstream"] == new["upstream"] == member.name
        assert new["route_decision"] == "cache_hit"
        assert all(m.gate.free == m.gate.capacity for m in pool.members)


async def _decoding(http: aiohttp.ClientSession, url: str) -> None:
    """Until the server's one slot decodes (its prompt read: a stop takes one token)."""
    async with asyncio.timeout(120):
        while True:
            async with http.get(url + "/slots") as r:
                (slot,) = await r.json()
            if slot["is_processing"] and slot.get("next_token", [{}])[0].get("n_decoded", 0):
                return
            await asyncio.sleep(0.01)
