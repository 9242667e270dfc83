"""Writing an upstream response to the client: headers, pieces unbuffered, and how it ends.

Bytes pass through as received (no re-encoding, no buffering): each piece is written as
soon as it arrives. A body that arrived whole with the upstream's head goes out with the
status line and headers in one write; a stream's last piece goes out with its
terminator. Once the response has started its status cannot change, so a later error ends
the stream with an error event in the stream's own format (SSE ``data:`` line or NDJSON
line); for other bodies, and for any body of fixed length (Content-Length), the connection
is closed so the client sees a truncated response rather than a silently short one.

Concurrency contract (``Responder``):
- One writer task at a time calls ``whole``/``head``/``piece``/``end``: a gated request's
  upstream job, or a passthrough's handler. They block only on the client's flow control
  (a reader slower than the upstream holds the writer back, as a full socket should).
- Client-side failures never raise: a write that finds the client's connection closed, or
  ``detach()`` (the handler was cancelled: the client left), turns every later write into
  a no-op that returns at once, so a job that drains a generation never waits on a reader
  that is gone, and resolves ``outcome``.
- ``fail(error)`` never blocks and writes nothing: the request's handler, waiting in
  ``outcome()``, raises it (nothing sent yet: the middleware answers in the envelope) or
  writes the error event itself. So a job cut at shutdown, which cannot await a write in
  its ``finally``, still gets its error to the client through the handler, which lives
  until then (registry.py gives handlers a grace period for it).
- A writer cancelled while it waits for a slow client to read (a job's ``stop()``, the
  shutdown cut) has put its bytes in the transport already (``_tail`` counts them), but
  its cancellation also cancels aiohttp's flow-control future, which every writer on the
  connection shares: the handler's error write that follows then closes the connection
  once its bytes are out, instead of waiting on that future.
- The first ending wins (complete, failed or client gone); later ones are ignored.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from multidict import CIMultiDict

from llmproxy.proxy.errors import ProxyError


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


class Responder:
    """The response to one client request, written as the upstream's arrives (see the
    module's contract). ``request_id`` goes out as ``X-Request-Id``, as in the log line."""

    __slots__ = ("_request", "_request_id", "_resp", "_tail", "_last_write", "_ended", "_error", "gone")

    def __init__(self, request: web.Request, request_id: str) -> None:
        self._request = request
        self._request_id = request_id
        self._resp: web.StreamResponse | None = None
        self._tail = b""  # the last bytes written (up to 4): where an error event must start
        self._last_write = False  # the body's end was (being) written: no event can follow it
        self._ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._error: ProxyError | None = None
        self.gone = False  # the client's connection closed under a write, or detach()

    @property
    def started(self) -> bool:
        """Has the status gone out (so an error can only end the stream)?"""
        return self._resp is not None

    @property
    def ended(self) -> bool:
        return self._ended.done()

    # -- the writer's side ----------------------------------------------------------------
    async def whole(self, status: int, headers: CIMultiDict[str], body: bytes) -> None:
        """A body that is all here: status line, headers and body in one write."""
        if self._stopped():
            return
        headers["X-Request-Id"] = self._request_id
        resp = web.Response(status=status, headers=headers, body=body)
        self._last_write = True
        try:
            await resp.prepare(self._request)
            self._resp = resp
            await resp.write_eof()
        except ConnectionError:
            self.detach()
            return
        self._end()

    async def head(self, status: int, headers: CIMultiDict[str], content_length: int | None) -> None:
        """Start a response whose body follows in pieces."""
        if self._stopped():
            return
        headers["X-Request-Id"] = self._request_id
        resp = web.StreamResponse(status=status, headers=headers)
        if content_length is not None:
            resp.content_length = content_length
        try:
            await resp.prepare(self._request)
        except ConnectionError:
            self.detach()
            return
        self._resp = resp

    async def piece(self, data: bytes) -> None:
        """One piece of the body, as it came (after ``head``)."""
        if self._stopped():
            return
        assert self._resp is not None
        # Before the write: its bytes are in the transport even if a stop() cuts the wait
        # for the client to read them, and an error event must start after them.
        self._tail = data[-4:] if len(data) >= 4 else (self._tail + data)[-4:]
        try:
            await self._resp.write(data)
        except ConnectionError:
            self.detach()

    async def end(self, last: bytes = b"") -> None:
        """The body's end, with its ``last`` piece if there is one (one write, after ``head``)."""
        if self._stopped():
            return
        assert self._resp is not None
        self._last_write = True
        try:
            await self._resp.write_eof(last)
        except ConnectionError:
            self.detach()
            return
        self._end()

    def fail(self, error: ProxyError) -> None:
        """End with ``error`` (the handler answers or writes it; see the contract)."""
        if not self._ended.done():
            self._error = error
            self._ended.set_result(None)

    def detach(self) -> None:
        """The client left (the handler was cancelled, or a write found the connection
        closed): later writes are no-ops."""
        self.gone = True
        self._end()

    def _stopped(self) -> bool:
        return self.gone or self._ended.done()

    def _end(self) -> None:
        if not self._ended.done():
            self._ended.set_result(None)

    # -- the handler's side ---------------------------------------------------------------
    async def outcome(self) -> web.StreamResponse:
        """Wait for the end; the response (already written) for aiohttp to finish, or the
        ProxyError to answer with when nothing was sent. A failure after the start is
        written here as the stream's last event (or the connection is closed)."""
        await self._ended
        resp, error = self._resp, self._error
        if resp is None:
            if error is not None:
                raise error
            raise ConnectionResetError("client gone before the response started")
        if error is not None and not self.gone:
            # Nothing can follow the body's end once it went out (a cut while it drained), nor
            # fit in a body of fixed length: the event would be clipped to the bytes still owed.
            fixed = self._last_write or resp.content_length is not None
            last = None if fixed else stream_error_bytes(resp.content_type, error, self._tail)
            try:
                if last is not None:
                    await resp.write(last)
                    await resp.write_eof()
                else:
                    self._close()
            except ConnectionError:
                self.gone = True
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise  # this handler's own cancellation: the client left, or the shutdown cut
                # Not ours to take: the job was stopped while it waited for this client to
                # read, and aiohttp's flow-control future, shared by every writer on the
                # connection, was cancelled with it. The event is in the transport; nothing
                # can wait for the client here, so the connection ends once it is sent.
                self._close()
        return resp

    def _close(self) -> None:
        """A body with no error event: cut it, so the client sees it truncated."""
        assert self._resp is not None
        self._resp.force_close()
        if self._request.transport is not None:
            self._request.transport.close()
