"""``--preempt solo`` (pool/preempt.py ``solo``, ``beside``): a completion that lived
``preempt_after_ms`` runs alone on its upstream even where a slot is free. The chats there
pause (stopped and resumed exactly, one answer for their clients) and none starts beside
it until it ends. Through the real app, against the fake llama-server with two slots (the
reserve keeps one for completions), which continues its own answers as a deterministic
model does."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from llmproxy.bench.fake.script import Script
from llmproxy.bench.fake.shapes import text
from llmproxy.bench.fake.upstream import FakeUpstream
from tests.helpers.net import wait_until
from tests.helpers.proxy import RunningProxy, run_proxy
from tests.proxy.test_preemption import (
    CHAT,
    TOKENS,
    keystroke,
    long_request,
    offered,
    streamed_text,
)

PATH = "/v1/chat/completions"


def held_infill(
    hold: asyncio.Event, tokens: int = TOKENS, chat: asyncio.Event | None = None
) -> Any:
    """The fake's script: a keystroke's completion generates only once ``hold`` is set; a
    chat answer of ``tokens`` (10 ms each), only once ``chat`` is set, if given."""

    def scripted(path: str, body: dict[str, Any]) -> Script:
        if path == "/infill":
            return Script(tokens=4, token_delay_s=0.001, hold=hold)
        return Script(tokens=tokens, token_delay_s=0.01, hold=chat)

    return scripted


def chats_running(fake: FakeUpstream) -> int:
    """Chat generations on the fake's slots now (begun, neither completed nor aborted)."""
    ended = set(fake.completed) | set(fake.aborted)
    return len([g for g in fake.generations if g.path == PATH and g.id not in ended])


def completion_running(px: RunningProxy) -> bool:
    return any(t.klass == "complete" for t in px.member.gate.inflight_snapshot())


@pytest.mark.parametrize(
    ("settings", "paused"),
    [
        ({"preempt": "solo", "preempt_after_ms": 0}, True),
        ({"preempt": "on", "preempt_after_ms": 0}, False),  # a slot is free: no preemption
        # a keystroke replaced within preempt_after_ms never pauses anything
        ({"preempt": "solo", "preempt_after_ms": 60_000}, False),
        # running past its class's bound, it waited none of it: paused all the same
        ({"preempt": "solo", "preempt_after_ms": 0, "class_max_wait_s": "chat=0.01"}, True),
    ],
    ids=["solo", "on", "young", "ran-past-bound"],
)
async def test_a_completion_runs_alone_while_the_chat_pauses_and_resumes_exactly(
    http: aiohttp.ClientSession, settings: dict[str, Any], paused: bool
) -> None:
    hold = asyncio.Event()
    started = asyncio.Event()
    async with (
        FakeUpstream(slots=2, continues=True, script=held_infill(hold)) as fake,
        run_proxy(fake.url, type_through="off", **settings) as px,
    ):
        long = asyncio.create_task(long_request(http, px, PATH, CHAT, started))
        await started.wait()
        await wait_until(lambda: offered(px), what="the chat under way")
        answer = asyncio.create_task(keystroke(http, px))
        await fake.wait_for(lambda f: any(g.path == "/infill" for g in f.generations))
        if paused:  # stopped while the completion is held before its first token
            # the completion alone on the server (the chat's slot given back)
            await fake.wait_for(lambda f: chats_running(f) == 0 and f.slot_busy.count(True) == 1)
            # its stop confirmed, the chat waits to resume: not beside the completion
            await wait_until(lambda: len(px.state.pool.queue) == 1, what="the chat waiting")
            assert px.member.gate.free == 1 and fake.slot_busy.count(True) == 1
        hold.set()
        assert (await answer)["content"] == text(4)
        status, raw = await long
        assert status == 200 and streamed_text(PATH, raw) == text(TOKENS)
        chats = [g for g in fake.generations if g.path == PATH]
        assert len(chats) == (2 if paused else 1)
        assert px.state.pool.preemptions == (1 if paused else 0)
        assert fake.deferred == []


async def test_no_chat_starts_beside_a_completion_running_alone(
    http: aiohttp.ClientSession,
) -> None:
    hold = asyncio.Event()
    async with (
        FakeUpstream(slots=2, continues=True, script=held_infill(hold)) as fake,
        run_proxy(fake.url, type_through="off", preempt="solo", preempt_after_ms=0) as px,
    ):
        answer = asyncio.create_task(keystroke(http, px))
        await wait_until(lambda: completion_running(px), what="the completion granted")
        long = asyncio.create_task(long_request(http, px, PATH, CHAT, asyncio.Event()))
        await wait_until(lambda: len(px.state.pool.queue) == 1, what="the chat waiting")
        assert fake.slot_busy.count(True) == 1 and px.member.gate.free == 1
        hold.set()
        assert (await answer)["content"] == text(4)
        status, raw = await long
        assert status == 200 and streamed_text(PATH, raw) == text(TOKENS)
        assert px.state.pool.preemptions == 0


