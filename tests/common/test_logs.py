"""Logging setup (logs.py): stdlib records (aiohttp, asyncio) rendered like our own lines."""

from __future__ import annotations

import json
import subprocess
import sys

_SNIPPET = """
import logging
from llmproxy.common.logs import configure_logging
configure_logging("info", json=True)
try:
    raise ValueError("boom")
except ValueError:
    logging.getLogger("aiohttp.server").exception("Unhandled exception")
logging.getLogger("asyncio").info("below warning: not shown")
"""


def test_stdlib_records_are_json_lines_with_the_traceback_inside() -> None:
    # a fresh process: logging configuration is process-wide
    out = subprocess.run(
        [sys.executable, "-c", _SNIPPET], capture_output=True, text=True, timeout=60, check=True
    )
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    rec = json.loads(lines[0])
    assert (
        rec["event"] == "Unhandled exception"
        and rec["level"] == "error"
        and rec["logger"] == "aiohttp.server"
    )
    assert "ValueError: boom" in rec["exception"] and rec["timestamp"]


_WRITES_SNIPPET = """
import json, sys
class Recorder:
    def __init__(self): self.writes = []
    def write(self, s): self.writes.append(s); return len(s)
    def flush(self): pass
    def isatty(self): return False
rec = sys.stderr = Recorder()
import structlog
from llmproxy.common.logs import configure_logging
configure_logging("info", json=True)
log = structlog.get_logger()
log.info("request", request_id="a", outcome="completed")
log.warning("second", n=2)
sys.stdout.write(json.dumps(rec.writes))
"""


def test_each_line_is_one_write() -> None:
    # The proxy and its backend child share stderr (the journal's pipe): a line written in
    # two calls can have the other process's line land between its text and its newline.
    out = subprocess.run(
        [sys.executable, "-c", _WRITES_SNIPPET],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    writes = json.loads(out.stdout)
    assert len(writes) == 2, writes
    assert all(w.endswith("\n") and w.count("\n") == 1 for w in writes), writes
    assert [json.loads(w)["event"] for w in writes] == ["request", "second"]
