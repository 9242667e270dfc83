"""Running the proxy app: bind (or inherit a systemd socket), signals, graceful stop.

Shutdown contract: the first SIGTERM/SIGINT stops accepting connections, answers queued
requests with 503 and lets in-flight requests finish for up to ``shutdown_timeout_s`` in
all (app.py's on_shutdown: the gate closes, then upstream jobs and request handlers are
drained and stragglers cut, a started stream ending with an error event; registry.py).
aiohttp's own connection shutdown comes after that and finds nothing left to wait for;
its timeout (``_WRITE_GRACE_S``, counted twice: wait, then cancel and wait) is only a
backstop. Cleanup then stops the embedded backend (embedded.py: at most ``BACKEND_STOP_S``);
exit 0. The embedded backend dying on its own (embedded.py) starts the same stop, with
exit status 1 (a service manager's ``Restart=on-failure`` then restarts both). So a stop takes at most ``shutdown_timeout_s`` + 1 s (handlers' grace) + 2 x
``_WRITE_GRACE_S`` + ``BACKEND_STOP_S`` = ``shutdown_timeout_s`` + 14 s, inside the systemd
unit's ``TimeoutStopSec`` (+ 15 s). A second signal exits at once (status 1); the embedded
backend dies with us (PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import os
import signal
import socket

import structlog
from aiohttp import web

from llmproxy.proxy import loops, parse_errors
from llmproxy.proxy.portfile import clear_port_file, remove_port_file, write_port_file
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.state import STOP, StopRequest

log = structlog.get_logger("llmproxy.server")
SD_LISTEN_FDS_START = 3
_WRITE_GRACE_S = 2.0  # aiohttp's part, after our drain (a backstop: nothing should be left)


def inherited_socket() -> socket.socket | None:
    """The listening socket passed by systemd socket activation (LISTEN_FDS), if any.

    Taken before the embedded backend starts, so that neither the socket nor the
    ``LISTEN_*`` variables reach it: the socket is made non-inheritable (uvloop spawns
    children without ``close_fds``, so an inheritable fd would be passed on).
    """
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return None
    if int(os.environ.get("LISTEN_FDS", "0")) < 1:
        return None
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(var, None)  # not inherited by the embedded backend
    sock = socket.socket(fileno=SD_LISTEN_FDS_START)
    sock.set_inheritable(False)
    return sock


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def serve(settings: ProxySettings, app: web.Application) -> int:
    loop = asyncio.get_running_loop()
    sock = inherited_socket()  # before runner.setup() starts the embedded backend
    clear_port_file(settings.port_file)  # a stale one would be read while the backend loads
    port: int | None = None
    stop = app[STOP] = StopRequest()  # signals, and the embedded backend's death (embedded.py)
    signals_seen = 0

    def on_signal(signum: int) -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen > 1:
            log.warning("second signal: exiting now", signal=signal.Signals(signum).name)
            os._exit(1)
        log.info("signal received: shutting down gracefully", signal=signal.Signals(signum).name)
        stop.request(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=max(min(settings.shutdown_timeout_s, _WRITE_GRACE_S), 0.01),  # aiohttp: 0 = no limit
        keepalive_timeout=settings.idle_timeout_s,  # also bounds slow (slowloris) request headers
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
        parse_errors.install(runner)
        # Startup objects (modules, app, settings; ~55k) go to the permanent generation, so a
        # full collection scans only what requests allocate: ~19 ms pauses -> well under 1 ms.
        gc.freeze()
        # A backlog that holds a full queue's worth of simultaneous connects (the default 128
        # would drop SYNs and stall new clients, /llmproxy/status probes included, by >= 1 s);
        # also for systemd's socket, which aiohttp listen()s on again with its own backlog.
        backlog = max(1024, settings.max_queue + 64)
        site: web.BaseSite
        if sock is not None:
            site = web.SockSite(runner, sock, backlog=backlog)
        else:
            site = web.TCPSite(runner, settings.host, settings.port, reuse_address=True, backlog=backlog)
        await site.start()
        bound = runner.addresses[0]
        port = bound[1]
        if settings.port_file is not None:
            write_port_file(settings.port_file, port)
        if sock is None and not _is_loopback(settings.host) and settings.api_key is None:
            log.warning("listening on a non-loopback address WITHOUT an API key: anyone on the network can use it",
                        host=settings.host)
        log.info("listening", url=f"http://{bound[0]}:{port}", socket_activated=sock is not None,
                 loop=loops.running())
        await stopper
        return stop.exit_code
    finally:
        stopper.cancel()
        await runner.cleanup()
        remove_port_file(settings.port_file, port)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
