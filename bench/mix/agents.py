"""The chat agents of ``llmproxy bench mix``: streams back to back, counted per caller.

``agent`` sends ``/v1/chat/completions`` streams one after another, each agent its own
caller session, with its caller's client key when it has one, until it is cancelled
(which closes its connection). ``Agents`` counts what every agent read: tokens (a ``data:``
object each), answers per caller, errors (by HTTP status or exception); ``working`` is set
at the first token any agent reads. Event loop thread only.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class Caller:
    name: str
    agents: int
    key: str | None = None  # None: no client key (the callers scenario gives each one)


@dataclass
class Agents:
    tokens: int = 0
    errors: int = 0
    answers: dict[str, int] = field(default_factory=dict)  # caller -> answers read to the end
    tokens_by: dict[str, int] = field(default_factory=dict)  # caller -> tokens
    failures: dict[str, int] = field(default_factory=dict)  # HTTP status or exception -> count
    working: asyncio.Event = field(default_factory=asyncio.Event)

    def failed(self, why: str) -> None:
        self.errors += 1
        self.failures[why] = self.failures.get(why, 0) + 1

    def snapshot(self) -> tuple[int, dict[str, int], dict[str, int]]:
        return self.tokens, dict(self.answers), dict(self.tokens_by)


async def agent(
    http: aiohttp.ClientSession,
    url: str,
    k: int,
    caller: Caller,
    max_tokens: int,
    extra: dict[str, Any],
    out: Agents,
) -> None:
    """Chat streams back to back until cancelled; see the module docstring."""
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": f"agent {k}: write a long answer"}],
        "stream": True,
        "max_tokens": max_tokens,
        **extra,
    }
    headers = {"X-LLMProxy-Session": f"agent-{k}"}
    if caller.key is not None:
        headers["Authorization"] = f"Bearer {caller.key}"
    out.answers.setdefault(caller.name, 0)
    out.tokens_by.setdefault(caller.name, 0)
    while True:
        try:
            async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                if r.status != 200:
                    out.failed(str(r.status))
                    await r.read()
                    await asyncio.sleep(0.05)
                    continue
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        out.tokens += 1
                        out.tokens_by[caller.name] += 1
                        out.working.set()
        except (aiohttp.ClientError, TimeoutError) as exc:
            out.failed(type(exc).__name__)
            await asyncio.sleep(0.05)
            continue
        out.answers[caller.name] += 1
