"""A real aiohttp server on a loopback listener, stopped as a killed server is.

``Loopback(handler, host, port)`` serves every method and path with ``handler`` (the app
runs with ``handler_cancellation=True``: a client disconnect cancels the handler).
``start()`` binds (port 0: an ephemeral one) and returns the base URL; ``close()`` stops
accepting at once and closes every connection accepted before, a request on it
unanswered once ``shutdown_timeout`` has passed. The caller owns the object and must
``close()`` it; the server owns its handler tasks.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Loopback:
    """One listening aiohttp server; see the module docstring."""

    def __init__(self, handler: Handler, host: str, port: int) -> None:
        self._handler, self._host, self._port = handler, host, port
        self._runner: web.AppRunner | None = None
        self._listener: socket.socket | None = None

    async def start(self) -> str:
        """Listen; returns ``http://host:port``."""
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handler)
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5
        )
        await self._runner.setup()
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        # SO_REUSEADDR (as aiohttp's own sites): a new server may take this port at once
        self._listener = socket.create_server((self._host, self._port), family=family)
        site = web.SockSite(self._runner, self._listener)
        await site.start()
        port = self._listener.getsockname()[1]
        return f"http://{self._host}:{port}"

    async def close(self) -> None:
        """From now on the port refuses connections, and every connection accepted before is
        closed. Safe to call twice or before ``start()``."""
        if self._runner is not None:
            await self._stop_accepting()
            await self._runner.cleanup()
            self._runner = None

    async def _stop_accepting(self) -> None:
        """No more accepts, and those already made handed to the server (asyncio's loop on
        Python 3.11 leaves a connection it accepted just before its listener closed open
        and unread: the client's request would wait forever, the socket leak)."""
        loop = asyncio.get_running_loop()
        if self._listener is not None and isinstance(loop, asyncio.SelectorEventLoop):
            loop.remove_reader(self._listener.fileno())
            await asyncio.sleep(0)  # each accept in flight gets its transport, in order
