"""One simulated editor of ``llmproxy bench soak``.

An ``Editor`` is one session (its own ``X-LLMProxy-Session``) doing random actions until a
deadline, with a seeded RNG: keystroke bursts on ``/infill`` (half of them abort the
previous request, like llm-ls; the others leave the superseding to the proxy, like
Continue), ``n_predict: 0`` warm-ups, streamed chat completions and non-streamed
completions. It counts every request it sent by what it saw (status code, ``aborted`` or
the client error's name). A burst's requests are tasks it owns: it cancels them (abort)
or awaits them before returning.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import aiohttp

from llmproxy.bench.soak.result import SoakResult
from llmproxy.bench.soak.settings import SoakSettings


class Editor:
    """One editor session doing random actions until ``deadline``."""

    def __init__(
        self, http: aiohttp.ClientSession, url: str, i: int, s: SoakSettings, result: SoakResult
    ) -> None:
        self.http, self.url, self.s, self.result = http, url, s, result
        self.rng = random.Random(s.seed * 1000 + i)
        self.headers = {"X-LLMProxy-Session": f"soak-editor-{i}", "User-Agent": f"soak/{i}"}

    async def request(self, path: str, body: dict[str, Any]) -> None:
        try:
            async with self.http.post(self.url + path, json=body, headers=self.headers) as r:
                await r.read()
                self.result.client[str(r.status)] += 1
        except asyncio.CancelledError:
            self.result.client["aborted"] += 1
            raise
        except aiohttp.ClientError as exc:
            self.result.client[type(exc).__name__] += 1

    async def burst(self, abort: bool) -> None:
        tasks: list[asyncio.Task[None]] = []
        text = "def f(x):\n    return "
        try:
            for _ in range(self.rng.randint(2, 8)):
                text += self.rng.choice("abcxyz+-*() ")
                if abort and tasks:
                    tasks[-1].cancel()
                body = {
                    "input_prefix": text,
                    "input_suffix": "\n",
                    "n_predict": self.s.n_predict,
                    "stream": abort,
                }
                tasks.append(asyncio.create_task(self.request("/infill", body)))
                await asyncio.sleep(self.rng.uniform(0.03, 0.08))
        finally:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def act(self) -> None:
        roll = self.rng.random()
        if roll < 0.5:
            await self.burst(abort=roll < 0.25)
        elif roll < 0.65:
            await self.request("/completion", {"prompt": "import os\n", "n_predict": 0})  # warm-up
        elif roll < 0.85:
            await self.request(
                "/v1/chat/completions",
                {
                    "messages": [{"role": "user", "content": "Say hi"}],
                    "max_tokens": self.s.n_predict,
                    "stream": True,
                },
            )
        else:
            await self.request(
                "/completion", {"prompt": "def add(a, b):", "n_predict": self.s.n_predict}
            )

    async def run(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            await self.act()
            await asyncio.sleep(self.rng.uniform(0, 0.3))
