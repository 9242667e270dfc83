"""Who may use the proxy: the Host and Origin checks, CORS, and the client keys.

A loopback bind keeps other machines out, not a browser on this one. A web page can make
the browser send requests to the proxy in two ways, and each is refused here before any
route runs (the middleware calls ``Trust.admit`` first):

- DNS rebinding: the page's own name resolves to 127.0.0.1, so to the browser the proxy is
  same-origin and the page may read its answers. Its requests carry the page's name in
  ``Host``: only ``localhost`` (and ``*.localhost``), loopback addresses, the bound address
  and ``allowed_hosts`` are served (any IP address when bound to every interface: a
  rebinding page always has a name). 403 otherwise.
- Cross-site requests: a page elsewhere posts to ``http://localhost:PORT`` (a
  ``text/plain`` POST needs no preflight). Browsers put the page's origin in ``Origin``: a
  request with an ``Origin`` that is neither the proxy's own (same-origin: llama-server's
  web UI served through the proxy) nor in ``allowed_origins`` gets 403. Editors, curl and
  LSP servers send no ``Origin`` and are not affected.

CORS is the proxy's own: a preflight (``OPTIONS`` with ``Access-Control-Request-Method``)
is answered here for allowed origins, an allowed cross-origin answer gets
``Access-Control-Allow-Origin`` (``cors_headers``, on every response), and an upstream's
``Access-Control-*`` headers are never relayed (upstream/headers.py drops them).

With client keys configured, a valid key (``Authorization: Bearer``, ``api-key`` or
``x-api-key``) is needed on every route but ``GET /llmproxy/health`` and the live page's
static files (``_OPEN``); compared in constant time against every key. The name of the
key that matched is the caller's.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from llmproxy.common.net import (
    ip_literal,
    is_unspecified,
    normal_origin,
    origin_of,
    split_host,
)
from llmproxy.proxy.errors import Forbidden, Unauthorized
from llmproxy.proxy.settings import ProxySettings

KEY_HEADERS = ("Authorization", "api-key", "x-api-key")
#: the allowed cross origin a request came from: its answer carries CORS headers
CORS_ORIGIN = web.RequestKey("cors_origin", str)
#: the name of the client key a request presented (absent: no keys configured)
CALLER = web.RequestKey("caller", str)
#: no key asked on GET: liveness, and the live page's own files (static, no data: a browser
#: cannot send a key when it navigates; the page's data, /llmproxy/events, needs one)
_OPEN = frozenset({"/llmproxy/health", "/llmproxy/", "/llmproxy/page.js", "/llmproxy/page.css"})
_PREFLIGHT_MAX_AGE_S = "600"
_METHODS = "GET, POST, PUT, PATCH, DELETE, OPTIONS"


class Trust:
    """The checks, built once per app from the settings (the key files read then)."""

    def __init__(self, settings: ProxySettings) -> None:
        self.any_host = "*" in settings.allowed_hosts
        self.names = {h.lower().rstrip(".") for h in settings.allowed_hosts}
        self.names.add("localhost")
        self.ips = set()
        bound = settings.host.strip("[]").lower()
        self.any_ip = is_unspecified(bound)
        ip = ip_literal(bound)
        if ip is not None:
            self.ips.add(ip)
        elif bound:
            self.names.add(bound.rstrip("."))
        for name in list(self.names):
            literal = ip_literal(name)
            if literal is not None:
                self.ips.add(literal)
        self.any_origin = "*" in settings.allowed_origins
        self.origins = frozenset(settings.allowed_origins)
        self.keys = settings.client_keys()
        self.strip = KEY_HEADERS if self.keys else ()

    def host_allowed(self, host: str) -> bool:
        """Is ``host`` (a ``Host`` header's name, no port) one the proxy answers to?"""
        if self.any_host:
            return True
        ip = ip_literal(host)
        if ip is not None:
            return ip.is_loopback or self.any_ip or ip in self.ips
        return host in self.names or host.endswith(".localhost")

    def admit(self, request: web.Request) -> web.Response | None:
        """Raise ``Forbidden`` or ``Unauthorized`` for a request the proxy does not serve;
        a CORS preflight's answer for an allowed one; None: go on to the route."""
        host_header = request.headers.get("Host")
        port: int | None = None
        if host_header is not None:
            try:
                host, port = split_host(host_header)
            except ValueError:
                raise Forbidden("the Host header names no host") from None
            if not self.host_allowed(host):
                raise Forbidden(
                    f"host {host!r} is not served (see allowed_hosts): a web page that "
                    "rebinds its name to this address is refused"
                )
        origin = request.headers.get("Origin")
        if origin is not None:
            self._check_origin(request, origin, host_header, port)
            if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
                return _preflight(request)
        if request.path not in _OPEN or request.method not in ("GET", "HEAD"):
            self._check_key(request)
        return None

    def _check_origin(
        self, request: web.Request, origin: str, host_header: str | None, port: int | None
    ) -> None:
        seen = normal_origin(origin)
        if host_header is not None and seen is not None:
            host, _ = split_host(host_header)
            if seen == origin_of("http", host, port):
                return  # same-origin: a page the proxy served itself
        if self.any_origin or (seen is not None and seen in self.origins):
            request[CORS_ORIGIN] = origin
            return
        raise Forbidden(
            f"origin {origin!r} is not allowed (see allowed_origins): web pages may not use "
            "this proxy"
        )

    def _check_key(self, request: web.Request) -> None:
        if not self.keys:
            return
        name = None
        for value in _presented(request):
            for key_name, key in self.keys:
                if hmac.compare_digest(value, key):  # every pair compared: no early exit
                    name = key_name
        if name is None:
            raise Unauthorized("missing or invalid API key")
        request[CALLER] = name


def _presented(request: web.Request) -> list[bytes]:
    """The values a request may carry its key in; editors' placeholders ("Bearer
    undefined", an empty header) are just wrong keys."""
    values = []
    auth = request.headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer":
        values.append(token.strip().encode("utf-8", "surrogateescape"))
    for name in KEY_HEADERS[1:]:
        if name in request.headers:
            values.append(request.headers[name].strip().encode("utf-8", "surrogateescape"))
    return values


def _preflight(request: web.Request) -> web.Response:
    """The answer to an allowed origin's CORS preflight (never forwarded)."""
    asked = request.headers.get("Access-Control-Request-Headers", "")
    headers = {
        "Access-Control-Allow-Methods": _METHODS,
        "Access-Control-Max-Age": _PREFLIGHT_MAX_AGE_S,
    }
    if asked:
        headers["Access-Control-Allow-Headers"] = asked
    return web.Response(status=204, headers=headers)


async def cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: an allowed cross-origin request's answer says so (the
    upstream's own CORS headers were dropped on the way)."""
    origin = request.get(CORS_ORIGIN)
    if origin is not None:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers.add("Vary", "Origin")


TRUST = web.AppKey("trust", Trust)
