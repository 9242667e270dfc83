"""The slow-client guard around a ``Responder``'s writes: ``Stall`` drops a client that takes
no byte of its response for ``write_timeout_s`` while a write waits for it.

Concurrency contract: a ``Stall`` is entered by the one writer task of its response, around
one write (or the wait for the buffer to drain). Its timer is a loop callback, not a task,
and is cancelled when the block ends. At the deadline the write is cancelled
(``asyncio.timeout``), ``on_drop`` is called and the block ends normally; a cancellation
from elsewhere (a job's stop, the shutdown cut) propagates as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from types import TracebackType

from aiohttp import web

# The guard of a write that cannot wait (it stays under the buffer's high-water mark).
NO_GUARD: contextlib.AbstractAsyncContextManager[None] = contextlib.nullcontext()


class Stall:
    """``async with``: a write to the client of ``request`` that must not wait more than
    ``timeout_s`` without the client taking a byte. A loop timer looks at the transport's
    send buffer every quarter of the timeout: if it shrank, the deadline moves on. At the
    deadline the write is cancelled and ``on_drop`` called (see the module's contract)."""

    __slots__ = ("_request", "_timeout_s", "_on_drop", "_scope", "_timer", "_left")

    def __init__(self, request: web.Request, timeout_s: float, on_drop: Callable[[], None]) -> None:
        self._request = request
        self._timeout_s = timeout_s
        self._on_drop = on_drop
        self._scope: asyncio.Timeout | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._left = 0

    def _unsent(self) -> int:
        transport = self._request.transport
        return transport.get_write_buffer_size() if transport is not None else 0

    def _check(self) -> None:
        loop = asyncio.get_running_loop()
        timeout = self._timeout_s
        assert self._scope is not None
        left = self._unsent()
        if left < self._left and not self._scope.expired():  # the client took some: a new deadline
            self._scope.reschedule(loop.time() + timeout)
        self._left = left
        self._timer = loop.call_later(timeout / 4, self._check)

    async def __aenter__(self) -> None:
        timeout = self._timeout_s
        self._scope = asyncio.timeout(timeout)
        await self._scope.__aenter__()
        self._left = self._unsent()
        self._timer = asyncio.get_running_loop().call_later(timeout / 4, self._check)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if self._timer is not None:
            self._timer.cancel()
        assert self._scope is not None
        try:
            await self._scope.__aexit__(exc_type, exc, tb)
        except TimeoutError:
            self._on_drop()
            return True
        return False
