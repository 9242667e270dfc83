"""Type-through in front of a real llama-server (``make interop``): keystrokes that type
the model's suggestion are answered from its one generation."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import aiohttp

from llmproxy.proxy.gating.sessions import session_key
from tests.helpers.interop import LlamaServer
from tests.helpers.net import wait_until
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
        await wait_until(lambda: "stop processing" in srv.log_text(), what="the task's end")
        assert srv.log_text().count("launch_slot_") == 1  # llama-server ran one task


async def test_keystrokes_while_the_stream_runs_get_its_remainder(
    llama_server: LlamaServer,
) -> None:
    """Continue's way (streaming ``/completion``): keystrokes sent while the generation runs,
    typing what it has streamed so far, continue it live. Each supersedes the one before
    (its stream ends with the superseded event); the last gets the rest of the output."""
    body: dict[str, Any] = {"prompt": "def fibonacci(n):", "n_predict": 64, "stream": True}
    body |= {"ignore_eos": True, "cache_prompt": True}

    async def stream_text(typed: str, enough: asyncio.Event) -> tuple[str, str]:
        grown = {**body, "prompt": body["prompt"] + typed}
        pieces, end = [], "ok"
        async with http.post(px.url + "/completion", json=grown, headers=HEADERS) as r:
            assert r.status == 200
            try:
                async for line in r.content:
                    if line.startswith(b"data: "):
                        obj = json.loads(line[6:])
                        if "error" in obj:
                            end = obj["error"]["type"]
                        pieces.append(obj.get("content", ""))
                        if len("".join(pieces)) >= 3:
                            enough.set()
            except aiohttp.ClientPayloadError:  # a superseded stream: cut after its event
                assert end != "ok", "cut without the proxy's error event"
        return "".join(pieces), end

    def latest() -> Any:
        """The session's generation in the proxy."""
        key = session_key(parts=[], header_name="X-LLMProxy-Session", headers=HEADERS,
                          peer=None, path="/completion", body=None)  # fmt: skip
        assert px.state.generations is not None
        return px.state.generations.latest(key)

    async with (
        llama_server(parallel=1) as srv,
        run_proxy(srv.url) as px,
        aiohttp.ClientSession() as http,
    ):
        enough = asyncio.Event()
        keys = [asyncio.ensure_future(stream_text("", enough))]
        await asyncio.wait_for(enough.wait(), 60)
        typed = latest().text[:3]  # what the user read and typed, while it streams on
        for n in (1, 2, 3):
            keys.append(asyncio.ensure_future(stream_text(typed[:n], asyncio.Event())))
            await wait_until(lambda n=n: latest().readers == n, what=f"keystroke {n} joined")
        answers = await asyncio.gather(*keys)
        assert [end for _text, end in answers] == ["superseded"] * 3 + ["ok"]
        output = typed + answers[-1][0]
        assert len(output) > 3
        for n, (text, _end) in zip((0, 1, 2), answers, strict=False):
            assert output.startswith(typed[:n] + text), (n, text, output)
        assert srv.log_text().count("stop processing") == 1  # llama-server ran one task
