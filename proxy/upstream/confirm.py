"""After a job's stop: waiting until the upstream has stopped its request, or holding the
permit in the confirmation's stead where the adapter cannot see it.

``confirm_stop`` runs in the job's task, after the upstream connection was closed, while the
job still holds its permit; only app shutdown cancels it (with the job).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from llmproxy.proxy.telemetry.metrics import Metrics
from llmproxy.proxy.telemetry.record import RequestRecord
from llmproxy.proxy.upstream.adapters.base import Adapter


async def confirm_stop(
    adapter: Adapter,
    path: str,
    slots: Sequence[int],
    record: RequestRecord,
    metrics: Metrics,
    *,
    stopped: bool,
    hold_s: float,
) -> bool:
    """Wait until the request on ``path`` is over at the upstream: confirmed by the adapter
    where it can (``Adapter.confirm_stopped``); else a hold, ``unconfirmed_hold`` for a stop
    (``stopped``: policy cancel without a view, best effort) or ``hold_s`` for a request that
    failed mid-way (a read timeout, a cut body: the upstream may run on, unseen). Records
    the wait on ``record``. False if the confirmation timed out (counted, and recorded): the
    request's ``slots`` may still be busy."""
    start = time.monotonic()
    confirmed = True
    if adapter.confirms(path):
        answered = record.upstream_status is not None
        if not await adapter.confirm_stopped(slots, answered=answered):
            metrics.confirm_timeouts.inc()
            record.confirm_timed_out = True
            confirmed = False
    elif stopped:
        await asyncio.sleep(unconfirmed_hold(record, adapter, hold_s))
    else:
        await asyncio.sleep(hold_s)
    record.confirm_wait_s = time.monotonic() - start
    return confirmed


def unconfirmed_hold(record: RequestRecord, adapter: Adapter, hold_s: float) -> float:
    """How long a stop nothing can confirm holds the permit: a stream that has started (its
    first piece came, so its prompt is done) stops at its next token, so twice the mean gap
    between its pieces, or between those of the adapter's recent streams when this one has
    only one yet (``Adapter.piece_gap_s``); at most ``hold_s`` (``unconfirmed_cancel_hold_s``),
    which is also the hold before the first piece."""
    gap = record.piece_gap_s if record.piece_gap_s is not None else adapter.piece_gap_s
    if record.upstream_ttfb_s is None or gap is None:
        return hold_s
    return min(hold_s, 2 * gap)
