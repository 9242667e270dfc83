"""The fake upstream's prompt-cache model (``prefill_s_per_char`` > 0) over real loopback HTTP.

A prompt that extends a slot's cached one evaluates only the extension (counted, reported
in llama-server's ``timings``, and a shorter prefill); requests go to the slot holding
their prefix; an abort during prefill frees the slot and keeps its cache; the ``/infill``
and chat prompt texts; and with the model off the bodies are what they always were.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from llmproxy.bench.fake.prompts import prompt_text
from llmproxy.bench.fake.upstream import FakeUpstream, Script
from tests.helpers.fake import sse_events

QUICK = Script(tokens=2, token_delay_s=0)


async def first_event_after(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[float, list[dict[str, Any]]]:
    """Seconds from sending a streamed request to its first event, and all its events."""
    t0 = time.monotonic()
    async with session.post(url, json={**body, "stream": True}) as r:
        first = await r.content.readline()
        ttfb = time.monotonic() - t0
        raw = first + await r.read()
    return ttfb, [json.loads(e) for e in sse_events(raw) if e != "[DONE]"]


async def test_extension_evaluates_only_its_new_part(session: aiohttp.ClientSession) -> None:
    base, extension = "p" * 500, "e" * 25
    async with FakeUpstream(prefill_s_per_char=0.002, script=lambda _p, _b: QUICK) as up:
        url = up.url + "/completion"
        async with session.post(url, json={"prompt": base}) as r:
            assert (await r.json())["timings"] == {"prompt_n": 500, "cache_n": 0}
        t_ext, ext_events = await first_event_after(session, url, {"prompt": base + extension})
        t_new, new_events = await first_event_after(session, url, {"prompt": "q" * 525})
        first, ext, new = up.generations
        assert (first.prompt_chars_evaluated, first.prompt_chars_cached) == (500, 0)
        assert (ext.prompt_chars_evaluated, ext.prompt_chars_cached) == (25, 500)
        assert (new.prompt_chars_evaluated, new.prompt_chars_cached) == (525, 0)
        assert (up.prompt_chars_evaluated, up.prompt_chars_cached) == (1050, 500)
        assert up.snapshot()["prompt_chars_cached"] == 500
        assert ext_events[-1]["timings"] == {"prompt_n": 25, "cache_n": 500}
        assert new_events[-1]["timings"] == {"prompt_n": 525, "cache_n": 0}
        assert all("timings" not in e for e in ext_events[:-1])
        assert t_new >= 525 * 0.002 and t_ext < 0.5 * t_new  # 50 ms of prefill against 1.05 s
        assert up.slot_prompts == ["q" * 525]


async def test_extensions_go_to_the_slot_holding_their_prefix(
    session: aiohttp.ClientSession,
) -> None:
    prompts = ["a" * 300, "b" * 300, "c" * 300]
    hold = asyncio.Event()
    script = Script(tokens=2, token_delay_s=0, hold=hold)
    async with FakeUpstream(slots=3, prefill_s_per_char=0.0005, script=lambda _p, _b: script) as up:
        url = up.url + "/completion"

        async def slot_of(prompt: str) -> int:
            async with session.post(url, json={"prompt": prompt}) as r:
                return int((await r.json())["id_slot"])

        firsts = [asyncio.create_task(slot_of(p)) for p in prompts]
        await up.wait_for(lambda u: u.slot_busy == [True, True, True])  # one slot each
        hold.set()
        placed = dict(zip(prompts, await asyncio.gather(*firsts), strict=True))
        assert sorted(placed.values()) == [0, 1, 2]
        assert up.slot_prompts == sorted(prompts, key=placed.__getitem__)
        extended = [p + "+" * 10 for p in reversed(prompts)]
        landed = await asyncio.gather(*(slot_of(p) for p in extended))
        assert landed == [placed[p[:300]] for p in extended]
        assert [(r.prompt_chars_evaluated, r.prompt_chars_cached) for r in up.generations[3:]] == [
            (10, 300)
        ] * 3
        assert (up.prompt_chars_evaluated, up.prompt_chars_cached) == (930, 900)


async def test_disconnect_during_prefill_frees_the_slot_and_keeps_its_cache(
    session: aiohttp.ClientSession,
) -> None:
    prompt = "x" * 500  # 25 s of prefill: only the abort can free the slot in time
    async with FakeUpstream(
        prefill_s_per_char=0.05, abort_linger_s=0.05, script=lambda _p, _b: QUICK
    ) as up:
        url = up.url + "/completion"
        r = await session.post(url, json={"prompt": prompt, "stream": True})  # head at start
        assert up.slot_busy == [True] and up.prompt_chars_evaluated == 500
        r.close()
        await up.wait_for(lambda u: u.aborted == [0])
        await up.wait_for(lambda u: u.slot_busy == [False] and u.concurrent == 0)
        assert up.completed == [] and up.slot_prompts == [prompt]
        async with session.post(url, json={"prompt": prompt}) as r2:  # all cached: no prefill
            assert (await r2.json())["timings"] == {"prompt_n": 0, "cache_n": 500}
        assert up.completed == [1]


async def test_model_off_leaves_bodies_as_they_were(session: aiohttp.ClientSession) -> None:
    """The bodies the fake answered before the model existed, byte for byte."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with FakeUpstream(script=lambda _p, _b: QUICK) as up:
        async with session.post(up.url + "/completion", json={"prompt": "abc"}) as r:
            assert await r.read() == (
                b'{"index":0,"content":"t0 t1 ","id_slot":0,"stop":true,"model":"fake",'
                b'"tokens_predicted":2,"tokens_evaluated":1,"stop_type":"limit","truncated":false}'
            )
        async with session.post(up.url + "/v1/chat/completions", json=chat) as r:
            events = sse_events(await r.read())
        assert events[-2:] == [
            '{"id":"cmpl-1","object":"chat.completion.chunk","created":1767225600,'
            '"model":"fake","choices":[{"index":0,"finish_reason":"length","delta":{}}],'
            '"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}',
            "[DONE]",
        ]
        assert [(g.prompt_chars_evaluated, g.prompt_chars_cached) for g in up.generations] == [
            (0, 0)
        ] * 2
        assert (up.prompt_chars_evaluated, up.prompt_chars_cached, up.slot_prompts) == (0, 0, [""])


