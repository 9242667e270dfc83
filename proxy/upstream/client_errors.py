"""The one client-exception boundary: aiohttp's and asyncio's client exceptions, raised
while the proxy talks to an upstream, become ProxyErrors (errors.py) here and nowhere else
(as httpx's ``map_httpcore_exceptions`` beside its transport)."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError

from llmproxy.proxy.errors import (
    ProxyError,
    UpstreamConnectTimeout,
    UpstreamFailed,
    UpstreamTimeout,
    UpstreamUnreachable,
)


def map_client_errors(what: str = "upstream") -> ClientErrorMap:
    """``with map_client_errors():`` translates aiohttp/asyncio client exceptions raised in
    the block into ProxyErrors (the one boundary)."""
    return ClientErrorMap(what)


class ClientErrorMap:
    """The context manager ``map_client_errors`` returns (a plain class: it is on every
    relayed request's path, where a generator-based one costs more)."""

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, _type: type[BaseException] | None, exc: BaseException | None, _tb: object
    ) -> None:
        if exc is None or isinstance(exc, ProxyError) or not isinstance(exc, Exception):
            return  # nothing raised, already ours, or not an error (cancellation): as it is
        mapped = _translate(exc, self.what)
        if mapped is not None:
            raise mapped from exc
        # anything else is a bug of ours: it propagates as it is


def _translate(exc: Exception, what: str) -> ProxyError | None:
    if isinstance(exc, (aiohttp.ClientConnectorError, ConnectionRefusedError)):
        return UpstreamUnreachable(f"{what} unreachable: {exc.__class__.__name__}: {exc}")
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return UpstreamConnectTimeout(f"{what} connect timed out")
    if isinstance(exc, (aiohttp.ServerTimeoutError, asyncio.TimeoutError, TimeoutError)):
        return UpstreamTimeout(f"{what} timed out")
    if isinstance(exc, aiohttp.ClientResponseError):
        return UpstreamFailed(f"{what} error: {exc.status} {exc.message}")
    if isinstance(exc, HttpProcessingError):
        # aiohttp's response parser: not HTTP/1.1 as it knows it
        return UpstreamFailed(f"{what} sent a malformed response: {exc.message}")
    if isinstance(exc, (aiohttp.ClientError, ConnectionError, OSError)):
        return UpstreamFailed(f"{what} failed: {exc.__class__.__name__}: {exc}")
    return None
