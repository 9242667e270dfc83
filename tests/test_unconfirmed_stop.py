"""Stops nothing can confirm (OpenAI-compatible upstreams): a superseded stream is cut and its
permit held about one token's time; a non-streaming request is left to finish.

llama-cpp-python's server, measured in tests/interop/test_llama_cpp_python.py, notices a
dropped streaming client after its next chunk and a dropped non-streaming one never."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import structlog

from llmproxy.proxy.bench.fake_upstream import FakeUpstream, Script
from tests.conftest import run_proxy
from tests.helpers import wait_until

TOKEN_S = 0.02


def script(_path: str, body: dict[str, Any]) -> Script:
    return Script(tokens=200 if body.get("prompt") == "first" else 3, token_delay_s=TOKEN_S)


async def supersede(http: aiohttp.ClientSession, stream: bool) -> tuple[FakeUpstream, list[dict[str, Any]]]:
    # the fake's slot stays busy one more token after a dropped client, as llama-cpp-python's
    async with FakeUpstream(kind="openai", slots=1, script=script, abort_linger_s=TOKEN_S) as fake, \
            run_proxy(fake.url) as px:
        headers = {"X-LLMProxy-Session": "editor"}

        async def post(prompt: str) -> int:
            body = {"model": "fake", "prompt": prompt, "max_tokens": 200, "stream": stream}
            async with http.post(px.url + "/v1/completions", json=body, headers=headers) as r:
                await r.read()
                return r.status

        with structlog.testing.capture_logs() as logs:
            async with asyncio.TaskGroup() as tg:
                first = tg.create_task(post("first"))
                await wait_until(lambda: fake._slots[0].n_decoded >= 5, what="first generation under way")
                second = tg.create_task(post("second"))
            assert second.result() == 200 and first.result() in (200, 499)
            await wait_until(lambda: px.state.gate.free == 1, what="permits back")
            px.flush_log()
        return fake, [ln for ln in logs if ln.get("event") == "request" and ln.get("route") == "/v1/completions"]


async def test_superseded_stream_is_cut_and_held_about_one_token(http: aiohttp.ClientSession) -> None:
    fake, (first, _second) = await supersede(http, stream=True)
    assert len(fake.aborted) == 1 and fake.max_concurrent == 1
    assert first["outcome"] == "superseded"
    assert first["confirm_wait_ms"] < 1000 * 10 * TOKEN_S  # twice a token's gap, not unconfirmed_cancel_hold_s (1 s)


async def test_superseded_non_streaming_request_runs_to_its_end(http: aiohttp.ClientSession) -> None:
    fake, (first, _second) = await supersede(http, stream=False)
    assert fake.aborted == [] and len(fake.completed) == 2 and fake.max_concurrent == 1
    assert first["outcome"] == "completed" and first["status"] == 200  # policy finish: its client got it
