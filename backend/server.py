"""Running the backend: bind, write the port file, serve until SIGTERM/SIGINT, drain.

With ``--no-sigint`` (``llmproxy serve``'s embedded backend) SIGINT is ignored.

Shutdown order: stop listening; in-flight requests get ``shutdown_timeout_s`` to finish
(aiohttp's graceful shutdown); handlers still running are then cancelled (each sends
``Cancel`` to its worker); the app cleanup sends ``Shutdown`` pills, joins the workers
and kills stragglers.
"""

from __future__ import annotations

import asyncio
import gc
import signal

import structlog
from aiohttp import web
from llmproxy.backend.app import create_app
from llmproxy.backend.settings import BackendSettings
from llmproxy.proxy import loops
from llmproxy.proxy.config import describe
from llmproxy.proxy.portfile import clear_port_file, remove_port_file, write_port_file

log = structlog.get_logger("llmproxy.backend")


async def serve(settings: BackendSettings, stop: asyncio.Event | None = None) -> None:
    clear_port_file(settings.port_file)
    port: int | None = None
    app = create_app(settings)
    runner = web.AppRunner(
        app, handler_cancellation=True, shutdown_timeout=settings.shutdown_timeout_s, access_log=None
    )
    await runner.setup()
    gc.freeze()  # startup objects out of full collections (~20 ms pauses otherwise; see proxy/server.py)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    # --no-sigint (llmproxy serve's embedded backend): Ctrl-C is the proxy's to handle, so it
    # must neither stop this server nor reach asyncio's default (KeyboardInterrupt)
    loop.add_signal_handler(signal.SIGINT, stop.set if settings.sigint else (lambda: None))
    try:
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
        port = runner.addresses[0][1]
        if settings.port_file is not None:
            write_port_file(settings.port_file, port)
        log.info("backend_listening", host=settings.host, port=port, loop=loops.running(), settings=describe(settings))
        await stop.wait()
        log.info("backend_stopping")
    finally:
        await runner.cleanup()
        remove_port_file(settings.port_file, port)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        log.info("backend_stopped")
