"""Type-through through the proxy: a keystroke that types what the model is writing is
answered from that generation, on a fake llama-server with deterministic output.

The fake writes ``t0 t1 t2 ...`` whatever the prompt, so the typist knows the output in
advance and types it one character per request."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.proxy.gating.sessions import session_key
from llmproxy.proxy.reuse.generation import Generation
from tests.helpers.net import wait_until
from tests.helpers.proxy import RunningProxy, run_proxy

TOKENS = 12
OUTPUT = "".join(f"t{i} " for i in range(TOKENS))
HEADERS = {"X-LLMProxy-Session": "editor"}
ROUTES = ["/infill", "/completion", "/completion (plain)", "/v1/completions"]


def body(route: str, typed: str, stream: bool, **extra: Any) -> dict[str, Any]:
    """The request an editor sends once it typed ``typed`` after the cursor's start."""
    if route == "/infill":
        base = {"input_prefix": "def f():\n", "prompt": "    " + typed, "input_suffix": "\n"}
        return {**base, "n_predict": TOKENS, "stream": stream, **extra}
    if route == "/completion":  # a fill-in-the-middle prompt the client built (Continue)
        prompt = "<fim_prefix>x = " + typed + "<fim_suffix>\n<fim_middle>"
        return {"prompt": prompt, "n_predict": TOKENS, "stream": stream, **extra}
    if route == "/completion (plain)":  # plain continuation: the cursor at the prompt's end
        return {"prompt": "x = " + typed, "n_predict": TOKENS, "stream": stream, **extra}
    return {"model": "m", "prompt": "x = " + typed, "max_tokens": TOKENS, "stream": stream, **extra}


async def answer_text(route: str, resp: aiohttp.ClientResponse, stream: bool) -> str:
    """The completion text of a response, stream or not."""
    assert resp.status == 200, await resp.text()
    if not stream:
        raw = await resp.read()
        obj = json.loads(raw)
        if route == "/v1/completions":
            return str(obj["choices"][0]["text"])
        assert re.search(rb'"content"\s*:"', raw)  # llama.vim finds the text this way
        return str(obj["content"])
    text = []
    async for line in resp.content:
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            if route == "/v1/completions":
                text.append(obj["choices"][0]["text"])
            else:
                text.append(obj["content"])
    return "".join(text)


def latest(px: RunningProxy, path: str) -> Generation | None:
    """The editor session's latest generation in the proxy."""
    key = session_key(
        parts=[], header_name="X-LLMProxy-Session", headers=HEADERS, peer=None, path=path, body=None
    )
    assert px.state.generations is not None
    return px.state.generations.latest(key)


def read_so_far(px: RunningProxy, path: str) -> int:
    """Characters of the session's generation the proxy has read from the upstream."""
    generation = latest(px, path)
    return 0 if generation is None else len(generation.text)


@asynccontextmanager
async def setup(
    type_through: str, delay_s: float = 0.03
) -> AsyncIterator[tuple[FakeUpstream, RunningProxy]]:
    def script(_path: str, _body: dict[str, Any]) -> Script:
        return Script(tokens=TOKENS, token_delay_s=delay_s)

    async with (
        FakeUpstream(kind="llamacpp", slots=1, script=script, abort_linger_s=0.01) as fake,
        run_proxy(fake.url, type_through=type_through) as px,
    ):
        yield fake, px


