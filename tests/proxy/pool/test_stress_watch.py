"""The stress test's watch (tests/helpers/stress.py ``Watch``) on FIFO within a caller's
classes, with aging: it counts ranks at the instant the scheduler chose its head, so a
pause of the process between that choice and the grant (a garbage collection, the machine
busy) is no violation, while a head chosen against the rule still is one."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from llmproxy.proxy.pool.entry import Entry
from llmproxy.proxy.pool.pool import Pool
from tests.helpers import stress
from tests.helpers.scheduler import make_pool, submit
from tests.helpers.stress import Limits, Watch

CHAT_WAIT_S = 1.0  # long beside any pause of this process here


@pytest.fixture
async def pool() -> AsyncIterator[Pool]:
    async with aiohttp.ClientSession() as session:  # never used to connect here
        p, _ = make_pool(session, [1], class_max_wait_s={"chat": CHAT_WAIT_S})
        yield p


async def finish(pool: Pool, entry: Entry) -> None:
    placement = await pool.acquire(entry, 1)
    placement.member.gate.take(placement.ticket)
    placement.member.gate.release(placement.ticket)


def watched(pool: Pool) -> tuple[Watch, Entry, Entry, Entry]:
    """A running completion; then caller c0's chat, which has waited half its aging bound,
    and c0's completion after it."""
    watch = Watch(pool, Limits("on", None, {"chat": CHAT_WAIT_S}, {}, {}))
    running = submit(pool, "x", "x")
    chat = submit(pool, "c", "c", klass="chat", caller="c0")
    complete = submit(pool, "k", "k", caller="c0")
    chat.created = chat.ticket.queued_at = time.monotonic() - CHAT_WAIT_S / 2
    return watch, running, chat, complete


async def test_a_pause_between_the_choice_and_the_grant_is_no_violation(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The completion is rightly the head (the chat not aged yet); the process pauses before
    its grant, long enough for the chat to age: at the watch's look it has."""
    watch, running, chat, complete = watched(pool)
    paused = [0.0]  # the watch's clock runs on by the pause
    monkeypatch.setattr(
        stress, "time", SimpleNamespace(monotonic=lambda: time.monotonic() + paused[0])
    )
    choose = pool.router.choose

    def choosing(req: Any, members: Any) -> Any:
        if req is complete.request:
            paused[0] = CHAT_WAIT_S  # the chat has waited 1.5 times its bound at the grant
        return choose(req, members)

    pool.router.choose = choosing  # type: ignore[method-assign]
    await finish(pool, running)
    assert complete.future.done() and not chat.future.done()
    assert watch.violations == []
    await finish(pool, complete)
    await finish(pool, chat)


async def test_a_callers_completion_chosen_before_its_aged_chat_is_a_violation(
    pool: Pool,
) -> None:
    """The control: were the scheduler to choose c0's completion while c0's chat had aged
    (ranked as a completion, and the earlier one), the watch says so."""
    choose = pool.order.head

    def against_the_rule(queue: Any, *args: Any, **kw: Any) -> Entry | None:
        chosen = choose(queue, *args, **kw)
        mine = [e for e in queue if e.ticket.caller == "c0" and e.ticket.klass == "complete"]
        return mine[0] if mine else chosen

    pool.order.head = against_the_rule  # type: ignore[method-assign]
    watch, running, chat, complete = watched(pool)  # the watch looks at the wrong order
    chat.created -= CHAT_WAIT_S  # aged
    chat.ticket.queued_at -= CHAT_WAIT_S
    await finish(pool, running)
    assert complete.future.done() and not chat.future.done()
    assert len(watch.violations) == 1 and "still waited" in watch.violations[0], watch.violations
    await finish(pool, complete)
    await finish(pool, chat)
