"""Preemption against a real llama-server (``make interop``): a keystroke's completion
stops a greedy generation on the one slot, runs, and the generation resumes from its text
so far (a chat: as a closing assistant message, which llama-server continues); the
resumed answer's text equals the uninterrupted one, after one preemption or two, and with
``--preempt solo`` where a slot was free."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from tests.helpers.interop import LlamaServer
from tests.helpers.net import wait_until
from tests.helpers.proxy import RunningProxy, run_proxy

GREEDY = {"temperature": 0, "top_k": 1, "seed": 1, "cache_prompt": True}
CHAT = {
    "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
    "max_tokens": 96,
    **GREEDY,
}
TEXT = {"prompt": "The history of the lighthouse begins", "n_predict": 96, **GREEDY}
KEYSTROKE = {"prompt": "def add(a, b):\n    return", "n_predict": 8, **GREEDY}


def streamed(path: str, raw: bytes) -> str:
    pieces = []
    for line in raw.decode().split("\n"):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        assert "error" not in event, event
        if "chat" in path:
            pieces.append((event["choices"][0].get("delta") or {}).get("content") or "")
        elif "choices" in event:
            pieces.append(event["choices"][0].get("text") or "")
        else:
            pieces.append(event.get("content") or "")
    return "".join(pieces)


def whole(path: str, raw: bytes) -> str:
    body = json.loads(raw)
    if "chat" in path:
        return str(body["choices"][0]["message"]["content"])
    return str(body["content"] if "content" in body else body["choices"][0]["text"])


async def answer(http: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> str:
    """An agent's request (its own session: an editor's keystroke must not supersede it)."""
    headers = {"X-LLMProxy-Class": "chat", "X-LLMProxy-Session": "agent"}
    async with http.post(url + path, json=body, headers=headers) as r:
        raw = await r.read()
        assert r.status == 200, raw
    return streamed(path, raw) if body.get("stream") else whole(path, raw)


async def keystroke(http: aiohttp.ClientSession, px: RunningProxy) -> None:
    """An editor's completion through the proxy (a session of its own)."""
    editor = {"X-LLMProxy-Session": "editor"}
    async with http.post(px.url + "/completion", json=KEYSTROKE, headers=editor) as r:
        assert r.status == 200
        await r.read()


def offered(px: RunningProxy) -> bool:
    return any(t.on_preempt is not None for t in px.member.gate.inflight_snapshot())


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {**CHAT, "stream": True}),
        ("/v1/chat/completions", CHAT),
        ("/completion", {**TEXT, "stream": True}),
        ("/completion", TEXT),
        ("/v1/completions", {**TEXT, "max_tokens": 96, "stream": True}),
    ],
    ids=["chat-stream", "chat", "completion-stream", "completion", "v1-completions-stream"],
)
async def test_a_preempted_greedy_generation_resumes_to_the_same_text(
    llama_server: LlamaServer, path: str, body: dict[str, Any]
) -> None:
    async with (
        llama_server(parallel=1) as srv,
        run_proxy(srv.url, preempt_after_ms=0, type_through="off") as px,
        aiohttp.ClientSession() as http,
    ):
        uninterrupted = await answer(http, srv.url, path, body)
        long = asyncio.create_task(answer(http, px.url, path, body))
        await wait_until(lambda: offered(px), timeout=60, what="the generation under way")
        await keystroke(http, px)
        resumed = await long
        assert px.state.pool.preemptions == 1
        assert resumed == uninterrupted


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {**CHAT, "stream": True}),
        ("/v1/chat/completions", CHAT),
        ("/completion", {**TEXT, "stream": True}),
    ],
    ids=["chat-stream", "chat", "completion-stream"],
)
async def test_a_greedy_generation_preempted_twice_resumes_to_the_same_text(
    llama_server: LlamaServer, path: str, body: dict[str, Any]
) -> None:
    """The second continuation is built from the request as sent: llama-server refuses a
    chat closed by two assistant messages, and a text prompt must not repeat the text."""
    async with (
        llama_server(parallel=1) as srv,
        run_proxy(srv.url, preempt_after_ms=0, type_through="off") as px,
        aiohttp.ClientSession() as http,
    ):
        uninterrupted = await answer(http, srv.url, path, body)
        long = asyncio.create_task(answer(http, px.url, path, body))
        for n in (1, 2):
            await wait_until(lambda: offered(px), timeout=60, what=f"segment {n} under way")
            await keystroke(http, px)
        resumed = await long
        assert px.state.pool.preemptions == 2
        assert resumed == uninterrupted


async def test_solo_pauses_a_greedy_chat_beside_a_free_slot(llama_server: LlamaServer) -> None:
    """``--preempt solo`` on two slots: the keystroke's completion takes the free slot and
    the chat pauses while it runs; the resumed answer is the uninterrupted one."""
    path, body = "/v1/chat/completions", {**CHAT, "stream": True}
    async with (
        llama_server(parallel=2) as srv,
        run_proxy(srv.url, preempt="solo", preempt_after_ms=0, type_through="off") as px,
        aiohttp.ClientSession() as http,
    ):
        uninterrupted = await answer(http, srv.url, path, body)
        long = asyncio.create_task(answer(http, px.url, path, body))
        await wait_until(lambda: offered(px), timeout=60, what="the chat under way")
        await keystroke(http, px)
        resumed = await long
        assert px.state.pool.preemptions == 1
        assert resumed == uninterrupted
