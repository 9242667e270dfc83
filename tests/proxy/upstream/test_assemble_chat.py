"""A non-streaming chat answer rendered from llama-server's stream (assemble.py's chat
routes). The chunks are llama-server's as it streams a chat with ``include_usage``; the
differential test against the real server is tests/interop/test_llama_server.py."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from llmproxy.bench.fake.upstream import FakeUpstream
from llmproxy.proxy.relay.assemble import Assembler
from llmproxy.proxy.relay.sse import Framer
from llmproxy.proxy.upstream.resume import Echo, strip_echo
from tests.helpers.proxy import run_proxy

HEAD = {"created": 1795869124, "id": "chatcmpl-1", "model": "chat", "system_fingerprint": "b1"}
USAGE = {"completion_tokens": 3, "prompt_tokens": 32, "total_tokens": 35}
TIMINGS = {"cache_n": 31, "prompt_n": 1, "predicted_n": 3}


def chunk(delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choices = [] if delta is None else [{"finish_reason": finish, "index": 0, "delta": delta}]
    return {"choices": choices, **HEAD, "object": "chat.completion.chunk", **extra}


def sse(*objs: Any) -> bytes:
    lines = [b"data: " + json.dumps(o, separators=(",", ":")).encode() + b"\n\n" for o in objs]
    return b"".join(lines) + b"data: [DONE]\n\n"


STREAM = sse(
    chunk({"role": "assistant", "content": None}),
    chunk({"content": "I"}),
    chunk({"reasoning_content": "think"}),
    chunk({"content": "'m glad"}),
    chunk({}, "length"),
    chunk(None, usage=USAGE, timings=TIMINGS),
)


def test_the_body_is_llama_servers_chat_completion_in_its_key_order() -> None:
    a = Assembler("/v1/chat/completions")
    a.feed(STREAM)
    status, raw = a.render()
    assert status == 200
    body = json.loads(raw)
    assert list(body) == [
        "choices", "created", "model", "system_fingerprint", "object", "usage", "id", "timings",
    ]  # fmt: skip
    assert body["choices"] == [
        {
            "finish_reason": "length",
            "index": 0,
            "message": {"role": "assistant", "content": "I'm glad", "reasoning_content": "think"},
        }
    ]
    assert body["object"] == "chat.completion" and body["usage"] == USAGE
    assert body["timings"] == TIMINGS and body["id"] == "chatcmpl-1"


def test_any_split_of_the_stream_renders_the_same() -> None:
    whole = Assembler("/chat/completions")
    whole.feed(STREAM)
    expected = whole.render()
    for cut in range(1, len(STREAM), 7):
        a = Assembler("/chat/completions")
        a.feed(STREAM[:cut])
        a.feed(STREAM[cut:])
        assert a.render() == expected


def test_a_continuation_repeating_its_prefill_is_taken_out() -> None:
    a = Assembler("/v1/chat/completions")
    first = Framer()
    a.take(first.feed(sse(chunk({"content": "Once upon"})).removesuffix(b"data: [DONE]\n\n")))
    a.take(first.feed(b'data: {"choices":[{"delta":{"content":" a ti'))  # cut: continued
    echo, second = Echo(a.text()), Framer()
    rest = sse(chunk({"content": "Once"}), chunk({"content": " upon a"}), chunk({}, "stop"))
    a.take(echo.strip(second.feed(rest)))
    assert json.loads(a.render()[1])["choices"][0]["message"]["content"] == "Once upon a"


def test_strip_echo() -> None:
    assert strip_echo("abc def", "abc") == (" def", "")
    assert strip_echo("ab", "abc") == ("", "c")
    assert strip_echo("xyz", "abc") == ("xyz", "")


async def test_a_non_streaming_chat_is_sent_as_a_stream_and_answered_whole(
    http: aiohttp.ClientSession,
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    async with FakeUpstream(slots=1) as fake, run_proxy(fake.url) as px:
        async with http.post(px.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200 and r.content_type == "application/json"
            answer = await r.json()
    (sent,) = fake.generations
    assert sent.body is not None
    assert sent.body["stream"] is True and sent.body["stream_options"] == {"include_usage": True}
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["content"] == "t0 t1 t2 "
