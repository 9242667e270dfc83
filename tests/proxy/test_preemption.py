"""Preemption (pool/preempt.py, upstream/resume.py): a completion that waits behind chat
generations that can be resumed exactly stops the youngest, runs, and the stopped one goes
on from where it was; its client sees one answer. Through the real app, against the fake
llama-server (its continuation of ``t0 .. t{k-1}`` is ``t{k} ..``: a deterministic model)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
import structlog

from llmproxy.bench.fake.script import Kind, Script
from llmproxy.bench.fake.shapes import text
from llmproxy.bench.fake.upstream import FakeUpstream
from tests.helpers.net import wait_until
from tests.helpers.proxy import RunningProxy, request_events, run_proxy

CHAT = {"messages": [{"role": "user", "content": "write"}], "stream": True}
TOKENS = 40


def events(raw: bytes) -> list[Any]:
    out = []
    for line in raw.decode().split("\n"):
        if line.startswith("data: ") and line[6:] != "[DONE]":
            out.append(json.loads(line[6:]))
    return out


def streamed_text(path: str, raw: bytes) -> str:
    pieces = []
    for e in events(raw):
        assert "error" not in e, e
        if path == "/completion":
            pieces.append(e.get("content", ""))
        elif "chat" in path:
            pieces.append((e["choices"][0].get("delta") or {}).get("content") or "")
        else:
            pieces.append(e["choices"][0].get("text", ""))
    return "".join(pieces)


def whole_text(path: str, body: Any) -> str:
    if path == "/completion":
        return str(body["content"])
    if "chat" in path:
        return str(body["choices"][0]["message"]["content"])
    return str(body["choices"][0]["text"])


def continued(body: dict[str, Any] | None) -> bool:
    """Is this request a continuation of the fake's answer?"""
    if body is None:
        return False
    last = (body.get("messages") or [{}])[-1]
    return last.get("role") == "assistant" or str(body.get("prompt", "")).endswith(" ")


def script(path: str, body: dict[str, Any]) -> Script:
    if path == "/infill":
        return Script(tokens=4, token_delay_s=0.001)
    return Script(tokens=TOKENS, token_delay_s=0.01)


KEYSTROKE = {"input_prefix": "def f(", "input_suffix": "", "prompt": "", "n_predict": 4}


async def keystroke(http: aiohttp.ClientSession, px: RunningProxy) -> dict[str, Any]:
    async with http.post(px.url + "/infill", json=KEYSTROKE) as r:
        assert r.status == 200
        return dict(await r.json())


def held_keystrokes(hold: asyncio.Event) -> Callable[[str, dict[str, Any]], Script]:
    """The fake's script: a keystroke's completion generates once ``hold`` is set."""

    def held(path: str, body: dict[str, Any]) -> Script:
        if path == "/infill":
            return Script(tokens=4, token_delay_s=0.001, hold=hold)
        return script(path, body)

    return held


async def long_request(
    http: aiohttp.ClientSession,
    px: RunningProxy,
    path: str,
    body: dict[str, Any],
    started: asyncio.Event,
    **headers: str,
) -> tuple[int, bytes]:
    """Post ``body``; ``started`` is set once the upstream is generating it."""
    async with http.post(px.url + path, json=body, headers=headers) as r:
        if body.get("stream"):
            first = await r.content.readany()
            started.set()
            return r.status, first + await r.read()
        return r.status, await r.read()


async def keystroke_status(http: aiohttp.ClientSession, px: RunningProxy) -> int:
    async with http.post(px.url + "/infill", json=KEYSTROKE) as r:
        await r.read()
        return r.status


def offered(px: RunningProxy) -> bool:
    """Does a running generation offer to be preempted (its first event came)?"""
    return any(t.on_preempt is not None for t in px.member.gate.inflight_snapshot())


