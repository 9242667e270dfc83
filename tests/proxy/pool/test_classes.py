"""Request classes (gating/classes.py) in the scheduler: completions before chats before
bulk work, aging, the reserve of permits for completions; and how a request gets its
class (route, header, caller's key), through the real app."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import structlog
from pydantic import ValidationError

from llmproxy.bench.fake.script import Script
from llmproxy.bench.fake.upstream import FakeUpstream
from llmproxy.proxy.errors import BadRequest
from llmproxy.proxy.gating.classes import request_class, route_class
from llmproxy.proxy.pool.entry import Entry
from llmproxy.proxy.pool.pool import Pool
from llmproxy.proxy.settings import ProxySettings
from tests.helpers.net import wait_until
from tests.helpers.proxy import request_events, run_proxy
from tests.helpers.scheduler import make_pool, submit


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:  # never used to connect here
        yield s


async def finish(pool: Pool, entry: Entry) -> None:
    placement = await pool.acquire(entry, 1)
    placement.member.gate.take(placement.ticket)
    placement.member.gate.release(placement.ticket)


def test_a_route_has_a_class_that_a_header_or_key_may_lower_only() -> None:
    assert [route_class(p) for p in ("/infill", "/v1/chat/completions", "/v1/embeddings")] == [
        "complete",
        "chat",
        "bulk",
    ]
    assert request_class("/infill", "chat", None) == "chat"
    assert request_class("/v1/chat/completions", "complete", None) == "chat"  # never raised
    assert request_class("/infill", None, ("chat", "bulk")) == "chat"  # the key's best
    assert request_class("/v1/embeddings", "Chat", ("complete",)) == "bulk"
    with pytest.raises(BadRequest, match="X-LLMProxy-Class"):
        request_class("/infill", "urgent", None)


async def test_a_waiting_completion_goes_before_an_earlier_chat(
    session: aiohttp.ClientSession,
) -> None:
    pool, (m,) = make_pool(session, [1])
    running = submit(pool, "x", "x")
    chat = submit(pool, "c", "c", klass="chat")
    bulk = submit(pool, "b", "b", klass="bulk")
    complete = submit(pool, "k", "k")
    await finish(pool, running)
    assert complete.future.done() and not chat.future.done()
    await finish(pool, complete)
    assert chat.future.done() and not bulk.future.done()
    await finish(pool, chat)
    await finish(pool, bulk)
    assert m.gate.free == 1


async def test_classes_off_is_one_fifo_queue(session: aiohttp.ClientSession) -> None:
    pool, _ = make_pool(session, [1], classes="off")
    running = submit(pool, "x", "x")
    chat = submit(pool, "c", "c", klass="chat")
    complete = submit(pool, "k", "k")
    await finish(pool, running)
    assert chat.future.done() and not complete.future.done()
    await finish(pool, chat)
    await finish(pool, complete)


async def test_a_chat_that_waited_its_max_wait_goes_as_a_completion(
    session: aiohttp.ClientSession,
) -> None:
    pool, _ = make_pool(session, [1], class_max_wait_s={"chat": 5.0})
    running = submit(pool, "x", "x")
    chat = submit(pool, "c", "c", klass="chat")
    complete = submit(pool, "k", "k")
    chat.created -= 5.0  # it has waited its class's bound
    chat.ticket.queued_at -= 5.0
    await finish(pool, running)
    assert chat.future.done() and not complete.future.done()  # first in the class above
    await finish(pool, chat)
    await finish(pool, complete)


async def test_a_bulk_request_ages_one_class_per_max_wait(session: aiohttp.ClientSession) -> None:
    pool, _ = make_pool(session, [1], class_max_wait_s={"bulk": 2.0})
    running = submit(pool, "x", "x")
    bulk = submit(pool, "b", "b", klass="bulk")
    complete = submit(pool, "k", "k")
    bulk.created -= 2.0  # served as a chat now: still after the completion
    bulk.ticket.queued_at -= 2.0
    await finish(pool, running)
    assert complete.future.done() and not bulk.future.done()
    bulk.created -= 2.0  # and as a completion, older than the next one
    bulk.ticket.queued_at -= 2.0
    later = submit(pool, "k2", "k2")
    await finish(pool, complete)
    assert bulk.future.done() and not later.future.done()
    await finish(pool, bulk)
    await finish(pool, later)


@pytest.mark.parametrize(("reserve", "second_chat_runs"), [(None, False), (0, True)])
async def test_the_reserve_keeps_a_permit_for_completions(
    session: aiohttp.ClientSession, reserve: int | None, second_chat_runs: bool
) -> None:
    """Two slots, reserve 1 (the default there): one chat runs, the second waits beside a
    free permit, which a completion then takes at once."""
    pool, (m,) = make_pool(session, [2], reserve=reserve)
    first = submit(pool, "c1", "c1", klass="chat")
    second = submit(pool, "c2", "c2", klass="chat")
    assert first.future.done() and second.future.done() is second_chat_runs
    if not second_chat_runs:
        assert m.gate.free == 1
        complete = submit(pool, "k", "k")
        assert complete.future.done() and m.gate.free == 0
        await finish(pool, complete)
        assert not second.future.done()  # the reserve again
    await finish(pool, first)
    await finish(pool, second)
    assert m.gate.free == 2


async def test_one_slot_has_no_reserve(session: aiohttp.ClientSession) -> None:
    pool, _ = make_pool(session, [1])
    assert submit(pool, "c", "c", klass="chat").future.done()


async def test_a_requests_class_is_logged_shown_and_counted(http: aiohttp.ClientSession) -> None:
    keys = [{"name": "agent", "key": "k-agent", "classes": ["chat", "bulk"]}]
    async with FakeUpstream(slots=2) as fake, run_proxy(fake.url, keys=keys) as px:
        auth = {"Authorization": "Bearer k-agent"}

        async def post(path: str, body: dict[str, Any], **headers: str) -> int:
            async with http.post(px.url + path, json=body, headers={**auth, **headers}) as r:
                await r.read()
                return r.status

        with structlog.testing.capture_logs() as logs:
            assert await post("/completion", {"prompt": "a"}, **{"X-Request-Id": "key"}) == 200
            chat = {"messages": [{"role": "user", "content": "hi"}]}
            assert await post("/v1/chat/completions", chat, **{"X-Request-Id": "chat"}) == 200
            lowered = {"X-Request-Id": "low", "X-LLMProxy-Class": "bulk"}
            assert await post("/completion", {"prompt": "b"}, **lowered) == 200
            bad = {"X-Request-Id": "bad", "X-LLMProxy-Class": "urgent"}
            assert await post("/completion", {"prompt": "c"}, **bad) == 400
            px.flush_log()
        lines = request_events(logs)
        assert [(lines[r]["class"], lines[r]["caller"]) for r in ("key", "chat", "low")] == [
            ("chat", "agent"),
            ("chat", "agent"),
            ("bulk", "agent"),
        ]
        async with http.get(px.url + "/llmproxy/metrics", headers=auth) as r:
            text = await r.text()
        assert 'llmproxy_class_requests_total{outcome="completed",request_class="chat"} 2.0' in text
        assert 'llmproxy_class_requests_total{outcome="completed",request_class="bulk"} 1.0' in text


async def test_a_keystroke_beside_two_chat_streams_runs_at_once(
    http: aiohttp.ClientSession,
) -> None:
    """Two slots, two long chat streams sent first: the second waits in the proxy (the
    reserve), so the completion sent next runs at once instead of after a whole answer."""
    hold = asyncio.Event()
    script = lambda p, _b: Script(tokens=2, hold=hold if "chat" in p else None)  # noqa: E731
    async with FakeUpstream(slots=2, script=script) as fake, run_proxy(fake.url) as px:
        chat = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
        chats = [
            asyncio.create_task(
                http.post(
                    px.url + "/v1/chat/completions",
                    json=chat,
                    headers={"X-LLMProxy-Session": f"agent{i}"},
                )
            )
            for i in range(2)
        ]
        await wait_until(lambda: len(px.state.pool.queue) == 1, what="the second chat queued")
        async with http.post(px.url + "/completion", json={"prompt": "x", "n_predict": 2}) as r:
            assert r.status == 200 and not hold.is_set()
        hold.set()
        for task in chats:
            async with await task as r:
                assert r.status == 200
                await r.read()
        assert fake.deferred == [] and fake.max_concurrent == 2


def test_class_max_wait_s_from_a_flag_or_env_value() -> None:
    assert ProxySettings(class_max_wait_s="chat=5").class_max_wait_s == {"chat": 5.0, "bulk": 30.0}
    assert ProxySettings(class_max_wait_s='{"bulk": 2}').class_max_wait_s["bulk"] == 2.0
    with pytest.raises(ValidationError, match="positive seconds"):
        ProxySettings(class_max_wait_s="complete=1")
