"""Type-through in front of llmproxy's own backend (the real model, temperature 0)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.helpers.backend.server import Backend
from tests.helpers.proxy import run_proxy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed"
    ),
]

BODY = {
    "input_prefix": "def fibonacci(n):\n",
    "prompt": "    ",
    "input_suffix": "\n",
    "n_predict": 24,
    "temperature": 0,
    "cache_prompt": True,
}


def comparable(raw: bytes) -> Any:
    """A body without what differs from run to run (timings)."""
    obj = json.loads(raw)
    obj.pop("timings", None)
    obj.pop("tokens_cached", None)
    return obj


async def test_a_typist_on_the_embedded_backend_runs_one_generation(tmp_path: Path) -> None:
    backend = await asyncio.to_thread(Backend(tmp_path, "llama-cpp").wait_ready)
    try:
        async with (
            run_proxy(backend.url, upstream_kind="llamacpp") as px,
            aiohttp.ClientSession() as http,
        ):
            for _ in range(2):  # the second one from the prompt cache, as the proxied one below
                async with http.post(backend.url + "/infill", json=BODY) as r:
                    direct = await r.read()
            headers = {"X-LLMProxy-Session": "typist"}
            async with http.post(px.url + "/infill", json=BODY, headers=headers) as r:
                proxied = await r.read()
            # streamed upstream and assembled: the backend's own non-streaming answer
            assert comparable(proxied) == comparable(direct)
            assert re.search(rb'"content"\s*:"', proxied)
            output = json.loads(proxied)["content"]
            assert len(output) > 8, output
            for n in range(1, 9):  # the user types the suggestion, a character per keystroke
                typed = {**BODY, "prompt": BODY["prompt"] + output[:n]}
                async with http.post(px.url + "/infill", json=typed, headers=headers) as r:
                    assert r.status == 200
                    assert json.loads(await r.read())["content"] == output[n:]
            async with http.get(px.url + "/llmproxy/metrics") as r:
                metrics = await r.text()
            counts = dict(
                re.findall(
                    r'^llmproxy_requests_total\{outcome="(\w+)",route="/infill"\} (\S+)$',
                    metrics,
                    re.M,
                )
            )
            assert counts == {"completed": "1.0", "reused": "8.0"}, counts
    finally:
        await asyncio.to_thread(backend.stop)
