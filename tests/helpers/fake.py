"""Helpers of the fake upstream's own tests (tests/bench/fake/)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmproxy.bench.fake.upstream import Script

TEXT8 = "".join(f"t{i} " for i in range(8))  # what the fake generates by default


def by_prompt(scripts: dict[str, Script]) -> Callable[[str, dict[str, Any]], Script]:
    """A script chosen by the request's "prompt" field (default Script() otherwise)."""
    return lambda _path, body: scripts.get(str(body.get("prompt")), Script())


def sse_events(raw: bytes) -> list[str]:
    """The ``data:`` payloads of a complete SSE body (every event must be a data event)."""
    text = raw.decode()
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: ") :] for e in events]
