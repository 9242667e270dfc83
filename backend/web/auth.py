"""The backend's API key, as llama-server's ``--api-key``: a key on every route but the
public ones (``/health``, ``/v1/health``, ``/models``, ``/v1/models``).

``llmproxy serve`` starts its embedded backend with a random key per start, passed in the
child's environment (``LLMPROXY_API_KEY``; never on its command line, which ``ps`` shows
every user), so no local process reaches the model around the proxy's keys and gate.
Accepted as ``Authorization: Bearer KEY`` or ``X-Api-Key: KEY``, compared in constant
time; a wrong or missing key gets llama-server's 401 envelope.
"""

from __future__ import annotations

import hmac

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

PUBLIC = frozenset({"/health", "/v1/health", "/models", "/v1/models"})
_INVALID = b'{"error":{"code":401,"message":"Invalid API Key","type":"authentication_error"}}'


def _presented(request: web.Request) -> bytes:
    auth = request.headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer":
        return token.strip().encode("utf-8", "surrogateescape")
    return request.headers.get("X-Api-Key", "").strip().encode("utf-8", "surrogateescape")


def key_middleware(key: str) -> Middleware:
    """A middleware that answers 401 unless the request carries ``key`` (or is public)."""
    expected = key.encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in PUBLIC and not hmac.compare_digest(_presented(request), expected):
            return web.Response(status=401, body=_INVALID, content_type="application/json")
        return await handler(request)

    return check
