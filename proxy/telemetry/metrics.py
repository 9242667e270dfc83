"""Prometheus metrics, one registry per app (no module-level singletons).

A request's counts and timings are observed once, from its finished RequestRecord
(``observe``, the record's ``on_done``), not while its response is still on the way:
prometheus-client's histograms take a lock per bucket update, and on the critical path of
a request that is time the client waits for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from llmproxy.proxy.gating.gate import Gate
from llmproxy.proxy.telemetry.recent import Recent
from llmproxy.proxy.telemetry.upstreams import BREAKER_CODES, PoolView, UpstreamMetrics

if TYPE_CHECKING:
    from llmproxy.proxy.telemetry.record import RequestRecord

OUTCOMES = (
    "completed",
    "reused",
    "superseded",
    "cancelled_queued",
    "cancelled_inflight",
    "rejected",
    "error",
)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "llmproxy_requests", "Requests by outcome and route", ["outcome", "route"], registry=r
        )
        self.queue_wait = Histogram(
            "llmproxy_queue_wait_seconds",
            "Time from arrival to permit grant",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_latency = Histogram(
            "llmproxy_upstream_latency_seconds",
            "Upstream request start to end of body",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_ttfb = Histogram(
            "llmproxy_upstream_ttfb_seconds",
            "Upstream request start to first body byte",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.permit_hold = Histogram(
            "llmproxy_permit_hold_seconds",
            "How long a permit was held",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.confirm_wait = Histogram(
            "llmproxy_confirm_wait_seconds",
            "Wait for the upstream to confirm a stop",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.class_requests = Counter(
            "llmproxy_class_requests",
            "Gated requests by request class (complete, chat, bulk) and outcome",
            ["request_class", "outcome"],
            registry=r,
        )
        self.model_requests = Counter(
            "llmproxy_model_requests",
            "Gated requests by the model they asked for and outcome; a name no upstream lists "
            "(served by one that takes any name, or refused) counts as 'other'",
            ["model", "outcome"],
            registry=r,
        )
        self.reused_tokens = Counter(
            "llmproxy_reused_tokens",
            "Tokens answered from a running or recent generation (type-through)",
            registry=r,
        )
        self.preemptions = Counter(
            "llmproxy_preemptions",
            "Generations stopped for a waiting completion and resumed after it",
            registry=r,
        )
        self.resume_prompt_tokens = Counter(
            "llmproxy_resume_prompt_tokens",
            "Prompt tokens the upstream evaluated again for resumed generations (llama-server)",
            registry=r,
        )
        self.confirm_timeouts = Counter(
            "llmproxy_confirm_timeouts",
            "Stop confirmations that timed out (the slot is quarantined until idle)",
            registry=r,
        )
        self.queue_depth = Gauge(
            "llmproxy_queue_depth", "Requests waiting for a permit", registry=r
        )
        self.inflight = Gauge(
            "llmproxy_inflight",
            "Requests holding permits (at the upstream or being stopped)",
            registry=r,
        )
        self.permits_free = Gauge("llmproxy_permits_free", "Free permits", registry=r)
        self.permits_total = Gauge(
            "llmproxy_permits_total", "Gate capacity (quarantined slots not counted)", registry=r
        )
        self.permits_quarantined = Gauge(
            "llmproxy_permits_quarantined",
            "Slots kept out of the gate after an unconfirmed stop, until seen idle",
            registry=r,
        )
        self.breaker_state = Gauge(
            "llmproxy_breaker_state",
            "Upstream circuit breaker: 0 closed, 1 open, 2 half-open (several upstreams: the "
            "best of theirs)",
            registry=r,
        )
        self.upstreams = UpstreamMetrics(r)
        self.recent = Recent()  # the live page's timeline and counters (recent.py)

    def observe(self, rec: RequestRecord) -> None:
        """Count a finished gated request by outcome and observe the timings it has."""
        if not rec.gated:
            return
        self.requests.labels(outcome=rec.outcome, route=rec.path).inc()
        if rec.request_class is not None:
            self.class_requests.labels(rec.request_class, rec.outcome).inc()
        if rec.model is not None:
            model = rec.model if rec.model_listed else "other"
            self.model_requests.labels(model, rec.outcome).inc()
        self.recent.add(rec)
        if rec.upstream_name is not None:
            self.upstreams.observe(rec.upstream_name, rec.route_decision)
        if rec.reused_tokens:
            self.reused_tokens.inc(rec.reused_tokens)
        if rec.preempted:
            self.preemptions.inc(rec.preempted)
            self.resume_prompt_tokens.inc(rec.resume_prompt_n or 0)
        for histogram, value in (
            (self.queue_wait, rec.queue_wait_s),
            (self.upstream_ttfb, rec.upstream_ttfb_s),
            (self.upstream_latency, rec.upstream_s),
            (self.permit_hold, rec.permit_hold_s),
            (self.confirm_wait, rec.confirm_wait_s),
        ):
            if value is not None:
                histogram.observe(value)

    def bind_pool(self, pool: PoolView) -> None:
        """The gauges above sum the upstreams' (those in the pool when scraped); the queue
        is the scheduler's; the breaker gauge is the best of theirs."""

        def gates() -> list[Gate]:
            return [m.gate for m in pool.members]

        self.queue_depth.set_function(lambda: len(pool.queue))
        self.inflight.set_function(lambda: sum(g.inflight for g in gates()))
        self.permits_free.set_function(lambda: sum(g.free for g in gates()))
        self.permits_total.set_function(lambda: sum(g.capacity for g in gates()))
        self.permits_quarantined.set_function(lambda: sum(len(g.quarantined) for g in gates()))
        self.breaker_state.set_function(
            lambda: min((BREAKER_CODES[m.breaker.state] for m in pool.members), default=0)
        )
        self.upstreams.bind(pool)
