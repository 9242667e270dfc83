"""upstream/resume.py: which requests can be resumed, the transcript of a stream, the
continuation's body, and the relay that passes whole events with the prefill echo out."""

from __future__ import annotations

import json
from typing import Any

import pytest

from llmproxy.proxy.upstream.resume import Framed, Transcript, continuation, resumable

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


class Sink:
    """What a Framed relay wrote (only its ready events matter here)."""

    def __init__(self) -> None:
        self.started = True


def test_the_relay_passes_whole_events_and_records_them_once() -> None:
    t = Transcript("/completion")
    framed = Framed(Sink(), t)  # type: ignore[arg-type]  # observe() never writes
    stream = sse({"content": "a", "stop": False, "tokens": [1]}) + sse(
        {"content": "bc", "stop": False, "tokens": [2, 3]}
    )
    framed.observe(stream[:10])
    assert framed._ready == b"" and t.text == ""  # half an event: nothing yet
    framed.observe(stream[10:-1])
    assert t.text == "a" and framed._ready.endswith(b"\n\n")
    framed.observe(stream[-1:])
    assert (t.text, t.tokens) == ("abc", 3)  # a native event names its tokens
    framed.observe(b'data: {"content": "d", "sto')
    framed.cut()  # cut there: the half event is gone, the continuation sends "d" again
    framed.observe(sse({"content": "d", "stop": False, "tokens": [4]}))
    assert (t.text, t.tokens) == ("abcd", 4)


def test_the_chat_continuation_loses_its_repeated_prefill_even_split() -> None:
    t = Transcript("/v1/chat/completions")
    framed = Framed(Sink(), t)  # type: ignore[arg-type]
    framed.observe(chat_piece("The") + chat_piece(" story"))
    assert (t.text, t.tokens) == ("The story", 2)
    framed.cut()
    framed.expect_echo(t.text)
    role = sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]})
    framed.observe(role + chat_piece("The sto") + chat_piece("ry of") + chat_piece(" a"))
    written = [json.loads(line[6:]) for line in framed._ready.decode().split("\n") if line]
    contents = [e["choices"][0]["delta"].get("content") for e in written]
    assert contents == [None, "", " of", " a"]
    assert t.text == "The story of a"


def test_a_continuation_without_echo_passes_unchanged() -> None:
    t = Transcript("/v1/chat/completions")
    framed = Framed(Sink(), t)  # type: ignore[arg-type]
    framed.expect_echo("The")
    framed.observe(chat_piece(" story"))
    assert t.text == " story" and framed._ready == chat_piece(" story")


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
    """Bounded: the relay holds back at most one event's worth waiting for its end."""
    t = Transcript("/completion")
    framed = Framed(Sink(), t)  # type: ignore[arg-type]
    framed.observe(b"data: x\r\n" * 10_000)  # framed in a way the relay does not read
    assert framed._pending == b"" and len(framed._ready) == 90_000
    assert t.exact is False
