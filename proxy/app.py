"""Builds the proxy's aiohttp Application: wiring only (routes, middleware, lifecycle)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import structlog
from aiohttp import web
from pydantic import SecretStr

from llmproxy.proxy.gating.registry import JobRegistry
from llmproxy.proxy.gating.routes import GATED_ROUTES, LLAMACPP_GATED_ROUTES, is_gated
from llmproxy.proxy.http import admin
from llmproxy.proxy.http.handlers import gated
from llmproxy.proxy.http.middleware import proxy_middleware
from llmproxy.proxy.http.passthrough import passthrough
from llmproxy.proxy.http.trust import TRUST, Trust, cors_headers
from llmproxy.proxy.pool.lifecycle import PoolRuntime, running_pool
from llmproxy.proxy.pool.specs import upstream_specs
from llmproxy.proxy.reuse.registry import Generations
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.state import (
    METRICS,
    RELOAD,
    REQUEST_LOG,
    SETTINGS,
    STATE,
    UPSTREAM_URL,
    ProxyState,
)
from llmproxy.proxy.telemetry.metrics import Metrics
from llmproxy.proxy.telemetry.request_log import RequestLog
from llmproxy.proxy.upstream.embedded import BACKEND_KEY, embedded_backend
from llmproxy.proxy.upstreams import UpstreamSpec

log = structlog.get_logger("llmproxy.app")


async def dispatch(request: web.Request) -> web.StreamResponse:
    """Everything the gated routes' own resources do not take: passed through."""
    # the router sends these to dispatch_gated; kept as a guard
    if is_gated(request.method, request.path):
        return await dispatch_gated(request)
    request.app[STATE].jobs.track_current()  # a graceful stop waits for this response too
    return await passthrough(request)


async def dispatch_gated(request: web.Request) -> web.StreamResponse:
    """POST on a route gated on some upstream, as written (the router finds it in its index,
    not by the catch-all's regex); anything else on these paths falls through to
    ``dispatch``. Gated if the upstream in use runs it on a slot (``Dialect.gated_routes``),
    else passed through."""
    st = request.app[STATE]
    st.jobs.track_current()  # a graceful stop waits for this response too
    if request.path not in st.gated_routes():
        return await passthrough(request)
    return await gated(request)


async def _request_log_ctx(app: web.Application) -> AsyncIterator[None]:
    """The canonical request log; registered first, so it is closed (flushed) last."""
    request_log = RequestLog(app[SETTINGS].log_flush_s)
    app[REQUEST_LOG] = request_log
    yield
    request_log.close()


async def _upstream_ctx(app: web.Application) -> AsyncIterator[None]:
    """The upstreams (one is a pool of one), run by the scheduler from start to exit."""
    s = app[SETTINGS]
    embedded = not upstream_specs(s)

    def specs_for(settings: ProxySettings) -> list[UpstreamSpec]:
        if not embedded:
            return upstream_specs(settings)
        # the embedded backend, with the key it was started with, stays what it is
        key = SecretStr(app[BACKEND_KEY])
        return [UpstreamSpec(url=app[UPSTREAM_URL], name="embedded", api_key=key)]

    jobs = JobRegistry()
    generations = Generations(s.reuse_ttl_s, s.reuse_grace_s) if s.type_through == "on" else None
    async with running_pool(s, specs_for(s)) as runtime:
        pool = runtime.pool
        assert pool is not None
        classes: dict[str, tuple[str, ...]] = {
            k.name: tuple(k.classes) for k in s.keys if k.classes
        }
        app[STATE] = ProxyState(s, pool, jobs, app[METRICS], generations, classes)
        app[METRICS].bind_pool(pool)
        app[RELOAD] = lambda new: _reload(runtime, embedded, new, specs_for)
        yield
        pool.close()
        await jobs.drain(0)  # on_shutdown drained already: cut anything that started since


def _reload(
    runtime: PoolRuntime,
    embedded: bool,
    new: ProxySettings,
    specs_for: Callable[[ProxySettings], list[UpstreamSpec]],
) -> None:
    if embedded and upstream_specs(new):
        log.warning(
            "reload: llmproxy runs its own backend; restart it to put upstreams in its place"
        )
    runtime.reload(specs_for(new))


async def _on_shutdown(app: web.Application) -> None:
    """First step of a graceful stop (before aiohttp closes connections): answer everything
    queued with 503, then give in-flight requests (their upstream jobs and their handlers,
    passthroughs included) ``shutdown_timeout_s`` in all and cut what is left (registry.py;
    server.py owns the sequence)."""
    if STATE in app:
        st = app[STATE]
        st.pool.close()
        await st.jobs.drain(st.settings.shutdown_timeout_s)


def build_app(settings: ProxySettings) -> web.Application:
    app = web.Application(middlewares=[proxy_middleware], client_max_size=settings.max_body_bytes)
    app[SETTINGS] = settings
    app[TRUST] = Trust(settings)
    app[METRICS] = Metrics()
    app.on_response_prepare.append(cors_headers)
    app.cleanup_ctx.append(_request_log_ctx)
    specs = upstream_specs(settings)
    if specs:
        app[UPSTREAM_URL] = specs[0].url
    else:
        app.cleanup_ctx.append(embedded_backend)  # sets UPSTREAM_URL once the backend is ready
    app.cleanup_ctx.append(_upstream_ctx)
    app.on_shutdown.append(_on_shutdown)
    admin.add_routes(app)
    for route in sorted(GATED_ROUTES | LLAMACPP_GATED_ROUTES):
        app.router.add_post(route, dispatch_gated)
    app.router.add_route("*", "/{tail:.*}", dispatch)
    return app
