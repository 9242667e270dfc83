"""The server side of ``llmproxy bench engine``: the backend as a process, timed over HTTP.

``Server`` starts ``python -m llmproxy.backend`` on a free loopback port (a child that
dies with this process: ``child_preexec``), blocks until its port file appears and stops
it with ``stop()`` (SIGTERM, SIGKILL after 30 s). Its coroutines time, on the client, one
streamed ``/completion`` (first token and decode speed; the server's own timings are kept
too) and the cancellation latency: a client closes its stream (after a few tokens, or while
the prompt is still evaluated) -> ``GET /slots`` shows every slot idle, polled every ~1 ms.
``PROMPTS`` are the prompts both sides of the bench run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from llmproxy.common.children import child_preexec

if TYPE_CHECKING:
    import aiohttp

PROMPTS = [
    'def quicksort(items):\n    """Sort a list with quicksort."""\n'
    "    if len(items) <= 1:\n        return items\n",
    "class LRUCache:\n    def __init__(self, capacity: int) -> None:\n"
    "        self.capacity = capacity\n",
    "// Parse a CSV line into fields, honouring quotes.\n"
    "function parseCsvLine(line) {\n  const out = [];\n",
    "SELECT customers.name, COUNT(orders.id) AS n\nFROM customers\n"
    "JOIN orders ON orders.customer_id = customers.id\n",
    "#include <stdio.h>\n\nint main(int argc, char **argv) {\n"
    "    for (int i = 1; i < argc; i++) {\n",
    "Once upon a time, in a small village at the edge of a forest, "
    "there lived an old clockmaker who",
]


class Server:
    """A ``python -m llmproxy.backend`` subprocess on a free port (``engine``, plus any
    ``extra`` flags), its log in a temporary folder; ``stop`` ends it."""

    def __init__(
        self,
        args: argparse.Namespace,
        n_threads: int,
        engine: str = "llama-cpp",
        extra: tuple[str, ...] = (),
    ) -> None:
        self.tmp = tempfile.mkdtemp(prefix="llmproxy-bench-")
        port_file = Path(self.tmp) / "port"
        cmd = [
            sys.executable,
            "-m",
            "llmproxy.backend",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--engine",
            engine,
            "--n-threads",
            str(n_threads),
            "--n-ctx",
            str(args.n_ctx),
            "--n-batch",
            str(args.n_batch),
            "--log-level",
            "warning",
            "--log-json",
            *extra,
        ]
        if args.model is not None:
            cmd += ["--model", str(args.model)]
        self.log = open(Path(self.tmp) / "backend.log", "wb")
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=child_preexec()
        )
        deadline = time.monotonic() + 300
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(
                    "backend did not start; see " + str(Path(self.tmp) / "backend.log")
                )
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{int(port_file.read_text())}"
        self.last_prompt_ms = 0.0  # the server's own prompt timings of the last ``run``
        self.last_prompt_n = -1

    async def wait_ready(self, session: aiohttp.ClientSession) -> None:
        for _ in range(6000):
            try:
                async with session.get(self.url + "/health") as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            await asyncio.sleep(0.05)
        raise SystemExit("backend never became healthy")

    async def run(
        self, session: aiohttp.ClientSession, prompt: str, n_predict: int
    ) -> tuple[float, float, float]:
        body = {
            "prompt": prompt,
            "n_predict": n_predict,
            "temperature": 0,
            "seed": 1,
            "ignore_eos": True,
            "stream": True,
        }
        t0 = time.perf_counter()
        t_first = 0.0
        n = 0
        server_tps = 0.0
        self.last_prompt_ms = 0.0
        self.last_prompt_n = -1
        async with session.post(self.url + "/completion", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"request failed: HTTP {r.status} {(await r.text())[:200]}")
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                ev = json.loads(line[6:])
                if ev.get("stop"):
                    server_tps = ev["timings"]["predicted_per_second"]
                    self.last_prompt_ms = ev["timings"]["prompt_ms"]
                    self.last_prompt_n = ev["timings"]["prompt_n"]
                    break
                if t_first == 0.0:
                    t_first = time.perf_counter()
                n = ev["tokens_predicted"]
        t_end = time.perf_counter()
        dec = (t_end - t_first) / max(1, n - 1)
        return (t_first - t0) * 1000.0, 1.0 / dec, server_tps

    async def cancel_latency(self, session: aiohttp.ClientSession, after_tokens: int = 4) -> float:
        body = {"prompt": PROMPTS[0], "n_predict": 400, "ignore_eos": True, "stream": True}
        resp = await session.post(self.url + "/completion", json=body)
        seen = 0
        while seen < after_tokens:
            line = await resp.content.readline()
            if line.startswith(b"data: "):
                seen += 1
        t0 = time.perf_counter()
        resp.close()
        return await self._until_idle(session, t0)

    async def cancel_in_prompt(
        self, session: aiohttp.ClientSession, prompt: str, after_s: float = 0.3
    ) -> float:
        """Close the request while the worker is still evaluating ``prompt`` (no token yet)."""
        body = {"prompt": prompt, "n_predict": 8, "stream": True}
        try:
            async with asyncio.timeout(after_s):
                await session.post(self.url + "/completion", json=body)
            raise SystemExit("the long prompt was evaluated before the cancel; lengthen it")
        except TimeoutError:
            t0 = time.perf_counter()  # the connection is closed by now
        return await self._until_idle(session, t0)

    async def _until_idle(self, session: aiohttp.ClientSession, t0: float) -> float:
        while True:
            async with session.get(self.url + "/slots") as r:
                if not any(slot["is_processing"] for slot in await r.json()):
                    return (time.perf_counter() - t0) * 1000.0
            await asyncio.sleep(0.001)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


if __name__ == "__main__":
    from llmproxy.bench.engine.run import cli

    raise SystemExit(cli("python -m llmproxy.bench.engine.server"))
