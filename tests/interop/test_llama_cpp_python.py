"""The proxy in front of llama-cpp-python's server (``python -m llama_cpp.server``), in
``make interop``.

It is detected as ``openai``: no view of its slot, so nothing confirms a stop. It checks for a
dropped streaming client after each chunk, and never for a non-streaming one, so the proxy
sends a non-streaming ``/v1/completions`` request as a stream and answers it whole. A
superseded request, streaming or not, is cut and its permit held about one token's time, so
the next request starts almost at once instead of after the old generation's end.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from tests.helpers.interop import Server
from tests.helpers.net import wait_until
from tests.helpers.proxy import run_proxy
from tests.helpers.streams import read_all

END_TOKENS = {"0": -100, "1": -100, "2": -100}  # SmolLM2's: every generation runs to max_tokens
PROMPT = "def fibonacci(n: int) -> int:\n    "


async def complete(
    http: aiohttp.ClientSession,
    url: str,
    prompt: str,
    *,
    stream: bool,
) -> tuple[int, float]:
    body = {
        "prompt": prompt,
        "max_tokens": 96,
        "stream": stream,
        "logit_bias": END_TOKENS,
        "seed": 1,
    }
    start = time.monotonic()
    async with http.post(
        url + "/v1/completions",
        data=json.dumps(body),
        headers={"Content-Type": "application/json", "X-LLMProxy-Session": "editor"},
    ) as r:
        await read_all(r)  # a superseded stream is cut after its error event
        return r.status, time.monotonic() - start


@pytest.mark.parametrize("stream", [True, False])
async def test_a_superseded_request_stops_and_the_next_one_starts_at_once(
    llama_cpp_python: Server, stream: bool
) -> None:
    async with run_proxy(llama_cpp_python.url) as px, aiohttp.ClientSession() as http:
        assert px.member.adapter.kind == "openai"
        await complete(http, px.url, PROMPT + "a", stream=stream)  # warm-up
        _, alone = await complete(http, px.url, PROMPT + "b", stream=stream)
        first = asyncio.create_task(complete(http, px.url, PROMPT + "c", stream=stream))
        await wait_until(lambda: not px.member.gate.free, 120, what="the first request's permit")
        await asyncio.sleep(alone / 4)  # well into its generation
        status, second = await complete(http, px.url, PROMPT + "d", stream=stream)
        first_status, first_s = await first
        assert status == 200
        # a started stream ends with an error event; a JSON answer not yet begun is a 499
        assert first_status == (200 if stream else 499)
        assert first_s < alone  # cut, not run to its end
        # not after the old generation's end (about 1.75 x alone)
        assert second < 1.4 * alone, (second, alone)
        px.flush_log()


async def test_a_non_streaming_answer_is_the_servers_own(llama_cpp_python: Server) -> None:
    """The same request direct and through the proxy (there sent as a stream): the same body
    but ``usage``, which llama-cpp-python's streams do not carry, and the per-request id."""
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "seed": 1}
    async with run_proxy(llama_cpp_python.url) as px, aiohttp.ClientSession() as http:
        answers = []
        for url in (llama_cpp_python.url, px.url):
            async with http.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200 and r.content_type == "application/json"
                answers.append(await r.json())
        direct, proxied = answers
        assert direct.pop("usage")["completion_tokens"] == 16 and "usage" not in proxied
        for obj in (direct, proxied):
            del obj["id"], obj["created"]
        assert proxied == direct
