"""The proxy's own endpoints under /llmproxy/: health, status (JSON), metrics (Prometheus).

The whole /llmproxy/ prefix is the proxy's: another method on one of these paths is a 405,
any other path under it a 404, and nothing there is ever forwarded to the upstream.
"""

from __future__ import annotations

import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from llmproxy.proxy.errors import NotAllowed, NotFound
from llmproxy.proxy.state import REQUEST_LOG, STATE


async def health(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return web.json_response({"status": "ok", "upstream": st.adapter.kind})


async def status(request: web.Request) -> web.Response:
    st = request.app[STATE]
    gate = st.gate
    now = time.monotonic()
    inflight = [
        {
            "id": t.id,
            "slot": t.slot,
            "slots": list(t.slots),
            "state": t.state,
            "route": t.route,
            "session": t.session[:8],  # redacted: a prefix of the hashed key
            "age_s": round(now - (t.granted_at or t.created), 3),
        }
        for t in gate.inflight_snapshot()
    ]
    queued = [
        {
            "id": t.id,
            "route": t.route,
            "permits": t.permits,
            "session": t.session[:8],
            "age_s": round(now - t.created, 3),
        }
        for t in gate.queue_snapshot()
    ]
    return web.json_response(
        {
            "permits": {"total": gate.capacity, "free": gate.free, "held": gate.held},
            "queue": {"depth": gate.queued, "max": gate.max_queue, "requests": queued},
            # slots whose stop was not confirmed in time: out of the grants until seen idle
            "quarantine": {"slots": gate.quarantined},
            "inflight": inflight,
            "upstream": st.adapter.describe(),
            "jobs": len(st.jobs),
            "breaker": st.breaker.state,
            "policies": {
                "supersede_inflight": st.policy(st.settings.supersede_inflight),
                "on_disconnect": st.policy(st.settings.on_disconnect),
                # gated routes whose stop this upstream cannot confirm: 'auto' is 'finish' there
                "unconfirmed_routes": sorted(
                    r for r in st.adapter.gated_routes if not st.adapter.confirms(r)
                ),
            },
        }
    )


async def metrics(request: web.Request) -> web.Response:
    st = request.app[STATE]
    request.app[REQUEST_LOG].flush()  # requests that ended and wait in the batch count too
    body = generate_latest(st.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


_PATHS = ("/llmproxy/health", "/llmproxy/status", "/llmproxy/metrics")


async def reserved(request: web.Request) -> web.Response:
    """Everything else under /llmproxy/ (registered before the proxy's catch-all)."""
    if request.path in _PATHS:
        raise NotAllowed(
            f"{request.method} is not allowed on {request.path}", headers={"Allow": "GET, HEAD"}
        )
    raise NotFound(f"no such llmproxy endpoint: {request.path}")


def add_routes(app: web.Application) -> None:
    for path, handler in zip(_PATHS, (health, status, metrics), strict=True):
        app.router.add_get(path, handler)
    app.router.add_route("*", "/llmproxy/{tail:.*}", reserved)
