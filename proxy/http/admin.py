"""The proxy's own endpoints under /llmproxy/: health, status (JSON), metrics (Prometheus),
the live page (``/llmproxy/``, its script and style, files shipped in page/) and its event
stream (``/llmproxy/events``, events.py).

The whole /llmproxy/ prefix is the proxy's: another method on one of these paths is a 405,
any other path under it a 404, and nothing there is ever forwarded to the upstream.
"""

from __future__ import annotations

import time
from functools import cache
from importlib.resources import files
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from llmproxy.proxy.errors import NotAllowed, NotFound
from llmproxy.proxy.gating.ticket import Ticket
from llmproxy.proxy.http.events import PAGES, Pages, close_pages, events
from llmproxy.proxy.pool.specs import upstream_specs
from llmproxy.proxy.state import REQUEST_LOG, SETTINGS, STATE, ProxyState
from llmproxy.proxy.upstream.adapters.base import Adapter


async def health(request: web.Request) -> web.Response:
    """Liveness: always 200 while the proxy serves. ``status`` is ``degraded`` (with
    ``reasons``) while an upstream cannot be reached, as far as the proxy knows without
    sending anything: detection or its health probe failing, its breaker open, or its last
    request unable to connect."""
    st = request.app[STATE]
    reasons = _degraded(st)
    kind = st.pool.members[0].adapter.kind
    body: dict[str, Any] = {"status": "degraded" if reasons else "ok", "upstream": kind}
    if reasons:
        body["reasons"] = reasons
    return web.json_response(body)


def _degraded(st: ProxyState) -> list[str]:
    unreachable = st.metrics.recent.unreachable
    reasons = []
    for m in st.pool.members:
        if m.adapter.undetected:
            reasons.append(f"upstream {m.name}: it has not answered yet (detection goes on)")
        elif not m.healthy:
            reasons.append(f"upstream {m.name}: its health probe fails")
        elif m.breaker.state != "closed":
            reasons.append(f"upstream {m.name}: failing, circuit breaker {m.breaker.state}")
        elif m.name in unreachable:
            reasons.append(f"upstream {m.name}: {unreachable[m.name]}")
    return reasons


async def status(request: web.Request) -> web.Response:
    return web.json_response(status_of(request.app[STATE]))


def status_of(st: ProxyState) -> dict[str, Any]:
    """One shape, for one upstream or several: ``upstreams`` has an entry for each (its
    permits, breaker, quarantined slots, ...). The top-level ``permits``, ``queue``,
    ``inflight`` and ``jobs`` are proxy-wide (``bench soak`` waits on them); ``upstream``
    and ``policies`` are the first upstream's."""
    members, now = st.pool.members, time.monotonic()
    gates = [m.gate for m in members]
    return {
        "permits": {
            "total": sum(g.capacity for g in gates),
            "free": sum(g.free for g in gates),
            "held": sum(g.held for g in gates),
        },
        "queue": {
            "depth": len(st.pool.queue),
            "max": st.pool.max_queue,
            "requests": [
                {
                    "id": e.id,
                    "route": e.route,
                    "class": e.ticket.klass,
                    "session": e.session[:8],
                    "age_s": round(now - e.created, 3),
                }
                for e in st.pool.queue
            ],
        },  # fmt: skip
        "inflight": [
            {**_inflight(t, now), "upstream": m.name}
            for m in members
            for t in m.gate.inflight_snapshot()
        ],
        "upstream": members[0].adapter.describe(),
        "jobs": len(st.jobs),
        "preemptions": st.pool.preemptions,
        "policies": {**_policies(st, members[0].adapter), "route": st.settings.route},
        "upstreams": [m.describe() for m in members],
    }


def _inflight(t: Ticket, now: float) -> dict[str, Any]:
    return {
        "id": t.id,
        "slot": t.slot,
        "slots": list(t.slots),
        "state": t.state,
        "route": t.route,
        "class": t.klass,
        "session": t.session[:8],  # redacted: a prefix of the hashed key
        "age_s": round(now - (t.granted_at or t.created), 3),
    }


def _policies(st: ProxyState, adapter: Adapter) -> dict[str, Any]:
    return {
        "supersede_inflight": st.policy(st.settings.supersede_inflight, adapter),
        "on_disconnect": st.policy(st.settings.on_disconnect, adapter),
        # gated routes whose stop this upstream cannot confirm: 'auto' is 'finish' there
        "unconfirmed_routes": sorted(
            r for r in adapter.dialect.gated_routes if not adapter.confirms(r)
        ),
    }


async def metrics(request: web.Request) -> web.Response:
    st = request.app[STATE]
    request.app[REQUEST_LOG].flush()  # requests that ended and wait in the batch count too
    body = generate_latest(st.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


_PAGE_FILES = {
    "/llmproxy/": ("index.html", "text/html"),
    "/llmproxy/page.js": ("page.js", "text/javascript"),
    "/llmproxy/page.css": ("page.css", "text/css"),
}
#: the page loads only what the proxy serves; nothing inline, nothing from elsewhere
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; connect-src 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


@cache
def _page_file(name: str) -> bytes:
    return files("llmproxy.proxy.http.page").joinpath(name).read_bytes()


async def page(request: web.Request) -> web.Response:
    """The live page's files, read from the package once."""
    name, content_type = _PAGE_FILES[request.path]
    return web.Response(
        body=_page_file(name), content_type=content_type, charset="utf-8", headers=_PAGE_HEADERS
    )


_PATHS = ("/llmproxy/health", "/llmproxy/status", "/llmproxy/metrics", "/llmproxy/events")


async def reserved(request: web.Request) -> web.Response:
    """Everything else under /llmproxy/ (registered before the proxy's catch-all)."""
    if request.path in _PATHS or request.path in _PAGE_FILES:
        raise NotAllowed(
            f"{request.method} is not allowed on {request.path}", headers={"Allow": "GET, HEAD"}
        )
    raise NotFound(f"no such llmproxy endpoint: {request.path}")


async def to_page(request: web.Request) -> web.Response:
    """``GET /`` with the embedded backend (which serves nothing there): the live page."""
    return web.Response(status=302, headers={"Location": "/llmproxy/"})


def add_routes(app: web.Application) -> None:
    """The /llmproxy/ routes, and ``GET /`` -> the page where the upstream is the embedded
    backend (an upstream's own ``/``, llama-server's web UI, passes through)."""
    app[PAGES] = Pages()
    app.on_shutdown.append(close_pages)
    for path, handler in zip(_PATHS, (health, status, metrics, events), strict=True):
        app.router.add_get(path, handler)
    for path in _PAGE_FILES:
        app.router.add_get(path, page)
    if not upstream_specs(app[SETTINGS]):
        app.router.add_get("/", to_page)
    app.router.add_route("*", "/llmproxy/{tail:.*}", reserved)
