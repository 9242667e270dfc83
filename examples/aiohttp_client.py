"""An editor-like client in plain aiohttp: stream ``/completion`` (SSE), abandon it when
the user types again.

    python examples/aiohttp_client.py [BASE_URL]

Sends one completion per "keystroke" and cancels the previous request (closing its
connection) as Continue or twinny do; llmproxy drops or cancels the abandoned ones, so
only the last completion costs the backend anything. Prints the last completion's text
and its latency; exits 1 if it failed.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import aiohttp

PREFIX = "def fibonacci(n):\n    "
TYPED = "return fib"


async def complete(http: aiohttp.ClientSession, base: str, prompt: str) -> str:
    """Stream one completion; return its text (llama.cpp ``/completion`` SSE format)."""
    body = {"prompt": prompt, "n_predict": 24, "stream": True, "cache_prompt": True}
    text = []
    async with http.post(base + "/completion", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:  # one SSE line at a time, as it arrives
            if not line.startswith(b"data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(event["error"].get("message"))
            text.append(event.get("content", ""))
            if event.get("stop"):
                break
    return "".join(text)


async def main(base: str) -> int:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        pending: asyncio.Task[str] | None = None
        for i in range(1, len(TYPED) + 1):  # one keystroke every 30 ms
            if pending is not None:
                pending.cancel()  # the user typed: abandon the previous completion
            pending = asyncio.create_task(complete(http, base, PREFIX + TYPED[:i]))
            await asyncio.sleep(0.03)
        started = time.perf_counter()
        assert pending is not None
        text = await pending
    sys.stdout.write(
        f"{PREFIX}{TYPED}{text}\n-- last completion in {time.perf_counter() - started:.3f}s\n"
    )
    return 0 if text else 1


if __name__ == "__main__":
    url = (
        sys.argv[1]
        if len(sys.argv) > 1
        else os.environ.get("LLMPROXY_URL", "http://127.0.0.1:8080")
    )
    raise SystemExit(asyncio.run(main(url.rstrip("/"))))
