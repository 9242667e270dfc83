"""Job -> handler events and the bounded channel that carries them.

Events: ``Headers`` (status + filtered headers), ``Chunk`` (body bytes as received), and
one terminal event, ``End`` or ``Error``. See ``Channel`` for the blocking rules.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from multidict import CIMultiDict

from llmproxy.proxy.errors import ProxyError


@dataclass(frozen=True, slots=True)
class Headers:
    status: int
    headers: CIMultiDict[str]
    content_length: int | None = None


@dataclass(frozen=True, slots=True)
class Chunk:
    data: bytes


@dataclass(frozen=True, slots=True)
class End:
    pass


@dataclass(frozen=True, slots=True)
class Error:
    error: ProxyError


Event = Headers | Chunk | End | Error


class Channel:
    """Bounded job -> handler event stream with a terminal event and a discard mode.

    ``put`` (Headers/Chunk) blocks while the buffer is full: backpressure from a slow
    client. ``finish`` (End/Error) never blocks; ``get`` returns buffered events first,
    then the terminal one. ``detach`` (client gone) drops the buffer and turns every
    later ``put`` into a no-op, so a job that finishes its generation never waits on a
    reader that left.
    """

    def __init__(self, maxsize: int = 64) -> None:
        self._buf: deque[Event] = deque()
        self._max = maxsize
        self._final: Event | None = None
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        self.detached = False
        self._drained = False  # the terminal event was handed out

    async def put(self, ev: Event) -> None:
        while len(self._buf) >= self._max and not self.detached:
            self._writable.clear()
            await self._writable.wait()
        if self.detached or self._final is not None:
            return
        self._buf.append(ev)
        self._readable.set()

    def finish(self, ev: Event) -> None:
        if self._final is None:
            self._final = ev
            self._readable.set()

    async def get(self) -> Event:
        while True:
            if self._buf:
                ev = self._buf.popleft()
                self._writable.set()
                return ev
            if self._final is not None:
                return self._final
            self._readable.clear()
            await self._readable.wait()

    def __aiter__(self) -> Channel:
        """Iterate events up to and including the terminal one (single consumer).

        A plain iterator, not an async generator: a reader that stops at the terminal
        event leaves no suspended generator for the event loop's finalizer hook (which
        costs a self-pipe write and an extra loop wake-up per request).
        """
        return self

    async def __anext__(self) -> Event:
        if self._drained:
            raise StopAsyncIteration
        ev = await self.get()
        if isinstance(ev, (End, Error)):
            self._drained = True
        return ev

    def take_complete_body(self) -> bytes | None:
        """Hand out the whole rest of the body at once if it is already here, else None.

        Only when the terminal event is ``End`` and every buffered event is a ``Chunk`` (at
        least one): they are taken together with the terminal event (the channel is then
        drained). Otherwise nothing is taken. This lets the relay send a non-streamed
        response as one write instead of headers, body and terminator separately.
        """
        if not isinstance(self._final, End) or not self._buf:
            return None
        if not all(isinstance(ev, Chunk) for ev in self._buf):
            return None
        body = b"".join(ev.data for ev in self._buf)  # type: ignore[union-attr]
        self._buf.clear()
        self._writable.set()
        self._drained = True
        return body

    def take_end_if_next(self) -> bool:
        """True (and the channel is drained) if the next event would be a clean ``End``.

        Lets the relay write a stream's last chunk and its terminator in one piece.
        """
        if self._buf or not isinstance(self._final, End):
            return False
        self._drained = True
        return True

    def detach(self) -> None:
        self.detached = True
        self._buf.clear()
        self._writable.set()
