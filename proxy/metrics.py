"""Prometheus metrics, one registry per app (no module-level singletons)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from llmproxy.proxy.breaker import CircuitBreaker
from llmproxy.proxy.gate import Gate

OUTCOMES = ("completed", "superseded", "cancelled_queued", "cancelled_inflight", "rejected", "error")
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "llmproxy_requests", "Requests by outcome and route", ["outcome", "route"], registry=r
        )
        self.queue_wait = Histogram(
            "llmproxy_queue_wait_seconds", "Time from arrival to permit grant", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.upstream_latency = Histogram(
            "llmproxy_upstream_latency_seconds", "Upstream request start to end of body", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.upstream_ttfb = Histogram(
            "llmproxy_upstream_ttfb_seconds", "Upstream request start to first body byte", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.permit_hold = Histogram(
            "llmproxy_permit_hold_seconds", "How long a permit was held", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.confirm_wait = Histogram(
            "llmproxy_confirm_wait_seconds", "Wait for the upstream to confirm a stop", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.confirm_timeouts = Counter(
            "llmproxy_confirm_timeouts", "Stop confirmations that timed out (permit released unconfirmed)", registry=r
        )
        self.queue_depth = Gauge("llmproxy_queue_depth", "Requests waiting for a permit", registry=r)
        self.inflight = Gauge("llmproxy_inflight", "Permits held (requests at the upstream)", registry=r)
        self.permits_free = Gauge("llmproxy_permits_free", "Free permits", registry=r)
        self.permits_total = Gauge("llmproxy_permits_total", "Gate capacity", registry=r)
        self.breaker_state = Gauge(
            "llmproxy_breaker_state", "Upstream circuit breaker: 0 closed, 1 open, 2 half-open", registry=r
        )

    def bind_breaker(self, breaker: CircuitBreaker) -> None:
        codes = {"closed": 0, "open": 1, "half_open": 2}
        self.breaker_state.set_function(lambda: codes[breaker.state])

    def bind_gate(self, gate: Gate) -> None:
        self.queue_depth.set_function(lambda: gate.queued)
        self.inflight.set_function(lambda: gate.inflight)
        self.permits_free.set_function(lambda: gate.free)
        self.permits_total.set(gate.capacity)
