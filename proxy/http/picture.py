"""The picture the live page and ``llmproxy status`` draw: slots, queue, timeline, counters.

``picture(state, since)`` reads the gates, the pool and the type-through registry through
their read-only accessors, and the finished requests from ``Metrics.recent``
(telemetry/recent.py). It runs on the event loop's thread, never awaits and changes
nothing; its cost is linear in the slots, the queue and the requests finished since
``since``. Metadata only: routes, states, times, slot ids, token counts and an 8-character
prefix of each hashed session key, never prompt or completion text.
"""

from __future__ import annotations

import time
from typing import Any

from llmproxy.proxy.gating.gate import Gate
from llmproxy.proxy.gating.ticket import Ticket
from llmproxy.proxy.reuse.registry import Generations
from llmproxy.proxy.state import ProxyState
from llmproxy.proxy.telemetry.recent import request_class

_SLOT_STATE = {"granted": "generating", "running": "generating", "stopping": "stopping"}


def picture(st: ProxyState, since: int = 0) -> dict[str, Any]:
    """The whole picture; ``timeline`` holds the requests finished after number ``since``."""
    now = time.monotonic()
    recent = st.metrics.recent
    upstreams = [
        _upstream(m.name, m.adapter.kind, m.gate, st.generations, now, healthy=m.in_rotation)
        | {"models": [] if m.any_model else list(m.models)}  # only these (pool/models.py)
        | {"model_status": m.adapter.describe().get("model_status")}  # a router's model
        for m in st.pool.members
    ]
    places: list[tuple[str, Any]] = st.pool.queue.places()
    max_queue = st.pool.max_queue
    return {
        "upstreams": upstreams,
        "queue": {"max": max_queue, "places": [_place(s, w, now) for s, w in places]},
        "counters": recent.counters(),
        "timeline": [f.row(now) for f in recent.since(since)],
        "seq": recent.seq,
    }


def _upstream(
    name: str, kind: str, gate: Gate, generations: Generations | None, now: float, healthy: bool
) -> dict[str, Any]:
    holders: dict[int, Ticket] = {}
    for held in gate.inflight_snapshot():
        for slot in held.slots:
            holders[slot] = held
    quarantined = set(gate.quarantined)
    slots = []
    for slot in range(gate.total):
        ticket = holders.get(slot)
        tile: dict[str, Any] = {"id": slot, "state": "idle"}
        if ticket is not None:
            tile.update(
                state=_SLOT_STATE.get(ticket.state, "generating"),
                session=ticket.session[:8],
                route=ticket.route,
                cls=request_class(ticket.route),
                age_ms=round((now - (ticket.granted_at or ticket.created)) * 1000),
                tokens=_tokens(generations, ticket.session),
            )
        elif slot in quarantined:
            tile["state"] = "quarantined"
        slots.append(tile)
    return {
        "name": name,
        "kind": kind,
        "healthy": healthy,
        "permits": {"total": gate.capacity, "free": gate.free},
        "slots": slots,
    }


def _tokens(generations: Generations | None, session: str) -> int | None:
    """Tokens so far of the session's running generation, where the proxy reads its stream
    (type-through's routes); None where it does not."""
    if generations is None:
        return None
    generation = generations.latest(session)
    if generation is None or generation.done:
        return None
    return generation.tokens_after(0)


def _place(session: str, waiter: Any, now: float) -> dict[str, Any]:
    """A waiting request (a Ticket or a pool Entry), or a held place (``waiter`` None)."""
    if waiter is None:
        return {"kind": "held", "session": session[:8]}
    return {
        "kind": "waiting",
        "session": session[:8],
        "route": waiter.route,
        "cls": request_class(waiter.route),
        "age_ms": round((now - waiter.created) * 1000),
    }
