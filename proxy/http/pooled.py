"""The gated handler's path through the scheduler (pool/pool.py, one upstream or several):
its queue, then the upstream the request was granted on (granted.py). The model it asks
for (pool/models.py) is the record's from before it is admitted, so a refused one names it.

Failover: a request whose connection to its upstream could not be made (refused,
unreachable, connect timeout: none of its bytes left) goes to another upstream in rotation,
once, at the head of the queue. Never once it may have reached one: no generation runs twice.

Concurrency contract: the handler task belongs to the client connection; while queued a
cancellation abandons the pool entry (pool.py), from the grant on the upstream job owns the
permits (granted.py).
"""

from __future__ import annotations

import asyncio
import functools
import time

from aiohttp import web

from llmproxy.proxy.errors import UpstreamConnectTimeout, UpstreamUnreachable
from llmproxy.proxy.http.granted import Target, forward_granted
from llmproxy.proxy.pool.member import Member
from llmproxy.proxy.pool.models import asked
from llmproxy.proxy.request import GatedRequest
from llmproxy.proxy.state import RECORD, ProxyState


async def pooled(
    st: ProxyState, request: web.Request, req: GatedRequest, first: bool = False
) -> web.StreamResponse:
    """``req``, read from ``request``; ``first``: at the queue's head (see ``Pool.submit``)."""
    rec = request[RECORD]
    member, resp = await _once(st, request, req, None, first)
    if resp is None:  # nothing of it left: once more, on another upstream
        rec.upstream_error, rec.upstream_status, rec.failover = None, None, member.name
        _, resp = await _once(st, request, req, member)
        assert resp is not None
    return resp


async def _once(
    st: ProxyState,
    request: web.Request,
    req: GatedRequest,
    exclude: Member | None,
    first: bool = False,
) -> tuple[Member, web.StreamResponse | None]:
    """One try: (the upstream, the response; None if it failed before anything was sent and
    another try may go elsewhere)."""
    rec = request[RECORD]
    path, parsed = req.route, req.body

    def sizing(m: Member, capacity: int) -> int:
        return m.adapter.permits(path, parsed, capacity)  # or BadRequest

    model = asked(path, parsed, st.settings.default_model, st.pool.members)
    rec.model = model
    rec.model_listed = model is not None and any(model in m.models for m in st.pool.members)

    entry = st.pool.submit(
        req.session,
        supersedable=req.continuable,
        route=path,
        parsed=parsed,
        sizing=sizing,
        klass=req.klass,
        caller=req.caller,
        model=model,
        twin=req.twin,
        exclude=exclude,
        first=first,
    )
    try:
        placement = await st.pool.acquire(entry, st.settings.queue_timeout_s)
    except asyncio.CancelledError:
        rec.client_gone = True
        rec.outcome = "cancelled_queued"
        raise
    m = placement.member
    rec.queue_wait_s = time.monotonic() - entry.created
    rec.permits = placement.ticket.permits
    rec.upstream_name, rec.route_decision = m.name, placement.decision
    if placement.adapter.cold():  # a router's model it does not run: loaded for this one
        rec.model_loading = True
        m.model_loads += 1
    target = Target(m.gate, m.breaker, placement.adapter)
    # a preempted request's new permits: the scheduler's, asked by its job
    resume = functools.partial(st.pool.again, entry)
    preemptible = st.settings.preempt != "off" and req.klass in ("chat", "bulk")
    try:
        resp = await forward_granted(
            st,
            target,
            placement.ticket,
            request,
            req,
            placement.probe,
            resume if preemptible else None,
        )
    except (UpstreamUnreachable, UpstreamConnectTimeout):
        others = [o for o in st.pool.rotation() if o is not m]
        if exclude is not None or rec.sent or not others:
            raise  # the error as it is: nowhere else to go
        return m, None
    _learn(m, rec.upstream_ttfb_s, entry.prompt_chars - placement.cached_chars)
    return m, resp


def _learn(member: Member, ttfb_s: float | None, uncached_chars: int) -> None:
    if ttfb_s is not None:
        member.learn_prefill(uncached_chars, ttfb_s)