async def outcome(route: str, resp: aiohttp.ClientResponse, stream: bool) -> tuple[str, str]:
    """(completion text read, how it ended: "ok" or the error type) of a response. A stream
    the proxy ends with its error event is cut after it, without its terminator
    (relay/error_event.py): "cut" if one ends so without the event. The upstream's own
    error event is relayed as it came."""
    if resp.status != 200:
        return "", json.loads(await resp.read())["error"]["type"]
    if not stream:
        return await answer_text(route, resp, stream), "ok"
    text, end, ours = [], "ok", False
    try:
        async for line in resp.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                obj = json.loads(line[6:])
                if "error" in obj:
                    end, ours = obj["error"]["type"], obj["error"].get("src") == "llmproxy"
                elif route == "/v1/completions":
                    text.append(obj["choices"][0]["text"])
                else:
                    text.append(obj["content"])
    except aiohttp.ClientPayloadError:
        end = "cut" if end == "ok" else end
    else:
        assert not ours, f"{end}: the proxy's error event must be followed by the cut"
    return "".join(text), end


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ROUTES)
async def test_a_typist_typing_the_output_is_answered_from_one_generation(
    http: aiohttp.ClientSession, route: str, stream: bool
) -> None:
    """Keystrokes that type what the model wrote, sent while the generation runs: each
    continues it and supersedes the keystroke before (which ends with 499, or its stream
    with the superseded event, after a part of its answer); the newest gets the output's
    remainder. The upstream runs one generation in all, on one permit."""
    async with setup("on") as (fake, px):
        path = route.split()[0]

        async def keystroke(n: int) -> tuple[str, str]:
            async with http.post(
                px.url + path, json=body(route, OUTPUT[:n], stream), headers=HEADERS
            ) as r:
                return await outcome(path, r, stream)

        keys = [asyncio.ensure_future(keystroke(0))]
        await fake.wait_for(lambda f: len(f.generations) == 1)
        # the user types what the model wrote (what an editor showed them)
        await wait_until(lambda: read_so_far(px, path) >= 8, what="8 characters")
        for n in range(1, 8):
            keys.append(asyncio.ensure_future(keystroke(n)))
            await wait_until(lambda n=n: joined(px, path) == n, what=f"keystroke {n} joined")
            assert px.member.gate.free == 0  # still the first request's permit only
        answers = await asyncio.gather(*keys)
        assert answers[-1] == (OUTPUT[7:], "ok")
        for n, (text, end) in enumerate(answers[:-1]):
            assert end == "superseded", (n, text, end)
            assert OUTPUT[n:].startswith(text), (n, text)
            assert stream or text == ""
        # after the generation ended, a later keystroke is answered from what it wrote
        assert await keystroke(9) == (OUTPUT[9:], "ok")
        assert len(fake.generations) == 1
        await wait_until(lambda: px.member.gate.free == 1, what="permit back")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ROUTES)
async def test_a_typist_who_reads_each_answer_gets_the_remainder_every_time(
    http: aiohttp.ClientSession, route: str, stream: bool
) -> None:
    """llama.vim's way: a keystroke's request goes out once the previous answer was read.
    Every answer is the output's remainder, from the one generation."""
    async with setup("on", delay_s=0.005) as (fake, px):
        path = route.split()[0]
        for n in range(8):
            async with http.post(
                px.url + path, json=body(route, OUTPUT[:n], stream), headers=HEADERS
            ) as r:
                assert await answer_text(path, r, stream) == OUTPUT[n:]
        assert len(fake.generations) == 1


def joined(px: RunningProxy, path: str) -> int:
    """Keystrokes answered from the session's generation so far."""
    generation = latest(px, path)
    return 0 if generation is None else generation.readers


@pytest.mark.parametrize("type_through", ["on", "off"])
async def test_an_editor_that_drops_each_request_for_the_next(
    http: aiohttp.ClientSession, type_through: str
) -> None:
    """llama.vim's way: each keystroke closes the previous request and sends the next. With
    type-through the generation survives the drops; without, each keystroke starts one."""
    route, keys = "/infill", 6
    async with setup(type_through) as (fake, px):
        pending: asyncio.Future[str] | None = None

        async def keystroke(n: int) -> str:
            async with http.post(
                px.url + route, json=body(route, OUTPUT[:n], False), headers=HEADERS
            ) as r:
                return await answer_text(route, r, False)

        for n in range(keys):
            if pending is not None:
                pending.cancel()
            pending = asyncio.ensure_future(keystroke(n))
            if type_through == "off":  # each keystroke's request reaches the upstream first
                await fake.wait_for(lambda f, want=n + 1: len(f.generations) >= want)
            else:  # the user types what the model wrote so far
                await wait_until(lambda n=n: read_so_far(px, route) > n, what="the next piece")
            await asyncio.sleep(0.04)  # the typist's pace
        assert pending is not None
        # the last keystroke gets the remainder, or a whole generation of its own
        assert await pending == (OUTPUT[keys - 1 :] if type_through == "on" else OUTPUT)
        await wait_until(lambda: px.member.gate.free == 1 and fake.concurrent == 0, what="idle")
        if type_through == "on":
            assert len(fake.generations) == 1
        else:
            assert len(fake.generations) == keys


@pytest.mark.parametrize("at", [0, 5, len(OUTPUT) - 1])
async def test_typing_something_else_supersedes_the_generation(
    http: aiohttp.ClientSession, at: int
) -> None:
    route = "/completion"
    async with setup("on") as (fake, px):
        first = asyncio.ensure_future(
            http.post(px.url + route, json=body(route, "", True), headers=HEADERS)
        )
        await fake.wait_for(lambda f: len(f.generations) == 1)
        diverged = OUTPUT[:at] + "X"
        async with http.post(
            px.url + route, json=body(route, diverged, False), headers=HEADERS
        ) as r:
            assert await answer_text(route, r, False) == OUTPUT  # a generation of its own
        assert len(fake.generations) == 2
        resp = await first
        resp.close()
        await wait_until(lambda: px.member.gate.free == 1, what="permit back")


