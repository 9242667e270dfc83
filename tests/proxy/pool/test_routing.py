"""Several upstreams behind one queue, routed by ``--route`` (fake llama-servers, loopback)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
import structlog

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from tests.helpers.proxy import RunningProxy, request_events, run_proxy

PREFIXES = ["alpha " * 200, "bravo " * 200, "charlie " * 150]  # one file per editor


def quick(_path: str, _body: dict[str, Any]) -> Script:
    return Script(tokens=4, token_delay_s=0.005)


@contextlib.asynccontextmanager
async def pool(
    n: int,
    route: str,
    slots: int = 1,
    prefill: float = 0.0,
    script: Callable[[str, dict[str, Any]], Script] = quick,
    **overrides: Any,
) -> AsyncIterator[tuple[list[FakeUpstream], RunningProxy]]:
    async with contextlib.AsyncExitStack() as stack:
        fakes = [
            await stack.enter_async_context(
                FakeUpstream(slots=slots, script=script, prefill_s_per_char=prefill)
            )
            for _ in range(n)
        ]
        specs = [{"url": f.url, "name": f"u{i}"} for i, f in enumerate(fakes)]
        px = await stack.enter_async_context(
            run_proxy(None, upstreams=specs, route=route, **overrides)
        )
        yield fakes, px


async def complete(
    http: aiohttp.ClientSession, px: RunningProxy, prompt: str, session: str, rid: str = ""
) -> int:
    headers = {"X-LLMProxy-Session": session, "X-Request-Id": rid or session}
    async with http.post(px.url + "/completion", json={"prompt": prompt}, headers=headers) as r:
        await r.read()
        return r.status


def prompts_at(fake: FakeUpstream) -> list[str]:
    return [str(r.body["prompt"]) for r in fake.generations if r.body]


async def test_cache_sends_each_editor_to_the_upstream_holding_its_file(
    http: aiohttp.ClientSession,
) -> None:
    async with pool(3, "cache") as (fakes, px):
        with structlog.testing.capture_logs() as logs:

            async def editor(k: int) -> None:
                for i in range(6):  # typing: each request's prompt extends the last one's
                    text = PREFIXES[k] + "x" * i
                    assert await complete(http, px, text, f"e{k}", f"e{k}-{i}") == 200

            await asyncio.gather(*(editor(k) for k in range(3)))
            px.flush_log()
        for fake in fakes:  # every upstream served one editor, all of its requests
            owners = {p[:6] for p in prompts_at(fake)}
            assert len(owners) == 1 and len(prompts_at(fake)) == 6, owners
        decisions = [e["route_decision"] for e in request_events(logs).values()]
        assert decisions.count("cache_hit") == 15 and decisions.count("cache_miss") == 3
        assert all(f.max_concurrent <= 1 for f in fakes)


async def test_cache_still_spreads_one_busy_editor(http: aiohttp.ClientSession) -> None:
    """Requests for one file (from its several sessions: tabs, tools) all prefer its
    upstream; once it is busy they take free ones instead of queueing behind it."""

    def slow(_path: str, _body: dict[str, Any]) -> Script:  # much longer than the wait
        return Script(tokens=20, token_delay_s=0.01)

    async with pool(3, "cache", script=slow, affinity_wait_s=0.02) as (fakes, px):
        assert await complete(http, px, PREFIXES[0], "warm") == 200
        statuses = await asyncio.gather(
            *(complete(http, px, PREFIXES[0] + str(i), f"s{i}") for i in range(9))
        )
        assert statuses == [200] * 9
        assert sum(1 for f in fakes if f.generations) >= 2
        assert all(f.max_concurrent <= 1 for f in fakes)


async def test_session_keeps_each_session_on_its_upstream(http: aiohttp.ClientSession) -> None:
    async with pool(3, "session") as (fakes, px):
        for _ in range(3):
            for s in range(12):
                assert await complete(http, px, f"{s}:" + "z" * 50, f"s{s}") == 200
        homes = {}
        for k, fake in enumerate(fakes):
            for p in prompts_at(fake):
                homes.setdefault(p.split(":")[0], set()).add(k)
        assert all(len(h) == 1 for h in homes.values()) and len(homes) == 12
        assert len({next(iter(h)) for h in homes.values()}) > 1  # and not all on one


@pytest.mark.parametrize("route", ["round-robin", "least-busy"])
async def test_load_policies_spread_evenly(http: aiohttp.ClientSession, route: str) -> None:
    async with pool(3, route, slots=2) as (fakes, px):
        for i in range(6):  # one at a time: round robin takes turns, least-busy ties
            assert await complete(http, px, "p" * 100, f"s{i}") == 200
        if route == "round-robin":
            assert [len(f.generations) for f in fakes] == [2, 2, 2]
        statuses = await asyncio.gather(*(complete(http, px, "q", f"t{i}") for i in range(12)))
        assert statuses == [200] * 12
        assert all(f.max_concurrent <= 2 for f in fakes)
        assert all(len(f.generations) >= 3 for f in fakes)


@pytest.mark.parametrize("route", ["cache", "round-robin"])
async def test_the_upstreams_prompt_caches_hit_with_cache_routing(
    http: aiohttp.ClientSession, route: str
) -> None:
    """The fakes model a prompt cache per slot: with cache routing nearly every prompt
    character is already cached where it lands; taking turns, most have to be evaluated."""
    async with pool(3, route, prefill=1e-5) as (fakes, px):
        for i in range(6):  # two editors taking turns (3 upstreams: no accidental match)
            for k in range(2):
                assert await complete(http, px, PREFIXES[k] + "x" * i, f"e{k}", f"{k}-{i}") == 200
        cached = sum(f.prompt_chars_cached for f in fakes)
        evaluated = sum(f.prompt_chars_evaluated for f in fakes)
        ratio = cached / (cached + evaluated)
        if route == "cache":
            assert ratio > 0.8, (cached, evaluated)  # only each file's first request misses
        else:
            assert ratio < 0.5, (cached, evaluated)
