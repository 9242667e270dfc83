"""Reading the live page's event stream (/llmproxy/events) as the page does, for tests."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import aiohttp


class Events:
    """An open ``/llmproxy/events`` stream and the picture its events add up to."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp
        self.picture: dict[str, Any] = {}
        self.timeline: list[dict[str, Any]] = []
        self.raw = bytearray()  # every byte read, to check what it never carries

    async def next(self) -> tuple[str, dict[str, Any]]:
        """The next event (keepalive comments skipped), merged into ``picture``."""
        while True:
            block = bytearray()
            while not block.endswith(b"\n\n"):
                line = await self.resp.content.readline()
                if not line:
                    raise EOFError("the event stream ended")
                block += line
            self.raw += block
            fields = dict(
                ln.split(": ", 1) for ln in block.decode().splitlines() if ln and ": " in ln
            )
            if "data" not in fields:
                continue
            data = json.loads(fields["data"])
            self.picture.update(data)
            self.timeline.extend(data.get("timeline", []))
            return fields["event"], data

    async def until(
        self,
        pred: Callable[[Events], bool],
        timeout: float = 10.0,  # noqa: ASYNC109 - as tests/helpers/net.py wait_until
        what: str = "condition",
    ) -> None:
        """Read events until ``pred(self)`` holds; fail loudly at the deadline."""
        try:
            async with asyncio.timeout(timeout):
                while not pred(self):
                    await self.next()
        except TimeoutError:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}") from None

    def slots(self, upstream: int = 0) -> list[dict[str, Any]]:
        return list(self.picture["upstreams"][upstream]["slots"])

    def outcomes(self) -> list[str]:
        return [row["outcome"] for row in self.timeline]
