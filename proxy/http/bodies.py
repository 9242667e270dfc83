"""Reading request bodies within the size limit and parsing the JSON the gate needs.

Request bodies are forwarded byte for byte, so a compressed one (``Content-Encoding``
other than identity; no editor sends one) is refused with 400: aiohttp would hand us the
decoded bytes while the header still says gzip.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from llmproxy.common import fastjson
from llmproxy.proxy.errors import BadRequest, BodyTooLarge, RequestTimeout


# ``timeout`` is the handlers' API (the body's deadline), kept as a parameter
async def read_body(request: web.Request, limit: int, timeout: float) -> bytes:  # noqa: ASYNC109
    """Read the whole body within ``timeout`` (slow-body clients get 408), at most ``limit``
    bytes (413, refused before reading when Content-Length already says too much)."""
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise BadRequest(
            f"compressed request bodies are not supported (Content-Encoding: {encoding}); "
            "send it uncompressed"
        )
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(
            f"request body of {request.content_length} bytes exceeds the limit of {limit}"
        )
    if request.content_length is not None and request.content.is_eof():
        # already buffered: no timer
        body = request.content.read_nowait()
        if len(body) != request.content_length:
            raise BadRequest("request body shorter than its Content-Length")
        return body
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            if request.content_length is not None:  # known size, within the limit: one read
                return await request.content.readexactly(request.content_length)
            async for chunk in request.content.iter_any():
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
                parts.append(chunk)
    except asyncio.IncompleteReadError as exc:
        raise BadRequest("request body shorter than its Content-Length") from exc
    except TimeoutError:
        raise RequestTimeout(f"request body not received within {timeout:g}s") from None
    return b"".join(parts)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Parse a gated request body: a JSON object, else 400 with a clear message."""
    if not raw or raw.isspace():
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        parsed = fastjson.exact(raw)
    except ValueError:
        parsed = _slow(raw)
    if not isinstance(parsed, dict):
        raise BadRequest(f"request body must be a JSON object, not {type(parsed).__name__}")
    for key, kinds in (("n_predict", int), ("max_tokens", int), ("stream", bool), ("model", str)):
        value = parsed.get(key)
        if value is not None and (
            not isinstance(value, kinds) or (kinds is int and isinstance(value, bool))
        ):
            raise BadRequest(f"field {key!r} must be {kinds.__name__}")
    return parsed


def _slow(raw: bytes) -> Any:
    """The standard library's reading (see common/fastjson.py), with its error as a 400."""
    try:
        return json.loads(raw.decode("utf-8"))  # strict UTF-8; a BOM is a JSON error
    except UnicodeDecodeError as exc:
        raise BadRequest(f"request body is not valid UTF-8: {exc.reason}") from exc
    except RecursionError as exc:
        raise BadRequest("request body JSON is nested too deeply") from exc
    except ValueError as exc:
        raise BadRequest(f"malformed JSON in request body: {exc}") from exc
