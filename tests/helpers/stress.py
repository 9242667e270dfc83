"""Helpers of the scheduler's stress test (tests/proxy/pool/test_pool_stress.py): fake
llama-servers that die and come back at the same address, clients that record what they
got, a watch on the members that leave the pool, and a watch on the scheduler's admissions
and grants (request classes, callers' caps, the reserve).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import structlog
from yarl import URL

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.proxy.errors import BadRequest
from llmproxy.proxy.gating.classes import RANK
from llmproxy.proxy.pool.entry import Entry
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

    def seen(self, rid: str) -> list[dict[str, Any]]:
        """Where the request ``rid`` reached a fake, and what became of it there."""
        return [
            {
                "upstream": i,
                "id": r.id,
                "path": r.path,
                "completed": r.id in fake.completed,
                "aborted": r.id in fake.aborted,
                "deferred": r.id in fake.deferred,
                "live": fake in self.live,
            }
            for i, fake in self.incarnations
            for r in fake.received
            if r.headers.get("X-Request-Id") == rid
        ]

    def reached(self) -> set[str]:
        """The request ids of the generations that reached any incarnation."""
        return {
            r.headers["X-Request-Id"]
            for _, fake in self.incarnations
            for r in fake.generations
            if "X-Request-Id" in r.headers
        }


STALLED = "no whole answer within the client's timeout"


@dataclass
class Call:
    """One client request: the status of the response's head, if one came."""

    rid: str
    aborted: bool = False  # the client gave up on it
    status: int | None = None
    retry_after: str | None = None  # the response's Retry-After
    error: str | None = None  # what failed before a head came, or STALLED


async def post(
    http: aiohttp.ClientSession,
    url: str,
    call: Call,
    body: dict[str, Any],
    session: str,
    abort_ms: int | None = None,
    headers: dict[str, str] | None = None,
) -> None:
    """POST ``body`` as ``call`` (with ``headers`` too); the client leaves after
    ``abort_ms`` if given."""
    headers = {**(headers or {}), "X-LLMProxy-Session": session, "X-Request-Id": call.rid}

    async def exchange() -> None:
        try:
            async with http.post(url, json=body, headers=headers) as r:
                call.status = r.status
                call.retry_after = r.headers.get("Retry-After")
                with contextlib.suppress(aiohttp.ClientPayloadError):  # a cut stream
                    await r.read()
        except aiohttp.ClientError as exc:
            if call.status is None:
                call.error = repr(exc)
        except TimeoutError:  # the session's timeout: no answer, or an answer that stalled
            call.error = STALLED

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


