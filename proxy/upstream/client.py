"""The HTTP/1.1 client for requests relayed to the upstream: aiohttp's client protocol, pooled.

Every relayed request (gated or passthrough) goes through ``UpstreamClient.exchange``. It is
built from aiohttp's own client parts, the ones ``ClientSession`` uses underneath:
``ResponseHandler`` (the connection protocol: aiohttp's C response parser, flow control,
the ``sock_read`` inactivity timeout and aiohttp's exceptions) and ``StreamWriter`` (request
serialization, with header validation). What it leaves out is ``ClientSession.request``'s
per-request object layer, which sits on every relayed request's critical path and none of
which a reverse proxy to one configured origin uses: cookie jars, redirects, auth, proxies,
client middlewares, traces, payload type dispatch, and on Python < 3.12 a separate task
that writes the body. The adapters' probes and ``/slots`` polls, off that path, keep using
the app's ``ClientSession``.

What is this module's own: a keep-alive pool of connections to the one upstream origin
(most recently used first, at most ``max_idle`` kept, each closed ``keepalive_s`` after its
last use: 4 s, under the 5 s idle timeout of llama-server and uvicorn, so a connection the
upstream is about to close is never picked), the request head (method, origin-form target
under the base URL's path, ``Host``, ``Content-Length``, and ``Authorization`` when one is
configured (``authorization``: the upstream API key) or the base URL carries credentials
(Basic); the caller's headers otherwise as given) and the connect timeout. One request on
one connection is an ``Exchange`` (exchange.py: the retry, interim responses, when a
connection goes back to the pool). Responses are never decompressed and redirects never
followed.

Concurrency contract: pool state is touched from the event loop's thread only and never
across an ``await``. ``close()`` (the app's cleanup) closes the idle connections;
connections in use are closed by their exchanges. Exceptions are aiohttp's (and
``OSError``/``TimeoutError`` from connecting); ``client_errors.map_client_errors`` is the boundary
that turns them into ProxyErrors.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable, Mapping

from aiohttp import encode_basic_auth
from aiohttp.client_exceptions import ClientConnectorError, ConnectionTimeoutError
from aiohttp.client_proto import ResponseHandler
from aiohttp.client_reqrep import ConnectionKey
from multidict import CIMultiDict
from yarl import URL

from llmproxy.proxy.upstream.exchange import Exchange

# Methods whose requests carry a body, so an empty one is sent as Content-Length: 0.
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
KEEPALIVE_S = 4.0


class UpstreamClient:
    """Keep-alive HTTP/1.1 connections to one upstream origin (see the module docstring)."""

    def __init__(
        self,
        base_url: URL,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_idle: int = 64,
        keepalive_s: float = KEEPALIVE_S,
        authorization: str | None = None,
    ) -> None:
        host, port = base_url.host, base_url.port  # yarl gives a scheme's default port
        if base_url.scheme not in ("http", "https") or not host or port is None:
            raise ValueError(
                f"upstream URL must be http:// or https:// with a host, not {str(base_url)!r}"
            )
        self.base_url = base_url
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_idle = max_idle
        self.keepalive_s = keepalive_s
        self._host = host
        self._port = port
        self._ssl = ssl.create_default_context() if base_url.scheme == "https" else None
        self.tls = self._ssl is not None
        # the default port left out, as aiohttp does
        self._host_header = base_url.host_port_subcomponent or self._host
        self._prefix = base_url.raw_path.rstrip("/")
        if authorization is None and base_url.user is not None:  # http://user:pass@host
            authorization = encode_basic_auth(base_url.user, base_url.password or "")
        self._authorization = authorization  # sent on every request in place of the caller's
        # (protocol, released at), newest last
        self._idle: deque[tuple[ResponseHandler, float]] = deque()
        self._expiry: asyncio.TimerHandle | None = None  # closes idle connections as they expire
        self._closed = False
        # False for llama-server: it closes a connection after an event stream although it
        # says keep-alive, and a request sent on it at once fails (see Exchange.__aexit__)
        self.reuse_after_stream = True

    @property
    def idle(self) -> int:
        """Idle connections in the pool (for tests and status)."""
        return len(self._idle)

    def exchange(
        self,
        method: str,
        target: str,
        headers: Mapping[str, str],
        body: bytes | None,
        on_send: Callable[[], None] | None = None,
    ) -> Exchange:
        """``async with client.exchange(...) as response``: send ``method target``
        (origin-form, under the base URL's path) and get the response once its head has
        arrived; its body streams in ``response.content``.

        ``on_send`` is called just before the request's bytes are handed to the connection:
        from then on the upstream may have it. A failure or cancellation before that (while
        connecting, say) means it certainly never left."""
        return Exchange(self, method, target, headers, body, on_send)

    def close(self) -> None:
        """Close the idle connections; later releases close theirs too."""
        self._closed = True
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        while self._idle:
            self._idle.pop()[0].close()

    # -- for Exchange: the request head, the pool, new connections --------------------------
    def request_head(
        self, method: str, target: str, headers: Mapping[str, str], body: bytes | None
    ) -> tuple[str, CIMultiDict[str]]:
        """The request line and headers of ``method target`` (see the module docstring)."""
        head = CIMultiDict(headers)
        head["Host"] = self._host_header
        if self._authorization is not None:
            head["Authorization"] = self._authorization
        if body or method in _BODY_METHODS:
            head["Content-Length"] = str(len(body or b""))
        return f"{method} {self._prefix}{target} HTTP/1.1", head

    def take_idle(self, now: float) -> ResponseHandler | None:
        """The most recently used idle connection still open and within ``keepalive_s`` (the
        warmest, least likely closed), or None; the others taken on the way are closed."""
        while self._idle:
            proto, since = self._idle.pop()
            if proto.is_connected() and not proto.should_close and now - since < self.keepalive_s:
                return proto
            proto.close()
        return None

    def release(self, proto: ResponseHandler, now: float) -> None:
        """Put ``proto`` back as idle (closed instead after ``close()``), making room by
        closing the oldest beyond ``max_idle`` or ``keepalive_s``."""
        if self._closed:
            proto.close()
            return
        idle = self._idle
        while idle and (len(idle) >= self.max_idle or now - idle[0][1] >= self.keepalive_s):
            idle.popleft()[0].close()  # the oldest go first
        idle.append((proto, now))
        if self._expiry is None:
            self._expiry = asyncio.get_running_loop().call_at(
                idle[0][1] + self.keepalive_s, self._expire
            )

    def _expire(self) -> None:
        """Close the idle connections older than ``keepalive_s``; re-arm for the next one."""
        loop = asyncio.get_running_loop()
        idle, now = self._idle, loop.time()
        while idle and now - idle[0][1] >= self.keepalive_s:
            idle.popleft()[0].close()
        self._expiry = loop.call_at(idle[0][1] + self.keepalive_s, self._expire) if idle else None

    async def connect(self, loop: asyncio.AbstractEventLoop) -> ResponseHandler:
        """A new connection, as aiohttp's connector reports failures: ClientConnectorError
        (refused, unreachable, name not resolved) or ConnectionTimeoutError."""
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, proto = await loop.create_connection(
                    lambda: ResponseHandler(loop),
                    self._host,
                    self._port,
                    ssl=self._ssl,
                    server_hostname=self._host if self.tls else None,
                )
        except TimeoutError as exc:
            raise ConnectionTimeoutError(f"connect to {self._host_header} timed out") from exc
        except OSError as exc:
            raise ClientConnectorError(self._connection_key, exc) from exc
        return proto

    @property
    def _connection_key(self) -> ConnectionKey:
        return ConnectionKey(self._host, self._port, self.tls, self._ssl or True, None, None, None)
