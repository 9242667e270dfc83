"""OpenAI-compatible upstreams (llama-cpp-python's server, vLLM): a non-streaming
``/v1/completions`` request is sent as a stream and answered whole (proxy/upstream/assemble.py),
so that cancelling it stops its generation at the next token; the differential test against
llama-cpp-python's own server is in tests/interop/test_llama_cpp_python.py."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.proxy.relay.assemble import Assembler
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.upstream.adapters.openai import OpenAIAdapter
from tests.helpers.proxy import run_proxy


def chunk(text: str, finish: str | None = None) -> bytes:
    choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
    obj = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
    return b"data: " + json.dumps({**obj, "choices": [choice]}).encode() + b"\n\n"


def test_a_stream_that_ends_at_done_without_a_finish_reason_takes_its_last_chunk() -> None:
    a = Assembler("/v1/completions")
    a.feed(chunk("x") + chunk("y"))
    assert not a.complete
    a.feed(b"data: [DONE]\n\n")
    assert a.complete
    status, body = a.render()
    obj = json.loads(body)
    assert status == 200 and obj["choices"][0]["text"] == "xy"
    assert obj["choices"][0]["finish_reason"] is None  # as the server left it


@pytest.mark.parametrize(
    ("setting", "path", "body", "expected"),
    [
        ("auto", "/v1/completions", {"prompt": "x"}, True),
        ("on", "/v1/completions", {"prompt": "x", "stream": False}, True),
        ("auto", "/v1/completions", {"prompt": "x", "stream": True}, False),  # a stream already
        ("auto", "/v1/completions", {"prompt": "x", "n": 2}, False),
        ("auto", "/v1/completions", {"prompt": "x", "logprobs": 1}, False),
        ("auto", "/v1/chat/completions", {"messages": []}, False),
        ("off", "/v1/completions", {"prompt": "x"}, False),
    ],
)
async def test_which_requests_are_sent_as_streams(
    setting: str, path: str, body: dict[str, Any], expected: bool
) -> None:
    async with aiohttp.ClientSession() as session:
        settings = ProxySettings(upstream_stream=setting)
        adapter = OpenAIAdapter("http://127.0.0.1:9", session, settings)
        assert adapter.dialect.assembles(path, body) is expected
        sent = json.loads(adapter.dialect.prepare_body(path, json.dumps(body).encode(), body, 0))
        assert sent == ({**body, "stream": True} if expected else body)


@pytest.mark.parametrize("body", [{"prompt": "x"}, {"prompt": "x", "stream": False}])
async def test_the_answer_is_the_upstreams_own_non_streaming_body(
    http: aiohttp.ClientSession, body: dict[str, Any]
) -> None:
    def script(_path: str, _body: dict[str, Any]) -> Script:
        return Script(tokens=5, token_delay_s=0.001)

    async with (
        FakeUpstream(kind="openai", slots=1, script=script) as fake,
        run_proxy(fake.url) as px,
    ):
        assert px.member.adapter.kind == "openai"
        async with http.post(px.url + "/v1/completions", json=body) as r:
            assert r.status == 200 and r.content_type == "application/json"
            proxied = await r.json()
        assert fake.generations[-1].body["stream"] is True
        async with http.post(fake.url + "/v1/completions", json=body) as d:
            direct = await d.json()
        assert proxied.pop("id") != direct.pop("id")  # one per request
        assert proxied == direct
