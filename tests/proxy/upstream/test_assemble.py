"""A non-streaming answer rendered from llama-server's stream (proxy/upstream/assemble.py), and the
proxy sending non-streaming completions upstream as streams (llamacpp adapter).

The event shapes here are llama-server's (tools/server/server-task.cpp); the differential
test against the real server is tests/interop/test_llama_server.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.proxy.errors import UpstreamFailed
from llmproxy.proxy.relay.assemble import Assembler
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.upstream.adapters.llamacpp import LlamaCppAdapter
from llmproxy.proxy.upstream.assemble import assembles
from tests.helpers.net import wait_until
from tests.helpers.proxy import run_proxy


def sse(*objs: Any) -> bytes:
    return b"".join(
        b"data: " + json.dumps(o, separators=(",", ":")).encode() + b"\n\n" for o in objs
    )


def native_partial(text: str, index: int = 0) -> dict[str, Any]:
    return {
        "index": index,
        "content": text,
        "tokens": [7],
        "stop": False,
        "id_slot": 0,
        "tokens_predicted": 1,
        "tokens_evaluated": 3,
    }


def native_final(index: int = 0, **extra: Any) -> dict[str, Any]:
    return {
        "index": index,
        "content": "",
        "tokens": [],
        "id_slot": 0,
        "stop": True,
        "model": "m",
        "tokens_predicted": 2,
        "tokens_evaluated": 3,
        "generation_settings": {"n_predict": 2, "stream": True, "temperature": 0.800000011920929},
        "prompt": "é ",
        "truncated": False,
        "stop_type": "limit",
        "timings": {"prompt_n": 3},
        **extra,
    }


def render(path: str, raw: bytes, cut: list[int] | None = None) -> tuple[int, Any, bytes]:
    a = Assembler(path)
    pos = 0
    for end in sorted(cut or []) + [len(raw)]:
        a.feed(raw[pos:end])
        pos = max(pos, end)
    status, body = a.render()
    return status, json.loads(body), body


def test_native_body_is_the_final_event_with_the_streamed_text() -> None:
    raw = sse(native_partial("héllo"), native_partial(" wörld"), native_final())
    status, body, wire = render("/infill", raw)
    want = native_final()
    want["content"] = "héllo wörld"
    want["generation_settings"]["stream"] = False
    assert status == 200 and body == want
    assert list(body) == list(want)  # llama-server's key order
    assert (
        b'"content":"h\xc3\xa9llo w\xc3\xb6rld"' in wire
    )  # compact, UTF-8 as it is (llama.vim's match)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=400), max_size=8))
def test_any_split_of_the_stream_renders_the_same(cuts: list[int]) -> None:
    raw = (
        sse(
            native_partial("a\nb"),
            {"index": 0, "content": "", "stop": False, "prompt_progress": {}},
            native_partial("ç"),
            native_final(),
        )
        + b":\n\n"
    )
    assert render("/completion", raw, cuts)[1]["content"] == "a\nbç"


def test_response_fields_final_gets_the_text_under_its_flat_keys() -> None:
    final = {
        "content": "",
        "timings/prompt_n": 3,
        "generation_settings/stream": True,
        "truncated": False,
    }
    _, body, _ = render("/infill", sse(native_partial("x = 1"), final))
    assert body == {
        "content": "x = 1",
        "timings/prompt_n": 3,
        "generation_settings/stream": False,
        "truncated": False,
    }


def test_several_completions_are_an_array_in_index_order() -> None:
    raw = sse(
        native_partial("b0", 1),
        native_partial("a0", 0),
        native_partial("b1", 1),
        native_final(1),
        native_partial("a1", 0),
        native_final(0),
    )
    _, body, _ = render("/completion", raw)
    assert [b["index"] for b in body] == [0, 1] and [b["content"] for b in body] == ["a0a1", "b0b1"]


def oai_chunk(text: str, index: int = 0, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "choices": [{"text": text, "index": index, "logprobs": None, "finish_reason": finish}],
        "created": 1,
        "model": "m",
        "system_fingerprint": "b1",
        "object": "text_completion",
        "id": "c1",
        **extra,
    }


def test_openai_completion_merges_choices_like_llama_server() -> None:
    usage = {"completion_tokens": 2, "prompt_tokens": 3, "total_tokens": 5}
    raw = (
        sse(
            oai_chunk("x", 0),
            oai_chunk("y", 1),
            oai_chunk("", 1, "length", usage=usage),
            oai_chunk("z", 0),
            oai_chunk("", 0, "stop", usage=usage),
        )
        + b"data: [DONE]\n\n"
    )
    _, body, _ = render("/v1/completions", raw)
    assert [c["text"] for c in body["choices"]] == ["xz", "y"]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]
    assert body["usage"] == usage and list(body) == list(oai_chunk("", usage=usage))


def test_an_error_event_becomes_the_status_llama_server_would_answer() -> None:
    err = {
        "code": 400,
        "message": "the request exceeds the available context size",
        "type": "exceed_context_size_error",
    }
    status, body, _ = render("/completion", sse(native_partial("a"), {"error": err}))
    assert status == 400 and body == {"error": err}


def test_a_stream_without_its_final_event_is_an_upstream_failure() -> None:
    a = Assembler("/completion")
    a.feed(sse(native_partial("a")))
    with pytest.raises(UpstreamFailed):
        a.render()
    with pytest.raises(UpstreamFailed):
        Assembler("/completion").feed(b"data: {broken\n\n")


@pytest.mark.parametrize(
    ("path", "body", "expected"),
    [
        ("/infill", {"prompt": "x"}, True),
        ("/completion", {"prompt": "x", "stream": False}, True),
        ("/completion", {"prompt": "x", "stream": 0}, True),  # llama-server reads only true as true
        ("/v1/completions", {"prompt": "x", "n": 2}, True),
        ("/completion", {"prompt": "x", "stream": True}, False),
        ("/completion", {"prompt": "x", "n_probs": 3}, False),
        ("/completion", {"prompt": "x", "return_tokens": True}, False),
        ("/v1/completions", {"prompt": "x", "logprobs": 2}, False),
        ("/completion", {"prompt": "x", "n_cmpl": 2, "response_fields": ["content"]}, False),
        ("/v1/chat/completions", {"messages": []}, True),
        ("/chat/completions", {"messages": [], "stream": False}, True),
        ("/v1/chat/completions", {"messages": [], "stream": True}, False),
        ("/v1/chat/completions", {"messages": [], "tools": [{"type": "function"}]}, False),
        ("/v1/chat/completions", {"messages": [], "logprobs": True}, False),
        ("/completion", ["not", "an", "object"], False),
    ],
)
def test_which_requests_are_sent_as_streams(path: str, body: Any, expected: bool) -> None:
    assert assembles(path, body) is expected


async def test_which_upstreams_are_asked_for_streams() -> None:
    """llama-server always (its stops need it); llmproxy's own backend only for type-through,
    which reads the text as it is generated; nothing with the off switch."""
    async with aiohttp.ClientSession() as session:
        for setting, type_through, build_info, expected in [
            ("auto", "on", "b4000-abc", True),
            ("auto", "off", "b4000-abc", True),
            ("auto", "off", "llmproxy-backend", False),
            ("auto", "on", "llmproxy-backend", True),
            ("on", "off", "llmproxy-backend", True),
            ("off", "on", "b4000-abc", False),
        ]:
            settings = ProxySettings(upstream_stream=setting, type_through=type_through)
            adapter = LlamaCppAdapter("http://127.0.0.1:9", session, settings)
            adapter.learn_props({"total_slots": 1, "build_info": build_info})
            got = adapter.dialect.assembles("/infill", {"prompt": "x"})
            assert got is expected, (setting, type_through, build_info)
        # the own backend streams only what type-through may continue (it refuses a streamed
        # n_cmpl > 1)
        settings = ProxySettings(upstream_stream="auto", type_through="on")
        adapter = LlamaCppAdapter("http://127.0.0.1:9", session, settings)
        adapter.learn_props({"total_slots": 2, "build_info": "llmproxy-backend"})
        assert not adapter.dialect.assembles("/completion", {"prompt": "x", "n_cmpl": 2})
        assert not adapter.dialect.assembles("/infill", {"prompt": "x", "n_predict": 0})
        assert adapter.dialect.assembles("/completion", {"prompt": "x", "n_predict": 8})


async def test_superseded_non_streaming_request_is_cut_at_the_next_token(
    http: aiohttp.ClientSession,
) -> None:
    """The upstream sees a stream, so it can stop the superseded generation between tokens; the
    client that waits gets one JSON body, identical to the upstream's own non-streaming one."""

    def script(path: str, body: dict[str, Any]) -> Script:
        return Script(tokens=400 if body.get("prompt") == "first" else 3, token_delay_s=0.01)

    async with (
        FakeUpstream(kind="llamacpp", slots=1, script=script) as fake,
        run_proxy(fake.url) as px,
    ):
        headers = {"X-LLMProxy-Session": "editor"}

        async def post(prompt: str) -> tuple[int, bytes]:
            async with http.post(
                px.url + "/completion", json={"prompt": prompt}, headers=headers
            ) as r:
                return r.status, await r.read()

        async with asyncio.TaskGroup() as tg:
            first = tg.create_task(post("first"))
            await wait_until(lambda: fake.concurrent == 1, what="first generation running")
            second = tg.create_task(post("second"))
        assert first.result()[0] == 499 and second.result()[0] == 200
        sent = [rec for rec in fake.received if rec.path == "/completion"]
        assert [rec.body["stream"] for rec in sent if rec.body] == [True, True]
        assert fake.aborted == [sent[0].id] and fake.completed == [sent[1].id]
        async with http.post(fake.url + "/completion", json={"prompt": "second"}) as d:
            assert second.result()[1] == await d.read()