@pytest.mark.parametrize(
    ("path", "stream"),
    [
        ("/v1/chat/completions", True),
        ("/v1/chat/completions", False),  # sent as a stream, answered whole (assemble.py)
        ("/completion", True),
        ("/completion", False),
        ("/v1/completions", True),
        ("/v1/completions", False),
    ],
)
async def test_a_preempted_generation_resumes_into_one_answer(
    http: aiohttp.ClientSession, path: str, stream: bool
) -> None:
    if "chat" in path:
        body: dict[str, Any] = {**CHAT, "stream": stream}
    else:
        body = {
            "prompt": "Once upon a time\n",
            "stream": stream,
            "max_tokens": TOKENS,
            "n_predict": TOKENS,
        }
    started = asyncio.Event()
    async with (
        FakeUpstream(slots=1, continues=True, script=script) as fake,
        # type-through off: a generation later keystrokes may read is never preempted
        run_proxy(fake.url, preempt_after_ms=0, type_through="off") as px,
    ):
        # a completion route counts as chat when its caller says so (an agent's request)
        long = asyncio.create_task(
            long_request(http, px, path, body, started, **{"X-LLMProxy-Class": "chat"})
        )
        if stream:
            await started.wait()
        await wait_until(lambda: offered(px), what="the generation under way")
        answer = await keystroke(http, px)
        status, raw = await long
        assert answer["content"] == text(4)
        assert status == 200
        got = streamed_text(path, raw) if stream else whole_text(path, json.loads(raw))
        assert got == text(TOKENS)  # as if it had never stopped
        gens = [r for r in fake.generations if r.path == path]
        assert len(gens) == 2 and continued(gens[1].body) and not continued(gens[0].body)
        assert px.state.pool.preemptions == 1
        assert fake.deferred == []  # never two generations for the one slot
        await asyncio.sleep(0)
        px.flush_log()


@pytest.mark.parametrize(
    ("path", "stream"),
    [
        ("/v1/chat/completions", True),
        ("/v1/chat/completions", False),
        ("/completion", True),
        ("/v1/completions", False),
    ],
)
async def test_a_generation_preempted_twice_resumes_into_one_answer(
    http: aiohttp.ClientSession, path: str, stream: bool
) -> None:
    """The second continuation is built from the request as the client sent it, not from
    the first continuation: one prefill of the whole text so far (llama-server refuses two
    assistant messages at the end), and the limit less every token produced."""
    if "chat" in path:
        body: dict[str, Any] = {**CHAT, "stream": stream, "max_tokens": TOKENS}
    else:
        body = {"prompt": "Once upon a time\n", "stream": stream, "n_predict": TOKENS}
        body["max_tokens"] = TOKENS
    started = asyncio.Event()
    async with (
        FakeUpstream(slots=1, continues=True, script=script) as fake,
        run_proxy(fake.url, preempt_after_ms=0, type_through="off") as px,
    ):
        long = asyncio.create_task(
            long_request(http, px, path, body, started, **{"X-LLMProxy-Class": "chat"})
        )
        waited = [0.0]
        for n in (1, 2, 3):
            await wait_until(lambda: offered(px), what=f"segment {n} under way")
            # each resume carries the time its request waited so far, and adds its pause
            (chat,) = px.member.gate.inflight_snapshot()
            assert chat.granted_at is not None
            own = chat.granted_at - chat.queued_at  # this segment's wait for its permit
            assert chat.waited_s == pytest.approx(waited[-1] + own)
            waited.append(chat.waited_s)
            if n < 3:
                await keystroke(http, px)
                assert px.state.pool.preemptions == n
        status, raw = await long
        assert status == 200
        got = streamed_text(path, raw) if stream else whole_text(path, json.loads(raw))
        assert got == text(TOKENS)  # as if it had never stopped
        gens = [r for r in fake.generations if r.path == path]
        assert len(gens) == 3
        last = gens[2].body
        assert last is not None
        if "chat" in path:
            assert [m["role"] for m in last["messages"]] == ["user", "assistant"]
            done = last["messages"][-1]["content"]
        else:
            assert last["prompt"].startswith(body["prompt"])
            done = last["prompt"][len(body["prompt"]) :]
        produced = len(done.split())
        assert done == text(produced) and 0 < produced < TOKENS
        assert last["max_tokens"] == TOKENS - produced
        assert fake.deferred == []


