"""Writing an upstream response to the client: headers, pieces as they come, and how it ends.

Bytes pass through as received (no re-encoding): each piece is written as soon as it
arrives. What the client has not taken yet waits in its connection's send buffer, up to
``buffer_bytes`` per response (``client_buffer_bytes``; the transport's high-water mark),
so the writer can read its upstream to the end without waiting for a slower client. A
body that arrived whole with the upstream's head goes out with the status line and
headers in one write; a stream's last piece goes out with its terminator. Once the
response has started its status cannot change, so a later error ends the stream with an
error event in the stream's own format (SSE ``data:`` line or NDJSON line: error_event.py),
then, on completion routes, with the connection closed before the stream's terminator (no
editor client takes a cut stream for a suggestion then: error_event.py); for other
bodies, and for any body of fixed length (Content-Length), the connection is closed so the
client sees a truncated response rather than a silently short one.

Concurrency contract (``Responder``):
- One writer task at a time calls ``whole``/``head``/``piece``/``end``: a gated request's
  upstream job, or a passthrough's handler. They block only once ``buffer_bytes`` wait
  for the client (flow control), and then for at most ``write_timeout_s`` in which the
  client takes no byte: such a client is dropped (its connection aborted, as ``detach``
  with the connection closed; ``stalled``), and the write returns. ``whole`` and ``end``
  then wait, the same way, until the client took what is still buffered (after the
  outcome is resolved: the handler does not wait for it). The timer is a loop callback
  (stall.py), not a task.
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
import contextlib

from aiohttp import web
from multidict import CIMultiDict

from llmproxy.proxy.errors import ProxyError
from llmproxy.proxy.relay.error_event import cuts_after_error
from llmproxy.proxy.relay.error_event import (
    stream_error_bytes as stream_error_bytes,  # others import it from here too
)
from llmproxy.proxy.relay.stall import NO_GUARD, Stall


class Responder:
    """The response to one client request, written as the upstream's arrives (see the
    module's contract). ``request_id`` goes out as ``X-Request-Id``, as in the log line."""

    __slots__ = (
        "_request",
        "_request_id",
        "_resp",
        "_tail",
        "_last_write",
        "_ended",
        "_error",
        "gone",
        "_buffer_bytes",
        "_write_timeout_s",
        "stalled",
    )

    def __init__(
        self,
        request: web.Request,
        request_id: str,
        *,
        buffer_bytes: int | None = None,
        write_timeout_s: float | None = None,
    ) -> None:
        """``buffer_bytes``: the most of this response left waiting for the client before a
        write waits (None: the transport's default). ``write_timeout_s``: drop a client that
        takes no byte for this long while a write waits (None: never)."""
        self._request = request
        self._request_id = request_id
        self._buffer_bytes = buffer_bytes
        self._write_timeout_s = write_timeout_s
        self.stalled = False  # dropped for taking nothing for write_timeout_s
        transport = request.transport
        if buffer_bytes is not None and transport is not None and not transport.is_closing():
            transport.set_write_buffer_limits(high=buffer_bytes)
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
            async with self._guard(len(body) + 4096):  # 4096: the head
                await resp.prepare(self._request)
                self._resp = resp
                await resp.write_eof()
        except ConnectionError:
            self.detach()
            return
        self._end()
        await self._flush()

    async def head(
        self, status: int, headers: CIMultiDict[str], content_length: int | None
    ) -> None:
        """Start a response whose body follows in pieces."""
        if self._stopped():
            return
        headers["X-Request-Id"] = self._request_id
        resp = web.StreamResponse(status=status, headers=headers)
        if content_length is not None:
            resp.content_length = content_length
        try:
            async with self._guard(4096):
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
            async with self._guard(len(data)):
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
            async with self._guard(len(last)):
                await self._resp.write_eof(last)
        except ConnectionError:
            self.detach()
            return
        self._end()
        await self._flush()

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

    def _guard(self, size: int = 0) -> contextlib.AbstractAsyncContextManager[None]:
        """The stall timer around a write of ``size`` bytes; none where that write cannot
        wait (it stays under the buffer's high-water mark: the common case, no timers)."""
        timeout_s = self._write_timeout_s
        if timeout_s is None:
            return NO_GUARD
        transport = self._request.transport
        if self._buffer_bytes is not None and transport is not None:
            # 64: chunk framing
            if transport.get_write_buffer_size() + size + 64 <= self._buffer_bytes:
                return NO_GUARD
        return Stall(self._request, timeout_s, self._drop)

    async def _flush(self) -> None:
        """After the end: wait until the client took what is still buffered for it, so that
        one that takes nothing for ``write_timeout_s`` is dropped rather than left holding
        its buffer (the handler may have returned already: this is the writer's wait)."""
        transport, timeout_s = self._request.transport, self._write_timeout_s
        if timeout_s is None or transport is None or not transport.get_write_buffer_size():
            return
        transport.set_write_buffer_limits(high=0)  # paused until everything is out
        try:
            async with Stall(self._request, timeout_s, self._drop):
                await self._request.writer.drain()
        except ConnectionError:
            self.gone = True
        finally:
            if not transport.is_closing():
                transport.set_write_buffer_limits(high=self._buffer_bytes)

    def _drop(self) -> None:
        """The client took nothing for ``write_timeout_s``: abort its connection (its unsent
        bytes are dropped) and stop writing."""
        self.stalled = True
        transport = self._request.transport
        if transport is not None:
            transport.abort()
        self.detach()

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
                    async with self._guard(len(last)):
                        await resp.write(last)
                        if cuts_after_error(self._request.path):
                            self._close()  # once the event is out: no terminator
                        else:
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
