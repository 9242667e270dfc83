"""What the backend really did during ``llmproxy bench burst``, seen through ``GET /slots``.

llama-server and llmproxy's backend list their slots with ``is_processing``, ``id_task``
and ``next_token.n_decoded``; the proxy passes ``/slots`` through ungated, so the same
poll works on a proxy URL. From frequent polls we count distinct tasks (generations the
backend ran), the most slots busy at once, and per task the highest ``n_decoded`` seen
and when it was last seen busy. Polling can miss the last few tokens of a task, so
token counts are lower bounds. A task is matched to a response a client read to the end
when it was the latest unmatched task seen busy before that response ended; the tokens
of unmatched tasks were generated for nobody.

Concurrency contract: ``run(stop)`` polls until ``stop`` is set and is owned by the
caller's TaskGroup; ``wait_idle`` polls on its own (either may run; state updates are
synchronous after each response, so interleaving is harmless).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp


class SlotsPoller:
    def __init__(self, http: aiohttp.ClientSession, url: str, interval_s: float) -> None:
        self.http, self.url, self.interval_s = http, url, interval_s
        self.available = False
        self.busy_now = 0
        self.max_busy = 0
        self.decoded: dict[tuple[int, int], int] = {}  # (slot, id_task) -> highest n_decoded seen
        # (slot, id_task) -> perf_counter of the poll
        self.last_seen: dict[tuple[int, int], float] = {}
        self._timeout = aiohttp.ClientTimeout(total=5)

    async def poll(self) -> bool:
        """One GET /slots; False when the target does not serve it (or not in llama-server
        shape)."""
        sent = time.perf_counter()  # the state read is at least as recent as this
        try:
            async with self.http.get(self.url + "/slots", timeout=self._timeout) as resp:
                if resp.status != 200:
                    return False
                slots: Any = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return False
        if not isinstance(slots, list) or not all(
            isinstance(s, dict) and "is_processing" in s for s in slots
        ):
            return False
        busy = [s for s in slots if s["is_processing"]]
        self.busy_now = len(busy)
        for s in busy:
            key = (int(s.get("id", -1)), int(s.get("id_task", -1)))
            nxt = s.get("next_token") or {}
            nxt = nxt[0] if isinstance(nxt, list) and nxt else nxt  # llama-server: a list of one
            n = nxt.get("n_decoded", s.get("n_decoded", 0)) if isinstance(nxt, dict) else 0
            self.decoded[key] = max(self.decoded.get(key, 0), int(n or 0))
            self.last_seen[key] = sent
        return True

    async def probe(self) -> None:
        self.available = await self.poll()

    def reset(self) -> None:
        self.max_busy = 0
        self.decoded.clear()
        self.last_seen.clear()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if await self.poll():
                self.max_busy = max(self.max_busy, self.busy_now)
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
            except TimeoutError:
                pass

    async def wait_idle(self, timeout_s: float) -> None:
        """Until a poll shows no slot busy (raises TimeoutError after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while not (await self.poll() and self.busy_now == 0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.url}/slots still busy after {timeout_s}s")
            await asyncio.sleep(self.interval_s)

    def unmatched_tokens(self, completions: list[float]) -> int:
        """Tokens of the tasks not matched to a response read to the end at these times."""
        unmatched = dict(self.last_seen)
        for t_done in sorted(completions):
            before = [k for k, seen in unmatched.items() if seen <= t_done]
            if before:
                del unmatched[max(before, key=unmatched.__getitem__)]
        return sum(self.decoded[k] for k in unmatched)

    def summary(self, completions: list[float]) -> dict[str, Any]:
        return {
            "generations": len(self.decoded),
            "max_running": self.max_busy,
            "tokens_decoded": sum(self.decoded.values()),
            "tokens_for_nobody": self.unmatched_tokens(completions),
        }
