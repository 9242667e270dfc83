"""One request on one connection to the upstream: what ``UpstreamClient.exchange`` returns.

An ``Exchange`` takes its client's most recently used idle connection, or connects a new
one; writes the request head and body without waiting for the upstream to read them;
skips interim 1xx responses; and gives the final response once its head has arrived, its
body streaming in ``UpstreamResponse.content``. A reused connection found closed under
the request (the upstream's idle timeout racing the reuse) is retried once on a new one
when the method is idempotent (aiohttp's list, as ``ClientSession`` does; never a POST,
which may have started a generation).

Concurrency contract: one task uses an exchange, as ``async with``; the connection it holds
belongs to that block alone. Leaving the block after the response body was read to its end
returns the connection to the pool (if the upstream keeps it alive and all of the request
went out); leaving it any other way (an exception, a cancellation, a consumer that stops
early) aborts the connection, dropping request bytes not yet sent, which is how the proxy
cancels a generation at the upstream: a cancelled request can never still arrive whole
afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from aiohttp.client_exceptions import (
    ClientConnectionResetError,
    ClientConnectorError,
    ClientOSError,
    ConnectionTimeoutError,
    ServerDisconnectedError,
)
from aiohttp.client_proto import ResponseHandler
from aiohttp.http_parser import RawResponseMessage
from aiohttp.http_writer import StreamWriter
from aiohttp.streams import StreamReader
from multidict import CIMultiDict, CIMultiDictProxy

# Methods retried once on a new connection when a reused one was closed under them (aiohttp's list).
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
# Request bodies up to this size are all out once written (a transport's default high-water mark).
_TLS_SURE_SENT = 64 * 1024


class Connections(Protocol):
    """What an exchange needs of its client (``UpstreamClient``, client.py): the request
    head, the pool of idle connections, new connections. Called from the exchange's task."""

    @property
    def read_timeout_s(self) -> float: ...

    @property
    def tls(self) -> bool: ...

    @property
    def reuse_after_stream(self) -> bool:
        """May a connection that carried an event stream be reused?"""
        ...

    def request_head(
        self, method: str, target: str, headers: Mapping[str, str], body: bytes | None
    ) -> tuple[str, CIMultiDict[str]]:
        """The request line and headers of ``method target``."""
        ...

    def take_idle(self, now: float) -> ResponseHandler | None:
        """The most recently used idle connection still fit for a request, or None."""
        ...

    def release(self, proto: ResponseHandler, now: float) -> None:
        """``proto`` is idle again (the exchange read its response to the end)."""

    async def connect(self, loop: asyncio.AbstractEventLoop) -> ResponseHandler:
        """A new connection; a failure as aiohttp's connector reports it
        (ClientConnectorError, ConnectionTimeoutError)."""
        ...


@dataclass(frozen=True, slots=True)
class UpstreamResponse:
    """The final response, once its head has arrived."""

    status: int
    headers: CIMultiDictProxy[str]
    content: StreamReader  # the body as it arrives (aiohttp's reader, with flow control)

    @property
    def content_length(self) -> int | None:
        value = self.headers.get("Content-Length")
        return int(value) if value is not None and value.isdigit() else None


class Exchange:
    """One request on one connection of a client's (``Connections``; see
    ``UpstreamClient.exchange``).

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
        client: Connections,
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
        proto = client.take_idle(loop.time())
        retry = proto is not None and self._method in _IDEMPOTENT
        if proto is None:
            proto = await client.connect(loop)
        while True:
            try:
                message, payload = await self._attempt(proto, loop)
            except (ServerDisconnectedError, ClientOSError, ClientConnectionResetError) as exc:
                proto.abort()
                if not retry:
                    raise
                retry = False  # the reused connection was closed under us: once more, on a new one
                try:
                    proto = await client.connect(loop)
                except (ClientConnectorError, ConnectionTimeoutError):
                    # what happened to the request: it was sent, and the connection lost
                    raise exc from None
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
        status_line, head = client.request_head(
            self._method, self._target, self._headers, self._body
        )
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
            and self._client.tls
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
            self._client.release(proto, asyncio.get_running_loop().time())
