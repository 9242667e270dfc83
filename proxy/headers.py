"""Header filtering in both directions (hop-by-hop and proxy-owned headers)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from multidict import CIMultiDict
from yarl import URL

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# Recomputed by aiohttp for the hop we write.
_REQUEST_DROP = HOP_BY_HOP | {"host", "content-length", "expect"}
_RESPONSE_DROP = HOP_BY_HOP | {"content-length", "date", "server"}


def _connection_tokens(headers: Mapping[str, str]) -> set[str]:
    value = headers.get("Connection", "")
    return {t.strip().lower() for t in value.split(",") if t.strip()}


def _filter(items: Iterable[tuple[str, str]], drop: frozenset[str] | set[str]) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in items if k.lower() not in drop)


def request_headers(headers: Mapping[str, str], strip: Iterable[str] = ()) -> CIMultiDict[str]:
    """Headers to send upstream: end-to-end ones only, minus ``strip`` (e.g. our API key)."""
    drop = set(_REQUEST_DROP) | _connection_tokens(headers) | {s.lower() for s in strip}
    return _filter(headers.items(), drop)


def response_headers(headers: Mapping[str, str], upstream: URL | None = None) -> CIMultiDict[str]:
    """Headers to send back to the client (Content-Type, Content-Encoding... preserved).

    A ``Location`` that points into ``upstream`` (a redirect built from the upstream's own
    host, as Starlette's trailing-slash one is) becomes origin-relative, so a client that
    follows it comes back through the proxy and its gate (nginx's ``proxy_redirect default``).
    """
    drop = set(_RESPONSE_DROP) | _connection_tokens(headers)
    out = _filter(headers.items(), drop)
    location = out.get("Location")
    if upstream is not None and location is not None:
        target = URL(location, encoded=True)
        if target.absolute and target.origin() == upstream.origin():
            out["Location"] = target.raw_path_qs + (f"#{target.raw_fragment}" if target.raw_fragment else "")
    return out
