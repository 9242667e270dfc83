"""Running the backend: the shared lifecycle (common/server.py) over the backend's app.

With ``--no-sigint`` (``llmproxy serve``'s embedded backend) SIGINT is ignored. Requests
aiohttp's HTTP parser rejects are answered in llama-server's envelope too
(``common/parse_errors.py``), as every other error.

Shutdown order: stop listening; in-flight requests get ``shutdown_timeout_s`` to finish
(aiohttp's graceful shutdown); handlers still running are then cancelled (each sends
``Cancel`` to its worker); the app cleanup sends ``Shutdown`` pills, joins the workers
and kills stragglers.
"""

from __future__ import annotations

import structlog
from aiohttp import web

from llmproxy.backend.app import create_app
from llmproxy.backend.settings import BackendSettings
from llmproxy.backend.web.errors import error_bytes
from llmproxy.common import loops, parse_errors
from llmproxy.common.config import describe
from llmproxy.common.server import Listen, StopRequest
from llmproxy.common.server import serve as run

log = structlog.get_logger("llmproxy.backend")


async def serve(settings: BackendSettings, stop: StopRequest | None = None) -> int:
    def on_listening(host: str, port: int) -> None:
        log.info(
            "backend_listening",
            host=host,
            port=port,
            loop=loops.running(),
            settings=describe(settings),
        )

    listen = Listen(
        host=settings.host,
        port=settings.port,
        port_file=settings.port_file,
        shutdown_timeout_s=settings.shutdown_timeout_s,
        sigint=settings.sigint,
    )

    def on_ready(runner: web.AppRunner) -> None:
        parse_errors.install(runner, error_bytes, structlog.get_logger("llmproxy.backend.web"))

    try:
        return await run(
            create_app(settings), listen, stop, on_ready=on_ready, on_listening=on_listening
        )
    finally:
        log.info("backend_stopped")
