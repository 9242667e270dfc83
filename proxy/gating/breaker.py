"""Circuit breaker on the upstream: fail fast instead of queueing behind a dead backend.

closed --(``threshold`` consecutive failures)--> open --(``cooldown_s``)--> half-open:
exactly one probe request is let through; its success closes the breaker, its failure
opens it again for another cooldown. Failures are transport errors (unreachable, reset,
timeout) and upstream 5xx other than 501. Single-threaded (event loop) state; no locks.

The probe's slot belongs to the request admitted as the probe (``admit`` returned True):
only its own report (``success``/``failure``/``neutral`` with ``probe=True``) frees it, so
at most one probe is ever out. Any request's success closes the breaker and any failure
counts (and re-opens an open or half-open breaker), but an older request's failure never
lets a second probe through while the first is out. Callers report a success as soon as
the upstream's response head says so (upstream/job.py), not after the body: a probe that streams
for minutes does not keep everyone else out meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

from llmproxy.proxy.errors import ProxyError

State = Literal["closed", "open", "half_open"]


class UpstreamUnavailable(ProxyError):
    status, type, outcome = 503, "upstream_unavailable", "rejected"


class CircuitBreaker:
    def __init__(
        self, threshold: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.threshold = threshold  # 0 disables the breaker
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._failures = 0
        self._opened_at: float | None = None
        self._probe_out = False

    @property
    def state(self) -> State:
        if self._opened_at is None:
            return "closed"
        if self._clock() - self._opened_at >= self.cooldown_s:
            return "half_open"
        return "open"

    @property
    def admissible(self) -> bool:
        """Would ``admit`` let a request through now?"""
        state = self.state
        return state == "closed" or (state == "half_open" and not self._probe_out)

    def admit(self) -> bool:
        """Let a request through? Returns True if it is the half-open probe. Raises when open."""
        state = self.state
        if state == "closed":
            return False
        if state == "half_open" and not self._probe_out:
            self._probe_out = True
            return True
        retry = max(1, int(self.cooldown_s - (self._clock() - (self._opened_at or 0))) + 1)
        raise UpstreamUnavailable(
            f"upstream failing ({self._failures} consecutive errors); failing fast",
            headers={"Retry-After": str(retry)},
        )

    def success(self, probe: bool = False) -> None:
        """A request (the probe, if ``probe``) was answered: the upstream is up."""
        self._failures = 0
        self._opened_at = None
        if probe:
            self._probe_out = False

    def failure(self, probe: bool = False) -> None:
        """A request (the probe, if ``probe``) failed at the upstream."""
        self._failures += 1
        if probe:
            self._probe_out = False
        if self.threshold and (self._opened_at is not None or self._failures >= self.threshold):
            self._opened_at = self._clock()

    def neutral(self, probe: bool) -> None:
        """The request ended without telling anything (client left first): if it was the
        probe, its slot is free for the next one."""
        if probe:
            self._probe_out = False
