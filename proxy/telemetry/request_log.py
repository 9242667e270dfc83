"""The canonical request log and metrics: each finished request accounted for, in batches.

Accounting for a request (observing its metrics, whose histograms take a lock per bucket,
and rendering its line through structlog's processors) takes loop time, and a request
finishes exactly when its response has just been written, in the same loop turn as other
responses that completed together and just before the same client's next request arrives:
accounted for there, it would delay them. So, like nginx's ``access_log ... buffer=
flush=``, finished requests wait (bounded) and are accounted for together: ``flush_s``
after the first one (``per_turn`` per loop turn, so a batch never holds the loop for long
while other responses wait), at once when ``max_lines`` are waiting, on ``close()``, and
before metrics are read (``/llmproxy/metrics`` calls ``flush``). A line's ``timestamp`` is
when its request ended, not when it was written. ``flush_s = 0`` accounts for each at once.

Concurrency contract: used from the event loop's thread only. The flush timer (then one
``call_soon`` per further turn) is a loop handle owned by this object (no task); ``flush()``
and ``close()`` cancel it and account for everything waiting. The app's cleanup calls
``close()`` after every request has ended. Requests still waiting when the process dies
without cleanup (SIGKILL, a second signal) are lost from the log and the metrics: those
that ended in the last ``flush_s``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger("llmproxy.request")

MAX_LINES = 256
PER_TURN = 8  # entries the timer's flush accounts for in one loop turn
#: Accounts for one finished request when called (observes its metrics) and returns the
#: fields of its canonical line, or None for no line.
Entry = Callable[["RequestLog"], "dict[str, Any] | None"]


class RequestLog:
    def __init__(
        self, flush_s: float, max_lines: int = MAX_LINES, per_turn: int = PER_TURN
    ) -> None:
        self.flush_s = flush_s
        self.max_lines = max_lines
        self.per_turn = per_turn
        self._pending: list[Entry] = []
        self._timer: asyncio.Handle | None = None
        self._closed = False

    def enabled(self) -> bool:
        """Does the log level let request lines through (info)? If not, skip building them."""
        return log.is_enabled_for(logging.INFO)

    def write(self, entry: Entry) -> None:
        """Account for one finished request: ``entry(self)`` runs in the next flush."""
        if self.flush_s <= 0 or self._closed:
            self._account(entry)
            return
        self._pending.append(entry)
        if len(self._pending) >= self.max_lines:
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.flush_s, self._drain)

    def _drain(self) -> None:
        """The timer's flush: ``per_turn`` entries now, the rest in the next loop turns."""
        batch, self._pending = self._pending[: self.per_turn], self._pending[self.per_turn :]
        self._timer = asyncio.get_running_loop().call_soon(self._drain) if self._pending else None
        for entry in batch:
            self._account(entry)

    def flush(self) -> None:
        """Account for every waiting request, oldest first."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self._pending = self._pending, []
        for entry in pending:
            self._account(entry)

    def close(self) -> None:
        """Account for what is waiting; later requests are accounted for at once."""
        self._closed = True
        self.flush()

    def _account(self, entry: Entry) -> None:
        try:
            fields = entry(self)
            if fields is not None:
                log.info("request", **fields)
        except Exception:  # a bug in one entry must not lose the rest of the batch
            log.exception("request accounting failed")
