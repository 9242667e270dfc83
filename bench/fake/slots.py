"""The fake upstream's slots, its concurrency counters and the change notification.

``SlotTable`` holds llama-server's view of each slot (busy, its task id, tokens decoded,
the prompt text it caches when the prompt-cache model is on; see prompts.py), the tokens
decoded by all generations (``tokens_decoded``, the fake's ``/metrics``),
``concurrent`` / ``max_concurrent`` (generations received and not yet finished, waiting
ones included) and ``deferred`` (generations that found no slot free for them on arrival).

Every state is mutated synchronously, so a cancelled handler can never leave a slot busy.
``changed()`` then notifies one ``asyncio.Condition`` from a short task (only when someone
waits on it and the table is not stopping); ``wait(predicate)`` and generations waiting for
slots wait on it. The table owns those tasks and the abort-linger tasks: ``stop()`` cancels
and awaits them, and wakes every ``hang()``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from llmproxy.bench.fake.prompts import common_prefix


@dataclass
class Slot:
    busy: bool = False
    id_task: int = -1
    n_decoded: int = 0
    prompt: str = ""  # the prompt cache: the last prompt that ran here (model on only)


class SlotTable:
    """``count`` slots of one fake upstream; see the module docstring."""

    def __init__(self, count: int) -> None:
        self.slots = [Slot() for _ in range(count)]
        self.concurrent = 0
        self.max_concurrent = 0
        self.deferred: list[int] = []
        self.tokens_decoded = 0
        self._cond = asyncio.Condition()
        self.stopping = asyncio.Event()  # set by stop()
        self._tasks: set[asyncio.Task[None]] = set()
        self._waiters = 0  # coroutines waiting on _cond (wait, deferred generations)

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def busy(self) -> list[bool]:
        return [s.busy for s in self.slots]

    async def stop(self) -> None:
        """Wake every ``hang()``, cancel the linger and notification tasks and await them."""
        self.stopping.set()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def hang(self) -> None:
        """Until ``stop()``."""
        await self.stopping.wait()

    async def wait(self, predicate: Callable[[], bool]) -> None:
        """Until ``predicate()`` holds; re-checked at every ``changed()``."""
        self._waiters += 1
        try:
            async with self._cond:
                await self._cond.wait_for(predicate)
        finally:
            self._waiters -= 1

    def changed(self) -> None:
        """Publish a state change to the waiters (state is mutated synchronously).

        Notifying needs the condition's lock, so it runs in a tracked task; skipped when
        nobody waits or the table is stopping.
        """
        if self._waiters and not self.stopping.is_set():
            self._spawn(self._notify_all())

    async def _notify_all(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def enter(self, k: int) -> None:
        """A generation of ``k`` completions arrived: it counts in ``concurrent`` from now."""
        self.concurrent += k
        self.max_concurrent = max(self.max_concurrent, self.concurrent)
        self.changed()

    async def take(
        self, want: Any, k: int, task_id: int, prompt: str | None = None
    ) -> tuple[int, ...]:
        """Wait until slot ``want`` (or any slot when absent or < 0) and k - 1 others are idle
        (all at once, as llama-server launches a request with its extra completions), mark
        them busy and return them, the first one ``want``'s. Without ``want``, the first is
        the lowest idle slot, or with a ``prompt`` (the prompt-cache model) the idle slot
        whose cached prompt shares the longest prefix with it (ties: the lowest); the others
        are the lowest other idle ones. Waiters are woken in arrival order; a request that
        finds its slots idle on arrival takes them at once."""
        wanted = want if isinstance(want, int) and 0 <= want < len(self.slots) else None

        def free() -> tuple[int, ...] | None:
            idle = [i for i, s in enumerate(self.slots) if not s.busy]
            first = wanted
            if first is None and prompt is not None and idle:
                first = max(idle, key=lambda i: (common_prefix(self.slots[i].prompt, prompt), -i))
            if first is not None:
                if first not in idle:
                    return None
                idle.remove(first)
                idle.insert(0, first)
            return tuple(idle[:k]) if len(idle) >= k else None

        got = free()
        if got is None:
            self.deferred.append(task_id)
            await self.wait(lambda: free() is not None)
            got = free()
            assert got is not None
        for i in got:
            self.slots[i] = Slot(busy=True, id_task=task_id, prompt=self.slots[i].prompt)
        self.changed()
        return got

    def free(self, slots: tuple[int, ...], k: int) -> None:
        """End a generation now (synchronously): free its slots, drop its k from
        ``concurrent``."""
        for i in slots:
            self.slots[i] = Slot(prompt=self.slots[i].prompt)
        self.concurrent -= k
        self.changed()

    def linger(self, slots: tuple[int, ...], k: int, seconds: float) -> None:
        """``free(slots, k)`` after ``seconds``, in a task that ``stop()`` cancels (a slot
        stays busy a while after its client left, as llama-server notices it by polling)."""
        self._spawn(self._free_later(slots, k, seconds))

    async def _free_later(self, slots: tuple[int, ...], k: int, seconds: float) -> None:
        await asyncio.sleep(seconds)
        self.free(slots, k)

    async def tick(self, slots: tuple[int, ...], due: float) -> None:
        """Decode one token on ``slots``: wait until ``due`` (loop time), the token's place
        on the schedule.

        Tokens are paced against the generation's start, not by relative sleeps, so timer
        overshoot does not accumulate: a generation of n tokens takes n x delay plus one
        wake-up, however busy the machine.
        """
        await asyncio.sleep(max(0.0, due - asyncio.get_running_loop().time()))
        for i in slots:
            self.slots[i].n_decoded += 1
            self.tokens_decoded += 1
