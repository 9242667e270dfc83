"""Running a request that holds its permits: its upstream job, and its handler's wait for the
response (the last part of the gated handler).

Concurrency contract: see handlers.py. The job owns the permits from ``UpstreamJob``'s
construction on; this handler only waits for the outcome and tells the job if its client
left.
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

from aiohttp import web

from llmproxy.proxy.errors import ProxyError
from llmproxy.proxy.gating.breaker import CircuitBreaker
from llmproxy.proxy.gating.gate import Gate
from llmproxy.proxy.gating.ticket import Ticket
from llmproxy.proxy.http.trust import TRUST
from llmproxy.proxy.relay.responder import Responder
from llmproxy.proxy.request import GatedRequest
from llmproxy.proxy.state import RECORD, ProxyState
from llmproxy.proxy.upstream.adapters.base import Adapter
from llmproxy.proxy.upstream.headers import request_headers
from llmproxy.proxy.upstream.job import Resume, UpstreamJob


class Target(NamedTuple):
    """Where a granted request runs: its upstream's gate, breaker and adapter."""

    gate: Gate
    breaker: CircuitBreaker
    adapter: Adapter


async def forward_granted(
    st: ProxyState,
    target: Target,
    ticket: Ticket,
    request: web.Request,
    req: GatedRequest,
    probe: bool,
    resume: Resume | None = None,
) -> web.StreamResponse:
    """``req``, read from ``request``; ``resume``: how the job gets permits again if its
    request is preempted (job.py)."""
    s = st.settings
    adapter = target.adapter
    rec = request[RECORD]
    out = Responder(
        request,
        rec.request_id,
        buffer_bytes=s.client_buffer_bytes,
        write_timeout_s=s.client_write_timeout_s,
    )
    try:
        job = UpstreamJob(  # takes the permit (raises Superseded if replaced since the grant)
            gate=target.gate,
            ticket=ticket,
            adapter=adapter,
            request=req,
            headers=request_headers(request.headers, strip=request.app[TRUST].strip),
            out=out,
            record=rec,
            metrics=st.metrics,
            breaker=target.breaker,
            breaker_probe=probe,
            supersede_policy=st.policy(s.supersede_inflight, adapter, req.route, req.body),
            disconnect_policy=st.policy(s.on_disconnect, adapter, req.route, req.body),
            unconfirmed_hold_s=s.unconfirmed_cancel_hold_s,
            generations=st.generations if req.continuable else None,
            resume=resume,
        )
    except BaseException:
        target.breaker.neutral(probe)
        raise
    rec.slot = job.slot
    rec.add_ref()
    st.jobs.spawn(job.run())
    try:
        resp = await out.outcome()
    except (asyncio.CancelledError, ConnectionResetError):
        # CancelledError: aiohttp noticed the disconnect; ConnectionResetError: the client's
        # connection closed under a write before anything was sent.
        rec.client_gone = True
        job.client_gone()
        raise
    except ProxyError:
        raise  # an error before the response started: the middleware answers with the envelope
    if out.gone:  # the connection closed under a write, before aiohttp noticed
        rec.client_gone = True
        job.client_gone()
    return resp
