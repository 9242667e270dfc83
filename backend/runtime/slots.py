"""The dispatcher's slot table and in-flight requests (event loop side only).

A ``Slot`` is one global slot id mapped onto (worker, local slot). It is busy while a
``Request`` runs on it: from ``Dispatcher.submit`` until the worker's ``Done``/``Failed``
for that request arrives (or the worker is dead), never just because a client went away.
``standins`` keeps a slot whose worker is down reading busy while requests pinned to it
run on other slots. Only the event loop thread reads or writes these objects.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from llmproxy.backend.protocol import Done, Event, Failed, SamplingParams, Submit
from llmproxy.backend.runtime.supervisor import WorkerHandle


class Unavailable(Exception):
    """No worker can take the request now: 503 (loading / restarting), or 429 with
    ``Retry-After`` when the wait queue is full (``QueueFull``)."""

    status = 503
    retry_after_s = 0


class QueueFull(Unavailable):
    """``max_queue`` requests already wait for a slot."""

    status = 429
    retry_after_s = 1


@dataclass
class Slot:
    """Global slot ``id``: local slot ``local`` of ``worker``, and what /slots reports."""

    id: int
    worker: WorkerHandle
    local: int
    request: Request | None = None
    id_task: int = -1
    n_decoded: int = 0
    n_prompt: int = 0
    has_new_line: bool = False
    params: SamplingParams | None = None
    last_used: float = 0.0
    # ids of requests pinned here that run elsewhere (this slot's worker is down)
    standins: set[str] = field(default_factory=set)

    @property
    def busy(self) -> bool:
        return self.request is not None


@dataclass
class Request:
    """One generation on ``slot``: its events arrive on ``queue``; ``result`` is its last
    (``Done``/``Failed``) and ``done_event`` is set with it."""

    id: str
    slot: Slot
    submit: Submit
    generation: int
    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    finished: bool = False
    result: Event | None = None
    done_event: asyncio.Event = field(default_factory=asyncio.Event)
    t_submit: float = field(default_factory=time.perf_counter)
    pinned: Slot | None = None  # the slot its id_slot named, when it runs on another

    async def events(self) -> AsyncIterator[Event]:
        """The request's events up to and including its ``Done``/``Failed``."""
        while True:
            ev = await self.queue.get()
            yield ev
            if isinstance(ev, (Done, Failed)):
                return
