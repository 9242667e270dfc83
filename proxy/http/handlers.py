"""The gated request handler: the request read once (``GatedRequest``, proxy/request.py) ->
type-through -> scheduler -> job -> relay.

The adapter a request runs with, and so its permit count and its body (``id_slot``), is
the one in use on its upstream when it is granted (pool/grant.py): the watcher may swap in
the adapter detection found while it waited (upstream/watch.py).

Concurrency contract: the handler task belongs to the client connection (aiohttp runs
with ``handler_cancellation=True``, so a client disconnect cancels it). While queued, a
cancellation abandons the ticket (the request never reaches the upstream). Once the
permit is granted, an UpstreamJob owns it and writes the response through the request's
``Responder`` (relay/responder.py) while this handler waits for its outcome; a
cancellation then only tells the job that the client left (policy ``on_disconnect``); the
job, not this handler, releases the permit and reports the upstream's health to the
circuit breaker.
"""

from __future__ import annotations

from aiohttp import web

from llmproxy.proxy.gating.classes import HEADER, request_class
from llmproxy.proxy.gating.sessions import is_warmup, session_key
from llmproxy.proxy.http.bodies import parse_json_object, read_body
from llmproxy.proxy.http.pooled import pooled
from llmproxy.proxy.http.trust import CALLER
from llmproxy.proxy.relay.responder import Responder
from llmproxy.proxy.request import Body, GatedRequest
from llmproxy.proxy.reuse.answer import reused
from llmproxy.proxy.reuse.registry import Follow, Waited
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.state import RECORD, STATE
from llmproxy.proxy.twins import twin_key


async def gated(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    rec = request[RECORD]
    rec.gated = True
    req = await gated_request(request)
    rec.session, rec.request_class = req.session, req.klass
    first = False  # at the queue's head: it waited on the session's generation already
    if req.continuable and st.generations is not None:
        follow = await st.generations.follow(req.session, req.route, req.body, req.twin)
        if isinstance(follow, Follow):
            # answered from a generation: it supersedes the session's queued requests as
            # any newer request does, whatever the in-flight policy
            st.pool.supersede_queued(req.session, req.twin)
            out = Responder(
                request,
                rec.request_id,
                buffer_bytes=st.settings.client_buffer_bytes,
                write_timeout_s=st.settings.client_write_timeout_s,
            )
            resp = await reused(rec, out, follow)
            if resp is not None:
                return resp  # else the generation failed first: this request runs on its own
        first = isinstance(follow, Waited)
    return await pooled(st, request, req, first)


async def gated_request(request: web.Request) -> GatedRequest:
    """The request as the proxy reads it (request.py), built once: its body read and
    parsed (400, 408, 413 as bodies.py says), its session and class."""
    st = request.app[STATE]
    s = st.settings
    raw = await read_body(request, s.max_body_bytes, s.body_timeout_s)
    body = parse_json_object(raw)
    caller = request.get(CALLER)
    request[RECORD].caller = caller
    return GatedRequest(
        method=request.method,
        route=request.path,
        raw_path=request.raw_path,
        raw=raw,
        body=body,
        session=session_key(
            parts=s.session_parts,
            header_name=s.session_header,
            headers=request.headers,
            peer=request.remote,
            path=request.path,
            body=body,
        ),
        klass=request_class(
            request.path, request.headers.get(HEADER), st.key_classes.get(caller or "")
        ),
        caller=caller or request.remote or "",
        continuable=continuable(s, request.path, body),
        twin=twin_key(request.path, body),
    )


def continuable(s: ProxySettings, path: str, parsed: Body) -> bool:
    """May later keystrokes continue this request's generation (type-through)?"""
    return s.supersede and path in s.supersede_routes and not is_warmup(parsed)