async def test_infill_and_chat_prompt_texts(session: aiohttp.ClientSession) -> None:
    infill = {
        "input_extra": [{"filename": "a.py", "text": "A = 1\n"}, {"text": "B = 2\n"}],
        "input_prefix": "def f():\n    ",
        "prompt": "ret",
        "input_suffix": "\n",
    }
    messages = [{"role": "user", "content": "hi"}]
    async with FakeUpstream(prefill_s_per_char=1e-6, script=lambda _p, _b: QUICK) as up:
        async with session.post(up.url + "/infill", json=infill) as r:
            assert r.status == 200
        assert up.slot_prompts == ["a.pyA = 1\nB = 2\ndef f():\n    ret\n"]
        async with session.post(
            up.url + "/v1/chat/completions", json={"messages": messages, "stream": True}
        ) as r:
            events = [json.loads(e) for e in sse_events(await r.read()) if e != "[DONE]"]
        assert up.slot_prompts == [json.dumps(messages, sort_keys=True)]
        assert [("timings" in e, "usage" in e) for e in events] == [
            (False, False),
            (False, False),
            (True, True),
        ]
    assert prompt_text("/v1/completions", {"prompt": ["ab", 7, "c"]}) == "abc"
    assert prompt_text("/v1/embeddings", {"input": "x"}) is None
    async with FakeUpstream(kind="openai", prefill_s_per_char=1e-6) as up:
        async with session.post(up.url + "/v1/completions", json={"prompt": "abc"}) as r:
            assert "timings" not in await r.json()  # only llama-server reports timings
        assert up.prompt_chars_evaluated == 3
