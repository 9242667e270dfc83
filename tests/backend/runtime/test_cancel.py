"""Cancellation contract: a client that leaves stops its generation between tokens, and
/slots shows the slot processing until the worker has really stopped."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Any

import aiohttp

LONG = {
    "prompt": "Once upon a time",
    "n_predict": 500,
    "ignore_eos": True,
    "temperature": 0.8,
    "stream": True,
}


async def read_tokens(resp: aiohttp.ClientResponse, n: int) -> int:
    """Read SSE events until ``n`` tokens were seen; returns the last tokens_predicted."""
    seen = 0
    last = 0
    while seen < n:
        line = await resp.content.readline()
        assert line, "stream ended early"
        if line.startswith(b"data: "):
            ev = json.loads(line[6:])
            assert not ev.get("stop"), ev
            last = ev["tokens_predicted"]
            seen += 1
    return last


async def slot0(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/slots") as r:
        return (await r.json())[0]


async def test_client_close_stops_generation(backend: Any) -> None:
    async with aiohttp.ClientSession() as s:
        resp = await s.post(backend.url + "/completion", json=LONG)
        n_client = await read_tokens(resp, 5)
        t0 = time.perf_counter()
        resp.close()  # the client goes away mid-stream
        idle_at = None
        n_final = None
        while time.perf_counter() - t0 < 5:
            sl = await slot0(s, backend.url)
            if not sl["is_processing"]:
                idle_at = time.perf_counter() - t0
                n_final = sl["n_decoded"]
                break
            await asyncio.sleep(0.002)
        assert idle_at is not None, "slot still busy 5 s after the client left"
        assert idle_at < 1.0
        assert n_final is not None and n_final - n_client <= 16, (n_client, n_final)
        # the slot is usable right away
        async with s.post(backend.url + "/completion", json={"prompt": "hi", "n_predict": 2}) as r:
            assert r.status == 200


async def test_slot_busy_until_worker_stopped(backend: Any) -> None:
    """Freeze the worker (SIGSTOP) so it cannot act on the Cancel: the slot must stay busy."""
    pid = backend.worker_pids()[0]
    async with aiohttp.ClientSession() as s:
        resp = await s.post(backend.url + "/completion", json=LONG)
        await read_tokens(resp, 3)
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(0.2)  # let every event the worker sent arrive
            n_frozen = (await slot0(s, backend.url))["n_decoded"]
            resp.close()
            t_end = time.perf_counter() + 0.5
            while time.perf_counter() < t_end:
                sl = await slot0(s, backend.url)
                assert sl["is_processing"] is True, (
                    "slot reported idle while the worker is still generating"
                )
                await asyncio.sleep(0.02)
        finally:
            os.kill(pid, signal.SIGCONT)
        t0 = time.perf_counter()
        while True:
            sl = await slot0(s, backend.url)
            if not sl["is_processing"]:
                break
            assert time.perf_counter() - t0 < 3, "slot did not go idle after the worker resumed"
            await asyncio.sleep(0.005)
        # the worker stopped within a couple of tokens of resuming
        assert sl["n_decoded"] - n_frozen <= 2, (n_frozen, sl["n_decoded"])


async def test_non_stream_client_timeout_cancels(backend: Any) -> None:
    body = {**LONG, "stream": False}
    async with aiohttp.ClientSession() as s:
        try:
            async with s.post(
                backend.url + "/completion", json=body, timeout=aiohttp.ClientTimeout(total=0.5)
            ) as r:
                await r.read()
        except TimeoutError:
            pass
        t0 = time.perf_counter()
        while (await slot0(s, backend.url))["is_processing"]:
            assert time.perf_counter() - t0 < 2
            await asyncio.sleep(0.005)
        assert (await slot0(s, backend.url))["n_decoded"] < 500
