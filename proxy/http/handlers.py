"""The gated request handler: body -> session -> breaker -> queue -> permit -> job -> relay.

The adapter a request runs with, and so its permit count and its body (``id_slot``), is
the one in use when it is granted (``_Sizing``, the ticket's sizer): the watcher may swap
in the adapter detection found while it waited (upstream/watch.py).

Concurrency contract: the handler task belongs to the client connection (aiohttp runs
with ``handler_cancellation=True``, so a client disconnect cancels it). While queued, a
cancellation abandons the ticket (the request never reaches the upstream). Once the
permit is granted, an UpstreamJob owns it and writes the response through the request's
``Responder`` (upstream/responder.py) while this handler waits for its outcome; a
cancellation then only tells the job that the client left (policy ``on_disconnect``); the
job, not this handler, releases the permit and reports the upstream's health to the
circuit breaker.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from llmproxy.proxy.errors import QueueTimeout
from llmproxy.proxy.gating.sessions import session_key
from llmproxy.proxy.gating.ticket import Ticket
from llmproxy.proxy.http.bodies import parse_json_object, read_body
from llmproxy.proxy.http.granted import Target, continuable, forward_granted
from llmproxy.proxy.http.pooled import pooled
from llmproxy.proxy.reuse.answer import reused
from llmproxy.proxy.reuse.registry import Follow, Waited
from llmproxy.proxy.state import RECORD, STATE, ProxyState
from llmproxy.proxy.twins import twin_key


class _Sizing:
    """A gated request's permit count, asked of the adapter in use when it is asked: at
    admission (a 400 before queueing) and again by the gate at the grant. ``adapter`` is
    the one that answered last, the one the request then runs with from its grant on
    (even if the watcher swaps it again meanwhile)."""

    __slots__ = ("st", "path", "parsed", "adapter")

    def __init__(self, st: ProxyState, path: str, parsed: object) -> None:
        self.st, self.path, self.parsed = st, path, parsed
        self.adapter = st.adapter

    def __call__(self, capacity: int) -> int:
        self.adapter = self.st.adapter
        return self.adapter.permits(self.path, self.parsed, capacity)  # or BadRequest


async def gated(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    s = st.settings
    rec = request[RECORD]
    rec.gated = True
    raw = await read_body(request, s.max_body_bytes, s.body_timeout_s)
    parsed = parse_json_object(raw)
    rec.parsed_body = parsed
    rec.session = session_key(
        parts=s.session_parts,
        header_name=s.session_header,
        headers=request.headers,
        peer=request.remote,
        path=request.path,
        body=parsed,
    )
    supersedable = continuable(s, request.path, parsed)
    first = False  # at the queue's head: it waited on the session's generation already
    if supersedable and st.generations is not None:
        follow = await st.generations.follow(rec.session, request.path, parsed)  # may wait
        if isinstance(follow, Follow):
            resp = await reused(st, request, follow)
            if resp is not None:
                return resp  # else the generation failed first: this request runs on its own
        first = isinstance(follow, Waited)
    if st.pool is not None:
        return await pooled(st, request, raw, supersedable, first)
    sizing = _Sizing(st, request.path, parsed)
    rec.permits = permits = sizing(st.gate.total)  # or BadRequest
    probe = st.breaker.admit()  # raises UpstreamUnavailable (503) while the breaker is open
    try:
        ticket = st.gate.submit(
            rec.session,
            supersedable=supersedable,
            route=request.path,
            twin=twin_key(request.path, parsed) if supersedable else None,
            permits=permits,
            sizer=sizing,
            first=first,
        )
        await _wait_for_permit(st, ticket, request)
    except BaseException:
        st.breaker.neutral(probe)
        raise
    rec.permits = ticket.permits
    return await forward_granted(
        st, Target(st.gate, st.breaker, sizing.adapter), ticket, request, raw, probe
    )


async def _wait_for_permit(st: ProxyState, ticket: Ticket, request: web.Request) -> None:
    rec = request[RECORD]
    timeout = st.settings.queue_timeout_s
    try:
        if ticket.future.done():  # granted at submit (the common case): no timer to arm
            ticket.future.result()
        else:
            async with asyncio.timeout(timeout):
                await ticket.wait()
    except TimeoutError:
        st.gate.abandon(ticket)
        raise QueueTimeout(f"no permit within {timeout:g}s") from None
    except asyncio.CancelledError:
        st.gate.abandon(ticket)
        rec.client_gone = True
        rec.outcome = "cancelled_queued"
        raise
    rec.queue_wait_s = time.monotonic() - ticket.created
