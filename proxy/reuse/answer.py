"""Answering a request from a generation it continues, in the form it asked for.

A stream gets the generation's events from the first one after the typed text (the event
the typed text ends in is cut, see ``Generation.stream_from``), then each new one as it
arrives, and ends when the generation ends; a generation cut short ends it with an error
event in the stream's own format, and then the connection closes without the stream's
terminator, as any failed stream on a completion route (relay/error_event.py). A
non-streaming request waits for the generation's end and gets the body the upstream's
final event gives (``Assembler``) with the typed text taken off the front of ``content``
(``choices[0].text`` on ``/v1/completions``; none where ``response_fields`` left it out),
written compactly as the upstream writes it.

A later keystroke that joins the generation supersedes this request, as a newer request of
the session does (``Generation`` turns): nothing written yet, it is answered ``Superseded``
(499); a stream already started ends with that error event. Only the newest reader's
answer goes on.

A generation that fails before this request was sent a byte (the upstream reset, or the
generation was stopped) answers nothing: ``reused`` returns None and the request goes
through the gate as one of its own, so a keystroke is never failed for a request it did not
send. Unless a newer request of the session has arrived since (``Follow.stale``): this
request is superseded then (``Superseded``, 499), and never supersedes the newer one by
going through the gate after it.

Concurrency contract: runs in the request's handler task; it blocks on the generation
(``Generation.changed``) and on the client's writes, through the request's Responder
(relay/responder.py: the buffer limit and ``client_write_timeout_s``, as a gated answer's).
A client that leaves cancels it, and one dropped for taking nothing ends it; either way the
reader leaves the generation.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from llmproxy.proxy.errors import SUPERSEDED, Superseded
from llmproxy.proxy.relay.assemble import CONTENT_TYPE, Assembler
from llmproxy.proxy.relay.responder import Responder
from llmproxy.proxy.reuse.generation import Generation
from llmproxy.proxy.reuse.registry import Follow
from llmproxy.proxy.telemetry.record import RequestRecord

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def whole(generation: Generation, skip: int) -> tuple[int, bytes]:
    """(status, body) of the non-streaming answer of a request that typed ``skip``
    characters of the generation's text; the generation has ended."""
    if generation.error is not None:
        raise generation.error
    assembler = Assembler(generation.route)
    for event in generation.events:
        assembler.feed(event.raw)
    status, payload = assembler.render()
    if status != 200:
        return status, payload
    obj: Any = json.loads(payload)
    # the typed text off the front of the text, where the body has one (a client's
    # ``response_fields`` may leave ``content`` out, as llama-server then does)
    target = obj["choices"][0] if generation.oai else obj
    key = "text" if generation.oai else "content"
    if isinstance(target.get(key), str):
        target[key] = target[key][skip:]
    return status, json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


async def reused(rec: RequestRecord, out: Responder, follow: Follow) -> web.StreamResponse | None:
    """Answer the request of ``rec`` through ``out`` (its Responder: relay/responder.py, with
    the client write timeout), which continues ``follow.generation`` (the gated handler's
    branch: no permit, no queue); the generation is left once the answer is written or the
    client left. None: the generation failed before the client was sent anything (see
    above)."""
    generation = follow.generation
    try:
        resp = await answer(out, follow, rec)
    except asyncio.CancelledError:
        rec.client_gone = True
        out.detach()
        raise
    finally:
        generation.leave()
    if resp is None:
        return None
    if out.stalled:
        rec.client_gone = True
        rec.error = rec.error or "client took nothing of its response in time: dropped"
    if rec.outcome is None:  # not superseded mid-stream
        rec.outcome = "reused"
        rec.reused_tokens = generation.tokens_after(follow.skip)
    return resp


async def answer(out: Responder, follow: Follow, rec: RequestRecord) -> web.StreamResponse | None:
    """Write the answer of the reader ``follow`` (through ``out``, its record ``rec``) while
    its turn lasts; returns the response (aiohttp's handler result), or None when the
    generation failed before anything was written (``Superseded`` when this request is
    stale, or a newer reader joined first). A client that left or was dropped for taking
    nothing ends the reading."""
    generation, skip, turn = follow.generation, follow.skip, follow.turn
    if not generation.stream:
        while not generation.done:
            if generation.readers != turn:
                raise Superseded(SUPERSEDED)
            await generation.changed()
        if generation.error is not None:
            _raise_if_stale(follow)
            return None
        status, body = whole(generation, skip)
        await out.whole(status, CIMultiDict({"Content-Type": CONTENT_TYPE}), body)
        return await out.outcome()

    async def write(data: bytes) -> None:
        if not out.started:
            await out.head(200, CIMultiDict(SSE_HEADERS), None)
        await out.piece(data)
        if out.ended:  # the client left, or took nothing for the write timeout
            raise _Gone

    try:
        ended = await replay(generation, skip, write, turn)
    except _Gone:
        return await out.outcome()
    error = generation.error if ended else Superseded(SUPERSEDED)
    if not out.started:
        if not ended:
            raise Superseded(SUPERSEDED)
        if error is not None:
            _raise_if_stale(follow)
            return None
        await out.head(200, CIMultiDict(SSE_HEADERS), None)
    if error is not None:
        if not ended:
            rec.outcome = "superseded"
        out.fail(error)  # written as the stream's error event, cut where the route says
    else:
        await out.end()
    return await out.outcome()


async def replay(
    generation: Generation, skip: int, write: Callable[[bytes], Awaitable[None]], turn: int
) -> bool:
    """Write the generation's events for the reader whose ``turn`` it is and that typed
    ``skip`` characters, each new one as it arrives, until the generation has ended and
    every event went out (True), or a newer reader joined (False)."""
    sent = 0
    while True:
        if generation.readers != turn:
            return False
        data, sent = generation.stream_from(sent, skip)
        if data:
            await write(data)
        if sent < len(generation.events):
            continue  # more arrived while that was written
        if generation.done:
            return True
        await generation.changed()


def _raise_if_stale(follow: Follow) -> None:
    """Nothing was written: the request goes on as its own, unless it is stale (above)."""
    if follow.stale():
        raise Superseded(SUPERSEDED)


class _Gone(Exception):
    """The client left, or was dropped for taking nothing: nothing more is written."""
