"""``llmproxy bench tokenize --ttft``: does a special-token flood hold a backend's slot?

Against a real backend (one slot; started here with ``--n-ctx``, one llama.cpp thread and
``--metrics``, or the one at ``--url``, which needs ``--metrics``): for each count N a
client sends a completion of N ``<|im_end|>`` strings (under the context bound, so it is
tokenized: seconds of llama.cpp's tokenizer for N in the ten thousands) and leaves as
soon as the server has it (``requests_deferred`` + ``requests_processing`` > 0), as an
attacker would; then a short streamed completion is timed to its first token. Where
prompts are tokenized on the slot, that time is the flood's tokenization (nothing stops
it); where they are tokenized off the slot it stays near the time alone. Between counts
the bench waits for the slot and the tokenizers to be idle again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

SHORT = {"prompt": "Hello", "n_predict": 4, "stream": True}
SETTLE_S = 300.0


async def run(args: argparse.Namespace, counts: list[int]) -> int:
    n_ctx = int(args.ttft_n_ctx)
    async with _backend(args.url, n_ctx) as url, aiohttp.ClientSession() as http:
        await _idle(http, url)
        alone = statistics.median([await _ttft(http, url) for _ in range(3)])
        print(f"backend {url}  n_ctx {n_ctx}  time to first token alone: {alone * 1000:.0f} ms")
        print(f"{'N':>8} {'bytes':>9} {'TTFT after a flood (ms)':>24} {'x alone':>8}")
        for n in counts:
            if n >= n_ctx:
                print(f"{n:>8}  skipped: not under n_ctx {n_ctx} (refused before tokenizing)")
                continue
            text = "<|im_end|>" * n
            flood = {"prompt": text, "n_predict": 1}
            task = asyncio.create_task(_post(http, url + "/completion", flood))
            try:
                await _until_arrived(http, url)
            finally:
                task.cancel()  # the client leaves at once
                await asyncio.gather(task, return_exceptions=True)
            ttft = await _ttft(http, url)
            print(f"{n:>8} {len(text):>9} {ttft * 1000:>24.0f} {ttft / alone:>8.1f}")
            await _idle(http, url)
    return 0


@contextlib.asynccontextmanager
async def _backend(url: str | None, n_ctx: int) -> AsyncIterator[str]:
    if url:
        yield url.rstrip("/")
        return
    from llmproxy.bench.child import child

    argv = [sys.executable, "-m", "llmproxy.backend", "--port", "0", "--parallel", "1",
            "--n-threads", "1", "--n-ctx", str(n_ctx), "--metrics",
            "--log-level", "warning"]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-tokenize-") as tmp:
        async with child("backend", argv, Path(tmp), 180) as (_pid, base):
            await _ready(base)
            yield base


async def _ready(url: str) -> None:
    """Until the backend's /health answers 200 (its worker loaded)."""
    async with aiohttp.ClientSession() as http, asyncio.timeout(180):
        while True:
            async with http.get(url + "/health") as r:
                if r.status == 200:
                    return
            await asyncio.sleep(0.1)


async def _post(http: aiohttp.ClientSession, url: str, body: object) -> None:
    async with http.post(url, json=body) as r:
        await r.read()


async def _ttft(http: aiohttp.ClientSession, url: str) -> float:
    """Seconds from sending a short streamed completion to its first event."""
    t0 = time.perf_counter()
    async with http.post(url + "/completion", json=SHORT) as r:
        if r.status != 200:
            raise RuntimeError(f"short request: {r.status} {await r.text()}")
        async for line in r.content:
            if line.startswith(b"data: "):
                first = time.perf_counter() - t0
                break
        else:
            raise RuntimeError("short request: no event")
        await r.read()
    return first


async def _metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as r:
        if r.status != 200:
            raise RuntimeError(f"{url}/metrics answers {r.status}: start it with --metrics")
        text = await r.text()
    out = {}
    for line in text.splitlines():
        if line.startswith("llamacpp:"):
            name, value = line.split()
            out[name.removeprefix("llamacpp:")] = float(value)
    return out


async def _until_arrived(http: aiohttp.ClientSession, url: str) -> None:
    async with asyncio.timeout(60):
        while True:
            m = await _metrics(http, url)
            if m["requests_deferred"] + m["requests_processing"] >= 1:
                return
            await asyncio.sleep(0.005)


async def _idle(http: aiohttp.ClientSession, url: str) -> None:
    async with asyncio.timeout(SETTLE_S):
        while True:
            m = await _metrics(http, url)
            if m["requests_deferred"] + m["requests_processing"] == 0:
                return
            await asyncio.sleep(0.05)
