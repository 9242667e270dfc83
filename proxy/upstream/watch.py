"""Learning what detection could not: the upstream's kind, slot count and ``/slots``, later.

A proxy started together with its llama-server (systemd, a script) often meets it while
it loads its model (503 on every API route), while ``/slots`` is slow (answered from the
server's main loop, between decode steps), or before it listens at all (a unit ordered
after the proxy's, a server started by hand later). Detection (detect.py) then leaves the
slot count unknown, stop confirmation off or, with ``upstream_kind`` auto, the kind
undetected, and says so in the adapter's ``pending()``. ``watch_upstream`` asks again,
backing off from ``WATCH_FIRST_S`` to ``WATCH_MAX_S`` (to ``REDETECT_MAX_S`` while the kind
or slot count is unknown: a refused connection or a 503 costs nothing, and requests
meanwhile get one permit), until nothing is pending:

- an undetected upstream that answers gets the adapter detection finds then
  (``detect.redetect``), swapped into the member's ``adapter``, which is then in rotation
  (``learnt``): requests granted from then on use it, those that waited in the queue
  meanwhile included (their permit count is asked at the grant, pool/grant.py); jobs
  already running keep the one they started with, whose relay client is closed (its
  connections close as those jobs release them);
- confirmation turns on from then on (for new requests, and for stops of requests already
  in flight, which ask the adapter when they stop);
- the gate has one permit while the kind or slot count is unknown (nothing runs at the
  upstream then: it does not answer, or answers 503); once known it grows
  (``Gate.grow``) to what ``gate_capacity`` gives at start: ``capacity`` clamped to the
  slot count, or the slot count. It never has to shrink, so no permit granted before
  names a slot the upstream lacks.

Then it sets ``known`` on the adapter in use, and on any it replaced.

Concurrency contract: one task per upstream, started by ``watching`` (an async context
manager pool/lifecycle.py enters for each member) and cancelled and awaited there when the
member goes or the app stops; it only sleeps and polls with the adapters' probe session,
and touches the gate and the member on the event loop's thread between awaits (the swap
itself has no await: a request sees the old adapter or the new one).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Protocol

from llmproxy.proxy.gating.gate import Gate
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.upstream.adapters.base import Adapter, log
from llmproxy.proxy.upstream.detect import redetect

WATCH_FIRST_S = 0.5
WATCH_MAX_S = 30.0
REDETECT_MAX_S = 5.0


class Watched(Protocol):
    """What is watched: one upstream (pool/member.py)."""

    settings: ProxySettings
    gate: Gate
    adapter: Adapter

    def learnt(self) -> None:
        """The upstream answered re-detection: in rotation, and the queue may move."""


async def watch_upstream(state: Watched) -> None:
    settings, gate = state.settings, state.gate
    replaced: list[Adapter] = []
    delay = WATCH_FIRST_S
    try:
        while state.adapter.pending():
            adapter = state.adapter
            await asyncio.sleep(delay)
            delay = min(delay * 2, REDETECT_MAX_S if adapter.capacity_pending() else WATCH_MAX_S)
            if adapter.undetected:
                found = await redetect(adapter.session, settings, str(adapter.base_url))
                if found is None:
                    continue
                state.adapter = found
                adapter.close()
                replaced.append(adapter)
                delay = WATCH_FIRST_S
                log.info("upstream detected", **found.describe())
                fit_gate(gate, settings, found)
                state.learnt()
                continue
            await adapter.refresh()
            fit_gate(gate, settings, adapter)
    except Exception:  # our own bug: say so, and leave the adapter as it is
        log.exception("upstream watch failed")
        return
    for adapter in (*replaced, state.adapter):
        adapter.known.set()
    log.info("upstream adapter complete", **state.adapter.describe())


def gate_capacity(settings: ProxySettings, adapter: Adapter, *, warn: bool = True) -> int:
    """Permits for the gate: 1 while what sizes it is still to be learnt (the upstream does
    not answer, or answers 503 while it loads: nothing runs there meanwhile); else
    ``capacity``, clamped to a llama-server's slot count (permit i is slot i: a higher one
    would name a slot it lacks; ``warn``: say so); else that slot count; else 1."""
    if adapter.capacity_pending():
        return 1
    slots = adapter.slots if adapter.kind == "llamacpp" else None
    if settings.capacity is None:
        return slots or 1
    if slots is not None and settings.capacity > slots:
        if warn:
            log.warning(
                "capacity exceeds the upstream's slots; clamping",
                capacity=settings.capacity,
                slots=slots,
            )
        return slots
    return settings.capacity


def fit_gate(gate: Gate, settings: ProxySettings, adapter: Adapter) -> None:
    """What sizes the gate was learnt after start, or a reload raised ``capacity``: grow it
    to fit (it never shrinks)."""
    if adapter.capacity_pending() or gate_capacity(settings, adapter, warn=False) <= gate.total:
        return
    capacity = gate_capacity(settings, adapter)  # says so once if it clamps
    log.info("upstream learnt: more permits", permits=capacity, were=gate.total)
    gate.grow(capacity)


@contextlib.asynccontextmanager
async def watching(state: Watched) -> AsyncIterator[None]:
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
