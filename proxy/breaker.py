"""Circuit breaker on the upstream: fail fast instead of queueing behind a dead backend.

closed --(``threshold`` consecutive failures)--> open --(``cooldown_s``)--> half-open:
exactly one probe request is let through; its success closes the breaker, its failure
opens it again for another cooldown. Failures are transport errors (unreachable, reset,
timeout) and upstream 5xx other than 501. Single-threaded (event loop) state; no locks.
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
    def __init__(self, threshold: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
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
            f"upstream failing ({self._failures} consecutive errors); failing fast", headers={"Retry-After": str(retry)}
        )

    def success(self) -> None:
        self._failures = 0
        self._opened_at = None
        self._probe_out = False

    def failure(self) -> None:
        self._failures += 1
        self._probe_out = False
        if self.threshold and (self._opened_at is not None or self._failures >= self.threshold):
            self._opened_at = self._clock()

    def neutral(self, was_probe: bool) -> None:
        """The request ended without telling anything (client left first): free the probe."""
        if was_probe:
            self._probe_out = False
