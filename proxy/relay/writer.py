"""Writing an exchange's events (events.py) to the client, through its ``Responder``.

- ``Head``: the status line and headers go out at once, unless the body came whole with it
  (it then goes out with them in one write, at ``End``), or the answer is assembled, or
  the response has started already (a preempted generation's continuation: the client
  reads one answer).
- ``Piece``: written as it came; for a resumable stream (``whole_events``) only the whole
  events it completes, so that a cut stream never leaves half an event with the client.
- ``End``: the last piece goes out with the terminator. An answer assembled for a client
  that asked for no stream (``assembler``: assemble.py) goes out whole, rendered from the
  stream's events; any other answer (an error before streaming) is relayed as it came.

Concurrency contract: the one writer task of the response (an upstream job, or a
passthrough's handler) calls ``write`` with each event in order; it blocks as the
Responder's writes do (flow control, the stall guard), never raises for a client that left,
and raises UpstreamFailed when an assembled stream ended without its final event.
"""

from __future__ import annotations

from llmproxy.proxy.relay.assemble import CONTENT_TYPE, Assembler
from llmproxy.proxy.relay.events import End, Head, Piece
from llmproxy.proxy.relay.responder import Responder


class Relay:
    """One request's answer, written from its exchange's events (see the module's docstring)."""

    __slots__ = ("out", "assembler", "whole_events", "_head", "_assembling", "_framed")

    def __init__(
        self, out: Responder, *, assembler: Assembler | None = None, whole_events: bool = False
    ) -> None:
        self.out, self.assembler, self.whole_events = out, assembler, whole_events
        self._head: Head | None = None
        self._assembling = False
        self._framed = False

    async def write(self, event: Head | Piece | End) -> None:
        out = self.out
        if type(event) is Piece:
            if self._assembling:
                assert self.assembler is not None
                self.assembler.take(event.events)
            elif self._framed:
                data = b"".join(e.raw for e in event.events)
                if data:
                    await out.piece(data)
            else:
                await out.piece(event.data)
        elif type(event) is Head:
            self._head = event
            self._assembling = self.assembler is not None and event.stream
            self._framed = self.whole_events and event.stream
            if not (self._assembling or event.whole or out.started):
                await out.head(event.status, event.headers, event.content_length)
        else:
            assert type(event) is End and self._head is not None
            await self._end(self._head, event)

    async def _end(self, head: Head, end: End) -> None:
        out = self.out
        if self._assembling:
            assert self.assembler is not None
            self.assembler.take(end.events)
            status, payload = self.assembler.render()  # or UpstreamFailed: the stream had no end
            head.headers["Content-Type"] = CONTENT_TYPE
            await out.whole(status, head.headers, payload)
            return
        last = b"".join(e.raw for e in end.events) if self._framed else end.last
        if out.started:
            await out.end(last)
        elif last:
            await out.whole(head.status, head.headers, last)
        else:  # no body (HEAD, 204, an empty answer): the head keeps the upstream's framing
            await out.head(head.status, head.headers, head.content_length)
            await out.end()
