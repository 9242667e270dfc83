"""Which upstream the request at the head of the pool's queue goes to (``--route``).

- ``cache``: the upstream whose prompt index (prefix.py) holds the longest prefix of the
  request's prompt; none holds any: the least busy (ties: the one routed the fewest).
- ``session``: the session's own upstream by rendezvous hashing of the session key
  (weighted), so a session keeps its upstream while the set stays, and only the sessions
  of an upstream that leaves move.
- ``least-busy``: the fewest permits held per weight; ``round-robin``: the next one in turn
  (by weight: an upstream of weight 2 gets two turns).

When the preferred upstream (``cache``, ``session``) has no free permit but another one
has, the request waits for it only while that is worth it: at most ``affinity_wait_s``
from its admission, and for ``cache`` no longer than the prefill its cached prefix would
save there (its characters x the upstream's measured prefill time per character); then it
takes the least busy free one (decision ``fallback``). The head's wait holds up the queue
behind it (strict FIFO), so no request overtakes another and none starves.

Pure decision logic: no I/O, no timers (the pool arms the wake-up ``Wait`` asks for).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from llmproxy.proxy.pool.member import Member
from llmproxy.proxy.pool.prefix import BLOCK_CHARS
from llmproxy.proxy.upstreams import RoutePolicy


@dataclass(frozen=True, slots=True)
class Choice:
    member: Member
    decision: str  # cache_hit, cache_miss, session, least_busy, round_robin, fallback
    cached_chars: int = 0


@dataclass(frozen=True, slots=True)
class Wait:
    """Wait for the preferred upstream; ask again after ``delay_s`` at the latest."""

    delay_s: float


@dataclass(slots=True)
class Request:
    """What routing knows of a queued request."""

    session: str
    hashes: list[bytes]  # its prompt's block hashes (prefix.py)
    admitted: float
    #: can it be granted there now? (set by the scheduler for each decision: the permits it
    #: needs there, asked of that upstream's adapter then, are free, and it need not wait
    #: for its session's slot being stopped there)
    room: Callable[[Member], bool] = lambda _m: False


def _least_busy(members: Sequence[Member]) -> Member:
    """The fewest permits held per weight; ties: the fewest requests routed per weight (so
    new prompts spread over the upstreams instead of all starting on the first)."""
    return min(members, key=lambda m: (m.load(), m.routed / m.spec.weight))


def _weighted_hash(session: str, member: Member) -> float:
    digest = hashlib.blake2b(f"{member.name}\0{session}".encode(), digest_size=8).digest()
    u = (int.from_bytes(digest, "big") + 1) / 2.0**64  # in (0, 1]
    return -member.spec.weight / math.log(u) if u < 1 else math.inf


class Router:
    def __init__(self, policy: RoutePolicy, affinity_wait_s: float) -> None:
        self.policy, self.affinity_wait_s = policy, affinity_wait_s

    def choose(self, req: Request, members: Sequence[Member]) -> Choice | Wait | None:
        """The upstream for ``req`` among ``members`` (in rotation, and it fits there), a
        ``Wait`` for the preferred one, or None: no room anywhere now."""
        room = [m for m in members if req.room(m)]
        preferred, decision, saved_s, cached = self._preferred(req, members)
        if preferred is not None and preferred in room:
            return Choice(preferred, decision, cached)
        if not room:
            return None
        if preferred is not None:
            left = min(self.affinity_wait_s, saved_s) - (time.monotonic() - req.admitted)
            if left > 0:
                return Wait(left)
            return Choice(_least_busy(room), "fallback")
        if self.policy == "round-robin":
            return Choice(self._next_turn(room), "round_robin")
        return Choice(_least_busy(room), decision)

    def _preferred(
        self, req: Request, members: Sequence[Member]
    ) -> tuple[Member | None, str, float, int]:
        """(preferred upstream or None, decision, prefill it would save in s, cached chars)."""
        if self.policy == "session" and members:
            best = max(members, key=lambda m: _weighted_hash(req.session, m))
            return best, "session", math.inf, 0
        if self.policy == "cache" and req.hashes:
            scored = [(m.index.match(req.hashes), m) for m in members]
            blocks = max(n for n, _ in scored)
            if blocks:
                best = _least_busy([m for n, m in scored if n == blocks])
                chars = blocks * BLOCK_CHARS
                return best, "cache_hit", chars * best.prefill_s_per_char, chars
            return None, "cache_miss", 0.0, 0
        return None, self.policy.replace("-", "_"), 0.0, 0

    def _next_turn(self, room: Sequence[Member]) -> Member:
        """By weight: the one furthest behind its share of the requests routed so far."""
        return min(room, key=lambda m: (m.routed + 1) / m.spec.weight)
