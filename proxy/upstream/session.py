"""The aiohttp ClientSession an upstream is reached with (its probes, polls and requests)."""

from __future__ import annotations

import aiohttp

from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.upstream.adapters.base import upstream_authorization


def open_session(settings: ProxySettings) -> aiohttp.ClientSession:
    """No total timeout (generations may be long), no cookies kept (one session serves every
    client), nothing decompressed, and the upstream's API key on the proxy's own requests.
    The caller closes it."""
    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=settings.connect_timeout_s, sock_read=settings.read_timeout_s
    )
    auth = upstream_authorization(settings)
    return aiohttp.ClientSession(
        timeout=timeout,
        connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True),
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),
        headers={"Authorization": auth} if auth else None,
    )
