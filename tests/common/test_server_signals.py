"""One Ctrl-C, one log line: a server started without SIGINT handling (the embedded backend,
whose parent handles Ctrl-C and then sends it SIGTERM) logs that SIGTERM at debug level only."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import pytest

from tests.helpers.net import wait_until

CHILD = """
import asyncio, sys
from pathlib import Path
from aiohttp import web
from llmproxy.common.logs import configure_logging
from llmproxy.common.server import Listen, serve
configure_logging("info", True)
listen = Listen("127.0.0.1", 0, port_file=Path(sys.argv[1]), sigint=sys.argv[2] == "1")
sys.exit(asyncio.run(serve(web.Application(), listen)))
"""


@pytest.mark.parametrize("sigint", [True, False])
async def test_the_stop_signal_is_logged_only_where_the_user_sent_it(
    tmp_path: Path, sigint: bool
) -> None:
    port_file = tmp_path / "port"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, str(port_file), "1" if sigint else "0",
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        await wait_until(lambda: port_file.exists() and port_file.read_text().strip() != "", 30)
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0
    events = [json.loads(ln)["event"] for ln in err.decode().splitlines() if ln.startswith("{")]
    assert ("signal received: shutting down gracefully" in events) is sigint, events
