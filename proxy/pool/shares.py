"""Fair shares between callers within a request class (start-time fair queuing).

A caller is the name of the client key a request came with (``[[keys]]``), else its
client's address. Among the waiting requests of the best class, the scheduler serves the
caller whose next start tag is the lowest: ``max(its last finish tag, now)`` where "now"
is the virtual time (the start tag of the last grant), and a grant of ``p`` permits moves
the caller's finish tag on by ``p / weight``. So callers are served in turn, weighted,
whatever their arrival order: one caller's agent loop with eight requests waiting does not
make another caller's one request wait for all eight. A caller at its key's
``max_inflight`` is passed over until one of its requests ends; one at ``max_queued``
waiting requests gets 429.

Pure bookkeeping, event loop thread only (the scheduler's grants: grant.py).
Callers caught up with the virtual time are forgotten (they would start there anyway), so
the table stays bounded by the callers that are ahead.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmproxy.proxy.keys import KeySpec


class Shares:
    def __init__(self, keys: Sequence[KeySpec]) -> None:
        self._keys = {k.name: k for k in keys}
        #: some key caps its caller's requests in flight (the queue's order must look)
        self.caps = any(k.max_inflight is not None for k in keys)
        self._finish: dict[str, float] = {}
        self._now = 0.0

    def start(self, caller: str) -> float:
        """The start tag ``caller``'s next grant would get."""
        return max(self._finish.get(caller, 0.0), self._now)

    def granted(self, caller: str, permits: int) -> None:
        key = self._keys.get(caller)
        weight = key.weight if key is not None else 1.0
        start = self.start(caller)
        self._now = start
        self._finish[caller] = start + permits / weight
        if len(self._finish) > 256:
            self._finish = {c: t for c, t in self._finish.items() if t > self._now}

    def max_inflight(self, caller: str) -> int | None:
        key = self._keys.get(caller)
        return key.max_inflight if key is not None else None

    def max_queued(self, caller: str) -> int | None:
        key = self._keys.get(caller)
        return key.max_queued if key is not None else None
