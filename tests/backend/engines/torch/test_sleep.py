"""Torch engine sleep/wake: through the real server, idle_unload_s frees the model,
/health and /props show it, the next request reloads it and answers the same; in-process,
sleep frees the KV store (with the worker's objects frozen out of the collector) and the
next admit reloads the model."""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import aiohttp
import pytest

from tests.helpers.backend.engine import PROMPTS, alone
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
            # the server shows the worker's sleep only on /health: polling is the point
            while (await _health(s, b.url)).get("model") != "sleeping":  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        async with s.get(b.url + "/props") as r:
            assert (await r.json())["is_sleeping"] is True
        async with s.post(b.url + "/completion", json=GREEDY) as r:
            assert r.status == 200
            assert (await r.json())["content"] == before  # reloaded, same weights
        assert await _health(s, b.url) == {"status": "ok"}


def test_sleep_then_admit_reloads(eng: Any) -> None:
    before = alone(eng, PROMPTS[1])
    loads = eng.load_count
    eng.sleep()
    assert eng.batch is None
    assert alone(eng, PROMPTS[1]) == before
    assert eng.load_count == loads + 1 and eng.last_load["converted"] is False


def test_sleep_frees_the_kv_store_with_the_worker_gc_frozen(eng: Any) -> None:
    """The worker freezes the loaded engine's objects out of the garbage collector
    (worker.py): the store must go by reference counting alone, with no cycle holding it."""
    import gc
    import weakref

    alone(eng, PROMPTS[0])
    store = weakref.ref(eng.batch.kv.store)
    gc.freeze()
    try:
        eng.sleep()
        assert store() is None
    finally:
        gc.unfreeze()
    alone(eng, PROMPTS[0])  # and it reloads