@pytest.mark.parametrize(
    ("kind", "body", "settings"),
    [
        ("openai", CHAT, {}),  # an OpenAI server's chat: no exact continuation
        ("llamacpp", {**CHAT, "tools": [{"type": "function"}]}, {}),  # tool calls restart
        ("llamacpp", {**CHAT, "response_format": {"type": "json_object"}}, {}),  # grammar
        ("llamacpp", CHAT, {"preempt": "off"}),
        ("llamacpp", CHAT, {"classes": "off"}),
    ],
    ids=["openai-chat", "tools", "json", "preempt-off", "classes-off"],
)
async def test_a_generation_without_exact_continuation_is_never_preempted(
    http: aiohttp.ClientSession, kind: Kind, body: dict[str, Any], settings: dict[str, Any]
) -> None:
    started = asyncio.Event()
    async with (
        FakeUpstream(kind=kind, slots=1, continues=True, script=script) as fake,
        run_proxy(fake.url, preempt_after_ms=0, **settings) as px,
    ):
        path = "/v1/chat/completions"
        long = asyncio.create_task(long_request(http, px, path, body, started))
        if body.get("stream"):
            await started.wait()
        else:
            await fake.wait_for(lambda f: f.slot_busy == [True])
        if kind == "openai":  # its completion route: the keystroke's
            answer = asyncio.create_task(
                http.post(px.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4})
            )
        else:
            answer = asyncio.create_task(keystroke(http, px))
        status, raw = await long
        assert status == 200 and not answer.done()  # the keystroke waited it out
        r = await answer
        if isinstance(r, aiohttp.ClientResponse):
            assert r.status == 200
            r.release()
        assert len([g for g in fake.generations if g.path == path]) == 1
        assert px.state.pool.preemptions == 0


async def test_a_chat_that_waited_its_class_bound_is_never_preempted(
    http: aiohttp.ClientSession,
) -> None:
    """Nothing starves: a chat that waited ``class_max_wait_s`` in the queue (behind
    another agent's) runs to its end, and the keystroke waits it out."""
    async with (
        FakeUpstream(slots=1, continues=True, script=script) as fake,
        run_proxy(fake.url, preempt_after_ms=0, class_max_wait_s="chat=0.2") as px,
    ):
        first = asyncio.create_task(
            long_request(http, px, "/v1/chat/completions", CHAT, asyncio.Event())
        )
        await wait_until(lambda: offered(px), what="the other agent's chat under way")
        body = {**CHAT, "messages": [{"role": "user", "content": "waits"}]}
        long = asyncio.create_task(
            long_request(http, px, "/v1/chat/completions", body, asyncio.Event())
        )
        await wait_until(lambda: len(px.state.pool.queue) == 1, what="the chat queued")
        await first  # 40 tokens of 10 ms: it waited about 0.4 s
        await wait_until(lambda: offered(px), what="the chat under way")
        answer = asyncio.create_task(keystroke(http, px))
        status, raw = await long
        assert status == 200 and not answer.done()  # the keystroke waited it out
        assert (await answer)["content"] == text(4)
        assert px.state.pool.preemptions == 0
        assert len([g for g in fake.generations if g.path == "/v1/chat/completions"]) == 2


async def test_a_long_answer_stays_preemptible_past_its_class_bound(
    http: aiohttp.ClientSession,
) -> None:
    """The bound counts time waited, not time run: a chat that has run longer than
    ``class_max_wait_s`` without waiting is still preempted, and resumes exactly."""
    async with (
        FakeUpstream(slots=1, continues=True, script=script) as fake,
        run_proxy(fake.url, preempt_after_ms=0, class_max_wait_s="chat=0.05") as px,
    ):
        path = "/v1/chat/completions"
        long = asyncio.create_task(long_request(http, px, path, CHAT, asyncio.Event()))

        def ran_past_bound() -> bool:
            held = px.member.gate.inflight_snapshot()
            return offered(px) and all(time.monotonic() - t.created > 0.1 for t in held)

        await wait_until(ran_past_bound, what="the chat running past its bound")
        assert (await keystroke(http, px))["content"] == text(4)
        status, raw = await long
        assert status == 200 and streamed_text(path, raw) == text(TOKENS)
        assert px.state.pool.preemptions == 1
        assert len([g for g in fake.generations if g.path == path]) == 2


