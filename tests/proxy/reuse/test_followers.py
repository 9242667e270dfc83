"""Type-through's edge cases through the proxy, on the fake llama-server of
test_type_through.py: a follower made stale by a newer keystroke, typing ahead of the model
while the editor drops each request, divergence after the model wrote text, and an
insertion that reads two ways in a client-built prompt."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import aiohttp
import pytest
import structlog

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from tests.helpers.net import wait_until
from tests.helpers.proxy import RunningProxy, request_events, run_proxy
from tests.proxy.reuse.test_type_through import (
    HEADERS,
    OUTPUT,
    TOKENS,
    answer_text,
    body,
    latest,
    read_so_far,
    setup,
)

ROUTE = "/infill"


async def post(
    http: aiohttp.ClientSession, px: RunningProxy, typed: str, rid: str
) -> tuple[int, str]:
    headers = {**HEADERS, "X-Request-Id": rid}
    async with http.post(px.url + ROUTE, json=body(ROUTE, typed, False), headers=headers) as r:
        if r.status != 200:
            return r.status, json.loads(await r.read())["error"]["type"]
        return r.status, await answer_text(ROUTE, r, False)


async def test_a_follower_of_a_generation_a_newer_keystroke_superseded_is_superseded_too(
    http: aiohttp.ClientSession,
) -> None:
    """Keystroke 1 follows the generation of keystroke 0; keystroke 2 types something else
    and supersedes it. Keystroke 1 is older than 2: it is superseded (499), and 2 runs."""
    async with setup("on") as (fake, px):
        with structlog.testing.capture_logs() as logs:
            first = asyncio.ensure_future(post(http, px, "", "k0"))
            await wait_until(lambda: read_so_far(px, ROUTE) >= 4, what="4 characters")
            follower = asyncio.ensure_future(post(http, px, OUTPUT[:2], "k1"))
            await wait_until(lambda: latest(px, ROUTE).readers == 1, what="the follower joined")
            newer = await post(http, px, "zzz", "k2")
            assert newer == (200, OUTPUT)  # a generation of its own
            assert await follower == (499, "superseded")
            assert await first == (499, "superseded")
            await wait_until(lambda: px.member.gate.free == 1, what="permit back")
            px.flush_log()
        assert len(fake.generations) == 2
        events = request_events(logs)
        assert [events[k]["outcome"] for k in ("k0", "k1", "k2")] == [
            "superseded",
            "superseded",
            "completed",
        ]
        assert not events["k1"]["reached_upstream"]


@pytest.mark.parametrize("stream", [False, True])
async def test_typing_ahead_keeps_the_generation_after_the_editor_dropped_its_request(
    http: aiohttp.ClientSession, stream: bool
) -> None:
    """Continue's and llm-ls's way: the editor closes the previous request, then sends the
    next keystroke, which typed further than the model has written. The generation runs on
    past its grace (0.1 s) for the waiting keystroke, which is answered from it."""

    async def read(typed: str) -> str:
        async with http.post(px.url + ROUTE, json=body(ROUTE, typed, stream), headers=HEADERS) as r:
            return await answer_text(ROUTE, r, stream)

    async with setup("on") as (fake, px):
        first = asyncio.ensure_future(read(""))
        await wait_until(lambda: read_so_far(px, ROUTE) >= 4, what="4 characters")
        first.cancel()  # the editor drops it
        await asyncio.gather(first, return_exceptions=True)
        ahead = OUTPUT[:24]  # 8 tokens, about 0.24 s of generation: past the grace
        assert read_so_far(px, ROUTE) < len(ahead)
        assert await read(ahead) == OUTPUT[len(ahead) :]
        assert len(fake.generations) == 1
        assert fake.aborted == []
        await wait_until(lambda: px.member.gate.free == 1, what="permit back")


LAST = len(OUTPUT) - 1


@pytest.mark.parametrize(("at", "ahead"), [(0, False), (5, False), (20, False), (LAST, False),
                                           (9, True), (20, True)])  # fmt: skip
async def test_diverging_from_what_the_model_wrote_supersedes_and_stops_it(
    http: aiohttp.ClientSession, at: int, ahead: bool
) -> None:
    """The user typed the output up to ``at``, then something else, once the model wrote
    past ``at`` (``ahead``: typed further than the model had written, so the keystroke
    waited until the output contradicted it). The generation is superseded and stopped,
    and the keystroke runs one of its own. At the output's last character the generation
    has ended, complete: nothing to supersede."""
    async with setup("on") as (fake, px):
        with structlog.testing.capture_logs() as logs:
            first = asyncio.ensure_future(post(http, px, "", "k0"))
            typed = OUTPUT[:at] + "X" + ("y" * 8 if ahead else "")
            if ahead:
                await wait_until(lambda: read_so_far(px, ROUTE) >= 3, what="a token")
                assert read_so_far(px, ROUTE) <= at
            elif at == LAST:
                assert await first == (200, OUTPUT)
            else:
                await wait_until(lambda: read_so_far(px, ROUTE) > at, what=f"{at + 1} characters")
            assert await post(http, px, typed, "k1") == (200, OUTPUT)
            if at != LAST:
                assert await first == (499, "superseded")
            await wait_until(lambda: px.member.gate.free == 1, what="permit back")
            px.flush_log()
        events = request_events(logs)
        assert events["k0"]["outcome"] == ("completed" if at == LAST else "superseded")
        assert events["k1"]["outcome"] == "completed"
        assert len(fake.generations) == 2
        assert len(fake.aborted) == (0 if at == LAST else 1)  # stopped at the upstream


async def test_an_insertion_that_reads_two_ways_is_matched_to_what_the_model_wrote(
    http: aiohttp.ClientSession,
) -> None:
    """A client-built prompt whose text after the cursor starts as the typed text ends:
    ``x = |t\\n`` with ``t0`` typed reads as ``t0`` at the cursor or ``0t`` after its ``t``.
    The model wrote ``t0 ...``: that is what the user typed."""
    route = "/completion"

    def prompt_body(typed: str) -> dict[str, Any]:
        return {"prompt": "x = " + typed + "t\n", "n_predict": TOKENS, "stream": False}

    async with setup("on") as (fake, px):
        first = asyncio.ensure_future(
            http.post(px.url + route, json=prompt_body(""), headers=HEADERS)
        )
        await wait_until(lambda: read_so_far(px, route) >= 2, what="2 characters")
        async with http.post(px.url + route, json=prompt_body("t0"), headers=HEADERS) as r:
            assert await answer_text(route, r, False) == OUTPUT[2:]
        (await first).close()
        assert len(fake.generations) == 1


async def test_of_two_keystrokes_waiting_on_the_model_the_older_never_supersedes_the_newer(
    http: aiohttp.ClientSession,
) -> None:
    """Two keystrokes typed ahead of the model wait on it; the output then contradicts the
    older one and confirms the newer. The older is stale (499, never sent upstream): going
    through the gate it would supersede the generation the newer one is answered from."""
    async with setup("on") as (fake, px):
        with structlog.testing.capture_logs() as logs:
            first = asyncio.ensure_future(post(http, px, "", "k0"))
            await wait_until(lambda: read_so_far(px, ROUTE) >= 3, what="a token")
            older = asyncio.ensure_future(post(http, px, "t0 t1 X", "k1"))
            await wait_until(lambda: latest(px, ROUTE).live == 2, what="the older one waiting")
            newer = asyncio.ensure_future(post(http, px, "t0 t1 t2 ", "k2"))
            assert await newer == (200, OUTPUT[9:])
            assert await older == (499, "superseded")
            assert await first == (499, "superseded")
            await wait_until(lambda: px.member.gate.free == 1, what="permit back")
            px.flush_log()
        assert len(fake.generations) == 1
        events = request_events(logs)
        assert [events[k]["outcome"] for k in ("k0", "k1", "k2")] == [
            "superseded",
            "superseded",
            "reused",
        ]
        assert not events["k1"]["reached_upstream"]


@pytest.mark.parametrize("pool", [False, True])
async def test_a_keystroke_that_waited_on_the_generation_goes_first_in_the_queue(
    http: aiohttp.ClientSession, pool: bool
) -> None:
    """A keystroke typed ahead of the model waits on it while another editor's request
    queues for the slot. The output then contradicts the keystroke: it goes through the
    gate at the head of the queue, before the other editor's request. With a pool of two,
    a third editor keeps the other upstream busy."""
    busy = asyncio.Event()

    def script(_path: str, req: dict[str, Any]) -> Script:
        hold = busy if req.get("prompt") == "    busy" else None
        return Script(tokens=TOKENS, token_delay_s=0.03, hold=hold)

    async with contextlib.AsyncExitStack() as stack:
        fakes = [
            await stack.enter_async_context(FakeUpstream(slots=1, script=script))
            for _ in range(2 if pool else 1)
        ]
        px = await stack.enter_async_context(run_proxy(",".join(f.url for f in fakes)))

        def send(typed: str, session: str) -> asyncio.Future[Any]:
            headers = {"X-LLMProxy-Session": session}
            return asyncio.ensure_future(
                http.post(px.url + ROUTE, json=body(ROUTE, typed, False), headers=headers)
            )

        def queued() -> int:
            return len(px.state.pool.queue) if px.state.pool else len(px.state.pool.queue)

        third = send("busy", "third") if pool else None
        if pool:
            await wait_until(lambda: sum(len(f.generations) for f in fakes) == 1, what="busy")
        first = asyncio.ensure_future(post(http, px, "", "k0"))
        await wait_until(lambda: read_so_far(px, ROUTE) >= 3, what="a token")
        other = send("# other file", "other")
        await wait_until(lambda: queued() == 1, what="the other editor queued")
        assert await post(http, px, "t0 t1 X", "k1") == (200, OUTPUT)
        assert await first == (499, "superseded")
        assert (await other).status == 200
        busy.set()
        if third is not None:
            assert (await third).status == 200
        (ours,) = [f for f in fakes if any(g.body["prompt"] == "    " for g in f.generations)]
        prompts = [g.body["prompt"] for g in ours.generations if g.path == ROUTE]
        assert prompts == ["    ", "    t0 t1 X", "    # other file"]
