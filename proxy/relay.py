"""Writing an upstream response to the client: headers, chunks unbuffered, stream errors.

Bytes pass through as received (no re-encoding, no buffering): each chunk is written as
soon as it arrives. Once the response has started, its status cannot change, so a later
error ends the stream with an error event in the stream's own format (SSE ``data:`` line
or NDJSON line); for other bodies the connection is closed so the client sees a
truncated response rather than a silently short one.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from aiohttp import web

from llmproxy.proxy.channel import Channel, Chunk, End, Error, Event, Headers
from llmproxy.proxy.errors import ProxyError
from llmproxy.proxy.state import RECORD


def stream_error_bytes(content_type: str, error: ProxyError, tail: bytes = b"") -> bytes | None:
    """The event that ends a started stream with ``error``, in the stream's own format.

    SSE (llama.cpp, OpenAI): a ``data:`` line holding the error envelope, the shape those
    servers use for their own in-stream errors. NDJSON (Ollama): Ollama's own error line,
    whose ``error`` is the message string (its clients raise ``Error(line.error)``: an object
    there reads "[object Object]"), with the envelope's other fields beside it. None for any
    other body: it has no error event.

    ``tail``: the last bytes relayed before. An upstream cut inside an event or line leaves
    it unfinished; it is ended first (line feeds), so the error event stands on its own and
    parses, instead of being glued onto the broken one.
    """
    if content_type.startswith("text/event-stream"):
        payload = json.dumps(error.envelope(), separators=(",", ":"))
        return _end_event(tail) + f"data: {payload}\n\n".encode()
    if content_type in ("application/x-ndjson", "application/jsonl", "application/json-seq"):
        fields = error.envelope()["error"]
        line = {"error": fields["message"]} | {k: v for k, v in fields.items() if k != "message"}
        rs = "\x1e" if content_type == "application/json-seq" else ""  # RFC 7464 record separator
        newline = b"" if not tail or tail.endswith(b"\n") else b"\n"
        return newline + (rs + json.dumps(line, separators=(",", ":")) + "\n").encode()
    return None


def _end_event(tail: bytes) -> bytes:
    """Line feeds that end an SSE event left open by ``tail`` (nothing at an event boundary)."""
    if not tail or tail.endswith((b"\n\n", b"\r\r", b"\r\n\r\n")):
        return b""
    return b"\n" if tail.endswith(b"\n") else b"\n\n"  # after a lone "\r", a "\n" would join it


async def relay(request: web.Request, events: AsyncIterator[Event]) -> web.StreamResponse:
    """Write ``events`` (Headers, Chunk*, End|Error) as the response to ``request``.

    When ``events`` is a ``Channel`` that already holds the whole body behind the headers
    (a non-streamed response that arrived at once), the result is a plain ``web.Response``
    that aiohttp writes as one piece (status line, headers and body in one send); the body
    bytes are the same. Otherwise headers go out at once and each chunk as it comes; a
    last chunk whose clean end is already here goes out with the stream's terminator.
    """
    resp: web.StreamResponse | None = None
    tail = b""  # the last bytes written (up to 4): where an error event must start
    buffered = events if isinstance(events, Channel) else None  # can tell what is already here
    async for ev in events:
        if isinstance(ev, Headers):
            whole = buffered.take_complete_body() if buffered is not None else None
            if whole is not None:
                return web.Response(status=ev.status, headers=ev.headers, body=whole)
            ev.headers["X-Request-Id"] = request[RECORD].request_id  # ours, as in the log line (see middleware)
            resp = web.StreamResponse(status=ev.status, headers=ev.headers)
            if ev.content_length is not None:
                resp.content_length = ev.content_length
            await resp.prepare(request)
        elif isinstance(ev, Chunk):
            assert resp is not None
            if buffered is not None and buffered.take_end_if_next():
                await resp.write_eof(ev.data)  # the last chunk and the terminator in one write
                return resp
            await resp.write(ev.data)
            tail = ev.data[-4:] if len(ev.data) >= 4 else (tail + ev.data)[-4:]
        elif isinstance(ev, End):
            if resp is None:
                raise ProxyError("upstream ended without a response")
            await resp.write_eof()
            return resp
        elif isinstance(ev, Error):
            if resp is None:
                raise ev.error
            last = stream_error_bytes(resp.content_type, ev.error, tail)
            if last is not None:
                await resp.write(last)
                await resp.write_eof()
            else:
                resp.force_close()
                if request.transport is not None:
                    request.transport.close()
            return resp
    raise ProxyError("upstream event stream ended early")
