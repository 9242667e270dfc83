"""A request in a pool's queue (``Entry``) and where it was granted (``Placement``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llmproxy.proxy.errors import ProxyError
from llmproxy.proxy.gating.ticket import Ticket
from llmproxy.proxy.pool.member import Member
from llmproxy.proxy.pool.router import Request


@dataclass(frozen=True, slots=True)
class Placement:
    member: Member
    ticket: Ticket
    probe: bool  # it holds the member's breaker probe
    decision: str
    cached_chars: int


@dataclass(eq=False)
class Entry:
    id: int
    session: str
    supersedable: bool
    route: str
    request: Request
    sizer: Callable[[Member], Callable[[int], int]]
    exclude: Member | None
    future: asyncio.Future[Placement]
    prompt_chars: int = 0
    twin: str | None = None  # its body's twin key (proxy/twins.py)
    created: float = field(default_factory=time.monotonic)
    placement: Placement | None = None

    def end(self, error: ProxyError) -> None:
        if not self.future.done():
            self.future.set_exception(error)
            self.future.exception()  # retrieved: its waiter may be gone