@dataclass(frozen=True)
class Limits:
    """What the scheduler was told: ``classes``, the ``reserve``, ``class_max_wait_s`` and
    each key's caps (by caller name)."""

    classes: str
    reserve: int | None
    max_wait_s: dict[str, float]
    max_inflight: dict[str, int]
    max_queued: dict[str, int]

    def aging_s(self, klass: str) -> float:
        """How long a request of ``klass`` waits, at most, before it is served as a
        completion: one ``class_max_wait_s`` of its class per class it is below."""
        if self.classes == "off" or not RANK[klass]:
            return 0.0
        return RANK[klass] * self.max_wait_s[klass]

    def rank(self, klass: str, waited: float) -> int:
        """The class rank a request of ``klass`` is served at after ``waited`` seconds."""
        if self.classes == "off" or not RANK[klass]:
            return 0
        return max(0, RANK[klass] - int(max(0.0, waited) // self.max_wait_s[klass]))

    def reserved(self, m: Member, klass: str, permits: int = 1) -> int:
        """Permits of ``m`` a request of ``klass`` needing ``permits`` may not take now: the
        reserve, but never so much that the request could not run there at all."""
        if self.classes == "off" or klass == "complete":
            return 0
        capacity = m.gate.capacity
        reserve = self.reserve if self.reserve is not None else (1 if capacity >= 2 else 0)
        return max(0, min(reserve, capacity - permits))


@dataclass
class Admitted:
    """One admission (``Pool.submit``; a failover is a second one of its request)."""

    entry: Entry
    rid: str | None  # its request's id
    seq: int  # admissions in order
    ordinary: bool  # queued at the tail: not first, not a failover, no place of its session's
    granted_at: float | None = None


class Watch:
    """Watches the scheduler's admissions (``submit``) and grants (``_place``), the only
    moments a caller's requests waiting or running, and the permits held by requests that
    are no completions, can grow, and records what breaks ``limits`` there (``violations``):

    - a caller with more requests holding permits than its key's ``max_inflight``, or more
      waiting than its ``max_queued`` (failovers and preempted requests' resumes aside:
      they were counted when first admitted, pool.py ``submit``; a keystroke sent to the
      queue's head after it waited on its session's generation counts as any other);
    - a request refused for ``max_queued`` that would have been granted at once (nothing
      waiting, every upstream in rotation idle with room for it): it would not have waited;
    - with classes on and a reserve, requests that are no completions holding more of an
      upstream's permits than its reserve leaves: at their grant, counted against the
      permits there are then; at any time, against its slots (quarantined ones included: a
      quarantine after the grant takes permits away, not the grant back). Counted in
      permits granted: a wide request also holds, for a while, slots below its highest
      extra that come back (llama-server may have put an extra completion there, see
      gating/slots.py), which is no grant;
    - a request granted while an earlier one of the same caller (of any caller with
      classes off: one FIFO queue) that it could not pass still waited: queued at the tail
      after it, not better in class rank (aging counted) than it, so FIFO within a class
      and aging must serve that earlier one first, unless the earlier one's caller was at
      its ``max_inflight``, or it does not wait for the upstream granted (a failover's own,
      one it does not fit: a waiter holds up the queue only on its upstreams, pool.py).
      Ranks are those at the scheduler's choice of its head (order.py ``head``, which reads
      its clock then), not at the watch's look after the grant: a pause in between (a
      garbage collection, the machine busy) may age the earlier waiter meanwhile.

    It also keeps every grant's time (``grants``) and each request's admissions
    (``by_rid``), for the bound on waits the test checks from the log lines."""

    def __init__(self, pool: Pool, limits: Limits) -> None:
        self.pool, self.limits = pool, limits
        self.admitted: dict[int, Admitted] = {}  # entry id -> its admission
        self.by_rid: dict[str, list[Admitted]] = {}
        self.grants: list[tuple[float, int]] = []  # (when, entry id)
        self.refused_max_queued = 0
        self.resumes: set[int] = set()  # entry ids of preempted requests' resumes
        self.violations: list[str] = []
        self._seq = itertools.count()
        self._newcomer: tuple[str | None, bool] | None = None  # in ``submit`` now
        #: the scheduler's last choice of its head, and the clock before and after it
        self._chosen: tuple[Entry | None, float, float] | None = None
        submit: Callable[..., Entry] = pool.submit
        grants = pool._grants
        head: Callable[..., Entry | None] = pool.order.head
        place: Callable[..., None] = grants._place

        def submitting(session: str, **kw: Any) -> Entry:
            first, exclude = kw.get("first", False), kw.get("exclude")
            held = kw["supersedable"] and any(
                s == session and (w is None or w.supersedable) for s, w in pool.queue.places()
            )
            at_once = self._runs_at_once(kw)
            # (rid, ordinary): the newcomer may be granted within ``submit`` already
            self._newcomer = (self._rid(), not (first or exclude is not None or held))
            try:
                entry = submit(session, **kw)
            except Exception as exc:
                if "max_queued" in str(exc):
                    self.refused_max_queued += 1
                    if at_once:
                        self.violations.append(
                            f"{self._rid()}: refused for max_queued, though it would have run "
                            f"at once ({kw.get('caller')!r}, nothing waiting, upstreams idle)"
                        )
                raise
            finally:
                newcomer, self._newcomer = self._newcomer, None
            if newcomer is not None:  # not granted meanwhile
                self._admit(entry, *newcomer)
            if kw.get("since") is not None:
                self.resumes.add(entry.id)
            self._check_queued(entry.ticket.caller)
            return entry

        def choosing(*args: Any, **kw: Any) -> Entry | None:
            before = time.monotonic()
            chosen = head(*args, **kw)
            self._chosen = (chosen, before, time.monotonic())
            return chosen

        def placing(entry: Entry, choice: Any, permits: int) -> None:
            place(entry, choice, permits)
            if entry.placement is None:  # the breaker refused it: ended, no grant
                return
            now = time.monotonic()
            self.grants.append((now, entry.id))
            if entry.id not in self.admitted and self._newcomer is not None:
                self._admit(entry, *self._newcomer)  # granted at its admission
                self._newcomer = None
            admitted = self.admitted.get(entry.id)
            if admitted is not None:
                admitted.granted_at = now
            chosen = self._chosen
            # when the scheduler ranked it its head (classes off: no rank, no matter)
            ranked = (chosen[1], chosen[2]) if chosen and chosen[0] is entry else (now, now)
            self._check_grant(entry, entry.placement.member, ranked)

        pool.order.head = choosing  # type: ignore[method-assign]
        pool.submit = submitting  # type: ignore[method-assign]
        grants._place = placing  # type: ignore[method-assign]

    def _admit(self, entry: Entry, rid: str | None, ordinary: bool) -> None:
        admitted = Admitted(entry, rid, next(self._seq), ordinary)
        self.admitted[entry.id] = admitted
        if rid is not None:
            self.by_rid.setdefault(rid, []).append(admitted)

    @staticmethod
    def _rid() -> str | None:
        """The request id the handler's context is bound to (http/middleware.py)."""
        rid = structlog.contextvars.get_contextvars().get("request_id")
        return rid if isinstance(rid, str) else None

    def _runs_at_once(self, kw: dict[str, Any]) -> bool:
        """Would a request submitted with ``kw`` surely be granted at once? Nothing waits,
        it is no failover, its caller is under its key's ``max_inflight`` (counted on every
        upstream: one a reload removed still runs its requests), every upstream in rotation
        is idle (so none is preferred while busy) and each that it fits leaves it room past
        the reserve; one at least."""
        pool = self.pool
        members = pool.rotation()
        if len(pool.queue) or kw.get("exclude") is not None or not members:
            return False
        cap = self.limits.max_inflight.get(kw.get("caller", ""))
        running = sum(
            t.caller == kw.get("caller") for m in pool.members for t in m.gate.inflight_snapshot()
        )
        if cap is not None and running >= cap:
            return False
        fits = False
        for m in members:
            if m.gate.inflight or m.gate.quarantined:
                return False
            try:
                n = kw["sizing"](m, m.gate.total)
            except BadRequest:
                continue
            if n > m.gate.free - self.limits.reserved(m, kw.get("klass", "complete"), n):
                return False
            fits = True
        return fits

    def _check_queued(self, caller: str) -> None:
        cap = self.limits.max_queued.get(caller)
        if cap is None:
            return
        waiting = [
            e
            for e in self.pool.queue
            if e.ticket.caller == caller and e.exclude is None and e.id not in self.resumes
        ]
        if len(waiting) > cap:
            rids = [(self.admitted[e.id].rid if e.id in self.admitted else None) for e in waiting]
            self.violations.append(
                f"caller {caller!r}: {len(waiting)} waiting ({rids}), max_queued {cap}"
            )

    def _check_grant(self, entry: Entry, m: Member, ranked: tuple[float, float]) -> None:
        limits, ticket = self.limits, entry.ticket
        rid = self.admitted[entry.id].rid if entry.id in self.admitted else None
        cap = limits.max_inflight.get(ticket.caller)
        if cap is not None:
            running = sum(
                t.caller == ticket.caller
                for x in self.pool.members
                for t in x.gate.inflight_snapshot()
            )
            if running > cap:
                self.violations.append(
                    f"{rid}: caller {ticket.caller!r} has {running} running, max_inflight {cap}"
                )
        if limits.classes == "on":
            g = m.gate
            others = sum(t.permits for t in g.inflight_snapshot() if t.klass != "complete")
            reserved = limits.reserved(m, ticket.klass, ticket.permits)
            if ticket.klass != "complete" and others > g.capacity - reserved:
                self.violations.append(
                    f"{rid} ({ticket.klass}) granted on {m.name}: {others} permits held by "
                    f"requests that are no completions, of {g.capacity}, reserve {reserved}"
                )
        self._check_order(entry, m, ranked)

    def _waits_for(self, other: Entry, m: Member) -> bool:
        """Could the waiter ``other`` run on ``m``? Not a failover's own upstream, nor one
        it does not fit (pool.py: a waiter holds up the queue only on those it waits for)."""
        if other.exclude is m:
            return False
        try:
            other.sizing(m, m.gate.total)
        except BadRequest:
            return False
        return True

    def _check_order(self, entry: Entry, m: Member, ranked: tuple[float, float]) -> None:
        """``entry`` was just granted on ``m``: no earlier waiter it could not pass (one that
        waits for ``m`` too) may still wait. ``ranked``: the clock just before and just after
        the scheduler ranked ``entry`` its head (it read its own in between): the earlier
        waiter's rank is taken at the first, ``entry``'s at the second, so only an order
        the scheduler got wrong at its own instant counts."""
        before, after = ranked
        limits, mine = self.limits, self.admitted.get(entry.id)
        if mine is None or not mine.ordinary:
            return
        running: dict[str, int] = {}  # before this grant
        for x in self.pool.members:
            for t in x.gate.inflight_snapshot():
                if t is not entry.ticket:
                    running[t.caller] = running.get(t.caller, 0) + 1
        for other in self.pool.queue:
            earlier = self.admitted.get(other.id)
            if other.future.done() or earlier is None or earlier.seq > mine.seq:
                continue
            if not self._waits_for(other, m):
                continue  # it does not wait for ``m``: held back only on its own upstreams
            cap = limits.max_inflight.get(other.ticket.caller)
            if cap is not None and running.get(other.ticket.caller, 0) >= cap:
                continue  # passed over while its caller is at its max_inflight
            if limits.classes == "on":
                if other.ticket.caller != entry.ticket.caller:
                    continue  # fair shares: another caller may be behind its share
                # a resume's rank counts only the time it waited (order.py)
                theirs = limits.rank(other.ticket.klass, other.ticket.waited(before))
                if theirs > limits.rank(entry.ticket.klass, after - entry.created):
                    continue
            self.violations.append(
                f"{mine.rid} ({entry.ticket.klass}, caller {entry.ticket.caller!r}) granted "
                f"while {earlier.rid} ({other.ticket.klass}, admitted before it, waiting "
                f"{other.ticket.waited(before):.3f}s when it was ranked) still waited"
            )
