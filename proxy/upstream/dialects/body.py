"""Byte-preserving edits of a JSON request body's top-level fields.

The proxy forwards request bodies byte for byte except the fields its dialect must set
(``id_slot`` for llama-server: llamacpp.py). Re-serialising would change number formats,
spacing and key order, so this scans the top-level object with the stdlib decoder to find
exact value spans and splices only the one value.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

# The stdlib decoder's own whitespace pattern and string scanner (typeshed leaves them out).
from json.decoder import WHITESPACE, scanstring  # type: ignore[attr-defined]

_DECODER = json.JSONDecoder()
_WHITESPACE: re.Pattern[str] = WHITESPACE
_scanstring: Callable[[str, int], tuple[str, int]] = scanstring


def _ws(text: str, i: int) -> int:
    """The index of the first non-whitespace character from ``i`` on."""
    match = _WHITESPACE.match(text, i)  # always matches (the pattern accepts "")
    return match.end() if match is not None else i


def top_level_spans(text: str) -> dict[str, tuple[int, int]] | None:
    """Map each top-level key to its value's (start, end) span; None if not an object."""
    i = _ws(text, 0)
    if i >= len(text) or text[i] != "{":
        return None
    spans: dict[str, tuple[int, int]] = {}
    i = _ws(text, i + 1)
    if i < len(text) and text[i] == "}":
        return spans
    while True:
        if i >= len(text) or text[i] != '"':
            return None
        key, i = _scanstring(text, i + 1)
        i = _ws(text, i)
        if i >= len(text) or text[i] != ":":
            return None
        start = _ws(text, i + 1)
        _, end = _DECODER.raw_decode(text, start)
        spans[key] = (start, end)
        i = _ws(text, end)
        if i < len(text) and text[i] == ",":
            i = _ws(text, i + 1)
            continue
        if i < len(text) and text[i] == "}":
            return spans
        return None


def set_top_level(raw: bytes, key: str, value: object, *, present: bool | None = None) -> bytes:
    """Return ``raw`` with top-level ``key`` set to ``value``, everything else untouched.

    ``raw`` must be a JSON object (the proxy parsed it already). ``present``: whether the
    parsed object has ``key`` (None: unknown). When it certainly does not, the key is simply
    inserted after the opening brace, without scanning the body."""
    encoded_key = json.dumps(key).encode()
    if present is False or (present is None and encoded_key not in raw and b"\\u" not in raw):
        brace = raw.index(b"{")
        rest = raw[brace + 1 :]
        sep = b"," if rest.strip()[:1] not in (b"}", b"") else b""
        encoded_value = (
            str(value) if type(value) is int else json.dumps(value, separators=(",", ":"))
        )
        return b"".join((raw[: brace + 1], encoded_key, b":", encoded_value.encode(), sep, rest))
    text = raw.decode("utf-8")
    spans = top_level_spans(text)
    if spans is None:
        raise ValueError("body is not a JSON object")
    encoded = json.dumps(value, separators=(",", ":"))
    if key in spans:
        start, end = spans[key]
        return (text[:start] + encoded + text[end:]).encode("utf-8")
    brace = text.index("{")
    comma = "," if spans else ""
    return (text[: brace + 1] + json.dumps(key) + ":" + encoded + comma + text[brace + 1 :]).encode(
        "utf-8"
    )
