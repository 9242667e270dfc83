"""``llmproxy serve`` as a real subprocess on an ephemeral port (it dies with pytest)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from llmproxy.common.children import child_preexec
from tests.helpers.net import wait_until

LLMPROXY = str(Path(sys.executable).with_name("llmproxy"))


@asynccontextmanager
async def serve(
    tmp_path: Path, *args: str, env_extra: dict[str, str] | None = None
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    port_file = tmp_path / "port"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMPROXY_")} | (env_extra or {})
    proc = await asyncio.create_subprocess_exec(
        LLMPROXY,
        "serve",
        "--port",
        "0",
        "--port-file",
        str(port_file),
        "--log-json",
        *args,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        preexec_fn=child_preexec(),
    )
    try:
        await wait_until(
            lambda: port_file.exists() or proc.returncode is not None, 30, what="port file"
        )
        assert proc.returncode is None, await proc.stderr.read()
        yield proc, f"http://127.0.0.1:{int(port_file.read_text())}"
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def wait_for_log(
    proc: asyncio.subprocess.Process,
    event: str,
    timeout: float = 10,  # noqa: ASYNC109 - part of the helper's API
) -> None:
    """Read ``proc``'s stderr until its JSON log has a line with this ``event``; fail after
    ``timeout`` or when the output ends."""
    async with asyncio.timeout(timeout):
        while line := await proc.stderr.readline():
            if line.startswith(b"{") and json.loads(line).get("event") == event:
                return
    raise AssertionError(f"process ended without logging {event!r}")