async def test_a_resumed_long_answer_is_not_aged_by_the_time_it_ran(
    http: aiohttp.ClientSession,
) -> None:
    """A chat that ran past its class's bound is preempted by a keystroke; another
    session's keystroke queues meanwhile. When the first keystroke ends, the second goes
    before the chat's resume: the resume has waited less than its bound (aging counts time
    waited, as the preemption exemption does), so it is still a chat, not a completion."""
    hold = asyncio.Event()

    def scripted(path: str, body: dict[str, Any]) -> Script:
        if path == "/infill" and body.get("input_prefix") == "first":
            return Script(tokens=4, token_delay_s=0.001, hold=hold)
        if path == "/infill":
            return Script(tokens=4, token_delay_s=0.001)
        return Script(tokens=200, token_delay_s=0.01)

    async def typed(prefix: str, session: str) -> int:
        body = {**KEYSTROKE, "input_prefix": prefix}
        headers = {"X-LLMProxy-Session": session}
        async with http.post(px.url + "/infill", json=body, headers=headers) as r:
            await r.read()
            return r.status

    path = "/v1/chat/completions"
    async with (
        FakeUpstream(slots=1, continues=True, script=scripted) as fake,
        run_proxy(fake.url, preempt_after_ms=0, class_max_wait_s="chat=0.3") as px,
    ):
        long = asyncio.create_task(long_request(http, px, path, CHAT, asyncio.Event()))

        def ran_past_bound() -> bool:
            held = px.member.gate.inflight_snapshot()
            return offered(px) and all(time.monotonic() - t.created > 0.35 for t in held)

        await wait_until(ran_past_bound, what="the chat running past its bound")
        first = asyncio.create_task(typed("first", "a"))
        await fake.wait_for(lambda f: any(g.path == "/infill" for g in f.generations))
        second = asyncio.create_task(typed("second", "b"))
        await wait_until(lambda: len(px.state.pool.queue) == 2, what="resume and keystroke")
        hold.set()
        assert await first == 200 and await second == 200
        status, raw = await long
        assert status == 200 and streamed_text(path, raw) == text(200)
        order = [
            g.body.get("input_prefix") if g.path == "/infill" else continued(g.body)
            for g in fake.generations
        ]
        assert order == [False, "first", "second", True], order
        assert px.state.pool.preemptions == 1


async def test_a_chat_still_in_its_prefill_is_preempted_once_it_offers(
    http: aiohttp.ClientSession,
) -> None:
    """The keystroke came while the agent's chat had no event yet (its prefill: it cannot
    be resumed yet); the scheduler looks again until it offers, then preempts it, rather
    than let the keystroke wait out the whole answer."""
    chat = asyncio.Event()

    def scripted(path: str, body: dict[str, Any]) -> Script:
        if path == "/infill":
            return Script(tokens=4, token_delay_s=0.001)
        return Script(tokens=TOKENS, token_delay_s=0.01, hold=chat)

    async with (
        FakeUpstream(slots=1, continues=True, script=scripted) as fake,
        run_proxy(fake.url, preempt_after_ms=0, type_through="off") as px,
    ):
        path = "/v1/chat/completions"
        long = asyncio.create_task(long_request(http, px, path, CHAT, asyncio.Event()))
        await fake.wait_for(lambda f: f.slot_busy == [True])  # on the slot, no event yet
        answer = asyncio.create_task(keystroke(http, px))
        await wait_until(lambda: len(px.state.pool.queue) == 1, what="the keystroke waiting")
        assert px.state.pool.preemptions == 0 and not offered(px)
        chat.set()  # its first event: it offers its resume, and is preempted
        assert (await answer)["content"] == text(4)
        status, raw = await long
        assert status == 200 and streamed_text(path, raw) == text(TOKENS)
        assert px.state.pool.preemptions == 1
        assert len([g for g in fake.generations if g.path == path]) == 2


async def test_a_failed_resume_ends_the_answer_with_the_error_event(
    http: aiohttp.ClientSession,
) -> None:
    def failing(path: str, body: dict[str, Any]) -> Script:
        if continued(body):
            return Script(status=500)
        return script(path, body)

    started = asyncio.Event()
    async with (
        FakeUpstream(slots=1, continues=True, script=failing) as fake,
        run_proxy(fake.url, preempt_after_ms=0) as px,
    ):
        long = asyncio.create_task(long_request(http, px, "/v1/chat/completions", CHAT, started))
        await started.wait()
        await keystroke(http, px)
        status, raw = await long
        assert status == 200
        *text_events, last = events(raw)
        assert "error" in last and "continuation failed (500)" in last["error"]["message"]
        assert all("error" not in e for e in text_events)
        assert px.state.pool.preemptions == 1
        await fake.wait_for(lambda f: not any(f.slot_busy))
        await wait_until(lambda: px.member.gate.free == 1, what="the permit back")


