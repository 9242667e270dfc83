"""Torch engine sleep/wake through the real server: idle_unload_s frees the model,
/health and /props show it, the next request reloads it and answers the same."""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import aiohttp
import pytest

from tests.helpers.backend.server import parallel_flags

HAVE_TORCH = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers", "gguf"))
pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(
        not HAVE_TORCH, reason="torch/transformers not installed (pip install 'llmproxy[torch]')"
    ),
]
GREEDY = {"prompt": "def add(a, b):", "n_predict": 6, "temperature": 0}


async def _health(s: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with s.get(url + "/health") as r:
        assert r.status == 200  # a sleeping engine still takes requests
        return await r.json()


async def test_idle_unload_and_wake(start_backend: Any) -> None:
    b = start_backend("torch", *parallel_flags("torch", 1), "--idle-unload-s", "0.5")
    async with aiohttp.ClientSession() as s:
        async with s.post(b.url + "/completion", json=GREEDY) as r:
            before = (await r.json())["content"]
        async with asyncio.timeout(30):
            while (await _health(s, b.url)).get("model") != "sleeping":
                await asyncio.sleep(0.05)
        async with s.get(b.url + "/props") as r:
            assert (await r.json())["is_sleeping"] is True
        async with s.post(b.url + "/completion", json=GREEDY) as r:
            assert r.status == 200
            assert (await r.json())["content"] == before  # reloaded, same weights
        assert await _health(s, b.url) == {"status": "ok"}
