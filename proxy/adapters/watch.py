"""Learning what detection could not: the upstream's slot count and ``/slots``, later.

A proxy started together with its llama-server (systemd, a script) often meets it while
it loads its model (503 on every API route) or while ``/slots`` is slow (answered from
the server's main loop, between decode steps). Detection (detect.py) then leaves the slot
count unknown or stop confirmation off, and says so in the adapter's ``pending()``.
``watch_upstream`` asks again, backing off from ``WATCH_FIRST_S`` to ``WATCH_MAX_S``,
until nothing is pending: confirmation turns on from then on (for new requests, and for
stops of requests already in flight, which ask the adapter when they stop), and a slot
count learnt this way grows the gate (``Gate.grow``) unless ``capacity`` is set; a
configured ``capacity`` above it is only logged (an error: requests on slots the upstream
does not have wait there), since permits already granted cannot be taken back. Then it
sets ``adapter.known``.

Concurrency contract: one task per app, started by ``watching`` (an async context
manager the app's upstream cleanup context enters once the gate exists) and cancelled and
awaited there when the app stops; it only sleeps and polls with the adapter's probe
session, and touches the gate on the event loop's thread between awaits.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from llmproxy.proxy.adapters.base import Adapter, log
from llmproxy.proxy.gate import Gate
from llmproxy.proxy.settings import ProxySettings

WATCH_FIRST_S = 0.5
WATCH_MAX_S = 30.0


async def watch_upstream(adapter: Adapter, gate: Gate, settings: ProxySettings) -> None:
    delay = WATCH_FIRST_S
    try:
        while adapter.pending():
            await asyncio.sleep(delay)
            delay = min(delay * 2, WATCH_MAX_S)
            unknown = adapter.slots is None
            await adapter.refresh()
            if not unknown or adapter.slots is None:
                continue
            if settings.capacity is None and adapter.slots > gate.capacity:
                log.info("upstream slot count learnt: more permits", permits=adapter.slots, were=gate.capacity)
                gate.grow(adapter.slots)
            elif adapter.slots < gate.capacity:
                log.error("capacity exceeds the upstream's slots: requests given the missing slots wait at "
                          "the upstream; lower --capacity", capacity=gate.capacity, slots=adapter.slots)
    except Exception:  # our own bug: say so, and leave the adapter as detection left it
        log.exception("upstream watch failed")
        return
    adapter.known.set()
    log.info("upstream adapter complete", **adapter.describe())


@contextlib.asynccontextmanager
async def watching(adapter: Adapter, gate: Gate, settings: ProxySettings) -> AsyncIterator[None]:
    """Run ``watch_upstream`` while the block runs (only if something is pending)."""
    if not adapter.pending():
        yield
        return
    task = asyncio.create_task(watch_upstream(adapter, gate, settings), name="llmproxy-upstream-watch")
    try:
        yield
    finally:
        task.cancel()
        await asyncio.wait([task])  # a cancellation of this task itself still propagates from here
