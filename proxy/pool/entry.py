"""A request in the scheduler's queue (``Entry``) and where it was granted (``Placement``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llmproxy.proxy.errors import ProxyError
from llmproxy.proxy.gating.breaker import CircuitBreaker
from llmproxy.proxy.gating.gate import Gate
from llmproxy.proxy.gating.ticket import Ticket
from llmproxy.proxy.pool.member import Member
from llmproxy.proxy.pool.router import Request
from llmproxy.proxy.request import Body
from llmproxy.proxy.upstream.adapters.base import Adapter

#: permits a request needs on an upstream, asked of its adapter with its slot count
#: (BadRequest: it cannot run there)
Sizing = Callable[[Member, int], int]


@dataclass(frozen=True, slots=True)
class Placement:
    member: Member
    ticket: Ticket
    probe: bool  # it holds the member's breaker probe
    decision: str
    cached_chars: int
    adapter: Adapter  # the upstream's adapter in force at the grant: the request's

    # what the upstream job takes of a grant (upstream/job.py ``Grant``)
    @property
    def gate(self) -> Gate:
        return self.member.gate

    @property
    def breaker(self) -> CircuitBreaker:
        return self.member.breaker

    @property
    def upstream(self) -> str:
        return self.member.name


@dataclass(eq=False)
class Entry:
    """``ticket`` is its claim, granted on the upstream it is placed on (its ``permits``
    are decided then, by that upstream's adapter in force then)."""

    id: int
    session: str
    supersedable: bool
    route: str
    parsed: Body
    sizing: Sizing
    request: Request
    ticket: Ticket
    exclude: Member | None
    future: asyncio.Future[Placement]
    prompt_chars: int = 0
    twin: str | None = None  # its body's twin key (proxy/twins.py)
    model: str | None = None  # the model it asks for (models.py; None: any upstream)
    #: held to its caller's ``max_queued`` while it waits: not a failover nor a resume,
    #: counted when first admitted (pool.py ``submit``)
    counted: bool = True
    created: float = field(default_factory=time.monotonic)
    placement: Placement | None = None

    def end(self, error: ProxyError) -> None:
        self.ticket.state = "done"
        if not self.future.done():
            self.future.set_exception(error)
            self.future.exception()  # retrieved: its waiter may be gone
