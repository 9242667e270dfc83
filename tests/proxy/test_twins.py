"""Twins end to end (proxy/twins.py): a session's identical requests at the same time each
run on their own permit and get their own generation; a different request of the session
supersedes all of them together. Both admission paths: one upstream (the gate) and a pool
(its shared queue, then each upstream's gate). The fake upstreams serve ``/slots``."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from tests.helpers.net import wait_until
from tests.helpers.proxy import RunningProxy, run_proxy
from tests.helpers.streams import read_all

TOKENS = 8
OUTPUT = "".join(f"t{i} " for i in range(TOKENS))
HEADERS = {"User-Agent": "curl/8.5.0"}  # no session header: minuet's twins share peer and UA


def body(route: str, stream: bool, line: str = "    re") -> dict[str, Any]:
    """minuet's /v1/completions body (its README's llama.cpp setup), or an /infill one, for
    the cursor's ``line``."""
    if route == "/infill":
        return {
            "input_prefix": "def f():\n",
            "prompt": line,
            "input_suffix": "\n",
            "n_predict": TOKENS,
            "stream": stream,
        }
    prompt = f"<|fim_prefix|>def f():\n{line}<|fim_suffix|>\n<|fim_middle|>"
    return {"model": "PLACEHOLDER", "stream": stream, "max_tokens": TOKENS, "prompt": prompt}


class Upstreams:
    """The fakes behind the proxy, and a gate on their generations (``hold``)."""

    def __init__(self, fakes: list[FakeUpstream]) -> None:
        self.fakes = fakes
        self.hold: asyncio.Event | None = None

    def script(self, _path: str, _body: dict[str, Any]) -> Script:
        return Script(tokens=TOKENS, token_delay_s=0.005, hold=self.hold)

    @property
    def generations(self) -> int:
        return sum(len(f.generations) for f in self.fakes)

    @property
    def running(self) -> int:
        return sum(f.concurrent for f in self.fakes)


@contextlib.asynccontextmanager
async def setup(admission: str) -> AsyncIterator[tuple[Upstreams, RunningProxy]]:
    """One fake of 3 slots behind one upstream, or two of 2 slots behind a pool."""
    sizes = [3] if admission == "single" else [2, 2]
    async with contextlib.AsyncExitStack() as stack:
        ups = Upstreams([])
        for n in sizes:
            fake = FakeUpstream(slots=n, abort_linger_s=0.02, script=ups.script)
            ups.fakes.append(await stack.enter_async_context(fake))
        if admission == "single":
            px = run_proxy(ups.fakes[0].url)
        else:
            specs = [{"url": f.url, "name": f"u{i}"} for i, f in enumerate(ups.fakes)]
            px = run_proxy(None, upstreams=specs, route="least-busy")
        yield ups, await stack.enter_async_context(px)


def text_of(route: str, raw: bytes, stream: bool) -> str:
    objs = [json.loads(raw)] if not stream else []
    if stream:
        for line in raw.split(b"\n"):
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                objs.append(json.loads(line[6:]))
    pieces = []
    for obj in objs:
        assert "error" not in obj, obj
        pieces.append(obj["choices"][0]["text"] if route == "/v1/completions" else obj["content"])
    return "".join(pieces)


async def post(
    http: aiohttp.ClientSession, px: RunningProxy, route: str, stream: bool, line: str = "    re"
) -> tuple[int, bytes, bool]:
    async with http.post(px.url + route, json=body(route, stream, line), headers=HEADERS) as r:
        raw, complete = await read_all(r)
        return r.status, raw, complete


ROUTES = ["/v1/completions", "/infill"]
CASES = [
    (admission, route, stream, n)
    for admission in ("single", "pool")
    for route in ROUTES
    for stream in (False, True)
    for n in (2, 3)
]


@pytest.mark.parametrize(("admission", "route", "stream", "n"), CASES)
async def test_twins_all_complete_with_their_own_generations(
    http: aiohttp.ClientSession, admission: str, stream: bool, route: str, n: int
) -> None:
    async with asyncio.timeout(10), setup(admission) as (ups, px):
        ups.hold = asyncio.Event()
        twins = [asyncio.ensure_future(post(http, px, route, stream)) for _ in range(n)]
        # all of them at the upstream at once, each on a slot of its own
        await wait_until(lambda: ups.running == n, what=f"{n} twins running")
        ups.hold.set()
        for status, raw, complete in await asyncio.gather(*twins):
            assert (status, complete) == (200, True), raw
            assert text_of(route, raw, stream) == OUTPUT
        assert ups.generations == n
        await wait_until(lambda: ups.running == 0, what="upstreams idle")


@pytest.mark.parametrize(("admission", "route", "stream", "n"), CASES)
async def test_a_different_request_supersedes_all_the_twins(
    http: aiohttp.ClientSession, admission: str, stream: bool, route: str, n: int
) -> None:
    """Twins running and one queued behind them (where the slots are full): the session's
    next keystroke supersedes every one of them and runs."""
    async with asyncio.timeout(10), setup(admission) as (ups, px):
        ups.hold = asyncio.Event()
        slots = sum(len(f.table.slots) for f in ups.fakes)
        twins = [asyncio.ensure_future(post(http, px, route, stream)) for _ in range(n + 1)]
        await wait_until(lambda: ups.running == min(n + 1, slots), what="the twins running")
        ups.hold = None  # the newer request's generation runs at once
        # a different line, no continuation of theirs (type-through would wait on them)
        status, raw, _ = await post(http, px, route, stream, line="    ro")
        assert status == 200 and text_of(route, raw, stream) == OUTPUT
        for status, raw, complete in await asyncio.gather(*twins):
            if status == 200:  # a stream that had started: its superseded event, then cut
                assert stream and not complete, raw
                assert b'"type":"superseded"' in raw
            else:
                assert json.loads(raw)["error"]["type"] == "superseded"
                assert status == 499
        assert ups.generations == min(n + 1, slots) + 1
