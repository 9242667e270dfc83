"""Ticket: one gated request's claim on permits, from admission to release (see gate.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

State = Literal["queued", "granted", "running", "stopping", "done"]


@dataclass(eq=False)
class Ticket:
    """One gated request's claim on a permit."""

    id: int
    session: str
    supersedable: bool
    route: str
    future: asyncio.Future[int]
    permits: int = 1
    sizer: Callable[[int], int] | None = None  # the permit count at grant time (capacity -> count)
    twin: str | None = None  # its body's twin key (proxy/twins.py): equal keys never supersede
    klass: str = "complete"  # its request class (classes.py)
    caller: str = ""  # who sent it: its key's name, else its client's address (fair shares)
    created: float = field(default_factory=time.monotonic)
    # time waited in all (queued, and paused by preemptions) before its current wait, and
    # when that began; a grant adds the current wait (gate.py)
    waited_s: float = 0.0
    queued_at: float = field(default_factory=time.monotonic)
    state: State = "queued"
    slot: int | None = None  # the first granted slot (the one ``id_slot`` names)
    slots: tuple[int, ...] = ()  # every granted slot, ``slot`` first
    granted_at: float | None = None
    on_supersede: Callable[[], None] | None = None
    superseded: bool = False  # set if superseded after the grant but before the job took it
    affinity_timer: asyncio.TimerHandle | None = None  # ends a wait for its session's slot
    affinity_waited: bool = False  # that timer fired: the wait is over
    # preemption (pool/preempt.py): its job can stop and resume it exactly from now on,
    # through ``on_preempt``; ``preempted``: asked to, once
    on_preempt: Callable[[], None] | None = None
    preempted: bool = False
    # its job will offer ``on_preempt`` once its first event came (a resumable request),
    # unless its stream turns out inexact
    may_offer: bool = False

    def waited(self, now: float) -> float:
        """Time waited in all by ``now``: queued now, or before its grant, and paused."""
        return self.waited_s + (now - self.queued_at if self.state == "queued" else 0.0)

    async def wait(self) -> int:
        """Block until granted; returns the (first) slot id. Raises Superseded/ShuttingDown."""
        return await self.future

    def end(self, error: Exception) -> None:
        """Done without a grant: its waiter, unless it was cancelled already, raises ``error``."""
        self.state = "done"
        if not self.future.done():  # done: its waiter was cancelled meanwhile
            self.future.set_exception(error)
            self.future.exception()  # retrieved: the waiter may already be gone
