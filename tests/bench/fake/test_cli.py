"""``python -m llmproxy.bench.fake.upstream``: the fake upstream as a process."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from llmproxy.common.children import child_preexec


def test_subprocess_entry(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmproxy.bench.fake.upstream",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--slots",
            "3",
            "--tokens",
            "2",
            "--token-delay-ms",
            "0",
            "--prefill-s-per-char",
            "0.0001",
        ],
        preexec_fn=child_preexec(),
    )
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        port = int(port_file.read_text())

        async def check() -> None:
            async with aiohttp.ClientSession() as s:
                async with s.get(f"http://127.0.0.1:{port}/props") as r:
                    assert (await r.json())["total_slots"] == 3
                payload = {"prompt": "abc"}
                async with s.post(f"http://127.0.0.1:{port}/completion", json=payload) as r:
                    body = await r.json()
                assert body["content"] == "t0 t1 "
                assert body["timings"] == {"prompt_n": 3, "cache_n": 0}  # the prompt-cache model

        asyncio.run(check())
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0
