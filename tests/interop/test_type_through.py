"""Type-through in front of a real llama-server (``make interop``): keystrokes that type
the model's suggestion are answered from its one generation."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import aiohttp

from tests.helpers.interop import LlamaServer
from tests.helpers.proxy import run_proxy

HEADERS = {"X-LLMProxy-Session": "typist"}
INFILL = {  # llama.vim's body, trimmed
    "input_prefix": "def fibonacci(n: int) -> int:\n",
    "input_suffix": "\n\nprint(fibonacci(10))\n",
    "input_extra": [],
    "prompt": "    ",
    "n_predict": 32,
    "top_k": 40,
    "top_p": 0.90,
    "samplers": ["top_k", "top_p", "infill"],
    "stream": False,
    "cache_prompt": True,
    "ignore_eos": True,
    "response_fields": ["content", "timings/predicted_n", "truncated"],
}


def counts(metrics: str, route: str) -> dict[str, str]:
    pattern = rf'^llmproxy_requests_total\{{outcome="(\w+)",route="{route}"\}} (\S+)$'
    return dict(re.findall(pattern, metrics, re.M))


async def test_a_llama_vim_typist_is_answered_from_one_generation(
    llama_server: LlamaServer, fim_gguf: Path
) -> None:
    async with (
        llama_server(parallel=1, model=fim_gguf) as srv,
        run_proxy(srv.url) as px,
        aiohttp.ClientSession() as http,
    ):
        async with http.post(px.url + "/infill", json=INFILL, headers=HEADERS) as r:
            output = json.loads(await r.read())["content"]
        assert len(output) >= 8, output
        for n in range(1, 9):
            typed = {**INFILL, "prompt": INFILL["prompt"] + output[:n]}
            async with http.post(px.url + "/infill", json=typed, headers=HEADERS) as r:
                raw = await r.read()
                assert r.status == 200 and re.search(rb'"content"\s*:"', raw)
                assert json.loads(raw)["content"] == output[n:]
        async with http.get(px.url + "/llmproxy/metrics") as r:
            assert counts(await r.text(), "/infill") == {"completed": "1.0", "reused": "8.0"}
        assert srv.log_text().count("stop processing") == 1  # llama-server ran one task


async def test_keystrokes_while_the_stream_runs_get_its_remainder(
    llama_server: LlamaServer,
) -> None:
    """Continue's way (streaming ``/completion``): keystrokes sent while the generation runs,
    typing what it has streamed so far, get the rest of it, live."""
    body: dict[str, Any] = {"prompt": "def fibonacci(n):", "n_predict": 64, "stream": True}
    body |= {"ignore_eos": True, "cache_prompt": True}

    async def stream_text(typed: str, pieces: list[str], enough: asyncio.Event) -> str:
        grown = {**body, "prompt": body["prompt"] + typed}
        async with http.post(px.url + "/completion", json=grown, headers=HEADERS) as r:
            assert r.status == 200
            async for line in r.content:
                if line.startswith(b"data: "):
                    pieces.append(json.loads(line[6:]).get("content", ""))
                    if len("".join(pieces)) >= 3:
                        enough.set()
        return "".join(pieces)

    async with (
        llama_server(parallel=1) as srv,
        run_proxy(srv.url) as px,
        aiohttp.ClientSession() as http,
    ):
        seen: list[str] = []
        enough = asyncio.Event()
        owner = asyncio.ensure_future(stream_text("", seen, enough))
        await asyncio.wait_for(enough.wait(), 60)
        typed = "".join(seen)[:3]  # what the user read and typed, while it streams on
        followers = [stream_text(typed[:n], [], asyncio.Event()) for n in (1, 2, 3)]
        answers = await asyncio.gather(*followers)
        output = await owner
        assert answers == [output[n:] for n in (1, 2, 3)]
        assert len(output) > 3
        assert srv.log_text().count("stop processing") == 1  # llama-server ran one task
