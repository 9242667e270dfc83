"""Headless Chromium driven over the DevTools protocol, for tests of the live page.

``chromium()`` starts Debian's ``chromium`` (skips the test, saying why, where it is absent)
with a fresh profile and the flags that keep it off the network, and yields a ``Tab``:
``goto``, ``eval`` (a JavaScript expression's value), ``until`` (an expression polled with a
deadline) and ``screenshot``. The context manager owns the process: it is killed and waited
for on exit, and its profile removed.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-port=0",
    "--window-size=1200,800",
)


def chromium_path() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no chromium on PATH: `make test` installs Debian's chromium as root")


class Tab:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws, self._ids = ws, itertools.count(1)
        self._extra: list[dict[str, str]] = []  # headers added to intercepted requests

    async def add_headers(self, patterns: list[str], headers: dict[str, str]) -> None:
        """Send ``headers`` with the browser's requests to URLs matching ``patterns`` (and
        only those: the page's own fetches elsewhere go as the page sends them). The
        paused requests are continued while ``call`` reads, so poll with ``until``."""
        self._extra = [{"name": k, "value": v} for k, v in headers.items()]
        await self.call("Fetch.enable", patterns=[{"urlPattern": p} for p in patterns])

    async def _continue(self, paused: dict[str, Any]) -> None:
        sent = [{"name": k, "value": v} for k, v in paused["request"]["headers"].items()]
        await self._ws.send_json(
            {
                "id": next(self._ids),
                "method": "Fetch.continueRequest",
                "params": {"requestId": paused["requestId"], "headers": sent + self._extra},
            }
        )

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; its result (events in between are skipped)."""
        msg_id = next(self._ids)
        await self._ws.send_json({"id": msg_id, "method": method, "params": params})
        async with asyncio.timeout(30):
            async for msg in self._ws:
                data = json.loads(msg.data)
                if data.get("method") == "Fetch.requestPaused":
                    await self._continue(data["params"])
                elif data.get("id") == msg_id:
                    if "error" in data:
                        raise RuntimeError(f"{method}: {data['error']}")
                    result: dict[str, Any] = data["result"]
                    return result
        raise EOFError("the DevTools connection closed")

    async def goto(self, url: str) -> None:
        """Navigate; returns once ``url``'s document has loaded."""
        await self.call("Page.navigate", url=url)
        await self.until(f"location.href === {url!r} && document.readyState === 'complete'")

    async def reload(self) -> None:
        """Reload; returns once the new document has loaded."""
        await self.eval("window.__old = true")
        await self.call("Page.reload")
        await self.until("!window.__old && document.readyState === 'complete'")

    async def eval(self, expression: str) -> Any:
        result = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def until(self, expression: str, timeout: float = 10.0) -> Any:  # noqa: ASYNC109
        """Poll ``expression`` until it is truthy; its value. Fails loudly at the deadline."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not (value := await self.eval(expression)):
            if loop.time() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {expression}")
            await asyncio.sleep(0.05)
        return value

    async def screenshot(self) -> bytes:
        return base64.b64decode((await self.call("Page.captureScreenshot", format="png"))["data"])


@asynccontextmanager
async def chromium(http: aiohttp.ClientSession) -> AsyncIterator[Tab]:
    exe = chromium_path()
    profile = tempfile.mkdtemp(prefix="llmproxy-chromium-")
    proc = await asyncio.create_subprocess_exec(
        exe,
        *FLAGS,
        f"--user-data-dir={profile}",
        "about:blank",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stderr is not None
        async with asyncio.timeout(30):
            while b"DevTools listening on" not in (line := await proc.stderr.readline()):
                if not line:
                    raise RuntimeError("chromium exited before it listened")
        endpoint = line.decode().split("listening on ", 1)[1].strip()
        port = endpoint.split("://", 1)[1].split("/", 1)[0]
        drain = asyncio.create_task(proc.stderr.read())  # keeps its pipe from filling
        try:
            async with http.get(f"http://{port}/json/list") as r:
                targets = await r.json()
            page = next(t for t in targets if t["type"] == "page")
            async with http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                yield Tab(ws)
        finally:
            drain.cancel()
            await asyncio.gather(drain, return_exceptions=True)
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        shutil.rmtree(profile, ignore_errors=True)