async def test_with_preempt_on_a_chat_starts_beside_a_completion(
    http: aiohttp.ClientSession,
) -> None:
    hold = asyncio.Event()
    async with (
        FakeUpstream(slots=3, continues=True, script=held_infill(hold)) as fake,
        run_proxy(fake.url, type_through="off", preempt="on", preempt_after_ms=0) as px,
    ):
        answer = asyncio.create_task(keystroke(http, px))
        await wait_until(lambda: completion_running(px), what="the completion granted")
        started = asyncio.Event()
        long = asyncio.create_task(long_request(http, px, PATH, CHAT, started))
        await started.wait()  # beside the held completion
        assert fake.slot_busy.count(True) == 2
        hold.set()
        await answer
        status, _ = await long
        assert status == 200


async def test_a_chat_that_offers_its_resume_late_is_paused_once_it_does(
    http: aiohttp.ClientSession,
) -> None:
    """The chat was granted before the completion came of age but had no event yet (so it
    could not be resumed): the scheduler looks again until it offers, then pauses it."""
    infill, chat = asyncio.Event(), asyncio.Event()

    async with (
        FakeUpstream(slots=2, continues=True, script=held_infill(infill, chat=chat)) as fake,
        run_proxy(fake.url, type_through="off", preempt="solo", preempt_after_ms=0) as px,
    ):
        long = asyncio.create_task(long_request(http, px, PATH, CHAT, asyncio.Event()))
        await fake.wait_for(lambda f: chats_running(f) == 1)  # on its slot, no event yet
        answer = asyncio.create_task(keystroke(http, px))
        await fake.wait_for(lambda f: any(g.path == "/infill" for g in f.generations))
        assert px.state.pool.preemptions == 0 and not offered(px)
        chat.set()  # its first event: it offers its resume, and is paused
        await wait_until(lambda: px.state.pool.preemptions == 1, what="the chat paused")
        await fake.wait_for(lambda f: chats_running(f) == 0 and f.slot_busy.count(True) == 1)
        infill.set()
        assert (await answer)["content"] == text(4)
        status, raw = await long
        assert status == 200 and streamed_text(PATH, raw) == text(TOKENS)


async def test_a_completion_pauses_the_chat_once_it_comes_of_age(
    http: aiohttp.ClientSession,
) -> None:
    """Granted at once beside the chat, the completion pauses it only once it has lived
    ``preempt_after_ms``: a timer, with nothing else happening meanwhile."""
    hold = asyncio.Event()
    started = asyncio.Event()
    tokens = 300  # 3 s: the chat outlives the completion's 0.5 s

    async with (
        FakeUpstream(slots=2, continues=True, script=held_infill(hold, tokens)) as fake,
        run_proxy(fake.url, type_through="off", preempt="solo", preempt_after_ms=500) as px,
    ):
        long = asyncio.create_task(long_request(http, px, PATH, CHAT, started))
        await started.wait()
        await wait_until(lambda: offered(px), what="the chat under way")
        answer = asyncio.create_task(keystroke(http, px))
        await fake.wait_for(lambda f: any(g.path == "/infill" for g in f.generations))
        assert px.state.pool.preemptions == 0  # young yet: the chat runs beside it
        await wait_until(lambda: px.state.pool.preemptions == 1, what="the chat paused")
        await fake.wait_for(lambda f: chats_running(f) == 0 and f.slot_busy.count(True) == 1)
        hold.set()
        assert (await answer)["content"] == text(4)
        status, raw = await long
        assert status == 200 and streamed_text(PATH, raw) == text(tokens)


async def test_a_chat_held_back_starts_at_its_class_bound_while_the_completion_runs(
    http: aiohttp.ClientSession,
) -> None:
    """A chat held back beside a completion of age starts once it has waited its class's
    ``class_max_wait_s``, though the completion still runs (nothing starves): a timer, with
    no health probe or other request to look at the queue again meanwhile."""
    hold = asyncio.Event()
    started = asyncio.Event()
    settings: dict[str, Any] = {"preempt": "solo", "preempt_after_ms": 0, "type_through": "off"}
    async with (
        FakeUpstream(slots=2, continues=True, script=held_infill(hold)) as fake,
        run_proxy(fake.url, class_max_wait_s="chat=0.3", health_interval_s=60, **settings) as px,
    ):
        answer = asyncio.create_task(keystroke(http, px))
        await wait_until(lambda: completion_running(px), what="the completion granted")
        long = asyncio.create_task(long_request(http, px, PATH, CHAT, started))
        await wait_until(lambda: len(px.state.pool.queue) == 1, what="the chat held back")
        await asyncio.wait_for(started.wait(), 3)  # at 0.3 s, beside the held completion
        assert not answer.done() and fake.slot_busy == [True, True]
        hold.set()
        await answer
        status, raw = await long
        assert status == 200 and streamed_text(PATH, raw) == text(TOKENS)
        assert px.state.pool.preemptions == 0
