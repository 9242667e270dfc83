"""Addresses, host names and web origins as the servers compare them. Pure functions."""

from __future__ import annotations

import ipaddress

from yarl import URL

_DEFAULT_PORTS = {"http": 80, "https": 443}


def is_loopback(host: str) -> bool:
    """Is ``host`` (a bind address or name) on this machine only?"""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def is_unspecified(host: str) -> bool:
    """Is ``host`` a bind address meaning every interface (``0.0.0.0``, ``::``, empty)?"""
    if host in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def ip_literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` as an IP address (``[::1]`` too), or None for a name."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def split_host(value: str) -> tuple[str, int | None]:
    """A ``Host`` header as (lower-case name without a trailing dot, port or None);
    ValueError when it is not one."""
    url = URL(f"http://{value}")
    if url.host is None or url.user is not None or url.raw_path not in ("", "/"):
        raise ValueError(f"not a host: {value!r}")
    return url.host.lower().rstrip("."), url.explicit_port


def origin_of(scheme: str, host: str, port: int | None) -> str:
    """The serialised origin ``scheme://host[:port]`` (default ports left out)."""
    shown = f"[{host}]" if ":" in host else host
    if port is None or _DEFAULT_PORTS.get(scheme) == port:
        return f"{scheme}://{shown}"
    return f"{scheme}://{shown}:{port}"


def normal_origin(value: str) -> str | None:
    """An ``Origin`` header value as ``origin_of`` writes it, or None if it names no
    scheme://host origin (``null``, garbage)."""
    try:
        url = URL(value)
    except ValueError:
        return None
    if not url.scheme or not url.host or url.raw_path not in ("", "/") or url.user is not None:
        return None
    return origin_of(url.scheme.lower(), url.host.lower().rstrip("."), url.explicit_port)


def check_origin(value: str) -> str:
    """A configured allowed origin, normalised; ``*`` as it is; ValueError otherwise."""
    if value == "*":
        return value
    origin = normal_origin(value.strip())
    if origin is None:
        raise ValueError(
            f"{value!r} is not an origin (scheme://host[:port], e.g. http://a.example)"
        )
    return origin
