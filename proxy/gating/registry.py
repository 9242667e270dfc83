"""What a graceful stop waits for: every upstream job, and every request handler.

Concurrency contract:
- ``spawn`` starts a gated request's upstream job (upstream/job.py) as a tracked task and keeps a
  strong reference until it is done: never a bare fire-and-forget task.
- ``track_current`` registers the calling request handler (a task aiohttp owns) for as
  long as it runs, so that the stop also waits for responses still being written
  (passthroughs, and gated handlers writing their job's error as a stream's last event).
- ``drain(timeout, grace)`` is the stop (app.py's on_shutdown, after the gate closed): it
  waits until all of them are done or ``timeout`` has passed, picking up jobs spawned
  while it waits. Then it cancels the jobs left (each puts a shutting-down error in its
  ``Responder``), gives the handlers ``grace`` to write that as their stream's last event,
  cancels the handlers still running, and waits for all of it to unwind. It owns no
  other teardown: a cancelled job releases its own permit, a cancelled handler's
  connection is closed by aiohttp.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import structlog

log = structlog.get_logger("llmproxy.registry")
DRAIN_GRACE_S = 1.0  # after the deadline: how long cut handlers get to relay their last event


class JobRegistry:
    def __init__(self) -> None:
        self._jobs: set[asyncio.Task[Any]] = set()
        self._handlers: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._jobs.add(task)
        task.add_done_callback(self._jobs.discard)
        return task

    def track_current(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)

    def __len__(self) -> int:
        """Upstream jobs still running (handlers are not counted)."""
        return len(self._jobs)

    # ``timeout`` is the stop's API (see the module's contract), kept as a parameter
    async def drain(self, timeout: float, grace: float = DRAIN_GRACE_S) -> None:  # noqa: ASYNC109
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (running := self._jobs | self._handlers) and (left := deadline - loop.time()) > 0:
            await asyncio.wait(running, timeout=left)
        jobs, handlers = set(self._jobs), set(self._handlers)
        if not (jobs or handlers):
            return
        log.warning(
            "shutdown deadline: cutting what is still running",
            jobs=len(jobs),
            handlers=len(handlers),
        )
        await _cut(jobs)
        if self._handlers:  # relaying the jobs' last event, or writing to a slow reader
            await asyncio.wait(set(self._handlers), timeout=grace)
        await _cut(set(self._handlers))


async def _cut(tasks: set[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait until they have unwound."""
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks)
