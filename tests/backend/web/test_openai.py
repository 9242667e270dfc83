"""OpenAI routes through a real server and model: /v1/completions and /v1/chat/completions,
streamed and not."""

from __future__ import annotations

from typing import Any

from tests.helpers.backend.api import post_stream, sse_events

PROMPT = "def fibonacci(n):\n"
GREEDY = {"temperature": 0, "seed": 1}


def test_v1_completions(backend: Any) -> None:
    status, body = backend.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, **GREEDY})
    assert status == 200, body
    assert body["object"] == "text_completion"
    choice = body["choices"][0]
    assert isinstance(choice["text"], str) and choice["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] <= 8
    assert (
        body["usage"]["total_tokens"]
        == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    )


async def test_v1_completions_stream(backend: Any) -> None:
    req = {"prompt": PROMPT, "max_tokens": 8, **GREEDY}
    _, whole = backend.post("/v1/completions", req)
    status, _, raw = await post_stream(backend.url + "/v1/completions", {**req, "stream": True})
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]


def test_chat(backend: Any) -> None:
    req = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, **GREEDY}
    status, body = backend.post("/v1/chat/completions", req)
    assert status == 200, body
    assert body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    assert body["choices"][0]["finish_reason"] in ("stop", "length")


async def test_chat_stream(backend: Any) -> None:
    req = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, **GREEDY}
    _, whole = backend.post("/v1/chat/completions", req)
    status, _, raw = await post_stream(
        backend.url + "/v1/chat/completions", {**req, "stream": True}
    )
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]
