"""API-key check (constant time) and the headers that carry the proxy's own key.

Clients may present the key as ``Authorization: Bearer KEY``, ``api-key: KEY`` or
``x-api-key: KEY``. Values that editors send when no key is configured ("Bearer
undefined", an empty header) are simply wrong keys: 401, never a crash. When a key is
configured, these headers are consumed by the proxy and not forwarded.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from llmproxy.proxy.errors import Unauthorized
from llmproxy.proxy.settings import ProxySettings

_KEY_HEADERS = ("Authorization", "api-key", "x-api-key")


def auth_headers_to_strip(settings: ProxySettings) -> tuple[str, ...]:
    return _KEY_HEADERS if settings.api_key is not None else ()


def _presented(request: web.Request) -> list[bytes]:
    values = []
    auth = request.headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer":
        values.append(token.strip().encode("utf-8", "surrogateescape"))
    for name in _KEY_HEADERS[1:]:
        if name in request.headers:
            values.append(request.headers[name].strip().encode("utf-8", "surrogateescape"))
    return values


def check_api_key(request: web.Request, settings: ProxySettings) -> None:
    if settings.api_key is None:
        return
    expected = settings.api_key.get_secret_value().encode()
    ok = False
    for value in _presented(request):
        ok |= hmac.compare_digest(value, expected)  # no early exit
    if not ok:
        raise Unauthorized("missing or invalid API key")
