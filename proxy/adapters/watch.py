"""Learning what detection could not: the upstream's kind, slot count and ``/slots``, later.

A proxy started together with its llama-server (systemd, a script) often meets it while
it loads its model (503 on every API route), while ``/slots`` is slow (answered from the
server's main loop, between decode steps), or before it listens at all (a unit ordered
after the proxy's, a server started by hand later). Detection (detect.py) then leaves the
slot count unknown, stop confirmation off or, with ``upstream_kind`` auto, the kind
undetected, and says so in the adapter's ``pending()``. ``watch_upstream`` asks again,
backing off from ``WATCH_FIRST_S`` to ``WATCH_MAX_S`` (to ``REDETECT_MAX_S`` while the kind
is undetected: a refused connection costs nothing, and requests meanwhile get one permit
and no ``id_slot``), until nothing is pending:

- an undetected upstream that answers gets the adapter detection finds then
  (``detect.redetect``), swapped into ``ProxyState.adapter``: requests admitted from then
  on use it; jobs already running keep the one they started with, whose relay client is
  closed (its connections close as those jobs release them);
- confirmation turns on from then on (for new requests, and for stops of requests already
  in flight, which ask the adapter when they stop);
- a slot count learnt this way grows the gate (``Gate.grow``) unless ``capacity`` is set;
  a configured ``capacity`` above it is only logged (an error: requests on slots the
  upstream does not have wait there), since permits already granted cannot be taken back.

Then it sets ``known`` on the adapter in use, and on any it replaced.

Concurrency contract: one task per app, started by ``watching`` (an async context
manager the app's upstream cleanup context enters once the state exists) and cancelled
and awaited there when the app stops; it only sleeps and polls with the adapters' probe
session, and touches the gate and the state on the event loop's thread between awaits
(the swap itself has no await: a request sees the old adapter or the new one).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from llmproxy.proxy.adapters.base import Adapter, log
from llmproxy.proxy.adapters.detect import redetect
from llmproxy.proxy.gate import Gate
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.state import ProxyState

WATCH_FIRST_S = 0.5
WATCH_MAX_S = 30.0
REDETECT_MAX_S = 5.0


async def watch_upstream(state: ProxyState) -> None:
    settings, gate = state.settings, state.gate
    replaced: list[Adapter] = []
    delay = WATCH_FIRST_S
    try:
        while state.adapter.pending():
            adapter = state.adapter
            await asyncio.sleep(delay)
            delay = min(delay * 2, REDETECT_MAX_S if adapter.undetected else WATCH_MAX_S)
            if adapter.undetected:
                found = await redetect(adapter.session, settings, str(adapter.base_url))
                if found is None:
                    continue
                state.adapter = found
                adapter.close()
                replaced.append(adapter)
                delay = WATCH_FIRST_S
                log.info("upstream detected", **found.describe())
                _fit_gate(gate, settings, found.slots)
                continue
            unknown = adapter.slots is None
            await adapter.refresh()
            if unknown:
                _fit_gate(gate, settings, adapter.slots)
    except Exception:  # our own bug: say so, and leave the adapter as it is
        log.exception("upstream watch failed")
        return
    for adapter in (*replaced, state.adapter):
        adapter.known.set()
    log.info("upstream adapter complete", **state.adapter.describe())


def _fit_gate(gate: Gate, settings: ProxySettings, slots: int | None) -> None:
    """A slot count learnt after start: more permits, unless ``capacity`` is configured."""
    if slots is None:
        return
    if settings.capacity is None and slots > gate.capacity:
        log.info("upstream slot count learnt: more permits", permits=slots, were=gate.capacity)
        gate.grow(slots)
    elif slots < gate.capacity:
        log.error("capacity exceeds the upstream's slots: requests given the missing slots wait at "
                  "the upstream; lower --capacity", capacity=gate.capacity, slots=slots)


@contextlib.asynccontextmanager
async def watching(state: ProxyState) -> AsyncIterator[None]:
    """Run ``watch_upstream`` while the block runs (only if something is pending)."""
    if not state.adapter.pending():
        yield
        return
    task = asyncio.create_task(watch_upstream(state), name="llmproxy-upstream-watch")
    try:
        yield
    finally:
        task.cancel()
        await asyncio.wait([task])  # a cancellation of this task itself still propagates from here
