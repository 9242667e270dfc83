"""Logging setup (logs.py): stdlib records (aiohttp, asyncio) rendered like our own lines."""

from __future__ import annotations

import json
import subprocess
import sys

_SNIPPET = """
import logging
from llmproxy.proxy.logs import configure_logging
configure_logging("info", json=True)
try:
    raise ValueError("boom")
except ValueError:
    logging.getLogger("aiohttp.server").exception("Unhandled exception")
logging.getLogger("asyncio").info("below warning: not shown")
"""


def test_stdlib_records_are_json_lines_with_the_traceback_inside() -> None:
    # a fresh process: logging configuration is process-wide
    out = subprocess.run([sys.executable, "-c", _SNIPPET], capture_output=True, text=True, timeout=60, check=True)
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    rec = json.loads(lines[0])
    assert rec["event"] == "Unhandled exception" and rec["level"] == "error" and rec["logger"] == "aiohttp.server"
    assert "ValueError: boom" in rec["exception"] and rec["timestamp"]
