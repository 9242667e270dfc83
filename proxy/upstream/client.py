"""The HTTP/1.1 client for requests relayed to the upstream: aiohttp's client protocol, pooled.

Every relayed request (gated or passthrough) goes through ``UpstreamClient.exchange``. It is
built from aiohttp's own client parts, the ones ``ClientSession`` uses underneath:
``ResponseHandler`` (the connection protocol: aiohttp's C response parser, flow control,
the ``sock_read`` inactivity timeout and aiohttp's exceptions) and ``StreamWriter`` (request
serialization, with header validation). What it leaves out is ``ClientSession.request``'s
per-request object layer, none of which a reverse proxy to one configured origin uses:
cookie jars, redirects, auth, proxies, client middlewares, traces, payload type dispatch,
and on Python < 3.12 a separate task that writes the body. ``llmproxy bench overhead``
measured that layer at about a quarter of a millisecond per request on the critical path
of a 2-core machine (see the README's benchmark section); the adapters' probes and ``/slots``
polls, off that path, keep using the app's ``ClientSession``.

What is this module's own: a keep-alive pool of connections to the one upstream origin
(most recently used first, at most ``max_idle`` kept, each closed ``keepalive_s`` after its
last use: 4 s, under the 5 s idle timeout of llama-server and uvicorn, so a connection the
upstream is about to close is never picked), one retry on a new connection when a reused
one turns out to be closed and the method is idempotent (as ``ClientSession`` does; never
for a POST, which may have started a generation), interim 1xx responses skipped, the
request head (method, origin-form target under the base URL's path, ``Host``,
``Content-Length``, and ``Authorization`` when one is configured (``authorization``: the
upstream API key) or the base URL carries credentials (Basic); the caller's headers
otherwise as given) and the connect timeout.
Responses are never decompressed and redirects never followed.

Concurrency contract: ``exchange`` is an async context manager used by one task at a time
per call; the connection it holds belongs to that call alone. Leaving the block after
the response body was read to its end returns the connection to the pool (if the
upstream keeps it alive and all of the request went out); leaving it any other way (an
exception, a cancellation, a consumer that stops early) aborts the connection, dropping
request bytes not yet sent, which is how the proxy cancels a generation at the upstream:
a cancelled request can never still arrive whole afterwards. Pool state is touched from
the event loop's thread only and never across an ``await``. ``close()`` (the app's cleanup) closes the idle connections;
connections in use are closed by their ``exchange`` blocks. Exceptions are aiohttp's
(and ``OSError``/``TimeoutError`` from connecting); ``errors.map_client_errors`` is the
boundary that turns them into ProxyErrors.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from aiohttp import encode_basic_auth
from aiohttp.client_exceptions import (
    ClientConnectionResetError,
    ClientConnectorError,
    ClientOSError,
    ConnectionTimeoutError,
    ServerDisconnectedError,
)
from aiohttp.client_proto import ResponseHandler
from aiohttp.client_reqrep import ConnectionKey
from aiohttp.http_parser import RawResponseMessage
from aiohttp.http_writer import StreamWriter
from aiohttp.streams import StreamReader
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

# Methods whose requests carry a body, so an empty one is sent as Content-Length: 0.
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# Methods retried once on a new connection when a reused one was closed under them (aiohttp's list).
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
KEEPALIVE_S = 4.0
# Request bodies up to this size are all out once written (a transport's default high-water mark).
_TLS_SURE_SENT = 64 * 1024


@dataclass(frozen=True, slots=True)
class UpstreamResponse:
    status: int
    headers: CIMultiDictProxy[str]
    content: StreamReader  # the body as it arrives (aiohttp's reader, with flow control)

    @property
    def content_length(self) -> int | None:
        value = self.headers.get("Content-Length")
        return int(value) if value is not None and value.isdigit() else None


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
        self._host_header = (
            base_url.host_port_subcomponent or self._host
        )  # default port left out, as aiohttp does
        self._prefix = base_url.raw_path.rstrip("/")
        if (
            authorization is None and base_url.user is not None
        ):  # http://user:pass@host, as aiohttp does
            authorization = encode_basic_auth(base_url.user, base_url.password or "")
        self._authorization = authorization  # sent on every request in place of the caller's
        self._idle: deque[tuple[ResponseHandler, float]] = (
            deque()
        )  # (protocol, released at); newest last
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

    # -- the pool -----------------------------------------------------------------------
    def _head(
        self, method: str, target: str, headers: Mapping[str, str], body: bytes | None
    ) -> tuple[str, CIMultiDict[str]]:
        head = CIMultiDict(headers)
        head["Host"] = self._host_header
        if self._authorization is not None:
            head["Authorization"] = self._authorization
        if body or method in _BODY_METHODS:
            head["Content-Length"] = str(len(body or b""))
        return f"{method} {self._prefix}{target} HTTP/1.1", head

    def _take_idle(self, now: float) -> ResponseHandler | None:
        while self._idle:
            proto, since = (
                self._idle.pop()
            )  # the most recently used: the warmest, least likely closed
            if proto.is_connected() and not proto.should_close and now - since < self.keepalive_s:
                return proto
            proto.close()
        return None

    def _release(self, proto: ResponseHandler, now: float) -> None:
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

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> ResponseHandler:
        """A new connection, as aiohttp's connector reports failures: ClientConnectorError
        (refused, unreachable, name not resolved) or ConnectionTimeoutError."""
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, proto = await loop.create_connection(
                    lambda: ResponseHandler(loop),
                    self._host,
                    self._port,
                    ssl=self._ssl,
                    server_hostname=self._host if self._ssl is not None else None,
                )
        except TimeoutError as exc:
            raise ConnectionTimeoutError(f"connect to {self._host_header} timed out") from exc
        except OSError as exc:
            raise ClientConnectorError(self._connection_key, exc) from exc
        return proto

    @property
    def _connection_key(self) -> ConnectionKey:
        return ConnectionKey(
            self._host, self._port, self._ssl is not None, self._ssl or True, None, None, None
        )


class Exchange:
    """One request on one connection of an ``UpstreamClient`` (see ``UpstreamClient.exchange``).

    A plain async context manager rather than a generator-based one: it is on every
    relayed request's path."""

    __slots__ = (
        "_client",
        "_method",
        "_target",
        "_headers",
        "_body",
        "_on_send",
        "_proto",
        "_payload",
        "_status",
        "_stream",
    )

    def __init__(
        self,
        client: UpstreamClient,
        method: str,
        target: str,
        headers: Mapping[str, str],
        body: bytes | None,
        on_send: Callable[[], None] | None,
    ) -> None:
        self._client, self._method, self._target = client, method, target
        self._headers, self._body, self._on_send = headers, body, on_send
        self._proto: ResponseHandler | None = None
        self._payload: StreamReader | None = None
        self._status = 0
        self._stream = False  # the response is an event stream

    async def __aenter__(self) -> UpstreamResponse:
        client, loop = self._client, asyncio.get_running_loop()
        proto = client._take_idle(loop.time())
        retry = proto is not None and self._method in _IDEMPOTENT
        if proto is None:
            proto = await client._connect(loop)
        while True:
            try:
                message, payload = await self._attempt(proto, loop)
            except (ServerDisconnectedError, ClientOSError, ClientConnectionResetError) as exc:
                proto.abort()
                if not retry:
                    raise
                retry = False  # the reused connection was closed under us: once more, on a new one
                try:
                    proto = await client._connect(loop)
                except (ClientConnectorError, ConnectionTimeoutError):
                    raise exc from None  # what happened to the request: it was sent, and the connection lost
                continue
            except BaseException:
                proto.abort()  # drops request bytes not yet sent: the upstream never gets the rest
                raise
            self._proto, self._payload, self._status = proto, payload, message.code
            self._stream = message.headers.get("Content-Type", "").startswith("text/event-stream")
            return UpstreamResponse(message.code, message.headers, payload)

    async def _attempt(
        self, proto: ResponseHandler, loop: asyncio.AbstractEventLoop
    ) -> tuple[RawResponseMessage, StreamReader]:
        client = self._client
        proto.set_response_params(
            skip_payload=self._method == "HEAD",
            read_until_eof=True,  # a body with neither length nor chunking ends at close
            auto_decompress=False,
            read_timeout=client.read_timeout_s,
        )
        status_line, head = client._head(self._method, self._target, self._headers, self._body)
        writer = StreamWriter(proto, loop)
        await writer.write_headers(status_line, head)
        if self._on_send is not None:
            self._on_send()
        # Head and body in one write, without waiting for the upstream to read it all: it may
        # answer first (a 413) and stop reading, and its answer must not wait behind our body.
        await writer.write(self._body or b"", drain=False)
        writer.set_eof()
        proto.start_timeout()
        while True:
            message, payload = await proto.read()
            if not 100 <= message.code < 200 or message.code == 101:
                return message, payload
            # An interim response (100 Continue, 103 Early Hints): the final one follows. Its
            # arrival stopped the read timeout; restart it unless the answer came with it.
            if not len(proto):
                proto.start_timeout()

    async def __aexit__(self, exc_type: type[BaseException] | None, *_exc: object) -> None:
        """Back to the pool only after a body read to its end, on a connection kept alive
        that has sent all of the request (an upstream may answer before reading it all).
        Otherwise closed; aborted (unsent request bytes dropped, the upstream sees a reset)
        when the exchange was cut or the request is not all out, so that a cancelled request
        can never still arrive whole after its cancel."""
        proto, payload = self._proto, self._payload
        assert proto is not None and payload is not None
        transport = proto.transport
        sent_all = (
            transport is not None
            and not transport.get_write_buffer_size()
            and not proto.writing_paused
        )
        if (
            sent_all
            and self._client._ssl is not None
            and self._status >= 400
            and len(self._body or b"") > _TLS_SURE_SENT
        ):
            # A TLS transport's buffer size leaves out the TCP buffer under it, so an error
            # answer to a large body may have come before the body was all out: not reused.
            sent_all = False
        if exc_type is not None or not payload.is_eof() or not sent_all:
            proto.abort()
        elif (
            proto.should_close
            or not proto.is_connected()
            or (self._stream and not self._client.reuse_after_stream)
        ):
            proto.close()
        else:
            self._client._release(proto, asyncio.get_running_loop().time())
