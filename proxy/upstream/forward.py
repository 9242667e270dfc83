"""One exchange with the upstream relayed to the client as it arrives, with nothing else to
do on the way (the ungated routes' handler: http/passthrough.py; a gated request's job
reads the same events itself: job.py).

Records on the request's record: the request handed to the connection (``mark_sent``), the
upstream's status, the time to its first body byte and to its end. Raises the ProxyError
an exchange failed with: the caller decides whether it becomes an HTTP error or the
stream's error event. Writes to the client never raise (relay/responder.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from llmproxy.proxy.relay.events import End, Failed, Head, Timing
from llmproxy.proxy.relay.responder import Responder
from llmproxy.proxy.relay.writer import Relay
from llmproxy.proxy.telemetry.record import RequestRecord
from llmproxy.proxy.upstream.adapters.base import Adapter
from llmproxy.proxy.upstream.stream import exchange_events


async def forward(
    adapter: Adapter,
    method: str,
    raw_path: str,
    headers: Mapping[str, str],
    body: bytes | None,
    out: Responder,
    rec: RequestRecord,
) -> None:
    """``method raw_path`` on the adapter's upstream, its response written through ``out``."""
    timing = Timing()
    relay = Relay(out)
    try:
        events = exchange_events(
            adapter, method, raw_path, headers, body, on_send=rec.mark_sent, timing=timing
        )
        async with contextlib.aclosing(events):
            async for event in events:
                if isinstance(event, Failed):
                    raise event.error
                if isinstance(event, Head):
                    rec.upstream_status = event.status
                elif isinstance(event, End):
                    timing_to(rec, timing)
                await relay.write(event)
    finally:
        timing_to(rec, timing)


def timing_to(rec: RequestRecord, timing: Timing) -> None:
    """The exchange's timing (relay/events.py), on the request's record."""
    rec.upstream_s, rec.upstream_ttfb_s = timing.total_s, timing.ttfb_s
    rec.piece_gap_s = timing.piece_gap_s
