"""An editor that closes its queued request and sends the next keystroke keeps its place in
the queue (gating/waitlist.py), with one upstream and with a pool."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from tests.helpers.net import wait_until
from tests.helpers.proxy import RunningProxy, run_proxy


@contextlib.asynccontextmanager
async def setup(
    releases: list[asyncio.Event], **overrides: Any
) -> AsyncIterator[tuple[RunningProxy, list[FakeUpstream]]]:
    """One-slot fakes (one, or a pool of several), one per event of ``releases``: a "busy"
    generation on fake i waits for ``releases[i]``."""

    def script_for(release: asyncio.Event) -> Any:
        def script(_path: str, body: dict[str, Any]) -> Script:
            return Script(tokens=2, hold=release if body["prompt"] == "busy" else None)

        return script

    async with contextlib.AsyncExitStack() as stack:
        fakes = [
            await stack.enter_async_context(FakeUpstream(slots=1, script=script_for(r)))
            for r in releases
        ]
        url = ",".join(f.url for f in fakes)
        px = await stack.enter_async_context(run_proxy(url, **overrides))
        yield px, fakes


def queued(px: RunningProxy) -> int:
    pool = px.state.pool
    return len(pool.queue) if pool is not None else len(px.state.pool.queue)


async def post(http: aiohttp.ClientSession, px: RunningProxy, session: str, prompt: str) -> int:
    async with http.post(
        px.url + "/completion",
        json={"prompt": prompt, "n_predict": 2},
        headers={"X-LLMProxy-Session": session},
    ) as r:
        await r.read()
        return r.status


@pytest.mark.parametrize("mode", ["single", "pool"])
@pytest.mark.parametrize("hold_s", [1.0, 0.0])
async def test_a_closed_and_resent_keystroke_keeps_its_sessions_place(
    http: aiohttp.ClientSession, mode: str, hold_s: float
) -> None:
    releases = [asyncio.Event() for _ in range(1 if mode == "single" else 2)]
    async with setup(releases, queue_hold_s=hold_s) as (px, fakes):
        busy = [asyncio.create_task(post(http, px, f"busy{i}", "busy")) for i in range(len(fakes))]
        await wait_until(lambda: sum(len(f.generations) for f in fakes) == len(fakes))
        first = asyncio.create_task(post(http, px, "editor", "a1"))
        await wait_until(lambda: queued(px) == 1, what="a1 queued")
        other = asyncio.create_task(post(http, px, "other", "b"))
        await wait_until(lambda: queued(px) == 2, what="b queued")
        first.cancel()  # the editor closes its request, then sends the next keystroke
        await wait_until(lambda: queued(px) == 1, what="a1 gone")
        second = asyncio.create_task(post(http, px, "editor", "a2"))
        await wait_until(lambda: queued(px) == 2, what="a2 queued")
        releases[0].set()  # one slot frees: the queue's head gets it

        def typed() -> list[str]:
            return [g.body["prompt"] for g in fakes[0].generations if g.body["prompt"] != "busy"]

        await wait_until(lambda: len(typed()) == 1, what="the head sent")
        assert typed() == (["a2"] if hold_s else ["b"])
        for r in releases:
            r.set()
        assert await second == 200 and await other == 200
        assert all(s == 200 for s in await asyncio.gather(*busy))
        with contextlib.suppress(asyncio.CancelledError):
            await first
