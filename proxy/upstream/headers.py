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


def _filter(headers: Mapping[str, str], drop: Iterable[str]) -> CIMultiDict[str]:
    """A copy of ``headers`` without the names in ``drop`` (lower case), order kept.

    Copied whole, then the few names to drop that are there deleted: both steps run in
    multidict's C code rather than item by item in Python (this runs twice on every relayed
    request)."""
    out = CIMultiDict(headers)
    for name in drop:
        if name in out:
            del out[name]  # every value of that name
    return out


def request_headers(headers: Mapping[str, str], strip: Iterable[str] = ()) -> CIMultiDict[str]:
    """Headers to send upstream: end-to-end ones only, minus ``strip`` (e.g. our API key)."""
    drop: frozenset[str] | set[str] = _REQUEST_DROP
    if strip or "Connection" in headers:
        drop = drop | _connection_tokens(headers) | {s.lower() for s in strip}
    return _filter(headers, drop)


def proxied_location(location: str, upstream: URL) -> str | None:
    """``location`` as seen through the proxy, if it points into the ``upstream`` base URL
    (same scheme, host and port, path under the base path), else None.

    A redirect built from the upstream's own host (Starlette's trailing-slash one) then
    brings a client that follows it back through the proxy and its gate, like nginx's
    ``proxy_redirect default``. Anything else (relative, scheme-relative, elsewhere,
    unparsable) is left as the upstream sent it.
    """
    try:
        target = URL(location, encoded=True)
        same_origin = (
            bool(target.scheme)
            and target.scheme.lower() == upstream.scheme
            and (target.host or "").lower() == (upstream.host or "").lower()
            and target.port == upstream.port
        )
    except ValueError:
        return None
    base = upstream.raw_path.rstrip("/")
    path = target.raw_path or "/"
    if not same_origin or not (path == base or path.startswith(base + "/")):
        return None
    rest = path[len(base) :] or "/"
    query = f"?{target.raw_query_string}" if target.raw_query_string else ""
    fragment = f"#{target.raw_fragment}" if target.raw_fragment else ""
    return rest + query + fragment


def response_headers(headers: Mapping[str, str], upstream: URL | None = None) -> CIMultiDict[str]:
    """Headers to send back to the client (Content-Type, Content-Encoding... preserved),
    without the upstream's ``Access-Control-*`` ones; a Location into the ``upstream`` base
    URL is rewritten (``proxied_location``)."""
    drop = (
        _RESPONSE_DROP | _connection_tokens(headers) if "Connection" in headers else _RESPONSE_DROP
    )
    out = _filter(headers, drop)
    cors = [k for k in out if k[:15].lower() == "access-control-"]
    for name in cors:  # the proxy's own CORS rules apply (http/trust.py), never the upstream's
        out.popall(name, None)
    location = out.get("Location")
    if upstream is not None and location is not None:
        out["Location"] = proxied_location(location, upstream) or location
    return out
