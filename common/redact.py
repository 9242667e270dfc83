"""Credentials never shown: URLs with ``user:password@`` in logs, status and messages.

``redact_urls(text)`` rewrites every ``scheme://user:password@`` in ``text`` to
``scheme://user:***@`` (a user alone, often a token, becomes ``***@``); ``strip_userinfo``
gives a URL without its credentials, for everything that shows or logs it once the
credentials have been turned into an ``Authorization`` header. Pure functions.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

# scheme://userinfo@ : userinfo has no '/', '?', '#', '@' or white space (RFC 3986)
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<info>[^/?#@\s]+)@")


def _masked(match: re.Match[str]) -> str:
    user, colon, _password = match.group("info").partition(":")
    shown = f"{user}:***" if colon else "***"
    return f"{match.group('scheme')}{shown}@"


def redact_urls(text: str) -> str:
    """``text`` with the credentials of every URL in it masked."""
    if "@" not in text:  # the common case, at C speed
        return text
    return _USERINFO.sub(_masked, text)


def redact_values(value: Any) -> Any:
    """``value`` (JSON-like: dicts, lists, strings) with every string passed through
    ``redact_urls``."""
    if isinstance(value, str):
        return redact_urls(value)
    if isinstance(value, dict):
        return {k: redact_values(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_values(v) for v in value]
    return value


def strip_userinfo(url: str) -> str:
    """``url`` without ``user:password@`` (everything else as written)."""
    return _USERINFO.sub(lambda m: m.group("scheme"), url, count=1)


def userinfo(url: str) -> tuple[str, str] | None:
    """(user, password) from ``url``'s ``user:password@``, percent-decoded; None without."""
    match = _USERINFO.match(url.strip())
    if match is None:
        return None
    user, _, password = match.group("info").partition(":")
    return unquote(user), unquote(password)
