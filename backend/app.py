"""The backend's web app: a llama-server compatible HTTP API (subset) over the dispatcher.

Routes: POST /completion /completions /infill (web/llama.py), /v1/completions
/v1/chat/completions /chat/completions (web/openai.py); GET /health /v1/health /props
/slots /v1/models /models (web/info.py), /metrics (web/metrics.py). Request parsing is
web/requests.py, error envelopes and the middleware web/errors.py, generation driving and
SSE web/gen.py, the typed app keys web/context.py.

Lifecycle: the dispatcher (and its workers) starts with the app and stops in its
``cleanup_ctx``. The app is meant to run with ``handler_cancellation=True`` (server.py);
a client that goes away cancels its handler, which cancels its generation (web/gen.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web
from aiohttp.typedefs import Middleware

from llmproxy.backend.model_path import resolve_model
from llmproxy.backend.runtime.dispatch import Dispatcher
from llmproxy.backend.settings import BackendSettings
from llmproxy.backend.web.auth import key_middleware
from llmproxy.backend.web.context import DISPATCHER, MODEL_PATH, SETTINGS
from llmproxy.backend.web.errors import error_middleware
from llmproxy.backend.web.info import health, models, props, slots
from llmproxy.backend.web.llama import completion, infill
from llmproxy.backend.web.metrics import metrics
from llmproxy.backend.web.openai import chat_completions, v1_completions

__all__ = ["DISPATCHER", "SETTINGS", "create_app"]


def create_app(settings: BackendSettings) -> web.Application:
    """The backend app; workers start with the app (on startup) and stop on cleanup."""
    middlewares: list[Middleware] = [error_middleware]
    if settings.api_key is not None:  # inside the error envelope's middleware
        middlewares.append(key_middleware(settings.api_key.get_secret_value()))
    app = web.Application(middlewares=middlewares, client_max_size=16 * 1024 * 1024)
    app[SETTINGS] = settings
    app[MODEL_PATH] = str(resolve_model(settings.model))
    dispatcher = Dispatcher(settings)
    app[DISPATCHER] = dispatcher

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await dispatcher.start()
        yield
        await dispatcher.stop()

    app.cleanup_ctx.append(lifecycle)
    r = app.router
    for path in ("/completion", "/completions"):
        r.add_post(path, completion)
    r.add_post("/infill", infill)
    r.add_post("/v1/completions", v1_completions)
    for path in ("/v1/chat/completions", "/chat/completions"):
        r.add_post(path, chat_completions)
    r.add_get("/health", health)
    r.add_get("/v1/health", health)
    r.add_get("/props", props)
    r.add_get("/slots", slots)
    r.add_get("/metrics", metrics)
    for path in ("/v1/models", "/models"):
        r.add_get(path, models)
    return app
