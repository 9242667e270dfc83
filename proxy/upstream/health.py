"""How an upstream exchange counts for the circuit breaker, and what a stop tells readers."""

from __future__ import annotations

from llmproxy.proxy.errors import SUPERSEDED, ProxyError, Superseded, UpstreamFailed
from llmproxy.proxy.gating.breaker import CircuitBreaker
from llmproxy.proxy.telemetry.record import RequestRecord


def upstream_failed(status: int) -> bool:
    """An upstream status the breaker counts as a failure."""
    return status >= 500 and status != 501


def report_health(
    breaker: CircuitBreaker, probe: bool, rec: RequestRecord, told_at_head: bool
) -> None:
    """Tell the breaker how the upstream did, once the exchange is over. ``probe``: the
    request holds the breaker's probe; ``told_at_head``: a good status was reported as a
    success when the head came (which freed the probe)."""
    status = rec.upstream_status
    probe = probe and not told_at_head  # the probe slot is freed once
    if rec.upstream_error is not None or (status is not None and upstream_failed(status)):
        breaker.failure(probe)
    elif told_at_head:
        pass
    elif status is not None:
        breaker.success(probe)
    else:  # never answered (cancelled before headers): no evidence either way
        breaker.neutral(probe)


def stopped_error(reason: str) -> ProxyError:
    """What the readers of a generation stopped for ``reason`` are told."""
    if reason == "superseded":
        return Superseded(SUPERSEDED)
    return UpstreamFailed(f"the generation was stopped ({reason})")
