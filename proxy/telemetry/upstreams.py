"""Per-upstream metrics of a pool (several upstreams), labelled ``upstream`` with the
configured names (a bounded set), and the pool-wide values of the gate's gauges.

Read when scraped (``set_function``), except the request counter, which ``observe`` counts
from each finished record. Typed structurally (``PoolView``): telemetry does not import the
pool.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence, Sized
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from llmproxy.proxy.gating.breaker import CircuitBreaker
from llmproxy.proxy.gating.gate import Gate

BREAKER_CODES = {"closed": 0, "open": 1, "half_open": 2}


class MemberView(Protocol):
    name: str
    gate: Gate
    breaker: CircuitBreaker
    healthy: bool


class PoolView(Protocol):
    @property
    def queue(self) -> Sized: ...

    @property
    def members(self) -> Sequence[MemberView]: ...

    @property
    def listeners(self) -> list[Callable[[Any, bool], None]]: ...


class UpstreamMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        label = ["upstream"]
        self.requests = Counter(
            "llmproxy_upstream_requests",
            "Gated requests routed to each upstream, by routing decision",
            ["upstream", "decision"],
            registry=r,
        )
        self.permits_free = Gauge(
            "llmproxy_upstream_permits_free", "Free permits", label, registry=r
        )
        self.permits_total = Gauge(
            "llmproxy_upstream_permits_total",
            "Permits (quarantined not counted)",
            label,
            registry=r,
        )
        self.inflight = Gauge(
            "llmproxy_upstream_inflight", "Requests holding its permits", label, registry=r
        )
        self.healthy = Gauge(
            "llmproxy_upstream_healthy", "1 while its health probe passes", label, registry=r
        )
        self.breaker = Gauge(
            "llmproxy_upstream_breaker_state",
            "Its circuit breaker: 0 closed, 1 open, 2 half-open",
            label,
            registry=r,
        )

    def bind(self, pool: PoolView) -> None:
        for m in pool.members:
            self.member(m, True)
        pool.listeners.append(self.member)  # upstreams that join or leave later (reload)

    def member(self, m: MemberView, joined: bool) -> None:
        """Start (``joined``) or stop reporting ``m``'s gauges (a pool's listener)."""
        gauges = (self.permits_free, self.permits_total, self.inflight, self.healthy, self.breaker)
        if not joined:
            for gauge in gauges:
                with contextlib.suppress(KeyError):
                    gauge.remove(m.name)
            return
        gate, breaker = m.gate, m.breaker
        self.permits_free.labels(m.name).set_function(lambda: gate.free)
        self.permits_total.labels(m.name).set_function(lambda: gate.capacity)
        self.inflight.labels(m.name).set_function(lambda: gate.inflight)
        self.healthy.labels(m.name).set_function(lambda: 1 if m.healthy else 0)
        self.breaker.labels(m.name).set_function(lambda: BREAKER_CODES[breaker.state])

    def observe(self, upstream: str, decision: str | None) -> None:
        self.requests.labels(upstream=upstream, decision=decision or "").inc()