async def test_a_resume_that_finds_its_upstream_gone_still_says_it_reached_it(
    http: aiohttp.ClientSession,
) -> None:
    """The server dies while the keystroke runs: the chat's resume cannot connect, and its
    stream ends with the error event. Its first segment did reach the upstream, and its
    log line says so (a request that reached one is not sent elsewhere as if new)."""
    hold = asyncio.Event()

    started = asyncio.Event()
    path = "/v1/chat/completions"
    with structlog.testing.capture_logs() as logs:
        async with (
            FakeUpstream(slots=1, continues=True, script=held_keystrokes(hold)) as fake,
            run_proxy(fake.url, preempt_after_ms=0) as px,
        ):
            long = asyncio.create_task(long_request(http, px, path, CHAT, started))
            await started.wait()
            answer = asyncio.create_task(keystroke_status(http, px))
            await wait_until(lambda: any(r.path == "/infill" for r in fake.received))
            await fake.stop()  # killed: the keystroke is cut, the port refuses connections
            assert await answer >= 500
            status, raw = await long
            assert status == 200
            *text_events, last = events(raw)
            assert "error" in last and "unreachable" in last["error"]["message"], last
            assert all("error" not in e for e in text_events)
            await wait_until(lambda: px.member.gate.inflight == 0, what="the permits back")
            px.flush_log()
    chat = next(e for e in request_events(logs).values() if e["route"] == path)
    assert chat["outcome"] == "error" and chat["preempted"] == 1, chat
    assert chat["reached_upstream"] is True, chat


async def test_the_request_log_and_metrics_count_preemptions(
    http: aiohttp.ClientSession,
) -> None:
    started = asyncio.Event()
    with structlog.testing.capture_logs() as logs:
        async with (
            FakeUpstream(slots=1, continues=True, script=script) as fake,
            run_proxy(fake.url, preempt_after_ms=0) as px,
        ):
            long = asyncio.create_task(
                long_request(http, px, "/v1/chat/completions", CHAT, started)
            )
            await started.wait()
            await keystroke(http, px)
            status, _ = await long
            assert status == 200
            await wait_until(lambda: px.member.gate.free == 1, what="the permit back")
            px.flush_log()
            async with http.get(px.url + "/llmproxy/metrics") as r:
                metrics = await r.text()
            async with http.get(px.url + "/llmproxy/status") as r:
                status_body = await r.json()
    chats = [e for e in request_events(logs).values() if e["route"] == "/v1/chat/completions"]
    assert [c.get("preempted") for c in chats] == [1]
    assert "llmproxy_preemptions_total 1.0" in metrics
    assert status_body["preemptions"] == 1
    assert len(fake.generations) == 3


async def test_a_preempted_request_whose_client_leaves_gives_its_place_up(
    http: aiohttp.ClientSession,
) -> None:
    hold = asyncio.Event()

    started = asyncio.Event()
    async with (
        FakeUpstream(slots=1, continues=True, script=held_keystrokes(hold)) as fake,
        run_proxy(fake.url, preempt_after_ms=0) as px,
    ):
        path = "/v1/chat/completions"
        long = asyncio.create_task(long_request(http, px, path, CHAT, started))
        await started.wait()
        answer = asyncio.create_task(keystroke(http, px))
        await wait_until(lambda: len(px.state.pool.queue) == 1, what="the chat waiting again")
        long.cancel()
        await wait_until(lambda: not px.state.pool.queue, what="its place given up")
        hold.set()
        assert (await answer)["content"] == text(4)
        await wait_until(lambda: px.state.pool.preemptions == 1 and px.member.gate.free == 1)
        assert len([g for g in fake.generations if g.path == path]) == 1


async def test_a_resume_is_never_refused_by_its_callers_max_queued(
    http: aiohttp.ClientSession,
) -> None:
    """The agent's key lets none of its requests wait (``max_queued`` 0): its chat, let in
    because it ran at once, still resumes after a preemption."""
    keys = [
        {"name": "agent", "key": "k-agent", "max_queued": 0},
        {"name": "editor", "key": "k-editor"},
    ]
    started = asyncio.Event()
    async with (
        FakeUpstream(slots=1, continues=True, script=script) as fake,
        run_proxy(fake.url, preempt_after_ms=0, keys=keys) as px,
    ):
        path = "/v1/chat/completions"
        auth = {"Authorization": "Bearer k-agent"}
        long = asyncio.create_task(long_request(http, px, path, CHAT, started, **auth))
        await started.wait()
        async with http.post(
            px.url + "/infill",
            json={"input_prefix": "def f(", "input_suffix": "", "n_predict": 4},
            headers={"Authorization": "Bearer k-editor"},
        ) as r:
            assert r.status == 200
        status, raw = await long
        assert status == 200 and streamed_text(path, raw) == text(TOKENS)
        assert px.state.pool.preemptions == 1
        assert len([g for g in fake.generations if g.path == path]) == 2
