"""Recent: finished gated requests' metadata (a bounded ring) and what the proxy saved.

Fed by ``Metrics.observe`` (a finished RequestRecord's ``on_done``, called in the request
log's batch, off the request's path): one O(1) append and a few additions per request,
whether or not a page is watching. Read by the live page and ``llmproxy status``
(proxy/http/picture.py) from the event loop's thread; nothing here blocks or awaits.

Metadata only: route, outcome, times, slot, upstream and a prefix of the hashed session
key; never prompt or completion text. Bounded: ``size`` requests and ``latencies``
keystroke latencies are kept, the oldest dropped first.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmproxy.proxy.errors import UpstreamConnectTimeout, UpstreamUnreachable
from llmproxy.proxy.gating.routes import family

if TYPE_CHECKING:
    from llmproxy.proxy.telemetry.record import RequestRecord

#: record outcome -> the page's colour (five kinds)
KINDS = {
    "completed": "completed",
    "reused": "reused",
    "superseded": "superseded",
    "cancelled_queued": "cancelled",
    "cancelled_inflight": "cancelled",
    "rejected": "error",
    "error": "error",
}


def request_class(route: str) -> str:
    """The class a route's requests belong to: complete (keystrokes), chat or bulk."""
    fam = family(route)
    return "complete" if fam in ("infill", "completion") else "chat" if fam == "chat" else "bulk"


@dataclass(frozen=True, slots=True)
class Finished:
    """One finished gated request; times are ``time.monotonic()`` seconds."""

    seq: int
    route: str
    outcome: str  # one of KINDS' values
    session: str  # a prefix of the hashed session key
    upstream: str | None
    slot: int | None
    sent: bool  # it reached the upstream
    arrived: float
    granted: float | None
    first_byte: float | None
    ended: float

    def row(self, now: float) -> dict[str, Any]:
        """JSON for the page: times in ms before ``now`` (so clocks never need to agree)."""
        ago = lambda t: None if t is None else round((now - t) * 1000)  # noqa: E731
        return {
            "seq": self.seq,
            "route": self.route,
            "outcome": self.outcome,
            "session": self.session,
            "upstream": self.upstream,
            "slot": self.slot,
            "sent": self.sent,
            "arrived_ago_ms": ago(self.arrived),
            "granted_ago_ms": ago(self.granted),
            "first_byte_ago_ms": ago(self.first_byte),
            "ended_ago_ms": ago(self.ended),
        }


class Recent:
    def __init__(self, size: int = 512, latencies: int = 1024) -> None:
        self._ring: deque[Finished] = deque(maxlen=size)
        self._latencies: deque[float] = deque(maxlen=latencies)
        self.seq = 0  # the newest request's number (0: none yet)
        self.requests = 0
        self.by_outcome = dict.fromkeys(sorted(set(KINDS.values())), 0)
        self.never_sent = 0  # superseded or cancelled before reaching the upstream
        self.stopped_early = 0  # superseded or cancelled at the upstream mid-generation
        self.reused = 0
        self.reused_tokens = 0
        # upstream name ("" for the one upstream) -> why its last request could not reach it;
        # cleared by its next answer (/llmproxy/health says degraded meanwhile)
        self.unreachable: dict[str, str] = {}

    def add(self, rec: RequestRecord) -> None:
        """A finished gated request (its outcome settled)."""
        kind = KINDS.get(rec.outcome or "error", "error")
        name = rec.upstream_name or ""
        if isinstance(rec.upstream_error, UpstreamUnreachable | UpstreamConnectTimeout):
            self.unreachable[name] = rec.upstream_error.message
        elif rec.upstream_status is not None:
            self.unreachable.pop(name, None)
        self.seq += 1
        self.requests += 1
        self.by_outcome[kind] += 1
        if kind in ("superseded", "cancelled"):
            if rec.sent:
                self.stopped_early += 1
            else:
                self.never_sent += 1
        if kind == "reused":
            self.reused += 1
            self.reused_tokens += rec.reused_tokens or 0
        total = rec.total_s if rec.total_s is not None else time.monotonic() - rec.started
        if kind in ("completed", "reused") and request_class(rec.path) == "complete":
            self._latencies.append(total)
        granted = None if rec.queue_wait_s is None else rec.started + rec.queue_wait_s
        first = None
        if granted is not None and rec.upstream_ttfb_s is not None:
            first = granted + rec.upstream_ttfb_s
        self._ring.append(
            Finished(
                self.seq, rec.path, kind, (rec.session or "")[:8], rec.upstream_name, rec.slot,
                rec.sent, rec.started, granted, first, rec.started + total,
            )
        )  # fmt: skip

    def since(self, seq: int) -> list[Finished]:
        """Requests numbered above ``seq``, oldest first (those still in the ring)."""
        if seq >= self.seq:
            return []
        return [f for f in self._ring if f.seq > seq]

    def counters(self) -> dict[str, Any]:
        """What the proxy bought, since it started; latencies over the last ones kept."""
        lat = sorted(self._latencies)
        pick = lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1000, 1)  # noqa: E731
        return {
            "requests": self.requests,
            "outcomes": dict(self.by_outcome),
            "never_sent": self.never_sent,
            "stopped_early": self.stopped_early,
            "reused": self.reused,
            "reused_tokens": self.reused_tokens,
            "keystroke_ms": {
                "p50": pick(0.5) if lat else None,
                "p95": pick(0.95) if lat else None,
                "n": len(lat),
            },
        }
