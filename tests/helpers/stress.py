"""Helpers of the scheduler's stress test (tests/proxy/pool/test_pool_stress.py): fake
llama-servers that die and come back at the same address, clients that record what they
got, and a watch on the members that leave the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from yarl import URL

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.proxy.pool.member import Member
from llmproxy.proxy.pool.pool import Pool

TOKEN_DELAY_S = 0.004


def script(_path: str, body: dict[str, Any]) -> Script:
    """What a stress request asks of the fake: its ``tokens``, and its ``fail``: ``reset``
    (the connection cut half-way through the body) or ``500`` (an error status at once)."""
    fail = body.get("fail")
    return Script(
        tokens=int(str(body.get("tokens", 4))),
        token_delay_s=TOKEN_DELAY_S,
        fail="reset_mid_stream" if fail == "reset" else None,
        status=500 if fail == "500" else 200,
    )


def output(tokens: int) -> str:
    """What the fake writes for a generation of ``tokens`` tokens."""
    return "".join(f"t{i} " for i in range(tokens))


class Fleet:
    """Fake llama-servers, each at a fixed address for the whole test. ``die`` stops one
    (its port refuses connections from then on); ``revive`` starts a new incarnation on the
    same port. Every incarnation is kept, with its slot count, for the invariants."""

    def __init__(
        self, stack: contextlib.AsyncExitStack, slots: list[int], linger_s: list[float]
    ) -> None:
        self._stack = stack
        self.slots = slots
        self.linger_s = list(linger_s)  # each fake's ``abort_linger_s``
        self.live: list[FakeUpstream | None] = [None] * len(slots)
        self.ports: list[int] = [0] * len(slots)
        self.urls: list[str] = [""] * len(slots)
        self.incarnations: list[tuple[int, FakeUpstream]] = []  # (index, fake)
        self._stopping: dict[int, asyncio.Task[None]] = {}

    async def start(self) -> None:
        for i in range(len(self.slots)):
            fake = await self._start(i)
            assert fake is not None
            self.urls[i] = fake.url
            self.ports[i] = URL(fake.url).port or 0

    async def _start(self, i: int) -> FakeUpstream | None:
        fake = FakeUpstream(
            slots=self.slots[i], script=script, abort_linger_s=self.linger_s[i], port=self.ports[i]
        )
        try:
            await self._stack.enter_async_context(fake)
        except OSError:  # the port was taken meanwhile: it stays dead
            return None
        self.live[i] = fake
        self.incarnations.append((i, fake))
        return fake

    def die(self, i: int) -> None:
        fake = self.live[i]
        if fake is not None:
            self.live[i] = None
            self._stopping[i] = asyncio.create_task(fake.stop())

    async def revive(self, i: int) -> bool:
        if self.live[i] is not None:
            return True
        stopping = self._stopping.pop(i, None)
        if stopping is not None:
            await stopping
        return await self._start(i) is not None

    async def revive_all(self) -> bool:
        results = [await self.revive(i) for i in range(len(self.slots))]
        return all(results)

    def linger(self, i: int, seconds: float) -> None:
        """How long a slot stays busy after its client left, from now on (and for the
        next incarnations)."""
        self.linger_s[i] = seconds
        fake = self.live[i]
        if fake is not None:
            fake.abort_linger_s = seconds

    def violations(self) -> list[dict[str, Any]]:
        """Incarnations that ran more generations than their slots at some instant, or
        made a generation wait for a slot (its request id and the ``id_slot`` it asked)."""
        return [
            {
                "upstream": i,
                "slots": self.slots[i],
                "max_concurrent": fake.max_concurrent,
                "deferred": [
                    (r.headers.get("X-Request-Id"), (r.body or {}).get("id_slot"))
                    for r in fake.received
                    if r.id in fake.deferred
                ],
            }
            for i, fake in self.incarnations
            if fake.max_concurrent > self.slots[i] or fake.deferred
        ]

    def reached(self) -> set[str]:
        """The request ids of the generations that reached any incarnation."""
        return {
            r.headers["X-Request-Id"]
            for _, fake in self.incarnations
            for r in fake.generations
            if "X-Request-Id" in r.headers
        }


@dataclass
class Call:
    """One client request: the status of the response's head, if one came."""

    rid: str
    aborted: bool = False  # the client gave up on it
    status: int | None = None
    error: str | None = None  # what failed before a head came


async def post(
    http: aiohttp.ClientSession,
    url: str,
    call: Call,
    body: dict[str, Any],
    session: str,
    abort_ms: int | None = None,
) -> None:
    """POST ``body`` as ``call``; the client leaves after ``abort_ms`` if given."""
    headers = {"X-LLMProxy-Session": session, "X-Request-Id": call.rid}

    async def exchange() -> None:
        try:
            async with http.post(url, json=body, headers=headers) as r:
                call.status = r.status
                with contextlib.suppress(aiohttp.ClientPayloadError):  # a cut stream
                    await r.read()
        except aiohttp.ClientError as exc:
            if call.status is None:
                call.error = repr(exc)

    task = asyncio.create_task(exchange())
    if abort_ms is not None:
        done, _ = await asyncio.wait([task], timeout=abort_ms / 1000)
        if not done:
            call.aborted = True
            task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@dataclass
class Leaving:
    """A member's gate when it left the pool and when it was closed."""

    member: Member
    removed: dict[str, Any] | None = None
    closed: dict[str, Any] | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


def _gate_state(m: Member) -> dict[str, Any]:
    g = m.gate
    return {"inflight": g.inflight, "quarantined": g.quarantined, "free": g.free}


class Departures:
    """Watches every member of ``pool`` (those that join later too, through the pool's
    listeners): the state of its gate when it leaves the pool and when it is closed."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.members: dict[int, Leaving] = {}
        for m in pool.members:
            self._watch(m)
        pool.listeners.append(self._listen)

    def _listen(self, m: Any, joined: bool) -> None:
        if joined:
            self._watch(m)
        elif m not in self.pool.members:  # it left (a renamed one is still in the pool)
            self.members[id(m)].removed = _gate_state(m)

    def _watch(self, m: Member) -> None:
        if id(m) in self.members:
            return
        leaving = self.members[id(m)] = Leaving(m)  # keeps m: ids stay unique
        close: Callable[[], Any] = m.close

        async def closing() -> None:
            leaving.closed = _gate_state(m)
            leaving.done.set()
            await close()

        m.close = closing  # type: ignore[method-assign]

    def of(self, m: Member) -> Leaving:
        return self.members[id(m)]

    def left(self) -> list[Leaving]:
        return [x for x in self.members.values() if x.removed is not None or x.closed]
