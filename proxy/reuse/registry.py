"""Each session's latest generation, and who reads it (type-through).

``Generations.begin`` records the generation a session's newest request starts (replacing
the session's previous one); ``Generations.follow`` decides whether a new request of the
session continues it and, when the user typed ahead of the model, waits until its text
confirms or contradicts what was typed.

Liveness: a generation runs for its readers, the request that started it and those that
follow it. When the last one leaves (``leave``), the generation's ``on_orphaned`` callback
runs after ``grace_s`` unless a new reader came meanwhile: the owning job then applies its
disconnect policy. The grace lets an editor that closes its previous request just before
sending the next keystroke's continue the generation instead of cancelling it.

Concurrency contract: event loop thread only. ``follow`` blocks only while the user typed
ahead of the model, until the next piece of text or the generation's end; its caller
cancels it when its client leaves. Timers are loop handles owned here, cancelled when a
reader comes back or the generation is replaced; no task is started.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmproxy.proxy.reuse.generation import Generation
from llmproxy.proxy.reuse.match import typed


@dataclass(frozen=True, slots=True)
class Follow:
    """A request answered from ``generation``: its text after the first ``skip`` characters."""

    generation: Generation
    skip: int


class _Entry:
    __slots__ = ("generation", "live", "orphaned", "timer")

    def __init__(self, generation: Generation, orphaned: Callable[[], None]) -> None:
        self.generation = generation
        self.live = 1  # the request that started it
        self.orphaned = orphaned
        self.timer: asyncio.TimerHandle | None = None


class Generations:
    """The latest generation per session, at most ``max_sessions`` (least recently used
    first out); a finished one is kept ``ttl_s``."""

    def __init__(self, ttl_s: float, grace_s: float, max_sessions: int = 4096) -> None:
        self.ttl_s, self.grace_s, self.max_sessions = ttl_s, grace_s, max_sessions
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def begin(self, session: str, generation: Generation, on_orphaned: Callable[[], None]) -> None:
        """``generation`` is the session's newest; the previous one is forgotten."""
        old = self._entries.pop(session, None)
        if old is not None and old.timer is not None:
            old.timer.cancel()
        self._entries[session] = _Entry(generation, on_orphaned)
        while len(self._entries) > self.max_sessions:
            _, dropped = self._entries.popitem(last=False)
            if dropped.timer is not None:
                dropped.timer.cancel()

    def latest(self, session: str) -> Generation | None:
        entry = self._entries.get(session)
        if entry is None:
            return None
        if entry.generation.expired(self.ttl_s, time.monotonic()):
            del self._entries[session]
            return None
        return entry.generation

    async def follow(self, session: str, route: str, body: Any) -> Follow | None:
        """A ``Follow`` when ``body`` continues the session's latest generation: the user
        typed ``d`` and the generation wrote ``d``. While the generation has written less
        than ``d`` (typing ahead), waits for more; None as soon as it writes something else
        or ends short (the caller then goes through the gate, superseding it)."""
        generation = self.latest(session)
        if generation is None or generation.route != route or generation.error is not None:
            return None
        d = typed(route, generation.body, body)
        if d is None:
            return None
        while True:
            if generation.text.startswith(d):
                break
            if generation.done or not d.startswith(generation.text):
                return None
            await generation.changed()
        if generation.error is not None and len(generation.text) <= len(d):
            return None  # cut before it wrote anything past what was typed
        entry = self._entries.get(session)
        if entry is None or entry.generation is not generation:
            return None  # replaced while waiting
        self.join(session, generation)
        generation.readers += 1
        return Follow(generation, len(d))

    def join(self, session: str, generation: Generation) -> None:
        entry = self._entries.get(session)
        if entry is None or entry.generation is not generation:
            return
        entry.live += 1
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None

    def leave(self, session: str, generation: Generation) -> None:
        """A reader of ``generation`` is gone (its client left or it read to the end)."""
        entry = self._entries.get(session)
        if entry is None or entry.generation is not generation:
            return
        entry.live -= 1
        if entry.live <= 0 and not generation.done and entry.timer is None:
            loop = asyncio.get_running_loop()
            entry.timer = loop.call_later(self.grace_s, self._orphaned, session, entry)

    def _orphaned(self, session: str, entry: _Entry) -> None:
        entry.timer = None
        if entry.live <= 0 and not entry.generation.done:
            entry.orphaned()

    def close(self) -> None:
        for entry in self._entries.values():
            if entry.timer is not None:
                entry.timer.cancel()
        self._entries.clear()
