"""The upstreams ``llmproxy bench pool`` puts behind the proxy, fresh for every target.

``fake_pool(settings, n)`` runs n ``FakeUpstream``s with the prompt-cache model in this
process (on this event loop); ``real_pool(settings, n, workdir)`` runs n ``llmproxy
backend`` processes with one slot each on free loopback ports, as children that die with
this process. Either yields an ``Upstreams``: their URLs, ``wait_idle`` (until no slot of
any is busy: the fakes' ``wait_for``, the backends' ``GET /slots`` polled with a deadline)
and ``counters``. Both own their upstreams: leaving the block stops them (the fakes'
linger tasks cancelled, the children SIGTERM then SIGKILL), so each target starts on
cold prompt caches and zeroed counters.

What ``counters`` counts. Fakes: the prompt characters of every generation that reached
them (``sent``), of which they ``evaluated`` and found ``cached`` (their own counters,
abandoned generations included), and each one's ``max_concurrent`` (generations received
and not finished, those waiting for a slot included). Real backends report nothing
themselves: those counts come from the answers (editors.py) and are ``None`` here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from llmproxy.backend.model_path import resolve_model
from llmproxy.bench.burst.slots import SlotsPoller
from llmproxy.bench.child import ChildFailed, child
from llmproxy.bench.fake.prompts import prompt_text
from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.bench.pool.settings import PoolSettings


@dataclass
class Upstreams:
    urls: list[str]
    slots: int
    wait_idle: Callable[[float], Awaitable[None]]
    fakes: list[FakeUpstream] = field(default_factory=list)

    def counters(self) -> dict[str, Any]:
        if not self.fakes:
            return {"sent": None, "evaluated": None, "cached": None, "max_concurrent": None}
        return {
            "generations": sum(len(f.generations) for f in self.fakes),
            "sent": sum(
                len(prompt_text(g.path, g.body or {}) or "")
                for f in self.fakes
                for g in f.generations
            ),
            "evaluated": sum(f.prompt_chars_evaluated for f in self.fakes),
            "cached": sum(f.prompt_chars_cached for f in self.fakes),
            "max_concurrent": [f.max_concurrent for f in self.fakes],
            "deferred": sum(len(f.deferred) for f in self.fakes),
        }


@contextlib.asynccontextmanager
async def fake_pool(settings: PoolSettings, n: int) -> AsyncIterator[Upstreams]:
    script = Script(tokens=settings.n_predict, token_delay_s=settings.token_delay_ms / 1000)
    async with contextlib.AsyncExitStack() as stack:
        fakes = [
            await stack.enter_async_context(
                FakeUpstream(
                    slots=settings.fake_slots,
                    abort_linger_s=settings.abort_linger_s,
                    prefill_s_per_char=settings.prefill_s_per_char,
                    script=lambda _p, _b: script,
                )
            )
            for _ in range(n)
        ]

        async def wait_idle(timeout_s: float) -> None:
            for f in fakes:
                await f.wait_for(lambda f: f.concurrent == 0, timeout_s)

        yield Upstreams([f.url for f in fakes], settings.fake_slots, wait_idle, fakes)


def backend_argv(settings: PoolSettings, model: Path, threads: int) -> list[str]:
    """``llmproxy backend`` with one slot (``--port-file`` is appended by ``child``)."""
    return [sys.executable, "-m", "llmproxy.backend", "--port", "0", "--parallel", "1"] + [
        "--model", str(model), "--n-threads", str(threads), "--n-ctx", str(settings.n_ctx),
        "--log-level", "warning",
    ]  # fmt: skip


async def _ready(http: aiohttp.ClientSession, url: str, timeout_s: float) -> None:
    """Until ``url``/health answers 200 (every worker loaded); ChildFailed after the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(url + "/health") as resp:
                if resp.status == 200:
                    return
        if time.monotonic() > deadline:
            raise ChildFailed(f"{url}/health not 200 after {timeout_s:g} s")
        await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def real_pool(
    settings: PoolSettings, n: int, workdir: Path, tag: str
) -> AsyncIterator[Upstreams]:
    model = resolve_model(settings.model)
    threads = settings.threads or max(1, (os.cpu_count() or 1) // settings.backends)
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(aiohttp.ClientSession())
        urls = []
        for i in range(n):
            argv = backend_argv(settings, model, threads)
            name = f"{tag}-backend-{i}"
            _pid, url = await stack.enter_async_context(
                child(name, argv, workdir, settings.start_timeout_s)
            )
            urls.append(url)
        for url in urls:
            await _ready(http, url, settings.start_timeout_s)

        async def wait_idle(timeout_s: float) -> None:
            for url in urls:
                await SlotsPoller(http, url, 0.05).wait_idle(timeout_s)

        yield Upstreams(urls, 1, wait_idle)
