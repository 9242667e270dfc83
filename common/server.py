"""The one server lifecycle of every llmproxy server process: bind, signals, port file, stop.

``serve(app, listen)`` runs an aiohttp app until a stop is requested and returns the exit
status the request carried. Both ``llmproxy serve`` (proxy/server.py) and ``llmproxy
backend`` (backend/server.py) run through it.

Contract:
- The socket is bound first (common/bind.py: a busy port is a one-line start-up mistake
  before the app loads anything). The port file is cleared first (a stale one would be
  read while the app starts), written once the socket listens and removed at exit only if
  it still names our port.
- ``runner.setup()`` (the app's startup and cleanup contexts: the proxy's embedded backend
  loads its model there) races the stop request: a signal during setup cancels it and
  returns at once.
- SIGHUP calls ``listen.on_reload`` (when given: re-read the settings and apply what can
  change while serving); without one it stops the process, as by default.
- SIGTERM asks for a graceful stop (status 0). SIGINT too, unless ``listen.sigint`` is
  false (an embedded backend: Ctrl-C is its parent's to handle), when it is ignored.
  A second signal while stopping exits at once with status 1.
- Parts of the app request a stop with their own status through ``StopRequest`` (the
  proxy's embedded backend dying). The first request's status wins.
- Teardown is ``runner.cleanup()``: aiohttp's graceful shutdown (``shutdown_timeout``),
  then the app's on_shutdown and cleanup contexts, owned by the app.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
from aiohttp import web

from llmproxy.common.bind import bind
from llmproxy.common.portfile import clear_port_file, remove_port_file, write_port_file

log = structlog.get_logger("llmproxy.server")


class StopRequest:
    """How parts of a server ask it to stop: ``serve`` owns it and waits on it.

    Used on the event loop's thread only."""

    def __init__(self) -> None:
        self.requested = asyncio.Event()
        self.exit_code = 0

    def request(self, exit_code: int = 0) -> None:
        if not self.requested.is_set():
            self.exit_code = exit_code
            self.requested.set()


@dataclass(frozen=True)
class Listen:
    """Where and how a server listens, and how long its graceful stop may take."""

    host: str
    port: int
    port_file: Path | None = None
    sock: socket.socket | None = None  # an inherited listening socket (systemd) instead
    backlog: int = 128
    shutdown_timeout_s: float = 60.0  # aiohttp's: 0 means no limit
    keepalive_timeout_s: float = 75.0
    sigint: bool = True
    on_reload: Callable[[], None] | None = None  # SIGHUP (systemctl reload)


async def serve(
    app: web.Application,
    listen: Listen,
    stop: StopRequest | None = None,
    on_ready: Callable[[web.AppRunner], None] | None = None,
    on_listening: Callable[[str, int], None] | None = None,
) -> int:
    """Serve ``app`` until a stop is requested; return its exit status.

    ``on_ready(runner)`` runs after setup, before listening; ``on_listening(host, port)``
    once the socket listens (after the port file is written).
    """
    loop = asyncio.get_running_loop()
    stop = stop or StopRequest()
    clear_port_file(listen.port_file)
    port: int | None = None
    signals_seen = 0

    def on_signal(signum: int) -> None:
        nonlocal signals_seen
        signals_seen += 1
        name = signal.Signals(signum).name
        if signals_seen > 1:
            log.warning("second signal: exiting now", signal=name)
            os._exit(1)
        # without sigint (the embedded backend) the SIGTERM is its parent's, which logged
        # the user's signal already: one line per Ctrl-C
        (log.info if listen.sigint else log.debug)(
            "signal received: shutting down gracefully", signal=name
        )
        stop.request(0)

    loop.add_signal_handler(signal.SIGTERM, on_signal, signal.SIGTERM)
    if listen.on_reload is not None:
        on_reload = listen.on_reload

        def on_hup() -> None:
            log.info("signal received: reloading", signal="SIGHUP")
            on_reload()

        loop.add_signal_handler(signal.SIGHUP, on_hup)
    if listen.sigint:
        loop.add_signal_handler(signal.SIGINT, on_signal, signal.SIGINT)
    else:  # neither a stop nor asyncio's default (KeyboardInterrupt)
        loop.add_signal_handler(signal.SIGINT, lambda: None)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=listen.shutdown_timeout_s,
        keepalive_timeout=listen.keepalive_timeout_s,  # also bounds slow request headers
    )
    # bound first: a busy port or a bad --host is a one-line mistake before anything loads
    socks = (
        [listen.sock] if listen.sock is not None else bind(listen.host, listen.port, listen.backlog)
    )
    setup = asyncio.ensure_future(runner.setup())
    stopper = asyncio.ensure_future(stop.requested.wait())
    try:
        await asyncio.wait([setup, stopper], return_when=asyncio.FIRST_COMPLETED)
        if not setup.done():
            setup.cancel()
            await asyncio.wait([setup])
            return stop.exit_code
        setup.result()
        if on_ready is not None:
            on_ready(runner)
        # Startup objects (modules, app, settings) go to the permanent generation, so a full
        # collection scans only what requests allocate.
        gc.freeze()
        for sock in socks:
            await web.SockSite(runner, sock, backlog=listen.backlog).start()
        host, port = runner.addresses[0][:2]
        if listen.port_file is not None:
            write_port_file(listen.port_file, port)
        if on_listening is not None:
            on_listening(host, port)
        await stopper
        return stop.exit_code
    finally:
        stopper.cancel()
        await runner.cleanup()
        for sock in socks:  # those no site took (a stop during setup)
            sock.close()
        remove_port_file(listen.port_file, port)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
