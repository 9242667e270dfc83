"""upstream/resume.py: which requests can be resumed, the transcript of a stream, the
continuation's body, and the prefill echo taken out of a chat continuation's events."""

from __future__ import annotations

import json
from typing import Any

import pytest

from llmproxy.proxy.relay.sse import Framer
from llmproxy.proxy.upstream.resume import MAX_EVENT, Echo, Transcript, continuation, resumable

CHAT = {"messages": [{"role": "user", "content": "hi"}], "stream": True}


@pytest.mark.parametrize(
    ("kind", "path", "body", "ok"),
    [
        ("llamacpp", "/v1/chat/completions", CHAT, True),
        ("openai", "/v1/chat/completions", CHAT, False),
        ("llamacpp", "/completion", {"prompt": "x", "n_predict": 8}, True),
        ("openai", "/completion", {"prompt": "x"}, False),
        ("openai", "/v1/completions", {"prompt": "x", "max_tokens": 8}, True),
        ("llamacpp", "/completion", {"prompt": [1, 2, 3]}, False),  # token ids
        ("llamacpp", "/completion", {"prompt": "x", "grammar": "root ::= x"}, False),
        ("llamacpp", "/completion", {"prompt": "x", "n_probs": 3}, False),
        ("llamacpp", "/completion", {"prompt": "x", "n_cmpl": 2}, False),
        ("llamacpp", "/completion", {"prompt": "x", "n_predict": -1}, False),
        ("llamacpp", "/infill", {"prompt": "x"}, False),
        ("llamacpp", "/v1/embeddings", {"input": "x"}, False),
        ("llamacpp", "/v1/chat/completions", {**CHAT, "tools": [{}]}, False),
        (
            "llamacpp",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
            False,  # parts, not text
        ),
        (
            "llamacpp",
            "/v1/chat/completions",
            {"messages": [{"role": "assistant", "content": "a prefill of its own"}]},
            False,
        ),
    ],
)
def test_only_requests_with_an_exact_continuation_are_resumable(
    kind: str, path: str, body: dict[str, Any], ok: bool
) -> None:
    assert resumable(kind, path, body) is ok


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chat_piece(text: str) -> bytes:
    return sse({"choices": [{"index": 0, "delta": {"content": text}}]})


def test_the_transcript_takes_whole_events_once() -> None:
    t = Transcript("/completion")
    framer = Framer(MAX_EVENT)
    stream = sse({"content": "a", "stop": False, "tokens": [1]}) + sse(
        {"content": "bc", "stop": False, "tokens": [2, 3]}
    )
    assert framer.feed(stream[:10]) == []  # half an event: nothing yet
    t.take(framer.feed(stream[10:-1]))
    assert t.text == "a"
    t.take(framer.feed(stream[-1:]))
    assert (t.text, t.tokens) == ("abc", 3)  # a native event names its tokens
    t.take(framer.feed(b'data: {"content": "d", "sto'))
    framer.cut()  # cut there: the half event is gone, the continuation sends "d" again
    t.take(framer.feed(sse({"content": "d", "stop": False, "tokens": [4]})))
    assert (t.text, t.tokens) == ("abcd", 4)


def test_the_chat_continuation_loses_its_repeated_prefill_even_split() -> None:
    t = Transcript("/v1/chat/completions")
    t.take(Framer().feed(chat_piece("The") + chat_piece(" story")))
    assert (t.text, t.tokens) == ("The story", 2)
    echo = Echo(t.text)
    role = sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]})
    framer = Framer()
    events = echo.strip(framer.feed(role + chat_piece("The sto")))
    events = [*events, *echo.strip(framer.feed(chat_piece("ry of") + chat_piece(" a")))]
    t.take(events)
    written = [json.loads(e.raw[6:]) for e in events]
    contents = [e["choices"][0]["delta"].get("content") for e in written]
    assert contents == [None, "", " of", " a"]
    assert t.text == "The story of a"


def test_a_continuation_without_echo_passes_unchanged() -> None:
    events = Framer().feed(chat_piece(" story"))
    assert Echo("The").strip(events) == events


def test_the_continuation_carries_the_text_and_the_tokens_left() -> None:
    t = Transcript("/v1/chat/completions")
    t.event({"choices": [{"index": 0, "delta": {"content": "Hel"}}]})
    t.event({"choices": [{"index": 0, "delta": {"content": "lo"}}]})
    body = continuation("/v1/chat/completions", {**CHAT, "max_tokens": 10}, t)
    assert body["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert body["max_tokens"] == 8 and body["messages"][:-1] == CHAT["messages"]
    t2 = Transcript("/completion")
    t2.event({"content": " world", "stop": False, "tokens": [5]})
    body = continuation("/completion", {"prompt": "Hello", "n_predict": 1}, t2)
    assert body == {"prompt": "Hello world", "n_predict": 0}


def test_a_stream_without_event_ends_is_passed_on_and_never_preempted() -> None:
    """Bounded: a resumable stream's framer holds back at most one event's worth waiting
    for its end; what it gave up on is passed on as it came."""
    t = Transcript("/completion")
    framer = Framer(MAX_EVENT)
    events = framer.feed(b"data: x\r\n" * 10_000)  # framed in a way the relay does not read
    assert framer.pending == 0 and [len(e.raw) for e in events] == [90_000]
    t.take(events)
    assert t.exact is False
