"""The proxy in front of llama-cpp-python's server (``python -m llama_cpp.server``), in
``make interop``.

It is detected as ``openai``: no view of its slot, so nothing confirms a stop. It checks for a
dropped streaming client after each chunk, and never for a non-streaming one. A superseded
stream is cut and its permit held about one token's time, so the next request starts almost
at once instead of after the old generation's end.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from tests.helpers.interop import Server
from tests.helpers.net import wait_until
from tests.helpers.proxy import run_proxy

END_TOKENS = {"0": -100, "1": -100, "2": -100}  # SmolLM2's: every generation runs to max_tokens
PROMPT = "def fibonacci(n: int) -> int:\n    "


async def complete(
    http: aiohttp.ClientSession,
    url: str,
    prompt: str,
    *,
    stream: bool,
    first_chunk: asyncio.Event | None = None,
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
        async for _ in r.content.iter_any():
            if first_chunk is not None:
                first_chunk.set()
        return r.status, time.monotonic() - start


async def test_a_superseded_stream_stops_and_the_next_request_starts_at_once(
    llama_cpp_python: Server,
) -> None:
    async with run_proxy(llama_cpp_python.url) as px, aiohttp.ClientSession() as http:
        assert px.state.adapter.kind == "openai"
        await complete(http, px.url, PROMPT + "a", stream=True)  # warm-up
        _, alone = await complete(http, px.url, PROMPT + "b", stream=True)
        started = asyncio.Event()
        first = asyncio.create_task(
            complete(http, px.url, PROMPT + "c", stream=True, first_chunk=started)
        )
        await asyncio.wait_for(started.wait(), 120)
        status, second = await complete(http, px.url, PROMPT + "d", stream=True)
        first_status, first_s = await first
        assert status == 200 and first_status == 200  # a started stream ends with an error event
        assert first_s < alone  # cut, not run to its end
        # not after the old generation's end (about 2 x alone)
        assert second < 1.5 * alone, (second, alone)
        px.flush_log()


async def test_a_non_streaming_request_is_left_to_finish(llama_cpp_python: Server) -> None:
    """Closing it would not stop llama-cpp-python's generation: the permit stays with it."""
    async with run_proxy(llama_cpp_python.url) as px, aiohttp.ClientSession() as http:
        first = asyncio.create_task(complete(http, px.url, PROMPT + "c", stream=False))
        await wait_until(lambda: not px.state.gate.free, 120, what="the first request's permit")
        status, _ = await complete(http, px.url, PROMPT + "d", stream=False)
        assert status == 200 and (await first)[0] == 200
        assert px.state.gate.free == 1
