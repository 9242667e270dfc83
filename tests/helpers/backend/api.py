"""Reading the backend's HTTP answers in tests: SSE streams and error envelopes."""

from __future__ import annotations

import json
from typing import Any

import aiohttp


def sse_events(raw: str) -> list[Any]:
    """The ``data:`` events of an SSE body, JSON-decoded (``[DONE]`` kept as the string)."""
    out = []
    for block in raw.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def post_stream(url: str, body: dict[str, Any]) -> tuple[int, str, str]:
    """POST ``body`` as JSON; (status, Content-Type, whole body text)."""
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, r.headers.get("Content-Type", ""), await r.text()


def envelope(status: int, body: Any, code: int) -> None:
    """Assert a ``code`` answer in llama-server's error envelope."""
    assert status == code, body
    assert body["error"]["code"] == code and body["error"]["message"] and body["error"]["type"]
