"""Builds the proxy's aiohttp Application: wiring only (routes, middleware, lifecycle)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import structlog
from aiohttp import web
from pydantic import SecretStr

from llmproxy.proxy.gating.breaker import CircuitBreaker
from llmproxy.proxy.gating.gate import Gate
from llmproxy.proxy.gating.registry import JobRegistry
from llmproxy.proxy.gating.routes import GATED_ROUTES, LLAMACPP_GATED_ROUTES, is_gated
from llmproxy.proxy.http import admin
from llmproxy.proxy.http.handlers import gated
from llmproxy.proxy.http.middleware import proxy_middleware
from llmproxy.proxy.http.passthrough import passthrough
from llmproxy.proxy.http.trust import TRUST, Trust, cors_headers
from llmproxy.proxy.pool.lifecycle import running_pool
from llmproxy.proxy.pool.specs import UpstreamSpec, settings_for, upstream_specs
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
from llmproxy.proxy.upstream.detect import create_adapter
from llmproxy.proxy.upstream.embedded import BACKEND_KEY, embedded_backend
from llmproxy.proxy.upstream.session import open_session
from llmproxy.proxy.upstream.watch import gate_capacity, watching

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
    ``dispatch``. Gated if the upstream in use runs it on a slot (``Adapter.gated_routes``),
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
    s = app[SETTINGS]
    specs = upstream_specs(s)
    jobs = JobRegistry()
    generations = Generations(s.reuse_ttl_s, s.reuse_grace_s) if s.type_through == "on" else None
    if len(specs) > 1 or s.upstreams:  # [[upstreams]] tables: a pool, even of one
        async with running_pool(s, specs) as runtime:
            pool = runtime.pool
            assert pool is not None
            first = pool.members[0]
            app[STATE] = ProxyState(
                s, first.session, first.adapter, first.gate, jobs, app[METRICS], first.breaker,
                generations, pool=pool,
            )  # fmt: skip
            app[METRICS].bind_pool(pool)
            app[RELOAD] = lambda new: runtime.reload(upstream_specs(new))
            yield
            pool.close()
            await jobs.drain(0)  # on_shutdown drained already: cut anything that started since
        return
    app[RELOAD] = lambda new: _reload_one(specs, upstream_specs(new))
    if specs:
        own = settings_for(s, specs[0])
    else:  # the embedded backend, with the key it was started with
        own = s.model_copy(update={"upstream_api_key": SecretStr(app[BACKEND_KEY])})
    async with open_session(own) as session:
        adapter = await create_adapter(session, own, app[UPSTREAM_URL])
        gate = Gate(
            gate_capacity(own, adapter),
            own.max_queue,
            retry_after_s=own.retry_after_s,
            affinity_wait_s=own.affinity_wait_s,
            hold_s=own.queue_hold_s,
        )
        app[METRICS].bind_gate(gate)
        breaker = CircuitBreaker(own.breaker_threshold, own.breaker_cooldown_s)
        app[METRICS].bind_breaker(breaker)
        app[STATE] = ProxyState(
            own, session, adapter, gate, jobs, app[METRICS], breaker, generations
        )
        async with watching(app[STATE]):  # learns what detection could not, while serving
            yield
        gate.close()
        await jobs.drain(0)  # on_shutdown drained already: cut anything that started since
        app[STATE].adapter.close()  # the one in use (the watcher may have replaced detection's)


def _reload_one(specs: list[UpstreamSpec], new: list[UpstreamSpec]) -> None:
    """One ``--upstream`` (or the embedded backend) runs without a pool: its upstream stays."""
    if new != specs:
        log.warning(
            "reload: the upstreams change only in a pool (several, or [[upstreams]] tables); "
            "restart llmproxy to change them",
            configured=[x.label for x in new],
        )
    else:
        log.info("reload: the upstreams are unchanged")


async def _on_shutdown(app: web.Application) -> None:
    """First step of a graceful stop (before aiohttp closes connections): answer everything
    queued with 503, then give in-flight requests (their upstream jobs and their handlers,
    passthroughs included) ``shutdown_timeout_s`` in all and cut what is left (registry.py;
    server.py owns the sequence)."""
    if STATE in app:
        st = app[STATE]
        if st.pool is not None:
            st.pool.close()
        st.gate.close()
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
