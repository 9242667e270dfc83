"""``GET /llmproxy/events``: the live page's server-sent-events stream.

Each connected page is served by its own handler task (aiohttp's, cancelled when the page
leaves: ``handler_cancellation``), which every ``INTERVAL_S`` takes the picture
(picture.py) and writes what changed since its last write: first ``event: picture`` (all
of it), then ``event: change`` (the sections that differ, and the requests finished since).
Nothing changed: nothing written, but a comment line every ``KEEPALIVE_S``. So with no page
open this costs nothing at all, and with one open a snapshot of a few dozen objects four
times a second, on the event loop.

Bounded: at most ``MAX_PAGES`` streams at once (more get 503); a page that takes no bytes
for ``WRITE_TIMEOUT_S`` (its buffer full) is dropped, its connection aborted. ``Pages.close``
(the app's on_shutdown) ends every stream at once, so a graceful stop never waits on a
page. Same rules as every route (trust.py): the key, when keys are configured, comes in a
header, never in the URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import structlog
from aiohttp import web

from llmproxy.proxy.errors import HTTPStatusError
from llmproxy.proxy.http.picture import picture
from llmproxy.proxy.state import RECORD, STATE

log = structlog.get_logger("llmproxy.events")

INTERVAL_S = 0.25
KEEPALIVE_S = 15.0
WRITE_TIMEOUT_S = 5.0
MAX_PAGES = 8
_SECTIONS = ("upstreams", "queue", "counters")


class Pages:
    """The open event streams (a count, capped) and the app-wide stop signal."""

    def __init__(self, cap: int = MAX_PAGES) -> None:
        self.cap = cap
        self.open = 0
        self.closing = asyncio.Event()

    def close(self) -> None:
        self.closing.set()


PAGES = web.AppKey("pages", Pages)


async def close_pages(app: web.Application) -> None:
    """on_shutdown: every stream ends at its next tick (at most INTERVAL_S)."""
    app[PAGES].close()


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def events(request: web.Request) -> web.StreamResponse:
    """Blocks for as long as the page stays (or until the app stops)."""
    pages = request.app[PAGES]
    if pages.open >= pages.cap:
        raise HTTPStatusError(503, f"at most {pages.cap} pages may watch at once")
    pages.open += 1
    try:
        return await _stream(request, pages)
    finally:
        pages.open -= 1
        # a page that leaves ends its stream as it should: logged as completed, not cancelled
        request[RECORD].outcome = "completed"


async def _stream(request: web.Request, pages: Pages) -> web.StreamResponse:
    st = request.app[STATE]
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-store",
            "X-Accel-Buffering": "no",
        }
    )
    await resp.prepare(request)
    loop = asyncio.get_running_loop()
    last: dict[str, Any] = {}
    seq, quiet_since = 0, loop.time()
    while not pages.closing.is_set():
        pic = picture(st, seq)
        if not last:
            chunk = _event("picture", pic)
        else:
            change = {k: pic[k] for k in _SECTIONS if pic[k] != last[k]}
            if pic["timeline"]:
                change["timeline"] = pic["timeline"]
            chunk = _event("change", change) if change else b""
        seq, last = pic["seq"], pic
        if not chunk and loop.time() - quiet_since >= KEEPALIVE_S:
            chunk = b": keepalive\n\n"
        if chunk:
            quiet_since = loop.time()
            try:
                async with asyncio.timeout(WRITE_TIMEOUT_S):
                    await resp.write(chunk)
            except TimeoutError:
                log.warning("page dropped: it read nothing", timeout_s=WRITE_TIMEOUT_S)
                if request.transport is not None:
                    request.transport.abort()
                return resp
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(INTERVAL_S):
                await pages.closing.wait()
    return resp
