"""RequestRecord: what one request did, for the canonical log line and metrics.

A record is referenced by its handler and, for gated requests that got a permit, by
their upstream job. Whoever finishes last (``end_ref``) settles its outcome and hands it
to the app's RequestLog, which later (in a batch, off the request's path) observes its
metrics (``on_done``) and writes its single canonical log line; so a request whose client
left while its job still drains is logged and counted once, with the job's final numbers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from llmproxy.common.logs import iso_utc
from llmproxy.proxy.errors import ProxyError
from llmproxy.proxy.telemetry.request_log import RequestLog


@dataclass(eq=False, slots=True)
class RequestRecord:
    request_id: str
    method: str
    path: str
    on_done: Any = None  # callable(record) -> None: observes metrics (Metrics.observe)
    # the app's (batched); default: one that writes at once
    request_log: RequestLog = field(default_factory=lambda: RequestLog(0))
    session: str | None = None
    caller: str | None = None  # the name of the client key it came with (http/trust.py)
    request_class: str | None = None  # gated: complete, chat or bulk (gating/classes.py)
    model: str | None = None  # gated: the model it asks for (pool/models.py; None: any)
    model_listed: bool = False  # ... and an upstream lists that name (a bounded set)
    gated: bool = False
    started: float = field(default_factory=time.monotonic)
    refs: int = 1
    status: int | None = None
    outcome: str | None = None
    slot: int | None = None
    permits: int = 1  # slots the request runs on at once (n_cmpl); ``slot`` is the first
    queue_wait_s: float | None = None
    assembled: bool = False  # sent upstream as a stream, answered whole (upstream/assemble.py)
    upstream_sent: bool = False  # its bytes were handed to the upstream connection (mark_sent)
    upstream_s: float | None = None
    upstream_ttfb_s: float | None = None
    piece_gap_s: float | None = None  # mean time between a streamed body's pieces (about a token)
    upstream_status: int | None = None
    upstream_error: ProxyError | None = None
    permit_hold_s: float | None = None
    confirm_wait_s: float | None = None
    confirm_timed_out: bool = False
    superseded_inflight: bool = False
    preempted: int = 0  # times stopped for a completion and resumed (upstream/resume.py)
    resume_prompt_n: int | None = None  # prompt tokens its last continuation evaluated
    reused_tokens: int | None = None  # answered from a running generation (type-through)
    model_loading: bool = False  # its model was not loaded when it was granted (a router's)
    upstream_name: str | None = None  # several upstreams: the one it was routed to ...
    route_decision: str | None = None  # ... and why (pool/router.py)
    failover: str | None = None  # the upstream it could not reach first
    client_gone: bool = False
    error: str | None = None
    ended_at: float | None = None  # wall clock, for the line's timestamp
    total_s: float | None = None

    @property
    def sent(self) -> bool:
        """Did the request (possibly) reach the upstream? Not if it never left: stopped or failed
        before its bytes were written (no connection, say). A preempted request's did, at its
        first segment, whatever becomes of its resume."""
        return self.upstream_sent

    def mark_sent(self) -> None:
        """``on_send`` of the upstream exchange: from now on the upstream may have the request."""
        self.upstream_sent = True

    def add_ref(self) -> None:
        self.refs += 1

    def end_ref(self) -> None:
        self.refs -= 1
        if self.refs == 0:
            self._emit()

    def _resolve_outcome(self) -> str:
        if self.outcome is not None:
            return self.outcome
        if self.upstream_error is not None:
            return "error"
        if self.superseded_inflight and (self.client_gone or self.status == 499):
            return "superseded"
        if self.client_gone:  # left before anything was sent: it never reached the upstream
            return "cancelled_inflight" if self.sent else "cancelled_queued"
        return "completed" if self.status is not None and self.status < 500 else "error"

    def _emit(self) -> None:
        self.outcome = self._resolve_outcome()
        self.total_s = time.monotonic() - self.started
        self.ended_at = time.time()
        self.request_log.write(self._account)

    def _account(self, request_log: RequestLog) -> dict[str, Any] | None:
        """Observe the metrics and build the canonical line (RequestLog calls it, in a batch)."""
        if self.on_done is not None:
            self.on_done(self)
        if not request_log.enabled():
            return None
        ms = lambda v: None if v is None else round(v * 1000, 2)  # noqa: E731
        fields = {
            "request_id": self.request_id,
            "method": self.method,
            "route": self.path,
            "status": self.status,
            "outcome": self.outcome,
            "session": self.session,
            "caller": self.caller,
            "class": self.request_class,
            "model": self.model,
            "upstream": self.upstream_name,
            "route_decision": self.route_decision,
            "failover_from": self.failover,
            "slot": self.slot,
            "permits": self.permits if self.permits > 1 else None,
            "reached_upstream": self.sent,
            "queue_wait_ms": ms(self.queue_wait_s),
            "upstream_ms": ms(self.upstream_s),
            "upstream_status": self.upstream_status,
            "permit_hold_ms": ms(self.permit_hold_s),
            "confirm_wait_ms": ms(self.confirm_wait_s),
            "total_ms": ms(self.total_s),
        }
        if self.model_loading:  # its first byte waited for the router to load the model
            fields["model_load_ms"] = ms(self.upstream_ttfb_s)
        if self.assembled:
            fields["assembled"] = True
        if self.preempted:
            fields["preempted"] = self.preempted
            fields["resume_prompt_n"] = self.resume_prompt_n
        if self.reused_tokens is not None:
            fields["reused_tokens"] = self.reused_tokens
        if self.confirm_timed_out:
            fields["confirm_timed_out"] = True
        error = self.error or (
            self.upstream_error.message if self.upstream_error is not None else None
        )
        if error:
            fields["error"] = error
        fields["timestamp"] = iso_utc(self.ended_at)  # when it ended, whenever it is written
        return {k: v for k, v in fields.items() if v is not None}