@pytest.mark.parametrize(
    "change",
    [
        {"typed": "t"},  # the first request typed "t0"; this one took the "0" back
        {"input_suffix": "\n\nmore\n"},
        {"n_predict": TOKENS - 1},
        {"temperature": 0.5},
    ],
)
async def test_never_reused(http: aiohttp.ClientSession, change: dict[str, Any]) -> None:
    route = "/infill"
    async with setup("on", delay_s=0.001) as (fake, px):
        async with http.post(px.url + route, json=body(route, "t0", False), headers=HEADERS) as r:
            assert await answer_text(route, r, False) == OUTPUT
        typed = change.pop("typed", "t0 t")
        async with http.post(
            px.url + route, json=body(route, typed, False, **change), headers=HEADERS
        ) as r:  # a generation of its own (the fake writes n_predict tokens)
            n = change.get("n_predict", TOKENS)
            assert await answer_text(route, r, False) == "".join(f"t{i} " for i in range(n))
        assert len(fake.generations) == 2


async def test_reuse_is_logged_and_counted(http: aiohttp.ClientSession) -> None:
    route = "/infill"
    async with setup("on", delay_s=0.001) as (fake, px):
        async with http.post(px.url + route, json=body(route, "", False), headers=HEADERS) as r:
            await answer_text(route, r, False)
        async with http.post(px.url + route, json=body(route, "t0 t", False), headers=HEADERS) as r:
            assert await answer_text(route, r, False) == OUTPUT[4:]
        async with http.get(px.url + "/llmproxy/metrics") as r:
            metrics = await r.text()
        assert re.search(r"^llmproxy_reused_tokens_total 11\.0$", metrics, re.M), metrics
        assert re.search(r'^llmproxy_requests_total\{.*outcome="reused".*\} 1\.0$', metrics, re.M)
        assert len(fake.generations) == 1


async def test_an_error_event_in_the_generation_reaches_the_request_reading_it(
    http: aiohttp.ClientSession,
) -> None:
    """The upstream's error event ends the answer of the keystroke reading the generation
    then; the keystrokes it superseded ended with the superseded event before."""
    route = "/completion"

    def script(_path: str, _body: dict[str, Any]) -> Script:
        return Script(tokens=TOKENS, token_delay_s=0.03, fail="error_event")

    async def keystroke(n: int) -> tuple[str, str]:
        async with http.post(
            px.url + route, json=body(route, OUTPUT[:n], True), headers=HEADERS
        ) as r:
            return await outcome(route, r, True)

    async with (
        FakeUpstream(kind="llamacpp", slots=1, script=script) as fake,
        run_proxy(fake.url) as px,
    ):
        keys = [asyncio.ensure_future(keystroke(0))]
        await fake.wait_for(lambda f: len(f.generations) == 1)
        await wait_until(lambda: read_so_far(px, route) >= 4, what="4 characters")
        for i, n in enumerate((1, 2, 4), start=1):
            keys.append(asyncio.ensure_future(keystroke(n)))
            await wait_until(lambda i=i: joined(px, route) == i, what=f"keystroke {n} joined")
        ends = [end for _text, end in await asyncio.gather(*keys)]
        assert ends == ["superseded", "superseded", "superseded", "server_error"]
        assert len(fake.generations) == 1
        await wait_until(lambda: px.member.gate.free == 1, what="permit back")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_keystroke_on_a_generation_that_fails_first_runs_on_its_own(
    http: aiohttp.ClientSession, stream: bool
) -> None:
    """The upstream resets the generation after 6 tokens, before it wrote anything past what
    the next keystroke typed: that keystroke is sent to the upstream as a request of its
    own and gets a whole answer, not the failed generation's error."""
    route, cut = "/completion", len(OUTPUT[: 6 * 3])  # "t0 " .. "t5 "

    def script(_path: str, req: dict[str, Any]) -> Script:
        first = req["prompt"] == body(route, "", stream)["prompt"]
        return Script(tokens=TOKENS, token_delay_s=0.03, fail="reset_mid_stream" if first else None)

    async with (
        FakeUpstream(kind="llamacpp", slots=1, script=script) as fake,
        run_proxy(fake.url) as px,
    ):
        first = asyncio.ensure_future(
            http.post(px.url + route, json=body(route, "", stream), headers=HEADERS)
        )
        await wait_until(lambda: read_so_far(px, route) >= 4, what="4 characters")
        typed = OUTPUT[:cut] if stream else OUTPUT[:4]  # a stream types what it will all write
        async with http.post(px.url + route, json=body(route, typed, stream), headers=HEADERS) as r:
            assert await answer_text(route, r, stream) == OUTPUT
        (await first).close()
        assert len(fake.generations) == 2
        await wait_until(lambda: px.member.gate.free == 1, what="permit back")
